//! colotrain: a single-node trainer for on-policy post-training of LLMs (on-policy distillation
//! and RL) with low-precision rollout engines. The README describes the layout and the
//! decisions behind it.
//!
//! The modules form layers: each imports only modules listed before it (a test that needs a
//! higher layer lives in that layer or in `tests/`). Each module's header says what it owns,
//! what it may call and what it must not touch.
//! - [`util`], [`rand`]: small helpers (atomic writes, JSONL, the tracking allocator); Philox.
//! - [`parallel`]: worker threads (one per device) and collectives between ranks (in-process,
//!   or NCCL with the `cuda` feature), knowing nothing of tensors or models.
//! - [`formats`]: the FP8 and NVFP4 number formats, bit for bit.
//! - [`device`]: the CPU and CUDA devices, tensors and their storage; the CUDA context,
//!   allocator, stream, kernel modules, cuBLASLt handle and NVTX.
//! - [`quant`]: quantized tensors and the engines' precision recipes.
//! - [`ops`]: one room per op family: signature and dispatch, CPU twin, CUDA twin, training
//!   twin, tests.
//! - [`model`]: Hugging Face config / safetensors / tokenizer, the transformer forward and its
//!   training twin, quantized weight sets and calibration, ModelOpt import and export.
//! - [`data`]: prompt sets, the tiny arithmetic task, answer checking.
//! - [`engine`]: the decoding engine (paged KV cache, continuous batching, sampling), the
//!   rollout engines' weights, and rollouts.
//! - [`mismatch`]: the training–inference mismatch: per-step metrics, the RL monitor,
//!   budgets, admission.
//! - [`objective`]: token statistics to per-token coefficients (OPD, SFT, GRPO / TIS, TRIAGE).
//! - [`config`]: the job's TOML, validated up front.
//! - [`reward`]: the built-in math rule or a plug-in command, scoring responses as they finish.
//! - [`train`]: the training step, optimizer, checkpoints, evaluation, metrics.
//! - [`orchestrator`]: one process, N devices: plan, workers, schedules, the step loop.
//! - [`cli`]: the subcommands of the `colotrain` binary.

pub mod util;
pub mod rand;
pub mod parallel;
pub mod formats;
pub mod device;
pub mod quant;
pub mod ops;
pub mod model;
pub mod data;
pub mod engine;
pub mod mismatch;
pub mod objective;
pub mod config;
pub mod reward;
pub mod train;
pub mod orchestrator;
pub mod cli;

pub use anyhow::{Error, Result};
