//! The low-precision number formats, bit for bit: FP8 E4M3 / E5M2 and NVFP4 (E2M1 values, an
//! E4M3 scale per 16 values along K, one FP32 scale per tensor), encoded and decoded on the f32
//! bits with round-to-nearest-even and saturation, plus the vectorized encoders (`simd`).
//! Plain arithmetic on slices: the bottom of the stack, so the device layer can decode a
//! quantized weight and every layer above can encode one.
//!
//! Owns: the encodings. May call: `crate::rand` (RHT signs, stochastic rounding), rayon. Must
//! not: know about tensors, devices or models.

pub mod fp8;
pub mod nvfp4;
pub mod simd;
