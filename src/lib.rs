//! colotrain: a single-node trainer for on-policy post-training of LLMs (on-policy distillation
//! and RL) with low-precision rollout engines. See DESIGN notes in README.md.
//!
//! Module map (each module's header says what it owns and what it may call):
//! - [`device`]: devices (CPU, CUDA), tensors and their storage.
//! - [`ops`]: one function per op, dispatching to a CPU twin and a CUDA twin with one signature.
//! - [`model`]: Hugging Face config/safetensors/tokenizer loading and the transformer forward.
//! - [`engine`]: the decoding engine: paged KV cache, Philox sampler, continuous batching.
//! - [`data`]: prompt files (JSONL) and chat templates.
//! - [`cli`]: the subcommands of the `colotrain` binary.
//! - [`parallel`]: collectives between ranks and the per-device worker threads.

pub mod cli;
pub mod config;
pub mod data;
pub mod device;
pub mod engine;
pub mod mismatch;
pub mod model;
pub mod objective;
pub mod ops;
pub mod parallel;
pub mod quant;
pub mod rand;
pub mod train;
pub mod util;

pub use anyhow::{Error, Result};
