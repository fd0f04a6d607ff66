//! RMSNorm forward (saving 1/rms per row) and backward. Per row of C values:
//! r = (mean(x²) + eps)^(-1/2), y = x·r·w;
//! dx_i = r·w_i·dy_i − (r³/C)·x_i·Σ_j w_j·dy_j·x_j,  dw_i += Σ_rows dy_i·x_i·r.
//! The same kernels serve the per-head q/k norm (rows of D values, `rows` = tokens × heads).

use crate::ops::{column_sums, real::Real, rows_per_task};
use rayon::prelude::*;

/// y (rows, C) = rmsnorm(x) · w, rstd (rows) saved for the backward.
pub fn fwd<T: Real>(rows: usize, c: usize, x: &[T], w: &[T], eps: T, y: &mut [T], rstd: &mut [T]) {
    y[..rows * c]
        .par_chunks_mut(c)
        .zip(x[..rows * c].par_chunks(c))
        .zip(rstd[..rows].par_iter_mut())
        .with_min_len(rows_per_task(c))
        .for_each(|((yr, xr), rs)| {
            let ss: T = xr.iter().map(|&v| v * v).sum();
            let r = T::one() / (ss / T::from_usize(c) + eps).sqrt();
            *rs = r;
            for ((o, &v), &g) in yr.iter_mut().zip(xr).zip(w) {
                *o = v * r * g;
            }
        });
}

/// dx (rows, C) (+)= ∂/∂x, dw (C) += ∂/∂w, given dy (rows, C), the input x and the saved rstd.
/// dw is summed over the rows in the fixed order of `ops::reduction_chunk_rows` (the
/// kernels' too), independent of scheduling.
pub fn bwd<T: Real>(
    rows: usize,
    c: usize,
    dy: &[T],
    x: &[T],
    w: &[T],
    rstd: &[T],
    dx: &mut [T],
    accumulate: bool,
    dw: &mut [T],
) {
    column_sums(rows, &mut dw[..c], |row, j| dy[row * c + j] * x[row * c + j] * rstd[row]);
    dx[..rows * c].par_chunks_mut(c).enumerate().with_min_len(rows_per_task(c)).for_each(|(row, dxr)| {
        let (xr, dyr) = (&x[row * c..(row + 1) * c], &dy[row * c..(row + 1) * c]);
        let r = rstd[row];
        let dot: T = (0..c).map(|j| w[j] * dyr[j] * xr[j]).sum();
        let k = r * r * r * dot / T::from_usize(c);
        for j in 0..c {
            let g = r * w[j] * dyr[j] - k * xr[j];
            if accumulate {
                dxr[j] += g;
            } else {
                dxr[j] = g;
            }
        }
    });
}
