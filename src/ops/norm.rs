//! RMSNorm in its three uses: the block norms, the fused residual-add + norm, and the per-head
//! q/k norm of Qwen3. `y = x / sqrt(mean(x²) + eps) · w`, all in f32 (as transformers does).

use super::{check_rows, rows_per_task};
use crate::device::{cuda, CpuFloats, Device, Tensor};
use anyhow::Result;
use rayon::prelude::*;

/// Rows whose sum-of-squares chains run side by side (an f32 add's latency is several cycles;
/// one row's chain alone left the adder idle).
const R: usize = 8;

/// y_i = x_i / sqrt(mean(x_i²) + eps) · w for each row i of x (rows of c values): Σx² is the
/// sequential f32 chain (((x₀² + x₁²) + x₂²) + …), each square rounded, as
/// `iter().map(|v| v * v).sum()`; R rows' chains interleave, which changes no bits.
fn rms_rows(x: &[f32], c: usize, w: CpuFloats, eps: f32, y: &mut [f32]) {
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
pub fn rmsnorm(dev: &Device, x: &Tensor, w: &Tensor, eps: f32, y: &mut Tensor, m: usize) -> Result<()> {
    let c = w.numel();
    check_rows(x, m, c, "rmsnorm input")?;
    check_rows(y, m, c, "rmsnorm output")?;
    match dev {
        Device::Cpu(d) => {
            let (xs, wf, ys) = (x.f32s()?, CpuFloats::of(w)?, y.f32s_mut()?);
            d.install(|| {
                let g = R * c;
                ys[..m * c].par_chunks_mut(g).zip(xs[..m * c].par_chunks(g)).with_min_len(rows_per_task(g)).for_each(
                    |(yg, xg)| rms_rows(xg, c, wf, eps, yg),
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

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn interleaved_rows_give_the_one_row_definition_bitwise() {
        // The spec: y = v · rstd · w with rstd = 1 / sqrt(Σv² / c + eps), Σv² summed in order;
        // and within 2e-6 relative of an f64 reference.
        let mut s = crate::rand::Stream::new(3, 3);
        let c = 37;
        let w: Vec<f32> = (0..c).map(|_| s.normal() as f32).collect();
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        for rows in [1usize, 7, 8, 9, 16, 21] {
            let x: Vec<f32> = (0..rows * c).map(|_| (3.0 * s.normal()) as f32).collect();
            for wf in [CpuFloats::F32(&w), CpuFloats::BF16(&wb)] {
                let mut y = vec![f32::NAN; rows * c];
                rms_rows(&x, c, wf, 1e-6, &mut y);
                for r in 0..rows {
                    let xr = &x[r * c..(r + 1) * c];
                    let ss: f32 = xr.iter().map(|v| v * v).sum();
                    let rstd = 1.0 / (ss / c as f32 + 1e-6).sqrt();
                    let r64 = 1.0 / (xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / c as f64 + 1e-6).sqrt();
                    for j in 0..c {
                        let want = xr[j] * rstd * wf.get(j);
                        assert_eq!(y[r * c + j].to_bits(), want.to_bits(), "rows {rows} [{r},{j}]");
                        let ref64 = xr[j] as f64 * r64 * wf.get(j) as f64;
                        assert!((y[r * c + j] as f64 - ref64).abs() <= 1e-6 + 2e-6 * ref64.abs(), "f64 [{r},{j}]");
                    }
                }
            }
        }
    }
}
