//! RMSNorm's CPU twin (the reference of csrc/kernels/norm.cu): f32 throughout, rows split over
//! the device's thread pool. `super` checks the shapes before these run.
//!
//! Owns: the row kernel [`rms_rows`]. May call: `crate::device`. Must not: allocate.

use crate::device::{CpuDevice, CpuFloats, Tensor};
use crate::ops::rows_per_task;
use anyhow::Result;
use rayon::prelude::*;

/// Rows whose sum-of-squares chains run side by side (an f32 add's latency is several cycles;
/// one row's chain alone left the adder idle).
const R: usize = 8;

/// y_i = x_i / sqrt(mean(x_i²) + eps) · w for each row i of x (rows of c values): Σx² is the
/// sequential f32 chain (((x₀² + x₁²) + x₂²) + …), each square rounded, as
/// `iter().map(|v| v * v).sum()`; R rows' chains interleave, which changes no bits.
pub(super) fn rms_rows(x: &[f32], c: usize, w: CpuFloats, eps: f32, y: &mut [f32]) {
    for (xg, yg) in x.chunks(R * c).zip(y.chunks_mut(R * c)) {
        let mut ss = [0.0f32; R];
        if xg.len() == R * c {
            let rows: [&[f32]; R] = std::array::from_fn(|i| &xg[i * c..(i + 1) * c]);
            for j in 0..c {
                for (s, r) in ss.iter_mut().zip(&rows) {
                    *s += r[j] * r[j];
                }
            }
        } else {
            for (s, r) in ss.iter_mut().zip(xg.chunks(c)) {
                *s = r.iter().map(|v| v * v).sum();
            }
        }
        for ((s, xr), yr) in ss.iter().zip(xg.chunks(c)).zip(yg.chunks_mut(c)) {
            let rstd = 1.0 / (s / c as f32 + eps).sqrt();
            match w {
                CpuFloats::F32(wv) => yr.iter_mut().zip(xr).zip(wv).for_each(|((o, v), w)| *o = v * rstd * w),
                CpuFloats::BF16(wv) => yr.iter_mut().zip(xr).zip(wv).for_each(|((o, v), w)| *o = v * rstd * w.to_f32()),
                _ => yr.iter_mut().zip(xr).enumerate().for_each(|(j, (o, v))| *o = v * rstd * w.get(j)),
            }
        }
    }
}

/// y[..m] (m, C) = rmsnorm(x[..m]) · w, w (C).
pub fn rmsnorm(d: &CpuDevice, x: &Tensor, w: &Tensor, eps: f32, y: &mut Tensor, m: usize) -> Result<()> {
    let c = w.numel();
    let (xs, wf, ys) = (x.f32s()?, CpuFloats::of(w)?, y.f32s_mut()?);
    d.install(|| {
        let g = R * c;
        ys[..m * c]
            .par_chunks_mut(g)
            .zip(xs[..m * c].par_chunks(g))
            .with_min_len(rows_per_task(g))
            .for_each(|(yg, xg)| rms_rows(xg, c, wf, eps, yg))
    });
    Ok(())
}

/// x[..m] += r[..m]; y = rmsnorm(x) · w.
pub fn add_rmsnorm(
    d: &CpuDevice,
    x: &mut Tensor,
    r: &Tensor,
    w: &Tensor,
    eps: f32,
    y: &mut Tensor,
    m: usize,
) -> Result<()> {
    let c = w.numel();
    let (xs, rs, wf, ys) = (x.f32s_mut()?, r.f32s()?, CpuFloats::of(w)?, y.f32s_mut()?);
    d.install(|| {
        let g = R * c;
        ys[..m * c]
            .par_chunks_mut(g)
            .zip(xs[..m * c].par_chunks_mut(g))
            .zip(rs[..m * c].par_chunks(g))
            .with_min_len(rows_per_task(g))
            .for_each(|((yg, xg), rg)| {
                for (a, b) in xg.iter_mut().zip(rg) {
                    *a += b;
                }
                rms_rows(xg, c, wf, eps, yg);
            })
    });
    Ok(())
}

/// Per-head RMSNorm in place: x[..m] (m, heads·D), each head's D values normalized with w (D).
pub fn head_rmsnorm(dv: &CpuDevice, x: &mut Tensor, w: &Tensor, eps: f32, m: usize, heads: usize) -> Result<()> {
    let d = w.numel();
    let (xs, wf) = (x.f32s_mut()?, CpuFloats::of(w)?);
    dv.install(|| {
        xs[..m * heads * d].par_chunks_mut(d).with_min_len(rows_per_task(d)).for_each(|h| {
            let ss: f32 = h.iter().map(|v| v * v).sum();
            let rstd = 1.0 / (ss / d as f32 + eps).sqrt();
            for (j, v) in h.iter_mut().enumerate() {
                *v = *v * rstd * wf.get(j);
            }
        })
    });
    Ok(())
}
