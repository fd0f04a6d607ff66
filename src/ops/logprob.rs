//! Fused log-softmax + gather: the log-probability of one target token per row, without
//! materializing the normalized distribution. This is the quantity the trainer recomputes and
//! the engine reports: `log_softmax(z / T)[y] = z_y/T − max − log Σ_j exp(z_j/T − max)`.

use super::{check_rows, rows_per_task};
use crate::device::{cuda, Device, Tensor};
use anyhow::{bail, Result};
use rayon::prelude::*;

/// Max and log of the normalizer of a row of temperature-scaled logits: returns (max, ln Σ exp(z/T − max)).
/// Sums in f64 so that the value does not depend on the summation order beyond f32 rounding of
/// each term. The one definition used by scoring, sampling and training.
#[inline]
pub fn row_log_normalizer(z: &[f32], temperature: f32) -> (f32, f64) {
    let mx = z.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b / temperature));
    let s: f64 = z.iter().map(|&x| ((x / temperature) - mx).exp() as f64).sum();
    (mx, s.ln())
}

/// out[i] = log_softmax(logits[i] / T)[targets[i]] for i < m; logits (m, V), targets (m) u32.
pub fn log_softmax_gather(
    dev: &Device,
    logits: &Tensor,
    targets: &Tensor,
    temperature: f32,
    out: &mut Tensor,
    m: usize,
) -> Result<()> {
    let v = logits.dim(logits.shape().len() - 1);
    check_rows(logits, m, v, "log_softmax_gather logits")?;
    if !(temperature > 0.0) {
        bail!("log_softmax_gather: temperature must be positive, got {temperature}");
    }
    match dev {
        Device::Cpu(d) => {
            let (z, y, o) = (logits.f32s()?, targets.u32s()?, out.f32s_mut()?);
            if let Some(bad) = y[..m].iter().find(|&&t| t as usize >= v) {
                bail!("target token {bad} outside the vocabulary ({v})");
            }
            d.install(|| {
                o[..m].par_iter_mut().enumerate().with_min_len(rows_per_task(v)).for_each(|(i, o)| {
                    let row = &z[i * v..(i + 1) * v];
                    let (mx, lse) = row_log_normalizer(row, temperature);
                    *o = ((row[y[i] as usize] / temperature - mx) as f64 - lse) as f32;
                })
            });
            Ok(())
        }
        Device::Cuda(c) => cuda::ops::log_softmax_gather(c, logits, targets, temperature, out, m),
    }
}
