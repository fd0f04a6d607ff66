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
    /// e^x for the softmax loops: branch-free and vectorizable for f32 (within 2 ulp for
    /// x ≥ −87, e^−87 below that), the libm exp for f64.
    fn fexp(self) -> Self;
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
    #[inline(always)]
    fn fexp(self) -> f32 {
        exp_f32(self)
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
    #[inline(always)]
    fn fexp(self) -> f64 {
        self.exp()
    }
}

/// e^x in f32 without a libm call: x = n·ln2 + r (Cody–Waite, |r| ≤ ln2/2), e^r by its degree-6
/// Taylor polynomial (relative error ≤ 1.2e-7), 2^n assembled in the exponent bits. Inputs are
/// clamped to [−87, 88] (no denormals, no overflow to inf).
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const ROUND: f32 = 12_582_912.0; // 1.5·2^23: adding and subtracting rounds to an integer
    let x = x.clamp(-87.0, 88.0);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.0 + r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

#[cfg(test)]
mod tests {
    #[test]
    fn exp_f32_is_accurate() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let got = super::exp_f32(x) as f64;
            worst = worst.max((got - want).abs() / want);
            x += 0.0137;
        }
        assert!(worst < 2.5e-7, "max relative error {worst:e}");
        assert!(super::exp_f32(-1e30) > 0.0 && super::exp_f32(-1e30) < 1e-37);
        assert!(super::exp_f32(f32::NEG_INFINITY) < 1e-37);
    }
}

/// Rows per rayon task for row-wise kernels.
pub(crate) fn rows_per_task(cols: usize) -> usize {
    (16384 / cols.max(1)).max(1)
}
