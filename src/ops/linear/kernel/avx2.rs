//! The AVX2 + FMA kernels of the CPU linear (`super`): the 8-lane register tile and the panel packing.
//! Owns nothing. May call: std::arch. Must not touch: anything else.

use super::{Out, Prefetch, G};
use std::arch::x86_64::*;

tile_fn!(
    tile8,
    "avx2,fma",
    __m256,
    8,
    _mm256_setzero_ps,
    _mm256_loadu_ps,
    _mm256_set1_ps,
    _mm256_fmadd_ps,
    _mm256_storeu_ps,
    |_: &[__m256; C], _, _, _, _| false
);

/// # Safety
/// As [`super::block`] for 8 lanes of one row group and `c` ≤ 8 columns of a panel; AVX2+FMA.
#[allow(clippy::too_many_arguments)]
pub unsafe fn tile8_dispatch(
    c: usize,
    rows: usize,
    k: usize,
    xg: *const f32,
    w: *const f32,
    pf: Prefetch,
    y: *mut f32,
    ldy: usize,
    a: Out,
) {
    by_width!(c, tile8, (rows, k, xg, w, pf, y, ldy, a), [1 2 3 4 5 6 7 8])
}

/// d (k, G) ← 16 rows of src (16, k), p < k / 8 · 8: 8 × 8 transposes in registers.
///
/// # Safety
/// The CPU has AVX2; src holds 16 rows of k values and d k · G values.
#[target_feature(enable = "avx2")]
pub unsafe fn pack_panel(src: &[f32], k: usize, d: &mut [f32], pf: Prefetch) {
    assert!(src.len() >= G * k && d.len() >= G * k);
    let (s, o) = (src.as_ptr(), d.as_mut_ptr());
    // 2 · k/8 transposes; four lines of `pf` each covers a panel of f32 rows.
    let mut line = 0;
    for c0 in [0, 8] {
        let mut p = 0;
        while p + 8 <= k {
            for _ in 0..4 {
                pf.line(line);
                line += 1;
            }
            // (A loop, not array::from_fn: a closure would not inherit the target features.)
            let mut r = [_mm256_setzero_ps(); 8];
            for (i, v) in r.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(s.add((c0 + i) * k + p));
            }
            let t0 = _mm256_unpacklo_ps(r[0], r[1]);
            let t1 = _mm256_unpackhi_ps(r[0], r[1]);
            let t2 = _mm256_unpacklo_ps(r[2], r[3]);
            let t3 = _mm256_unpackhi_ps(r[2], r[3]);
            let t4 = _mm256_unpacklo_ps(r[4], r[5]);
            let t5 = _mm256_unpackhi_ps(r[4], r[5]);
            let t6 = _mm256_unpacklo_ps(r[6], r[7]);
            let t7 = _mm256_unpackhi_ps(r[6], r[7]);
            let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
            let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
            let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
            let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
            let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
            let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
            let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
            let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
            // Column j of the 8 × 8 block: x[c0..c0+8][p + j].
            let cols = [
                _mm256_permute2f128_ps::<0x20>(u0, u4),
                _mm256_permute2f128_ps::<0x20>(u1, u5),
                _mm256_permute2f128_ps::<0x20>(u2, u6),
                _mm256_permute2f128_ps::<0x20>(u3, u7),
                _mm256_permute2f128_ps::<0x31>(u0, u4),
                _mm256_permute2f128_ps::<0x31>(u1, u5),
                _mm256_permute2f128_ps::<0x31>(u2, u6),
                _mm256_permute2f128_ps::<0x31>(u3, u7),
            ];
            for (j, v) in cols.iter().enumerate() {
                _mm256_storeu_ps(o.add((p + j) * G + c0), *v);
            }
            p += 8;
        }
    }
}
