//! Sampling one token per row from temperature-scaled logits with optional top-k and top-p
//! truncation, with Philox uniforms keyed by (seed, request, sample, position) so that the
//! drawn token is a pure function of the logits and the key.
//!
//! The returned log-prob is the log-probability of the drawn token under the distribution it
//! was actually drawn from: softmax(z/T) restricted to the kept set and renormalized. With no
//! truncation this is exactly `log_softmax(z/T)[y]`, the value the trainer recomputes.
//! Greedy (T = 0) is the one exception: a point mass carries no information, so it reports
//! `log_softmax(z)[y]` at T = 1, like other engines' greedy log-probs.
//!
//! Order of operations (as transformers and vLLM): scale by 1/T, then top-k, then top-p on the
//! renormalized top-k distribution (the smallest prefix of the sorted candidates whose mass
//! reaches top_p, at least one token), then inverse-CDF sampling over the kept tokens in
//! descending-probability order (ties: lower token id first). Without truncation the CDF runs
//! over the vocabulary in token-id order.

use super::logprob::row_log_normalizer;
use super::softmax_cpu;
use crate::device::{cuda, Device, Tensor};
use anyhow::{bail, Result};
use rayon::prelude::*;
use std::cell::RefCell;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 disables top-k.
    pub top_k: u32,
    /// 1 disables top-p; must be in (0, 1].
    pub top_p: f32,
    pub seed: u64,
    pub request: u64,
    pub sample: u32,
    /// Position of the token being drawn (its index in prompt + response).
    pub position: u32,
}

impl SampleParams {
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0) || !self.temperature.is_finite() {
            bail!("temperature must be a finite number >= 0, got {}", self.temperature);
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("top_p must be in (0, 1], got {}", self.top_p);
        }
        Ok(())
    }
}

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

/// Draws tokens[i], logprobs[i] from row i of logits (S, V) with params[i].
pub fn sample(
    dev: &Device,
    logits: &Tensor,
    params: &[SampleParams],
    tokens: &mut [u32],
    logprobs: &mut [f32],
) -> Result<()> {
    let s = params.len();
    let v = logits.dim(logits.shape().len() - 1);
    super::check_rows(logits, s, v, "sample logits")?;
    if tokens.len() < s || logprobs.len() < s {
        bail!("sample: output slices shorter than the {s} rows");
    }
    for p in params {
        p.validate()?;
    }
    match dev {
        Device::Cpu(d) => {
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
        Device::Cuda(c) => cuda::ops::sample(c, logits, params, tokens, logprobs),
    }
}

/// The CPU reference of one row (also used by tests as the spec).
pub fn sample_row(z: &[f32], p: &SampleParams) -> (u32, f32) {
    let v = z.len();
    if p.temperature == 0.0 {
        // The first maximum (`x > z[best]` scanning up from 0): the first element equal to the
        // row's max (which ignores NaN; −0 == +0), or 0 when z[0] is NaN (nothing beats it).
        let (mx, lse) = row_log_normalizer(z, 1.0);
        let best = if z[0].is_nan() { 0 } else { softmax_cpu::first_equal(z, mx).unwrap_or(0) };
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
            softmax_cpu::exp_shifted(zb, t, mx, &mut w);
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
        softmax_cpu::exp_shifted(&g[..ib.len()], t, mx, wb);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Expected probabilities after temperature, top-k and top-p, computed in f64 by brute force.
    fn expected(z: &[f32], t: f64, k: usize, p: f64) -> Vec<f64> {
        let s: Vec<f64> = z.iter().map(|&x| x as f64 / t).collect();
        let mut idx: Vec<usize> = (0..s.len()).collect();
        idx.sort_by(|&a, &b| s[b].partial_cmp(&s[a]).unwrap().then(a.cmp(&b)));
        let k = if k == 0 { s.len() } else { k };
        let w: Vec<f64> = s.iter().map(|x| x.exp()).collect();
        let tot: f64 = idx[..k].iter().map(|&i| w[i]).sum();
        let (mut acc, mut kept) = (0.0, 0);
        for &i in &idx[..k] {
            acc += w[i];
            kept += 1;
            if acc >= p * tot {
                break;
            }
        }
        let ks: f64 = idx[..kept].iter().map(|&i| w[i]).sum();
        let mut out = vec![0.0; s.len()];
        for &i in &idx[..kept] {
            out[i] = w[i] / ks;
        }
        out
    }

    #[test]
    fn empirical_frequencies_match_the_truncated_distribution() {
        let z = [1.0f32, 2.5, -0.5, 2.5, 0.0, 1.7, -2.0, 3.0];
        let n = 40_000u32;
        for (t, k, p) in [(1.0f32, 0u32, 1.0f32), (0.5, 0, 1.0), (2.0, 3, 1.0), (1.0, 0, 0.6), (1.0, 4, 0.9), (0.7, 1, 1.0)] {
            let want = expected(&z, t as f64, k as usize, p as f64);
            let mut count = vec![0u32; z.len()];
            for pos in 0..n {
                let sp = SampleParams { temperature: t, top_k: k, top_p: p, seed: 9, request: 1, sample: 0, position: pos };
                let (tok, lp) = sample_row(&z, &sp);
                count[tok as usize] += 1;
                assert!(want[tok as usize] > 0.0, "drew token {tok} outside the kept set");
                assert!((lp as f64 - want[tok as usize].ln()).abs() < 1e-5, "logprob {lp} vs {}", want[tok as usize].ln());
            }
            for (i, &c) in count.iter().enumerate() {
                let (f, q) = (c as f64 / n as f64, want[i]);
                let sd = (q * (1.0 - q) / n as f64).sqrt();
                assert!((f - q).abs() <= 5.0 * sd + 1e-12, "T={t} k={k} p={p} token {i}: freq {f} vs {q}");
            }
        }
    }

    #[test]
    fn greedy_takes_the_first_maximum_and_reports_its_log_softmax() {
        let z = [0.5f32, 2.0, 2.0, -1.0];
        let sp = SampleParams { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0, request: 0, sample: 0, position: 0 };
        let (t, lp) = sample_row(&z, &sp);
        assert_eq!(t, 1);
        let lse = z.iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
        assert!((lp as f64 - (2.0 - lse)).abs() < 1e-6);
    }

    #[test]
    fn greedy_is_the_first_maximum_of_the_plain_scan_on_edge_rows() {
        let scan = |z: &[f32]| {
            let mut best = 0usize;
            for (i, &x) in z.iter().enumerate() {
                if x > z[best] {
                    best = i;
                }
            }
            best as u32
        };
        let nan = f32::NAN;
        let rows: [&[f32]; 8] = [
            &[0.5, 2.0, 2.0, -1.0],
            &[nan, 3.0, 1.0],
            &[1.0, nan, 3.0, 3.0],
            &[-0.0, 0.0, -1.0],
            &[0.0, -0.0, -1.0],
            &[f32::NEG_INFINITY; 5],
            &[-3.0, f32::INFINITY, 1.0, f32::INFINITY],
            &[nan, nan],
        ];
        let sp = SampleParams { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0, request: 0, sample: 0, position: 0 };
        for z in rows {
            assert_eq!(sample_row(z, &sp).0, scan(z), "{z:?}");
        }
        let mut s = crate::rand::Stream::new(12, 1);
        for _ in 0..50 {
            let z: Vec<f32> = (0..1000).map(|_| (s.normal() * 2.0).round() as f32).collect();
            assert_eq!(sample_row(&z, &sp).0, scan(&z));
        }
    }

    #[test]
    fn same_key_same_token_different_key_varies() {
        let z: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let sp = |pos, sample| SampleParams { temperature: 1.0, top_k: 0, top_p: 0.95, seed: 4, request: 2, sample, position: pos };
        assert_eq!(sample_row(&z, &sp(3, 0)), sample_row(&z, &sp(3, 0)));
        let draws: std::collections::HashSet<u32> = (0..40).map(|p| sample_row(&z, &sp(p, 0)).0).collect();
        assert!(draws.len() > 10);
        let other: Vec<u32> = (0..40).map(|p| sample_row(&z, &sp(p, 1)).0).collect();
        let base: Vec<u32> = (0..40).map(|p| sample_row(&z, &sp(p, 0)).0).collect();
        assert_ne!(other, base);
    }
}
