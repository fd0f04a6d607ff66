//! The CPU GEMM: `gemm` crate (f32 microkernels, rayon) behind one strided helper, plus
//! on-the-fly widening of BF16/F16 weight panels into per-thread f32 scratch.
//!
//! Owns: thread-local scratch buffers (grown once, then reused: no allocation in steady state).
//! May call: gemm, rayon. Used by every CPU op that multiplies matrices (forward and backward).

use crate::device::CpuFloats;
use rayon::prelude::*;
use std::cell::RefCell;

/// A strided matrix view: element (i, j) at `i * rs + j * cs`.
#[derive(Clone, Copy)]
pub struct Mat<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

/// `c[i*ldc + j] (+)= sum_p a(i, p) * b(p, j)` for i < m, j < n, p < k. `parallel` lets gemm
/// split the work over the current rayon pool.
pub fn sgemm(
    m: usize,
    n: usize,
    k: usize,
    a: Mat,
    b: Mat,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
    parallel: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                c[i * ldc..i * ldc + n].fill(0.0);
            }
        }
        return;
    }
    // Bounds checks up front: the unsafe call below reads exactly these extents.
    assert!(extent(m, n, ldc, 1) <= c.len(), "sgemm: dst out of bounds");
    // SAFETY: `c` is exclusively borrowed and its extent was checked.
    unsafe { sgemm_ptr(m, n, k, a, b, c.as_mut_ptr(), ldc, accumulate, parallel) }
}

/// One past the last element touched by a (rows x cols) view with strides (rs, cs).
fn extent(rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
    (rows - 1) * rs + (cols - 1) * cs + 1
}

/// # Safety
/// `c` must be valid for writes at `i * ldc + j` for i < m, j < n, and no other thread may
/// access those elements during the call. m, n, k must be non-zero.
unsafe fn sgemm_ptr(
    m: usize,
    n: usize,
    k: usize,
    a: Mat,
    b: Mat,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
    parallel: bool,
) {
    assert!(extent(m, k, a.rs, a.cs) <= a.data.len(), "sgemm: lhs out of bounds");
    assert!(extent(k, n, b.rs, b.cs) <= b.data.len(), "sgemm: rhs out of bounds");
    let par = if parallel { gemm::Parallelism::Rayon(rayon::current_num_threads()) } else { gemm::Parallelism::None };
    gemm::gemm(
        m,
        n,
        k,
        c,
        1,
        ldc as isize,
        accumulate,
        a.data.as_ptr(),
        a.cs as isize,
        a.rs as isize,
        b.data.as_ptr(),
        b.cs as isize,
        b.rs as isize,
        1.0f32,
        1.0f32,
        false,
        false,
        false,
        par,
    );
}

thread_local! {
    static PANEL: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Rows of `w` converted per panel when `w` is not f32.
const PANEL_ROWS: usize = 128;

/// `y[i, j] (+)= sum_p x[i, p] * w[j, p]` — x: (m, k) row-major with row stride `ldx`,
/// w: (n, k) row-major (an nn.Linear weight), y: (m, n) with row stride `ldy`.
pub fn matmul_nt(
    m: usize,
    n: usize,
    k: usize,
    x: &[f32],
    ldx: usize,
    w: CpuFloats,
    y: &mut [f32],
    ldy: usize,
    accumulate: bool,
) {
    let xa = Mat { data: x, rs: ldx, cs: 1 };
    match w {
        CpuFloats::F32(wd) => sgemm(m, n, k, xa, Mat { data: wd, rs: 1, cs: k }, y, ldy, accumulate, true),
        _ => {
            // Panels of output columns are independent: split them over the pool, widen each
            // panel of w once into thread-local scratch, multiply without nested parallelism.
            let panels = n.div_ceil(PANEL_ROWS);
            assert!(m == 0 || extent(m, n, ldy, 1) <= y.len(), "matmul_nt: dst out of bounds");
            if m == 0 || n == 0 || k == 0 {
                return sgemm(m, n, k, xa, Mat { data: &[], rs: 1, cs: 1 }, y, ldy, accumulate, false);
            }
            let yptr = SendPtr(y.as_mut_ptr());
            (0..panels).into_par_iter().for_each(|p| {
                let j0 = p * PANEL_ROWS;
                let nj = PANEL_ROWS.min(n - j0);
                PANEL.with(|s| {
                    let mut s = s.borrow_mut();
                    if s.len() < nj * k {
                        s.resize(nj * k, 0.0);
                    }
                    w.read_into(j0 * k, &mut s[..nj * k]);
                    let b = Mat { data: &s[..nj * k], rs: 1, cs: k };
                    // SAFETY: the extent of y was checked above; panels write the disjoint
                    // column ranges [j0, j0 + nj) of y, so no two threads touch one element.
                    unsafe { sgemm_ptr(m, nj, k, xa, b, yptr.get().add(j0), ldy, accumulate, false) };
                });
            });
        }
    }
}

/// `y[i, j] (+)= sum_p x[i, p] * w[p, j]` — w: (k, n) row-major (e.g. dX = dY · W with W (n_out, n_in)
/// read as (k = n_out, n = n_in)).
pub fn matmul_nn(
    m: usize,
    n: usize,
    k: usize,
    x: &[f32],
    ldx: usize,
    w: CpuFloats,
    y: &mut [f32],
    ldy: usize,
    accumulate: bool,
) {
    let xa = Mat { data: x, rs: ldx, cs: 1 };
    match w {
        CpuFloats::F32(wd) => sgemm(m, n, k, xa, Mat { data: wd, rs: n, cs: 1 }, y, ldy, accumulate, true),
        _ => {
            // Widen the whole weight once per call into scratch (backward only; not a hot loop).
            PANEL.with(|s| {
                let mut s = s.borrow_mut();
                if s.len() < k * n {
                    s.resize(k * n, 0.0);
                }
                w.read_into(0, &mut s[..k * n]);
                sgemm(m, n, k, xa, Mat { data: &s[..k * n], rs: n, cs: 1 }, y, ldy, accumulate, true);
            });
        }
    }
}

/// A raw pointer that may cross threads; each user proves disjointness of its writes.
#[derive(Clone, Copy)]
pub struct SendPtr<T>(pub *mut T);
// SAFETY: SendPtr is only a carrier; every dereference site documents why its accesses from
// different threads touch disjoint elements.
unsafe impl<T> Send for SendPtr<T> {}
// SAFETY: as above; shared references to the carrier never dereference by themselves.
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    #[inline]
    pub fn get(self) -> *mut T {
        self.0
    }
}
