//! The CPU twin of the fused log-softmax + gather (the reference of csrc/kernels/logprob.cu),
//! the row normalizer that scoring, sampling and the kernels share, and the host ranking of
//! score centering's top-k.

use crate::device::{CpuDevice, Device, Tensor};
use crate::ops::{rows_per_task, vecmath};
use anyhow::{bail, Result};
use rayon::prelude::*;

/// Max and log of the normalizer of a row of temperature-scaled logits: returns (max, ln Σ exp(z/T − max)),
/// with max = max_i z_i / T (IEEE division, NaN ignored), each term `vecmath::exp_f32` and
/// the sum in f64 over 16 lanes joined by a fixed tree (see `vecmath`), so the value is the
/// same bits on every CPU and does not depend on the summation order beyond f32 rounding of
/// each term. Scoring and sampling use this one definition (the GPU twins the same exp in
/// row_stats.cuh, summed in another order); the trainer's log-softmax (lm_head/grad.rs) agrees
/// with it to rounding.
#[inline]
pub fn row_log_normalizer(z: &[f32], temperature: f32) -> (f32, f64) {
    let mx = vecmath::scaled_max(z, temperature);
    (mx, vecmath::sum_exp_shifted(z, temperature, mx).ln())
}

/// out[i] = log_softmax(logits[i] / T)[targets[i]] for i < m; a target outside the vocabulary
/// is an error.
pub fn log_softmax_gather(
    d: &CpuDevice,
    logits: &Tensor,
    targets: &Tensor,
    temperature: f32,
    out: &mut Tensor,
    m: usize,
) -> Result<()> {
    let v = logits.dim(logits.shape().len() - 1);
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

/// The top-k ids and log-probs of host rows z (m, V) (see `super::topk_logprobs`), in the CPU
/// pool of `dev` when it has one.
pub fn topk_rows(dev: &Device, z: &[f32], v: usize, temps: &[f32], k: usize, ids: &mut Vec<u32>, lps: &mut Vec<f32>) {
    let m = temps.len();
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
}
