//! RMSNorm in its three uses: the block norms, the fused residual-add + norm, and the per-head
//! q/k norm of Qwen3. `y = x / sqrt(mean(x²) + eps) · w`, all in f32 (as transformers does).

use super::{check_rows, rows_per_task};
use crate::device::{cuda, CpuFloats, Device, Tensor};
use anyhow::Result;
use rayon::prelude::*;

#[inline]
fn rms_row(x: &[f32], w: CpuFloats, eps: f32, y: &mut [f32]) -> f32 {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let rstd = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    for (j, (o, v)) in y.iter_mut().zip(x).enumerate() {
        *o = v * rstd * w.get(j);
    }
    rstd
}

/// y[..m] (m, C) = rmsnorm(x[..m]) · w, w (C).
pub fn rmsnorm(dev: &Device, x: &Tensor, w: &Tensor, eps: f32, y: &mut Tensor, m: usize) -> Result<()> {
    let c = w.numel();
    check_rows(x, m, c, "rmsnorm input")?;
    check_rows(y, m, c, "rmsnorm output")?;
    match dev {
        Device::Cpu(d) => {
            let (xs, wf, ys) = (x.f32s()?, CpuFloats::of(w)?, y.f32s_mut()?);
            d.install(|| {
                ys[..m * c].par_chunks_mut(c).zip(xs[..m * c].par_chunks(c)).with_min_len(rows_per_task(c)).for_each(
                    |(yr, xr)| {
                        rms_row(xr, wf, eps, yr);
                    },
                )
            });
            Ok(())
        }
        Device::Cuda(d) => cuda::ops::rmsnorm(d, x, w, eps, y, m),
    }
}

/// The residual stream update fused with the next norm: x[..m] += r[..m]; y = rmsnorm(x) · w.
pub fn add_rmsnorm(
    dev: &Device,
    x: &mut Tensor,
    r: &Tensor,
    w: &Tensor,
    eps: f32,
    y: &mut Tensor,
    m: usize,
) -> Result<()> {
    let c = w.numel();
    check_rows(x, m, c, "add_rmsnorm residual")?;
    check_rows(r, m, c, "add_rmsnorm update")?;
    check_rows(y, m, c, "add_rmsnorm output")?;
    match dev {
        Device::Cpu(d) => {
            let (xs, rs, wf, ys) = (x.f32s_mut()?, r.f32s()?, CpuFloats::of(w)?, y.f32s_mut()?);
            d.install(|| {
                ys[..m * c]
                    .par_chunks_mut(c)
                    .zip(xs[..m * c].par_chunks_mut(c))
                    .zip(rs[..m * c].par_chunks(c))
                    .with_min_len(rows_per_task(c))
                    .for_each(|((yr, xr), rr)| {
                        for (a, b) in xr.iter_mut().zip(rr) {
                            *a += b;
                        }
                        rms_row(xr, wf, eps, yr);
                    })
            });
            Ok(())
        }
        Device::Cuda(d) => cuda::ops::add_rmsnorm(d, x, r, w, eps, y, m),
    }
}

/// Per-head RMSNorm in place: x[..m] (m, heads·D), each head's D values normalized with w (D).
pub fn head_rmsnorm(dev: &Device, x: &mut Tensor, w: &Tensor, eps: f32, m: usize, heads: usize) -> Result<()> {
    let d = w.numel();
    check_rows(x, m, heads * d, "head_rmsnorm input")?;
    match dev {
        Device::Cpu(dv) => {
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
        Device::Cuda(dv) => cuda::ops::head_rmsnorm(dv, x, w, eps, m, heads),
    }
}
