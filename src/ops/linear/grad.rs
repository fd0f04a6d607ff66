//! The three GEMMs of a linear layer y = x·Wᵀ (W: (N, K), an nn.Linear weight):
//! forward `nt`, input gradient `nn` (dx = dy·W) and weight gradient `tn` (dW += dyᵀ·x),
//! through the `gemm` crate (packed, cache-blocked, rayon-parallel).

use crate::ops::real::Real;

/// Strided matrix: element (i, j) at i·rs + j·cs.
#[derive(Clone, Copy)]
struct View<'a, T> {
    d: &'a [T],
    rs: usize,
    cs: usize,
}

fn extent(rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
    (rows - 1) * rs + (cols - 1) * cs + 1
}

/// c (m, n) row-major (+)= a (m, k) · b (k, n).
fn gemm<T: Real>(m: usize, n: usize, k: usize, a: View<T>, b: View<T>, c: &mut [T], accumulate: bool) {
    gemm_par(m, n, k, a, b, c, accumulate, true)
}

#[allow(clippy::too_many_arguments)]
fn gemm_par<T: Real>(
    m: usize,
    n: usize,
    k: usize,
    a: View<T>,
    b: View<T>,
    c: &mut [T],
    accumulate: bool,
    parallel: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            c[..m * n].fill(T::zero());
        }
        return;
    }
    assert!(extent(m, k, a.rs, a.cs) <= a.d.len(), "gemm: lhs out of bounds");
    assert!(extent(k, n, b.rs, b.cs) <= b.d.len(), "gemm: rhs out of bounds");
    assert!(m * n <= c.len(), "gemm: dst out of bounds");
    let par = if parallel { gemm::Parallelism::Rayon(rayon::current_num_threads()) } else { gemm::Parallelism::None };
    // SAFETY: all three extents were checked; `c` is exclusively borrowed and distinct from a, b.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.d.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.d.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            T::one(),
            T::one(),
            false,
            false,
            false,
            par,
        )
    }
}

/// y (m, n) (+)= x (m, k) · wᵀ, w (n, k).
pub fn nt<T: Real>(m: usize, n: usize, k: usize, x: &[T], w: &[T], y: &mut [T], accumulate: bool) {
    gemm(m, n, k, View { d: x, rs: k, cs: 1 }, View { d: w, rs: 1, cs: k }, y, accumulate)
}

/// dx (m, k) (+)= dy (m, n) · w, w (n, k).
pub fn nn<T: Real>(m: usize, n: usize, k: usize, dy: &[T], w: &[T], dx: &mut [T], accumulate: bool) {
    gemm(m, k, n, View { d: dy, rs: n, cs: 1 }, View { d: w, rs: k, cs: 1 }, dx, accumulate)
}

/// dw (n, k) (+)= dyᵀ · x, dy (m, n), x (m, k).
pub fn tn<T: Real>(m: usize, n: usize, k: usize, dy: &[T], x: &[T], dw: &mut [T], accumulate: bool) {
    gemm(n, k, m, View { d: dy, rs: 1, cs: n }, View { d: x, rs: k, cs: 1 }, dw, accumulate)
}

/// The three GEMMs without internal parallelism (for callers that already run one task per
/// thread, e.g. attention over (sequence, head) tasks). Same semantics as [`nt`], [`nn`], [`tn`].
pub mod serial {
    use super::*;
    pub fn nt<T: Real>(m: usize, n: usize, k: usize, x: &[T], w: &[T], y: &mut [T], accumulate: bool) {
        gemm_par(m, n, k, View { d: x, rs: k, cs: 1 }, View { d: w, rs: 1, cs: k }, y, accumulate, false)
    }
    pub fn nn<T: Real>(m: usize, n: usize, k: usize, dy: &[T], w: &[T], dx: &mut [T], accumulate: bool) {
        gemm_par(m, k, n, View { d: dy, rs: n, cs: 1 }, View { d: w, rs: k, cs: 1 }, dx, accumulate, false)
    }
    pub fn tn<T: Real>(m: usize, n: usize, k: usize, dy: &[T], x: &[T], dw: &mut [T], accumulate: bool) {
        gemm_par(n, k, m, View { d: dy, rs: 1, cs: n }, View { d: x, rs: k, cs: 1 }, dw, accumulate, false)
    }
}

/// db (n) += column sums of dy (m, n), in the order of `ops::reduction_chunk_rows`.
pub fn bias_grad<T: Real>(m: usize, n: usize, dy: &[T], db: &mut [T]) {
    crate::ops::column_sums(m, &mut db[..n], |row, j| dy[row * n + j]);
}

/// y (m, n) += b (n) on every row.
pub fn add_bias<T: Real>(m: usize, n: usize, y: &mut [T], b: &[T]) {
    for row in y[..m * n].chunks_exact_mut(n) {
        for (v, bb) in row.iter_mut().zip(b) {
            *v += *bb;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, s: u64) -> Vec<f64> {
        let mut r = crate::rand::Stream::new(s, 0);
        (0..n).map(|_| r.normal()).collect()
    }

    #[test]
    fn three_gemms_match_loops() {
        let (m, n, k) = (7, 5, 9);
        let (x, w, dy) = (data(m * k, 1), data(n * k, 2), data(m * n, 3));
        let mut y = vec![0.0; m * n];
        nt(m, n, k, &x, &w, &mut y, false);
        let mut dx = vec![1.0; m * k];
        nn(m, n, k, &dy, &w, &mut dx, true);
        let mut dw = vec![0.0; n * k];
        tn(m, n, k, &dy, &x, &mut dw, false);
        for i in 0..m {
            for j in 0..n {
                let r: f64 = (0..k).map(|p| x[i * k + p] * w[j * k + p]).sum();
                assert!((y[i * n + j] - r).abs() < 1e-12);
            }
            for p in 0..k {
                let r: f64 = 1.0 + (0..n).map(|j| dy[i * n + j] * w[j * k + p]).sum::<f64>();
                assert!((dx[i * k + p] - r).abs() < 1e-12);
            }
        }
        for j in 0..n {
            for p in 0..k {
                let r: f64 = (0..m).map(|i| dy[i * n + j] * x[i * k + p]).sum();
                assert!((dw[j * k + p] - r).abs() < 1e-12);
            }
        }
    }
}
