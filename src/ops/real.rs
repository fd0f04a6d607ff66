//! The element types of the training twins (`ops::<op>::grad`): forward-with-saved-state and
//! backward of every layer, on contiguous row-major slices, generic over [`Real`] (f32 for
//! training, f64 for the finite-difference checks). Like llm.c's CPU code, these are the spec
//! that the CUDA training kernels will mirror name for name.
//!
//! Owns: [`Real`] and the training exp. May call: `num_traits`. Must not: know about models.

use num_traits::Float;
use std::iter::Sum;
use std::ops::{AddAssign, MulAssign, SubAssign};

/// The element types the training ops run in.
pub trait Real:
    Float + Sum + AddAssign + SubAssign + MulAssign + Send + Sync + Default + std::fmt::Debug + 'static
{
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
        exp_f32_branchless(self)
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

/// e^x in f32 for the training loops, without a libm call and without branches: x = n·ln2 + r
/// (Cody–Waite, |r| ≤ ln2/2), e^r by its degree-6 Taylor polynomial (relative error ≤ 1.2e-7),
/// 2^n assembled in the exponent bits. Inputs are clamped to [−87, 88] (no denormals, no
/// overflow to inf, NaN not propagated).
///
/// Why a second exp next to `vecmath::exp_f32` (the engine's, which scoring, sampling and the
/// CUDA kernels share bit for bit): this one sits inside the generic [`Real`] loops of the
/// trainer's fused LM-head softmax, where only a branch-free body lets the compiler vectorize
/// it; the engine's handles NaN, +inf and subnormal results exactly and is vectorized by hand.
/// The two differ by at most 2 ulp; the trainer's log-probs and the engine's agree to
/// rounding, which the mismatch metrics measure (d_n ≈ 1e-6 on the tiny job).
#[inline(always)]
pub fn exp_f32_branchless(x: f32) -> f32 {
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
    fn exp_f32_branchless_is_accurate() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let got = super::exp_f32_branchless(x) as f64;
            worst = worst.max((got - want).abs() / want);
            x += 0.0137;
        }
        assert!(worst < 2.5e-7, "max relative error {worst:e}");
        assert!(super::exp_f32_branchless(-1e30) > 0.0 && super::exp_f32_branchless(-1e30) < 1e-37);
        assert!(super::exp_f32_branchless(f32::NEG_INFINITY) < 1e-37);
    }
}
