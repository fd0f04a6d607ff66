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
//!
//! Owns: [`SampleParams`], the public signature, its checks and the dispatch; the CPU twin
//! (`cpu.rs`: [`sample_row`], the spec), the CUDA twin (`cuda.rs`, kernels
//! csrc/kernels/sample.cu and sample_topk.cu). May call: `crate::device`, `super::logprob`'s
//! row normalizer. Must not: allocate in steady state (the CPU scratch is thread-local).

mod cpu;
mod cuda;
#[cfg(test)]
mod tests;

pub use cpu::{reserve, sample_row};
#[cfg(test)]
pub(crate) use cuda::sample_row_params;

use crate::device::{Device, Tensor};
use anyhow::{bail, Result};

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
        Device::Cpu(d) => cpu::sample(d, logits, params, tokens, logprobs),
        Device::Cuda(c) => cuda::sample(c, logits, params, tokens, logprobs),
    }
}
