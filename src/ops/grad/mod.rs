//! The training ops' CPU reference: forward-with-saved-state and backward of every layer, on
//! contiguous row-major slices, generic over the element type ([`Real`]: f32 for training,
//! f64 for the finite-difference checks). Like llm.c's CPU code, this is the spec that the CUDA
//! training kernels will mirror name for name; every tensor's shape is written next to it.
//!
//! Owns no state. May call: the `gemm` crate, rayon. Must not: know about models or configs.

pub mod activation;
pub mod attention;
pub mod lm_head;
pub mod matmul;
pub mod norm;
pub mod rope;

use num_traits::Float;
use std::iter::Sum;
use std::ops::{AddAssign, MulAssign, SubAssign};

/// The element types the training ops run in.
pub trait Real: Float + Sum + AddAssign + SubAssign + MulAssign + Send + Sync + Default + std::fmt::Debug + 'static {
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;
    fn from_usize(x: usize) -> Self {
        Self::from_f64(x as f64)
    }
}

impl Real for f32 {
    #[inline]
    fn from_f64(x: f64) -> f32 {
        x as f32
    }
    #[inline]
    fn to_f64(self) -> f64 {
        self as f64
    }
}

impl Real for f64 {
    #[inline]
    fn from_f64(x: f64) -> f64 {
        x
    }
    #[inline]
    fn to_f64(self) -> f64 {
        self
    }
}

/// Rows per rayon task for row-wise kernels.
pub(crate) fn rows_per_task(cols: usize) -> usize {
    (16384 / cols.max(1)).max(1)
}
