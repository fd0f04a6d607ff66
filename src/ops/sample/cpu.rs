//! Sampling's CPU twin: [`sample_row`] is the spec that csrc/kernels/sample.cu and
//! sample_topk.cu follow, step for step.

use super::SampleParams;
use crate::device::{CpuDevice, Tensor};
use crate::ops::logprob::row_log_normalizer;
use crate::ops::vecmath;
use anyhow::Result;
use rayon::prelude::*;
use std::cell::RefCell;

thread_local! {
    /// Candidate ids of a truncated row, and their weights in the same order.
    static IDX: RefCell<(Vec<u32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Grows this thread's candidate scratch to at least `n` entries.
pub fn reserve(n: usize) {
    IDX.with(|s| {
        let (idx, w) = &mut *s.borrow_mut();
        if idx.capacity() < n {
            idx.reserve(n - idx.len());
        }
        if w.capacity() < n {
            w.reserve(n - w.len());
        }
    });
}

/// Values per block of weights computed at once by the vector exp (a stack buffer).
const WBLOCK: usize = 256;

/// Draws tokens[i], logprobs[i] from row i of logits (S, V) with params[i], rows in parallel.
pub fn sample(
    d: &CpuDevice,
    logits: &Tensor,
    params: &[SampleParams],
    tokens: &mut [u32],
    logprobs: &mut [f32],
) -> Result<()> {
    let (s, v) = (params.len(), logits.dim(logits.shape().len() - 1));
    let z = logits.f32s()?;
    d.install(|| {
        tokens[..s].par_iter_mut().zip(logprobs[..s].par_iter_mut()).enumerate().for_each(|(i, (t, lp))| {
            let (tok, l) = sample_row(&z[i * v..(i + 1) * v], &params[i]);
            *t = tok;
            *lp = l;
        })
    });
    Ok(())
}

/// The CPU reference of one row (also used by tests as the spec).
pub fn sample_row(z: &[f32], p: &SampleParams) -> (u32, f32) {
    let v = z.len();
    if p.temperature == 0.0 {
        // The first maximum (`x > z[best]` scanning up from 0): the first element equal to the
        // row's max (which ignores NaN; −0 == +0), or 0 when z[0] is NaN (nothing beats it).
        let (mx, lse) = row_log_normalizer(z, 1.0);
        let best = if z[0].is_nan() { 0 } else { vecmath::first_equal(z, mx).unwrap_or(0) };
        return (best as u32, ((z[best] - mx) as f64 - lse) as f32);
    }
    let t = p.temperature;
    let u = crate::rand::sampling_uniform(p.seed, p.request, p.sample, p.position);
    let (mx, lse_full) = row_log_normalizer(z, t);
    // Weight of token i: exp_f32(z_i / T − max), the terms of row_log_normalizer's sum.
    let truncate_k = p.top_k > 0 && (p.top_k as usize) < v;
    if !truncate_k && p.top_p >= 1.0 {
        let total = lse_full.exp();
        let target = u * total;
        let mut acc = 0.0f64;
        let mut last_nonzero = 0usize;
        let mut w = [0.0f32; WBLOCK];
        for (b, zb) in z.chunks(WBLOCK).enumerate() {
            vecmath::exp_shifted(zb, t, mx, &mut w);
            for (j, &wi) in w[..zb.len()].iter().enumerate() {
                let (i, wi) = (b * WBLOCK + j, wi as f64);
                if wi > 0.0 {
                    last_nonzero = i;
                }
                acc += wi;
                if acc > target {
                    return (i as u32, ((z[i] / t - mx) as f64 - lse_full) as f32);
                }
            }
        }
        let i = last_nonzero;
        return (i as u32, ((z[i] / t - mx) as f64 - lse_full) as f32);
    }
    IDX.with(|scratch| {
        let (idx, wts) = &mut *scratch.borrow_mut();
        idx.clear();
        idx.extend(0..v as u32);
        // Descending score, ties by ascending id: a total order, so the kept set is unique.
        let cmp = |a: &u32, b: &u32| z[*b as usize].total_cmp(&z[*a as usize]).then(a.cmp(b));
        let k = if truncate_k { p.top_k as usize } else { v };
        // Mass the kept prefix must reach: top_p of the top-k candidates' total.
        let mut n = if truncate_k { k } else { 64.min(v) };
        let kept;
        let mut kept_sum;
        loop {
            if n < v {
                idx.select_nth_unstable_by(n - 1, cmp);
            }
            idx[..n].sort_unstable_by(cmp);
            weights_of(z, &idx[..n], t, mx, wts);
            let cand_total: f64 = if truncate_k { wts[..k].iter().map(|&w| w as f64).sum() } else { lse_full.exp() };
            let goal = p.top_p as f64 * cand_total;
            kept_sum = 0.0;
            let mut found = None;
            for (j, &w) in wts[..n].iter().enumerate() {
                kept_sum += w as f64;
                if kept_sum >= goal || (p.top_p >= 1.0 && j + 1 == n) {
                    found = Some(j + 1);
                    break;
                }
            }
            match found {
                Some(c) => {
                    kept = c;
                    break;
                }
                None if n >= k => {
                    // Rounding left the mass just short of the goal: keep every candidate.
                    kept = n;
                    break;
                }
                None => n = (n * 4).min(k),
            }
        }
        let target = u * kept_sum;
        let mut acc = 0.0f64;
        let mut pick = idx[0] as usize;
        for (&i, &w) in idx[..kept].iter().zip(&wts[..kept]) {
            let wi = w as f64;
            if wi > 0.0 {
                pick = i as usize;
            }
            acc += wi;
            if acc > target {
                pick = i as usize;
                break;
            }
        }
        (pick as u32, ((z[pick] / t - mx) as f64 - kept_sum.ln()) as f32)
    })
}

/// wts[j] = exp_f32(z[ids[j]] / T − mx) for j < ids.len() (wts resized), by blocks through the
/// vector exp.
fn weights_of(z: &[f32], ids: &[u32], t: f32, mx: f32, wts: &mut Vec<f32>) {
    wts.resize(ids.len(), 0.0);
    let mut g = [0.0f32; WBLOCK];
    for (ib, wb) in ids.chunks(WBLOCK).zip(wts.chunks_mut(WBLOCK)) {
        for (x, &i) in g.iter_mut().zip(ib) {
            *x = z[i as usize];
        }
        vecmath::exp_shifted(&g[..ib.len()], t, mx, wb);
    }
}
