//! The quantizers' inner loops, compiled twice: for the baseline target and with AVX2 + FMA
//! enabled, chosen at run time. The code is the same (no fast-math, no FMA contraction), so the
//! results are bit-identical; only the vector width differs.

use super::fp8::encode_e4m3_fast;
use super::nvfp4::{self, Nvfp4Opts, BLOCK};

#[inline(always)]
fn amax_body(x: &[f32]) -> f32 {
    let mut m = 0.0f32;
    let mut nan = false;
    for v in x {
        nan |= v.is_nan();
        m = m.max(v.abs());
    }
    if nan {
        f32::NAN
    } else {
        m
    }
}

#[inline(always)]
fn fp8_body(x: &[f32], scale: f32, out: &mut [u8]) {
    for (o, v) in out.iter_mut().zip(x) {
        *o = encode_e4m3_fast(v / scale);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn amax(x: &[f32]) -> f32 {
        amax_body(x)
    }
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fp8(x: &[f32], scale: f32, out: &mut [u8]) {
        fp8_body(x, scale, out)
    }
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn nvfp4(x: &[f32], global: f32, opts: &Nvfp4Opts, signs: Option<&[f32; BLOCK]>, first: u64, packed: &mut [u8], scales: &mut [u8]) {
        nvfp4::quantize_row(x, global, opts, signs, first, packed, scales)
    }
}

#[inline]
fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// max |x| (NaN if any value is NaN).
pub fn amax(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2 and FMA (checked above).
        return unsafe { avx2::amax(x) };
    }
    amax_body(x)
}

/// out[i] = e4m3_satfinite(x[i] / scale).
pub fn encode_fp8(x: &[f32], scale: f32, out: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: as above.
        return unsafe { avx2::fp8(x, scale, out) };
    }
    fp8_body(x, scale, out)
}

/// `nvfp4::quantize_row`, vectorized where the CPU allows.
pub fn quantize_nvfp4(x: &[f32], global: f32, opts: &Nvfp4Opts, signs: Option<&[f32; BLOCK]>, first: u64, packed: &mut [u8], scales: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: as above.
        return unsafe { avx2::nvfp4(x, global, opts, signs, first, packed, scales) };
    }
    nvfp4::quantize_row(x, global, opts, signs, first, packed, scales)
}

/// max |x| over BF16 values: the magnitude bits compared as integers (NaN propagates).
pub fn amax_bf16(x: &[half::bf16]) -> f32 {
    use rayon::prelude::*;
    let m = x
        .par_chunks(1 << 16)
        .map(|c| c.iter().map(|v| v.to_bits() & 0x7FFF).max().unwrap_or(0))
        .max()
        .unwrap_or(0);
    f32::from_bits((m as u32) << 16)
}

/// max |x| over f32 values, likewise (any NaN gives NaN).
pub fn amax_f32(x: &[f32]) -> f32 {
    use rayon::prelude::*;
    let m = x.par_chunks(1 << 16).map(|c| c.iter().map(|v| v.to_bits() & 0x7FFF_FFFF).max().unwrap_or(0)).max().unwrap_or(0);
    f32::from_bits(m)
}
