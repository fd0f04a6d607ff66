//! The CPU kernel behind `ops::linear` (y = x · Wᵀ for an nn.Linear weight W (N, K)): a
//! register-blocked dot-product kernel (3 rows of x × 4 rows of W per tile, 8 f32 lanes along
//! K, AVX2+FMA when the CPU has them), tiled so that a block of W stays in cache while every
//! row of x streams past it, parallel over (row block, weight block) tiles.
//!
//! Two properties the decoding engine relies on:
//! - **Batch invariance**: every output element is reduced over K in the same order (8 lane
//!   partial sums, a fixed horizontal sum, then the K % 8 tail), whatever the number of rows,
//!   their position in the batch or the tiling. So a sequence's logits do not depend on what
//!   else is in the batch, and samples are reproducible across batch sizes and arrival orders.
//! - **No allocation in steady state**: BF16/F16 weight blocks are widened into thread-local
//!   scratch that is grown once. (The `gemm` crate, used for the large training GEMMs in
//!   `gemm_cpu`, allocates packing buffers on every call.)

use super::gemm_cpu::SendPtr;
use crate::device::CpuFloats;
use rayon::prelude::*;
use std::cell::RefCell;

const MR: usize = 3;
const NR: usize = 4;
/// Rows of x per task.
const MB: usize = 3 * 64;

thread_local! {
    static WIDE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Grows this thread's widening scratch to at least `n` values.
pub fn reserve(n: usize) {
    WIDE.with(|s| {
        let mut s = s.borrow_mut();
        if s.len() < n {
            s.resize(n, 0.0);
        }
    });
}

/// y[i·ldy + j] (+)= Σ_p x[i·k + p] · w[j·k + p] for i < m, j < n.
pub fn linear_nt(m: usize, n: usize, k: usize, x: &[f32], w: CpuFloats, y: &mut [f32], ldy: usize, accumulate: bool) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(x.len() >= m * k, "linear: x too short");
    assert!(w.len() >= n * k, "linear: w too short");
    assert!(y.len() >= (m - 1) * ldy + n, "linear: y too short");
    let threads = rayon::current_num_threads().max(1);
    // Weight rows per task: enough tasks for every thread, at most 64 rows (a cache-sized block).
    let nb = (n.div_ceil(threads * 2)).next_multiple_of(NR).clamp(NR, 64);
    let n_tasks = n.div_ceil(nb);
    let m_tasks = m.div_ceil(MB);
    let yp = SendPtr(y.as_mut_ptr());
    (0..n_tasks * m_tasks).into_par_iter().for_each(|t| {
        let (bj, bi) = (t / m_tasks, t % m_tasks);
        let (j0, i0) = (bj * nb, bi * MB);
        let (nj, mi) = (nb.min(n - j0), MB.min(m - i0));
        let run = |wblk: &[f32]| {
            // SAFETY: tile (i0.., j0..) of y is written by this task only (tasks partition
            // rows × columns), and the extent was checked above.
            unsafe { block(mi, nj, k, &x[i0 * k..], wblk, yp.get().add(i0 * ldy + j0), ldy, accumulate) }
        };
        match w {
            CpuFloats::F32(wd) => run(&wd[j0 * k..(j0 + nj) * k]),
            _ => WIDE.with(|s| {
                let mut s = s.borrow_mut();
                if s.len() < nj * k {
                    s.resize(nj * k, 0.0);
                }
                w.read_into(j0 * k, &mut s[..nj * k]);
                run(&s[..nj * k]);
            }),
        }
    });
}

/// # Safety
/// y must be valid for writes at i·ldy + j for i < m, j < n and not accessed concurrently there.
unsafe fn block(m: usize, n: usize, k: usize, x: &[f32], w: &[f32], y: *mut f32, ldy: usize, acc: bool) {
    #[cfg(target_arch = "x86_64")]
    let fast = std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma");
    #[cfg(not(target_arch = "x86_64"))]
    let fast = false;
    let mut i = 0;
    while i < m {
        let mr = MR.min(m - i);
        let mut j = 0;
        while j < n {
            let nr = NR.min(n - j);
            let (xp, wp, yp) = (x.as_ptr().add(i * k), w.as_ptr().add(j * k), y.add(i * ldy + j));
            if fast {
                #[cfg(target_arch = "x86_64")]
                avx::tile_dispatch(mr, nr, k, xp, wp, yp, ldy, acc);
            } else {
                portable::tile(mr, nr, k, xp, wp, yp, ldy, acc);
            }
            j += nr;
        }
        i += mr;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx {
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi); // (l0+l4, l1+l5, l2+l6, l3+l7)
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s)); // (s0+s2, s1+s3, ..)
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1)); // (s0+s2)+(s1+s3)
        _mm_cvtss_f32(s)
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile<const R: usize, const C: usize>(
        k: usize,
        x: *const f32,
        w: *const f32,
        y: *mut f32,
        ldy: usize,
        accumulate: bool,
    ) {
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        let kv = k / 8 * 8;
        let mut p = 0;
        while p < kv {
            let mut wv = [_mm256_setzero_ps(); C];
            for (j, v) in wv.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(w.add(j * k + p));
            }
            for (i, a) in acc.iter_mut().enumerate() {
                let xv = _mm256_loadu_ps(x.add(i * k + p));
                for j in 0..C {
                    a[j] = _mm256_fmadd_ps(xv, wv[j], a[j]);
                }
            }
            p += 8;
        }
        for (i, a) in acc.iter().enumerate() {
            for (j, v) in a.iter().enumerate() {
                let mut s = hsum(*v);
                for q in kv..k {
                    s = (*x.add(i * k + q)).mul_add(*w.add(j * k + q), s);
                }
                let o = y.add(i * ldy + j);
                *o = if accumulate { *o + s } else { s };
            }
        }
    }

    /// Every (rows, cols) variant performs the identical per-element arithmetic.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn tile_dispatch(
        mr: usize,
        nr: usize,
        k: usize,
        x: *const f32,
        w: *const f32,
        y: *mut f32,
        ldy: usize,
        a: bool,
    ) {
        match (mr, nr) {
            (3, 4) => tile::<3, 4>(k, x, w, y, ldy, a),
            (3, 3) => tile::<3, 3>(k, x, w, y, ldy, a),
            (3, 2) => tile::<3, 2>(k, x, w, y, ldy, a),
            (3, 1) => tile::<3, 1>(k, x, w, y, ldy, a),
            (2, 4) => tile::<2, 4>(k, x, w, y, ldy, a),
            (2, 3) => tile::<2, 3>(k, x, w, y, ldy, a),
            (2, 2) => tile::<2, 2>(k, x, w, y, ldy, a),
            (2, 1) => tile::<2, 1>(k, x, w, y, ldy, a),
            (1, 4) => tile::<1, 4>(k, x, w, y, ldy, a),
            (1, 3) => tile::<1, 3>(k, x, w, y, ldy, a),
            (1, 2) => tile::<1, 2>(k, x, w, y, ldy, a),
            _ => tile::<1, 1>(k, x, w, y, ldy, a),
        }
    }
}

mod portable {
    /// The same reduction order as the AVX path (8 lanes, pairwise horizontal sum, tail), in
    /// plain Rust for CPUs without AVX2/FMA.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn tile(
        mr: usize,
        nr: usize,
        k: usize,
        x: *const f32,
        w: *const f32,
        y: *mut f32,
        ldy: usize,
        accumulate: bool,
    ) {
        let kv = k / 8 * 8;
        for i in 0..mr {
            for j in 0..nr {
                let mut l = [0.0f32; 8];
                let mut p = 0;
                while p < kv {
                    for (q, lq) in l.iter_mut().enumerate() {
                        *lq = (*x.add(i * k + p + q)).mul_add(*w.add(j * k + p + q), *lq);
                    }
                    p += 8;
                }
                let s4 = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
                let mut s = (s4[0] + s4[2]) + (s4[1] + s4[3]);
                for q in kv..k {
                    s = (*x.add(i * k + q)).mul_add(*w.add(j * k + q), s);
                }
                let o = y.add(i * ldy + j);
                *o = if accumulate { *o + s } else { s };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut s = crate::rand::Stream::new(seed, 0);
        (0..n).map(|_| s.normal() as f32).collect()
    }

    #[test]
    fn matches_f64_reference_on_ragged_shapes() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        for &(m, n, k) in &[(1, 1, 1), (5, 7, 9), (3, 4, 8), (200, 37, 70), (7, 130, 33), (2, 300, 64)] {
            let x = data(m * k, 1);
            let w = data(n * k, 2);
            let mut y = vec![f32::NAN; m * n];
            pool.install(|| linear_nt(m, n, k, &x, CpuFloats::F32(&w), &mut y, n, false));
            for i in 0..m {
                for j in 0..n {
                    let r: f64 = (0..k).map(|p| x[i * k + p] as f64 * w[j * k + p] as f64).sum();
                    let tol = 1e-5 * (k as f64).sqrt() * 4.0;
                    assert!(
                        (y[i * n + j] as f64 - r).abs() <= tol + 1e-5 * r.abs(),
                        "({m},{n},{k}) [{i},{j}]: {} vs {r}",
                        y[i * n + j]
                    );
                }
            }
        }
    }

    #[test]
    fn rows_are_batch_invariant_bitwise() {
        let (n, k) = (77, 45);
        let w = data(n * k, 3);
        let xs = data(50 * k, 4);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let mut all = vec![0.0; 50 * n];
        pool.install(|| linear_nt(50, n, k, &xs, CpuFloats::F32(&w), &mut all, n, false));
        for (start, len) in [(0, 1), (13, 1), (10, 7), (49, 1), (4, 40)] {
            let mut part = vec![0.0; len * n];
            pool.install(|| linear_nt(len, n, k, &xs[start * k..], CpuFloats::F32(&w), &mut part, n, false));
            assert_eq!(part, all[start * n..(start + len) * n].to_vec(), "rows {start}..+{len}");
        }
    }

    #[test]
    fn bf16_weights_equal_widened_f32() {
        let (m, n, k) = (9, 70, 40);
        let x = data(m * k, 5);
        let wb: Vec<bf16> = data(n * k, 6).into_iter().map(bf16::from_f32).collect();
        let wf: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
        let (mut a, mut b) = (vec![0.0; m * n], vec![0.0; m * n]);
        linear_nt(m, n, k, &x, CpuFloats::BF16(&wb), &mut a, n, false);
        linear_nt(m, n, k, &x, CpuFloats::F32(&wf), &mut b, n, false);
        assert_eq!(a, b);
        // accumulate adds exactly once more
        linear_nt(m, n, k, &x, CpuFloats::F32(&wf), &mut b, n, true);
        for (p, q) in a.iter().zip(&b) {
            assert_eq!(*q, *p + *p);
        }
    }
}
