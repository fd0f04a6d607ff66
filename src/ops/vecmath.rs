//! The CPU kernels behind a row's softmax statistics: the f32 exponential [`exp_f32`], the
//! scaled maximum max_i z_i / T, the weights exp(z_i / T − max) and their f64 sum. Scoring,
//! sampling and the engine's log-probs all go through these (via
//! `logprob::row_log_normalizer` and `sample::sample_row`), so the engine's numbers come from
//! one definition. The engine's attention weights and SwiGLU gate use the same exponential
//! ([`exp_sub_with`], [`silu_mul_with`]), so decode results do not depend on the C library's expf.
//!
//! Every result is bit-identical on AVX-512, AVX2 + FMA and the portable path:
//! - [`exp_f32`] is one fixed sequence of f32 operations, and each vector lane runs exactly that
//!   sequence. There are no table lookups, and every multiply-add is one fused operation.
//! - z / T is an IEEE division in every path, and the maximum ignores NaN in every path.
//! - the sum has 16 f64 lanes: lane j adds the terms i ≡ j (mod 16) in increasing i; then a fixed
//!   pairwise tree joins them (0..8 + 8..16, then 4, 2, 1). Vector f64 adds round like scalar
//!   ones.
//!
//! Owns no state. May call: std::arch (through `super::isa`). Must not touch: devices, tensors, rayon.

use super::isa::Isa;

/// Largest x whose exp is finite in f32 (above it: +inf).
const EXP_HI: f32 = 88.722_83;
/// Below this, exp(x) rounds to 0 in f32 (the polynomial is evaluated at the clamp).
const EXP_LO: f32 = -104.0;
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split so that n · LN2_HI is exact for |n| ≤ 2^9.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Minimax coefficients of (exp(r) − 1 − r) / r² on |r| ≤ ln2 / 2 (Cephes expf), highest first,
/// as f32 (the last one is exactly 1/2).
const P: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5];

/// e^x in f32, within 2 ulp of the true value for normal results; subnormal results are rounded
/// once; +inf above 88.72, 0 far below, NaN for NaN. The reference: every vector path below runs
/// these operations in this order.
#[inline]
pub fn exp_f32(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x > EXP_HI {
        return f32::INFINITY;
    }
    let xc = x.max(EXP_LO);
    let n = (xc * LOG2E).round_ties_even();
    let r = (-n).mul_add(LN2_HI, xc);
    let r = (-n).mul_add(LN2_LO, r);
    let mut p = P[0];
    for &c in &P[1..] {
        p = p.mul_add(r, c);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    // y · 2^n as two exact power-of-two scalings, so a subnormal result is rounded once.
    let ni = n as i32;
    let a = ni >> 1;
    let b = ni - a;
    y * f32::from_bits(((a + 127) as u32) << 23) * f32::from_bits(((b + 127) as u32) << 23)
}

/// max_i z_i / T, ignoring NaN (−inf for an empty or all-NaN row); a zero maximum is +0 (the
/// paths would otherwise pick −0 or +0 by position).
pub fn scaled_max(z: &[f32], t: f32) -> f32 {
    scaled_max_with(Isa::detect(), z, t)
}

/// The first i with z[i] == v (IEEE equality: −0 == +0, NaN equals nothing), 16 at a time
/// (greedy decoding's argmax, once the row's max is known).
pub fn first_equal(z: &[f32], v: f32) -> Option<usize> {
    first_equal_with(Isa::detect(), z, v)
}

fn first_equal_with(isa: Isa, z: &[f32], v: f32) -> Option<usize> {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::detect()` returned Avx512 only after detecting AVX-512F.
        Isa::Avx512 => unsafe { x86::first_equal512(z, v) },
        _ => z.iter().position(|&x| x == v),
    }
}

/// out[i] = exp_f32(z[i] / T − mx), i < z.len() (out at least as long).
pub fn exp_shifted(z: &[f32], t: f32, mx: f32, out: &mut [f32]) {
    exp_shifted_with(Isa::detect(), z, t, mx, &mut out[..z.len()]);
}

/// Σ_i exp_f32(z_i / T − mx) as f64, in the 16-lane order of the module comment.
pub fn sum_exp_shifted(z: &[f32], t: f32, mx: f32) -> f64 {
    sum_exp_shifted_with(Isa::detect(), z, t, mx)
}

fn scaled_max_with(isa: Isa, z: &[f32], t: f32) -> f32 {
    0.0 + match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::detect()` returned Avx512 / Avx2 only after detecting those features.
        Isa::Avx512 => unsafe { x86::max512(z, t) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { x86::max256(z, t) },
        _ => z.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b / t)),
    }
}

fn exp_shifted_with(isa: Isa, z: &[f32], t: f32, mx: f32, out: &mut [f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: features detected by `Isa::detect()`; `out` has z.len() elements (checked by slicing).
        Isa::Avx512 => unsafe { x86::exp512(z, t, mx, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { x86::exp256(z, t, mx, out) },
        _ => {
            for (o, &x) in out.iter_mut().zip(z) {
                *o = exp_f32(x / t - mx);
            }
        }
    }
}

/// x[i] = exp_f32(x[i] − m) in place (attention's chunk weights), the same bits on every ISA.
pub(crate) fn exp_sub_with(isa: Isa, x: &mut [f32], m: f32) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: features detected by `Isa::detect()`.
        Isa::Avx512 => unsafe { x86::exp_sub512(x, m) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { x86::exp_sub256(x, m) },
        _ => x.iter_mut().for_each(|v| *v = exp_f32(*v - m)),
    }
}

/// silu(g) = g / (1 + exp_f32(−g)): the engine's SwiGLU gate (`elementwise::swiglu`).
#[inline]
pub fn silu(g: f32) -> f32 {
    g / (1.0 + exp_f32(-g))
}

/// o[i] = silu(g[i]) · u[i], the same bits on every ISA (o, g, u of one length).
pub(crate) fn silu_mul_with(isa: Isa, g: &[f32], u: &[f32], o: &mut [f32]) {
    let n = o.len();
    let (g, u) = (&g[..n], &u[..n]);
    let done = match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: features detected by `Isa::detect()`; the slices have n elements.
        Isa::Avx512 => unsafe { x86::silu_mul512(g, u, o) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { x86::silu_mul256(g, u, o) },
        _ => 0,
    };
    for i in done..n {
        o[i] = silu(g[i]) * u[i];
    }
}

/// The fixed tree over the 16 lanes.
fn join(mut l: [f64; 16]) -> f64 {
    let mut w = 8;
    while w > 0 {
        for j in 0..w {
            l[j] += l[j + w];
        }
        w /= 2;
    }
    l[0]
}

fn sum_exp_shifted_with(isa: Isa, z: &[f32], t: f32, mx: f32) -> f64 {
    let body = z.len() / 16 * 16;
    let mut lanes = [0.0f64; 16];
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: features detected by `Isa::detect()`; the kernel reads z[..body] only.
        Isa::Avx512 => unsafe { x86::sum512(&z[..body], t, mx, &mut lanes) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { x86::sum256(&z[..body], t, mx, &mut lanes) },
        _ => {
            for c in z[..body].chunks_exact(16) {
                for (l, &x) in lanes.iter_mut().zip(c) {
                    *l += exp_f32(x / t - mx) as f64;
                }
            }
        }
    }
    for (j, &x) in z[body..].iter().enumerate() {
        lanes[j] += exp_f32(x / t - mx) as f64;
    }
    join(lanes)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The vector twins of `exp_f32` and the row passes. Each takes slices whose lengths its
    //! caller checked; tails shorter than a vector run the scalar `exp_f32`.
    use super::{exp_f32, EXP_HI, EXP_LO, LN2_HI, LN2_LO, LOG2E, P};
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx512f")]
    fn exp16(x: __m512) -> __m512 {
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
        let over = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_set1_ps(EXP_HI));
        // max(x, lo) with x first: a NaN x yields lo here and is restored at the end.
        let xc = _mm512_max_ps(x, _mm512_set1_ps(EXP_LO));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
            xc,
            _mm512_set1_ps(LOG2E),
        ));
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), xc);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
        let mut p = _mm512_set1_ps(P[0]);
        for &c in &P[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        let y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0));
        let ni = _mm512_cvtps_epi32(n);
        let a = _mm512_srai_epi32::<1>(ni);
        let b = _mm512_sub_epi32(ni, a);
        let bias = _mm512_set1_epi32(127);
        let sa = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(a, bias)));
        let sb = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(b, bias)));
        let res = _mm512_mul_ps(_mm512_mul_ps(y, sa), sb);
        let res = _mm512_mask_mov_ps(res, over, _mm512_set1_ps(f32::INFINITY));
        _mm512_mask_mov_ps(res, nan, x)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp8(x: __m256) -> __m256 {
        let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x);
        let over = _mm256_cmp_ps::<_CMP_GT_OQ>(x, _mm256_set1_ps(EXP_HI));
        let xc = _mm256_max_ps(x, _mm256_set1_ps(EXP_LO));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
            xc,
            _mm256_set1_ps(LOG2E),
        ));
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), xc);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
        let mut p = _mm256_set1_ps(P[0]);
        for &c in &P[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0));
        let ni = _mm256_cvtps_epi32(n);
        let a = _mm256_srai_epi32::<1>(ni);
        let b = _mm256_sub_epi32(ni, a);
        let bias = _mm256_set1_epi32(127);
        let sa = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(a, bias)));
        let sb = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(b, bias)));
        let res = _mm256_mul_ps(_mm256_mul_ps(y, sa), sb);
        let res = _mm256_blendv_ps(res, _mm256_set1_ps(f32::INFINITY), over);
        _mm256_blendv_ps(res, x, nan)
    }

    /// x / T, skipping the division at T = 1 (x / 1 is x, bit for bit: greedy decoding's
    /// log-probs and scoring run at T = 1, and a vector division costs more than the exp).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn div16(x: __m512, tv: __m512, t: f32) -> __m512 {
        if t == 1.0 {
            x
        } else {
            _mm512_div_ps(x, tv)
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn div8(x: __m256, tv: __m256, t: f32) -> __m256 {
        if t == 1.0 {
            x
        } else {
            _mm256_div_ps(x, tv)
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) fn first_equal512(z: &[f32], v: f32) -> Option<usize> {
        let vv = _mm512_set1_ps(v);
        let chunks = z.chunks_exact(16);
        let tail = chunks.remainder();
        for (c, x) in chunks.enumerate() {
            // SAFETY: `x` has 16 elements.
            let hit = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(unsafe { _mm512_loadu_ps(x.as_ptr()) }, vv);
            if hit != 0 {
                return Some(16 * c + hit.trailing_zeros() as usize);
            }
        }
        tail.iter().position(|&x| x == v).map(|i| z.len() - tail.len() + i)
    }

    /// x[i] = exp(x[i] − m), 16 lanes at a time, the tail masked.
    #[target_feature(enable = "avx512f")]
    pub(super) fn exp_sub512(x: &mut [f32], m: f32) {
        let mv = _mm512_set1_ps(m);
        for c in x.chunks_mut(16) {
            let k: __mmask16 = if c.len() == 16 { 0xFFFF } else { (1u16 << c.len()) - 1 };
            // SAFETY: the mask covers c.len() ≤ 16 elements of c.
            unsafe {
                let v = _mm512_maskz_loadu_ps(k, c.as_ptr());
                _mm512_mask_storeu_ps(c.as_mut_ptr(), k, exp16(_mm512_sub_ps(v, mv)));
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn exp_sub256(x: &mut [f32], m: f32) {
        let mv = _mm256_set1_ps(m);
        let n = x.len() / 8 * 8;
        for c in x[..n].chunks_exact_mut(8) {
            // SAFETY: `c` has 8 elements.
            unsafe { _mm256_storeu_ps(c.as_mut_ptr(), exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), mv))) };
        }
        for v in &mut x[n..] {
            *v = exp_f32(*v - m);
        }
    }

    /// o = silu(g)·u for the first n / 16 · 16 elements; returns how many.
    #[target_feature(enable = "avx512f")]
    pub(super) fn silu_mul512(g: &[f32], u: &[f32], o: &mut [f32]) -> usize {
        let n = o.len().min(g.len()).min(u.len()) / 16 * 16;
        let (one, sign) = (_mm512_set1_ps(1.0), _mm512_set1_epi32(i32::MIN));
        for i in (0..n).step_by(16) {
            // SAFETY: i + 16 ≤ n ≤ every length.
            unsafe {
                let gv = _mm512_loadu_ps(g.as_ptr().add(i));
                // −g flips the sign bit, as scalar negation does.
                let neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gv), sign));
                let s = _mm512_div_ps(gv, _mm512_add_ps(one, exp16(neg)));
                _mm512_storeu_ps(o.as_mut_ptr().add(i), _mm512_mul_ps(s, _mm512_loadu_ps(u.as_ptr().add(i))));
            }
        }
        n
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn silu_mul256(g: &[f32], u: &[f32], o: &mut [f32]) -> usize {
        let n = o.len().min(g.len()).min(u.len()) / 8 * 8;
        let (one, sign) = (_mm256_set1_ps(1.0), _mm256_set1_ps(-0.0));
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 ≤ n ≤ every length.
            unsafe {
                let gv = _mm256_loadu_ps(g.as_ptr().add(i));
                let s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_xor_ps(gv, sign))));
                _mm256_storeu_ps(o.as_mut_ptr().add(i), _mm256_mul_ps(s, _mm256_loadu_ps(u.as_ptr().add(i))));
            }
        }
        n
    }

    #[target_feature(enable = "avx512f")]
    pub(super) fn max512(z: &[f32], t: f32) -> f32 {
        let tv = _mm512_set1_ps(t);
        let mut acc = _mm512_set1_ps(f32::NEG_INFINITY);
        let chunks = z.chunks_exact(16);
        let tail = chunks.remainder();
        for c in chunks {
            // SAFETY: `c` has 16 elements.
            let x = div16(unsafe { _mm512_loadu_ps(c.as_ptr()) }, tv, t);
            acc = _mm512_max_ps(x, acc); // a NaN x yields acc
        }
        let mut l = [0.0f32; 16];
        // SAFETY: `l` has 16 elements.
        unsafe { _mm512_storeu_ps(l.as_mut_ptr(), acc) };
        tail.iter().fold(l.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)), |a, &b| a.max(b / t))
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn max256(z: &[f32], t: f32) -> f32 {
        let tv = _mm256_set1_ps(t);
        let mut acc = _mm256_set1_ps(f32::NEG_INFINITY);
        let chunks = z.chunks_exact(8);
        let tail = chunks.remainder();
        for c in chunks {
            // SAFETY: `c` has 8 elements.
            let x = div8(unsafe { _mm256_loadu_ps(c.as_ptr()) }, tv, t);
            acc = _mm256_max_ps(x, acc);
        }
        let mut l = [0.0f32; 8];
        // SAFETY: `l` has 8 elements.
        unsafe { _mm256_storeu_ps(l.as_mut_ptr(), acc) };
        tail.iter().fold(l.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)), |a, &b| a.max(b / t))
    }

    #[target_feature(enable = "avx512f")]
    pub(super) fn exp512(z: &[f32], t: f32, mx: f32, out: &mut [f32]) {
        let (tv, mv) = (_mm512_set1_ps(t), _mm512_set1_ps(mx));
        let n = z.len() / 16 * 16;
        for (c, o) in z[..n].chunks_exact(16).zip(out[..n].chunks_exact_mut(16)) {
            // SAFETY: `c` and `o` have 16 elements.
            unsafe {
                let x = _mm512_sub_ps(div16(_mm512_loadu_ps(c.as_ptr()), tv, t), mv);
                _mm512_storeu_ps(o.as_mut_ptr(), exp16(x));
            }
        }
        for (o, &x) in out[n..].iter_mut().zip(&z[n..]) {
            *o = exp_f32(x / t - mx);
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn exp256(z: &[f32], t: f32, mx: f32, out: &mut [f32]) {
        let (tv, mv) = (_mm256_set1_ps(t), _mm256_set1_ps(mx));
        let n = z.len() / 8 * 8;
        for (c, o) in z[..n].chunks_exact(8).zip(out[..n].chunks_exact_mut(8)) {
            // SAFETY: `c` and `o` have 8 elements.
            unsafe {
                let x = _mm256_sub_ps(div8(_mm256_loadu_ps(c.as_ptr()), tv, t), mv);
                _mm256_storeu_ps(o.as_mut_ptr(), exp8(x));
            }
        }
        for (o, &x) in out[n..].iter_mut().zip(&z[n..]) {
            *o = exp_f32(x / t - mx);
        }
    }

    /// lanes[j] += Σ over the 16-chunks of z of exp(z[16c + j] / T − mx); z.len() % 16 == 0.
    #[target_feature(enable = "avx512f")]
    pub(super) fn sum512(z: &[f32], t: f32, mx: f32, lanes: &mut [f64; 16]) {
        let (tv, mv) = (_mm512_set1_ps(t), _mm512_set1_ps(mx));
        // SAFETY: `lanes` has 16 f64.
        let (mut lo, mut hi) = unsafe { (_mm512_loadu_pd(lanes.as_ptr()), _mm512_loadu_pd(lanes.as_ptr().add(8))) };
        for c in z.chunks_exact(16) {
            // SAFETY: `c` has 16 elements.
            let e = exp16(_mm512_sub_ps(div16(unsafe { _mm512_loadu_ps(c.as_ptr()) }, tv, t), mv));
            lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
            hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(e)))));
        }
        // SAFETY: as above.
        unsafe {
            _mm512_storeu_pd(lanes.as_mut_ptr(), lo);
            _mm512_storeu_pd(lanes.as_mut_ptr().add(8), hi);
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn sum256(z: &[f32], t: f32, mx: f32, lanes: &mut [f64; 16]) {
        let (tv, mv) = (_mm256_set1_ps(t), _mm256_set1_ps(mx));
        let p = lanes.as_mut_ptr();
        // SAFETY: `lanes` has 16 f64: four groups of 4.
        let mut acc = unsafe {
            [_mm256_loadu_pd(p), _mm256_loadu_pd(p.add(4)), _mm256_loadu_pd(p.add(8)), _mm256_loadu_pd(p.add(12))]
        };
        for c in z.chunks_exact(16) {
            for half in 0..2 {
                // SAFETY: `c` has 16 elements; each half is 8.
                let e = exp8(_mm256_sub_ps(div8(unsafe { _mm256_loadu_ps(c.as_ptr().add(8 * half)) }, tv, t), mv));
                acc[2 * half] = _mm256_add_pd(acc[2 * half], _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
                acc[2 * half + 1] = _mm256_add_pd(acc[2 * half + 1], _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(e)));
            }
        }
        for (g, a) in acc.iter().enumerate() {
            // SAFETY: 4 f64 at offset 4g < 16.
            unsafe { _mm256_storeu_pd(p.add(4 * g), *a) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Units in the last place between a and the f64 reference b (for normal results).
    fn ulps(a: f32, b: f64) -> f64 {
        let ulp = (b.abs() as f32).max(f32::MIN_POSITIVE);
        let ulp = f32::from_bits(ulp.to_bits() + 1) - ulp;
        (a as f64 - b).abs() / ulp as f64
    }

    #[test]
    fn exp_is_within_2_ulp_of_f64_and_handles_the_edges() {
        let mut worst = 0.0f64;
        let mut s = crate::rand::Stream::new(5, 5);
        for i in 0..200_000 {
            let x = if i < 100_000 { -87.0 + 175.0 * s.uniform() as f32 } else { -20.0 * s.uniform() as f32 };
            let want = (x as f64).exp();
            if want < f32::MIN_POSITIVE as f64 || want > f32::MAX as f64 {
                continue;
            }
            worst = worst.max(ulps(exp_f32(x), want));
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(-0.0), 1.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(-200.0), 0.0);
        assert_eq!(exp_f32(89.0), f32::INFINITY);
        assert_eq!(exp_f32(f32::INFINITY), f32::INFINITY);
        assert!(exp_f32(f32::NAN).is_nan());
        assert!(exp_f32(88.7).is_finite());
        // Subnormal results: one rounding of the true value (within 1 subnormal step + 2 ulp of
        // the polynomial's relative error).
        for x in [-88.0f32, -95.5, -100.0, -103.0] {
            let want = (x as f64).exp();
            let step = f32::from_bits(1) as f64;
            assert!((exp_f32(x) as f64 - want).abs() <= step + 4.0 * f32::EPSILON as f64 * want, "exp({x})");
        }
    }

    #[test]
    fn a_zero_maximum_is_positive_on_every_isa() {
        let mut z = vec![-1.0f32; 40];
        z[1] = -0.0;
        z[16] = 0.0;
        for isa in Isa::available() {
            assert_eq!(scaled_max_with(isa, &z, 1.0).to_bits(), 0.0f32.to_bits(), "{isa:?}");
        }
        z[16] = -2.0;
        assert_eq!(scaled_max(&z, 1.0).to_bits(), 0.0f32.to_bits(), "a lone -0 maximum");
    }

    #[test]
    fn every_isa_gives_the_same_bits() {
        let mut s = crate::rand::Stream::new(6, 6);
        for n in [0usize, 1, 7, 15, 16, 17, 33, 1000, 32000 + 5] {
            let mut z: Vec<f32> = (0..n).map(|_| (6.0 * s.normal()) as f32).collect();
            if n > 20 {
                z[3] = f32::NAN;
                z[9] = -1e30;
                z[12] = -0.0;
            }
            for t in [1.0f32, 0.7] {
                let ref_max = scaled_max_with(Isa::Portable, &z, t);
                let ref_sum = sum_exp_shifted_with(Isa::Portable, &z, t, ref_max);
                let mut ref_w = vec![0.0f32; n];
                exp_shifted_with(Isa::Portable, &z, t, ref_max, &mut ref_w);
                for isa in Isa::available() {
                    assert_eq!(scaled_max_with(isa, &z, t).to_bits(), ref_max.to_bits(), "{isa:?} max n={n}");
                    assert_eq!(
                        sum_exp_shifted_with(isa, &z, t, ref_max).to_bits(),
                        ref_sum.to_bits(),
                        "{isa:?} sum n={n}"
                    );
                    let mut w = vec![1.0f32; n];
                    exp_shifted_with(isa, &z, t, ref_max, &mut w);
                    let same = w.iter().zip(&ref_w).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{isa:?} weights n={n}");
                }
                // The portable path is the written-out definition.
                let mut lanes = [0.0f64; 16];
                for (i, &x) in z.iter().enumerate() {
                    lanes[i % 16] += exp_f32(x / t - ref_max) as f64;
                }
                let mut w = 8;
                while w > 0 {
                    for j in 0..w {
                        lanes[j] += lanes[j + w];
                    }
                    w /= 2;
                }
                assert_eq!(ref_sum.to_bits(), lanes[0].to_bits(), "definition n={n}");
                let m =
                    z.iter().filter(|x| !x.is_nan()).fold(f32::NEG_INFINITY, |a, &b| if b / t > a { b / t } else { a });
                assert_eq!(ref_max, m, "max n={n}");
            }
        }
    }

    #[test]
    fn silu_matches_f64_and_every_isa_gives_its_bits() {
        // |silu(g) − g/(1+e^−g) (f64)| ≤ 1e-30 + 4 ulp·|ref| (exp_f32 is within 2 ulp; one add,
        // one division round once each); the vector paths equal the scalar definition bit for
        // bit, edges included (±0, ±inf, NaN, huge |g|), for every tail length.
        let mut s = crate::rand::Stream::new(8, 8);
        let mut g: Vec<f32> = (0..1000).map(|_| (8.0 * s.normal()) as f32).collect();
        g.extend([0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 100.0, -100.0, 1e-30, -1e-30, 88.0, -88.0]);
        let u: Vec<f32> = (0..g.len()).map(|i| if i % 3 == 0 { 1.0 } else { s.normal() as f32 }).collect();
        for &x in &g[..1000] {
            let want = x as f64 / (1.0 + (-(x as f64)).exp());
            let tol = 1e-30 + 4.0 * f32::EPSILON as f64 * want.abs();
            assert!((silu(x) as f64 - want).abs() <= tol, "silu({x}) = {} vs {want}", silu(x));
        }
        assert_eq!(silu(f32::INFINITY), f32::INFINITY);
        assert!(silu(-100.0) <= 0.0 && silu(-100.0) > -1e-40, "silu(−100) = −100·e^−100 ≈ −3.7e-42");
        assert_eq!(silu(0.0), 0.0);
        for n in [0usize, 1, 7, 8, 15, 16, 17, 31, g.len()] {
            let want: Vec<f32> = (0..n).map(|i| silu(g[i]) * u[i]).collect();
            for isa in Isa::available() {
                let mut o = vec![f32::NAN; n];
                silu_mul_with(isa, &g[..n], &u[..n], &mut o);
                let same = o.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{isa:?} n={n}");
            }
        }
    }

    #[test]
    fn shifted_exp_in_place_is_the_scalar_definition_on_every_isa() {
        let mut s = crate::rand::Stream::new(9, 9);
        for n in 0..=40 {
            let x: Vec<f32> = (0..n).map(|_| (5.0 * s.normal()) as f32).collect();
            let m = 1.25f32;
            let want: Vec<f32> = x.iter().map(|&v| exp_f32(v - m)).collect();
            for isa in Isa::available() {
                let mut y = x.clone();
                exp_sub_with(isa, &mut y, m);
                assert!(y.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{isa:?} n={n}");
            }
        }
    }

    #[test]
    fn first_equal_is_position_on_every_isa() {
        let mut s = crate::rand::Stream::new(10, 10);
        for n in [0usize, 1, 15, 16, 17, 33, 1000] {
            let mut z: Vec<f32> = (0..n).map(|_| s.normal() as f32).collect();
            if n > 20 {
                z[5] = f32::NAN;
                z[n - 3] = -0.0;
                z[n - 1] = 0.0;
            }
            let probes: Vec<f32> = z.iter().copied().chain([0.0, -0.0, f32::NAN, 9.0]).collect();
            for &v in &probes {
                let want = z.iter().position(|&x| x == v);
                for isa in Isa::available() {
                    assert_eq!(first_equal_with(isa, &z, v), want, "{isa:?} n={n} v={v}");
                }
            }
        }
    }
}
