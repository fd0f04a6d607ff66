//! Quantized tensors and recipes for the rollout engines: [`QTensor`] (FP8 codes, or NVFP4
//! codes + block scales, on a device, with the tensor scale) and the per-layer recipes of seed
//! 000 Table 3. The formats' arithmetic is `crate::formats` (re-exported here as `fp8`,
//! `nvfp4`, `simd`); the passes that rewrite a QTensor on a device are
//! `ops::quantize::requantize`; an engine's set of quantized weights is `model::QuantState`.
//!
//! Owns: quantized tensors, recipes. May call: `crate::device`, `crate::formats`, rayon. Must
//! not: run models or ops.

pub mod qtensor;
pub mod recipe;

pub use crate::formats::{fp8, nvfp4, simd};
pub use qtensor::QTensor;
