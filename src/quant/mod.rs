//! Low-precision formats and recipes for the rollout engines: FP8 (E4M3, E5M2) and NVFP4 (E2M1
//! values, an E4M3 scale per 16 values along K, one FP32 scale per tensor), the fused amax +
//! quantize passes that rewrite an engine's preallocated buffers from the trainer's weights,
//! and the per-layer recipes of seed 000 Table 3.
//!
//! Owns: element encodings, quantized tensors, recipes, calibration scales. May call: rayon,
//! `crate::rand`. Must not: run models (the engine consumes quantized tensors through ops).

pub mod calib;
pub mod fp8;
pub mod nvfp4;
pub mod qtensor;
pub mod recipe;
pub mod simd;
pub mod state;

pub use qtensor::QTensor;
pub use state::{QLayer, QuantState};
