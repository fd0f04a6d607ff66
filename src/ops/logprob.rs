//! Fused log-softmax + gather: the log-probability of one target token per row, without
//! materializing the normalized distribution. This is the quantity the trainer recomputes and
//! the engine reports: `log_softmax(z / T)[y] = z_y/T − max − log Σ_j exp(z_j/T − max)`.

use super::{check_rows, rows_per_task, softmax_cpu};
use crate::device::{cuda, Device, Tensor};
use anyhow::{bail, Result};
use rayon::prelude::*;

/// Max and log of the normalizer of a row of temperature-scaled logits: returns (max, ln Σ exp(z/T − max)),
/// with max = max_i z_i / T (IEEE division, NaN ignored), each term `softmax_cpu::exp_f32` and
/// the sum in f64 over 16 lanes joined by a fixed tree (see `softmax_cpu`), so the value is the
/// same bits on every CPU and does not depend on the summation order beyond f32 rounding of
/// each term. Scoring and sampling use this one definition (the GPU twins the same exp in
/// row_stats.cuh, summed in another order); the trainer's log-softmax (grad/lm_head.rs) agrees
/// with it to rounding.
#[inline]
pub fn row_log_normalizer(z: &[f32], temperature: f32) -> (f32, f64) {
    let mx = softmax_cpu::scaled_max(z, temperature);
    (mx, softmax_cpu::sum_exp_shifted(z, temperature, mx).ln())
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

/// The top-k log-probs of rows 0..temps.len() of logits (·, V), row i at temperature temps[i]
/// (≤ 0: 1): ids (m·k) in descending probability (ties: lower id first) and
/// lps (m·k) = log_softmax(z/T)[id]. Score centering's target (seed 000 App. B.1) is built from
/// these. On CUDA the rows are copied to the host and ranked there (centering only).
pub fn topk_logprobs(dev: &Device, logits: &Tensor, temps: &[f32], k: usize, ids: &mut Vec<u32>, lps: &mut Vec<f32>) -> Result<()> {
    let m = temps.len();
    let v = logits.dim(logits.shape().len() - 1);
    check_rows(logits, m, v, "topk_logprobs logits")?;
    if k == 0 || k > v {
        bail!("topk_logprobs: k = {k} must be in 1..={v} (the vocabulary)");
    }
    let host;
    let z: &[f32] = match dev {
        Device::Cpu(_) => logits.f32s()?,
        Device::Cuda(_) => {
            host = logits.to_f32_vec()?;
            &host
        }
    };
    ids.resize(m * k, 0);
    lps.resize(m * k, 0.0);
    let body = |(i, (ids, lps)): (usize, (&mut [u32], &mut [f32]))| {
        let t = if temps[i] > 0.0 { temps[i] } else { 1.0 };
        let row = &z[i * v..(i + 1) * v];
        let (mx, lse) = row_log_normalizer(row, t);
        let mut idx: Vec<u32> = (0..v as u32).collect();
        let better = |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
        if k < v {
            idx.select_nth_unstable_by(k - 1, better);
        }
        let top = &mut idx[..k];
        top.sort_unstable_by(better);
        for (j, &id) in top.iter().enumerate() {
            ids[j] = id;
            lps[j] = ((row[id as usize] / t - mx) as f64 - lse) as f32;
        }
    };
    let work = ids.par_chunks_mut(k).zip(lps.par_chunks_mut(k)).enumerate();
    match dev {
        Device::Cpu(d) => d.install(|| work.for_each(body)),
        Device::Cuda(_) => work.for_each(body),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topk_matches_a_full_sort_in_f64() {
        let dev = Device::cpu(2).unwrap();
        let (m, v, k) = (3, 50, 7);
        let mut rng = crate::rand::Stream::new(3, 1);
        let mut z: Vec<f32> = (0..m * v).map(|_| (rng.normal() * 3.0) as f32).collect();
        z[v + 4] = z[v + 9]; // a tie: the lower id comes first
        let logits = dev.from_f32(crate::device::DType::F32, &[m, v], &z).unwrap();
        let temps = [1.0f32, 0.7, 0.0];
        let (mut ids, mut lps) = (Vec::new(), Vec::new());
        topk_logprobs(&dev, &logits, &temps, k, &mut ids, &mut lps).unwrap();
        for i in 0..m {
            let t = if temps[i] > 0.0 { temps[i] as f64 } else { 1.0 };
            let row: Vec<f64> = z[i * v..(i + 1) * v].iter().map(|&x| x as f64 / t).collect();
            let mx = row.iter().cloned().fold(f64::MIN, f64::max);
            let lse = mx + row.iter().map(|x| (x - mx).exp()).sum::<f64>().ln();
            let mut order: Vec<usize> = (0..v).collect();
            order.sort_by(|a, b| row[*b].total_cmp(&row[*a]).then(a.cmp(b)));
            for j in 0..k {
                assert_eq!(ids[i * k + j] as usize, order[j], "row {i} rank {j}");
                let want = row[order[j]] - lse;
                // f32 log-probs vs f64: |Δ| ≤ 1e-5 + 1e-6·|ref|.
                assert!((lps[i * k + j] as f64 - want).abs() <= 1e-5 + 1e-6 * want.abs());
            }
        }
        assert!(topk_logprobs(&dev, &logits, &temps, 0, &mut ids, &mut lps).is_err());
    }
}
