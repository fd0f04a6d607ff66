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

/// max of the magnitude bits: BF16 (as i16, so the baseline target's SSE2 `pmaxsw` applies)
/// and f32 (as u32; vectorized in the AVX2 copy).
#[inline(always)]
fn amax_bits16_body(x: &[half::bf16]) -> u16 {
    x.iter().map(|v| (v.to_bits() & 0x7FFF) as i16).max().unwrap_or(0) as u16
}

#[inline(always)]
fn amax_bits32_body(x: &[f32]) -> u32 {
    x.iter().map(|v| v.to_bits() & 0x7FFF_FFFF).max().unwrap_or(0)
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
    use std::arch::x86_64::*;

    /// One NVFP4 block of 16 finite values with explicit AVX2: the same operations, in the same
    /// order and precision, as `nvfp4::quantize_row`'s round-to-nearest path (integer max of
    /// the magnitude bits, one scalar E4M3 scale, IEEE divisions, E2M1 by threshold counts),
    /// so the codes and scale are bit-identical to it. Returns the scale code; writes 8 bytes.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn nvfp4_block(x: &[f32], denom6: f32, global: f32, e4m3: &[f32; 256], packed: &mut [u8]) -> u8 {
        assert!(x.len() >= BLOCK);
        // SAFETY: x holds 16 floats (asserted); unaligned loads.
        let (a0, a1) = (_mm256_loadu_ps(x.as_ptr()), _mm256_loadu_ps(x.as_ptr().add(8)));
        nvfp4_block_v(a0, a1, denom6, global, e4m3, packed)
    }

    /// [`nvfp4_block`] reading 16 BF16 values directly (their bits are the f32's high half).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn nvfp4_block_bf16(
        x: &[half::bf16],
        denom6: f32,
        global: f32,
        e4m3: &[f32; 256],
        packed: &mut [u8],
    ) -> u8 {
        assert!(x.len() >= BLOCK);
        // SAFETY: x holds 16 BF16 values = 32 bytes (asserted); unaligned loads.
        let p = x.as_ptr() as *const __m128i;
        let a0 = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p))));
        let a1 = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(1)))));
        nvfp4_block_v(a0, a1, denom6, global, e4m3, packed)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn nvfp4_block_v(
        a0: __m256,
        a1: __m256,
        denom6: f32,
        global: f32,
        e4m3: &[f32; 256],
        packed: &mut [u8],
    ) -> u8 {
        let absmask = _mm256_set1_epi32(0x7FFF_FFFF);
        let m = _mm256_max_epu32(
            _mm256_and_si256(_mm256_castps_si256(a0), absmask),
            _mm256_and_si256(_mm256_castps_si256(a1), absmask),
        );
        let m = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256::<1>(m));
        let m = _mm_max_epu32(m, _mm_shuffle_epi32::<0b01_00_11_10>(m));
        let m = _mm_max_epu32(m, _mm_shuffle_epi32::<0b10_11_00_01>(m));
        let bamax = f32::from_bits(_mm_cvtsi128_si32(m) as u32);
        let mut bs = encode_e4m3_fast(bamax / denom6);
        if bs == 0 {
            bs = 0x38;
        }
        let d = _mm256_set1_ps(e4m3[bs as usize] * global);
        let c0 = e2m1(_mm256_div_ps(a0, d));
        let c1 = e2m1(_mm256_div_ps(a1, d));
        // In each 64-bit lane (even code low, odd code at bit 32): byte 0 = even | odd << 4.
        let s0 = _mm256_or_si256(c0, _mm256_srli_epi64::<28>(c0));
        let s1 = _mm256_or_si256(c1, _mm256_srli_epi64::<28>(c1));
        // Bytes 0 and 8 of each 128-bit lane to positions 0 and 1.
        let pick = _mm256_setr_epi8(
            0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
            -1, -1, -1, -1,
        );
        let s0 = _mm256_shuffle_epi8(s0, pick);
        let s1 = _mm256_shuffle_epi8(s1, pick);
        let word = (_mm256_extract_epi16::<0>(s0) as u16 as u64)
            | ((_mm256_extract_epi16::<8>(s0) as u16 as u64) << 16)
            | ((_mm256_extract_epi16::<0>(s1) as u16 as u64) << 32)
            | ((_mm256_extract_epi16::<8>(s1) as u16 as u64) << 48);
        packed[..8].copy_from_slice(&word.to_le_bytes());
        bs
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn nvfp4_bf16(x: &[half::bf16], global: f32, packed: &mut [u8], scales: &mut [u8]) {
        let (denom6, e4m3) = (6.0 * global, crate::formats::fp8::e4m3_table());
        for (b, (chunk, p)) in x.chunks_exact(BLOCK).zip(packed.chunks_exact_mut(BLOCK / 2)).enumerate() {
            scales[b] = nvfp4_block_bf16(chunk, denom6, global, e4m3, p);
        }
    }

    /// `fp8::encode_e2m1_fast` on 8 lanes: the magnitude code counts the thresholds below |v|
    /// (comparison masks are −1), the sign bit becomes bit 3.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn e2m1(v: __m256) -> __m256i {
        let a = _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF)));
        let t = |c: __m256| _mm256_castps_si256(c);
        let (c1, c2) = (
            t(_mm256_cmp_ps::<_CMP_GT_OQ>(a, _mm256_set1_ps(0.25))),
            t(_mm256_cmp_ps::<_CMP_GE_OQ>(a, _mm256_set1_ps(0.75))),
        );
        let (c3, c4) = (
            t(_mm256_cmp_ps::<_CMP_GT_OQ>(a, _mm256_set1_ps(1.25))),
            t(_mm256_cmp_ps::<_CMP_GE_OQ>(a, _mm256_set1_ps(1.75))),
        );
        let (c5, c6) = (
            t(_mm256_cmp_ps::<_CMP_GT_OQ>(a, _mm256_set1_ps(2.5))),
            t(_mm256_cmp_ps::<_CMP_GE_OQ>(a, _mm256_set1_ps(3.5))),
        );
        let c7 = t(_mm256_cmp_ps::<_CMP_GT_OQ>(a, _mm256_set1_ps(5.0)));
        // A sum tree (the counts are −1 per threshold passed).
        let n = _mm256_add_epi32(
            _mm256_add_epi32(_mm256_add_epi32(c1, c2), _mm256_add_epi32(c3, c4)),
            _mm256_add_epi32(_mm256_add_epi32(c5, c6), c7),
        );
        let code = _mm256_sub_epi32(_mm256_setzero_si256(), n);
        let sign = _mm256_and_si256(_mm256_srli_epi32::<28>(_mm256_castps_si256(v)), _mm256_set1_epi32(8));
        _mm256_or_si256(code, sign)
    }
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn amax(x: &[f32]) -> f32 {
        amax_body(x)
    }
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn amax_bits16(x: &[half::bf16]) -> u16 {
        amax_bits16_body(x)
    }
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn amax_bits32(x: &[f32]) -> u32 {
        amax_bits32_body(x)
    }
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fp8(x: &[f32], scale: f32, out: &mut [u8]) {
        fp8_body(x, scale, out)
    }
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn nvfp4(
        x: &[f32],
        global: f32,
        opts: &Nvfp4Opts,
        signs: Option<&[f32; BLOCK]>,
        first: u64,
        packed: &mut [u8],
        scales: &mut [u8],
    ) {
        if opts.stochastic.is_some() {
            return nvfp4::quantize_row(x, global, opts, signs, first, packed, scales);
        }
        let (denom6, e4m3) = (6.0 * global, crate::formats::fp8::e4m3_table());
        let mut blk = [0.0f32; BLOCK];
        for (b, (chunk, p)) in x.chunks_exact(BLOCK).zip(packed.chunks_exact_mut(BLOCK / 2)).enumerate() {
            let src: &[f32] = match signs {
                Some(s) => {
                    blk.copy_from_slice(chunk);
                    nvfp4::rht_block(&mut blk, s);
                    &blk
                }
                None => chunk,
            };
            scales[b] = nvfp4_block(src, denom6, global, e4m3, p);
        }
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
pub fn quantize_nvfp4(
    x: &[f32],
    global: f32,
    opts: &Nvfp4Opts,
    signs: Option<&[f32; BLOCK]>,
    first: u64,
    packed: &mut [u8],
    scales: &mut [u8],
) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: as above.
        return unsafe { avx2::nvfp4(x, global, opts, signs, first, packed, scales) };
    }
    nvfp4::quantize_row(x, global, opts, signs, first, packed, scales)
}

fn bits16(x: &[half::bf16]) -> u16 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: as above.
        return unsafe { avx2::amax_bits16(x) };
    }
    amax_bits16_body(x)
}

fn bits32(x: &[f32]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: as above.
        return unsafe { avx2::amax_bits32(x) };
    }
    amax_bits32_body(x)
}

/// `quantize_nvfp4` of BF16 values without the RHT or stochastic rounding, reading them
/// directly; None when the CPU lacks AVX2 (the caller converts and uses `quantize_nvfp4`).
pub fn quantize_nvfp4_bf16(x: &[half::bf16], global: f32, packed: &mut [u8], scales: &mut [u8]) -> Option<()> {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: as above.
        unsafe { avx2::nvfp4_bf16(x, global, packed, scales) };
        return Some(());
    }
    let _ = (x, global, packed, scales);
    None
}

/// max |x| over BF16 values: the magnitude bits compared as integers (NaN propagates).
pub fn amax_bf16(x: &[half::bf16]) -> f32 {
    use rayon::prelude::*;
    let m = x.par_chunks(1 << 16).map(bits16).max().unwrap_or(0);
    f32::from_bits((m as u32) << 16)
}

/// max |x| over f32 values, likewise (any NaN gives NaN).
pub fn amax_f32(x: &[f32]) -> f32 {
    use rayon::prelude::*;
    let m = x.par_chunks(1 << 16).map(bits32).max().unwrap_or(0);
    f32::from_bits(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The explicit AVX2 NVFP4 path against the scalar definition (`nvfp4::quantize_row`), bit
    /// for bit: random magnitudes over many octaves, every E2M1 rounding threshold and tie
    /// (scaled by the block's own scale), signed zeros, zero blocks, with and without the RHT.
    #[test]
    fn nvfp4_vector_path_equals_the_scalar_definition() {
        let mut s = crate::rand::Stream::new(5, 1);
        let mut x = Vec::new();
        for b in 0..512 {
            let oct = (b % 40) - 20;
            for j in 0..BLOCK {
                x.push((s.normal() as f32) * 2f32.powi(oct) * if j == 3 { 6.0 } else { 1.0 });
            }
        }
        // Blocks whose max is 6 units, so q = v exactly: the thresholds and ties themselves.
        let edges = [0.0, -0.0, 0.25, 0.2499, 0.2501, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 4.999, 5.001, -0.75, -2.5, 6.0];
        for scale in [1.0f32, 0.5, 3.0, 1e-3] {
            x.extend(edges.iter().map(|v| v * scale));
        }
        x.extend([0.0f32; BLOCK]);
        let global = nvfp4::global_scale(x.iter().fold(0.0f32, |a, v| a.max(v.abs())));
        for signs in [None, Some(nvfp4::rht_signs(9))] {
            let (mut p1, mut s1) = (vec![0u8; x.len() / 2], vec![0u8; x.len() / BLOCK]);
            let (mut p2, mut s2) = (p1.clone(), s1.clone());
            let opts = Nvfp4Opts::default();
            nvfp4::quantize_row(&x, global, &opts, signs.as_ref(), 0, &mut p1, &mut s1);
            quantize_nvfp4(&x, global, &opts, signs.as_ref(), 0, &mut p2, &mut s2);
            assert_eq!(s1, s2, "block scales (rht {})", signs.is_some());
            let bad = p1.iter().zip(&p2).position(|(a, b)| a != b);
            assert!(bad.is_none(), "codes differ at byte {bad:?} (rht {})", signs.is_some());
        }
        // BF16 sources read directly: the same as converting to f32 first.
        let xb: Vec<half::bf16> = x.iter().map(|&v| half::bf16::from_f32(v)).collect();
        let xf: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
        let (mut p1, mut s1) = (vec![0u8; x.len() / 2], vec![0u8; x.len() / BLOCK]);
        let (mut p2, mut s2) = (p1.clone(), s1.clone());
        nvfp4::quantize_row(&xf, global, &Nvfp4Opts::default(), None, 0, &mut p1, &mut s1);
        if quantize_nvfp4_bf16(&xb, global, &mut p2, &mut s2).is_some() {
            assert_eq!((s1, p1), (s2, p2), "BF16 path");
        }
    }
}
