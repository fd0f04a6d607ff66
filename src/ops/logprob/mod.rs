//! Fused log-softmax + gather: the log-probability of one target token per row, without
//! materializing the normalized distribution. This is the quantity the trainer recomputes and
//! the engine reports: `log_softmax(z / T)[y] = z_y/T − max − log Σ_j exp(z_j/T − max)`.
//!
//! Owns: the public signatures, their checks and the dispatch; the CPU twin (`cpu.rs`: the
//! one definition of the row normalizer), the CUDA twin (`cuda.rs`, kernel
//! csrc/kernels/logprob.cu). The trainer's log-softmax is `lm_head::grad` (see there for why it
//! is a second implementation). May call: `crate::device`. Must not: allocate on the CPU
//! in the scoring path (`topk_logprobs`, score centering's, sorts a copy of each row).

mod cpu;
mod cuda;
#[cfg(test)]
mod tests;

pub use cpu::row_log_normalizer;

use super::check_rows;
use crate::device::{Device, Tensor};
use anyhow::{bail, Result};

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
        Device::Cpu(d) => cpu::log_softmax_gather(d, logits, targets, temperature, out, m),
        Device::Cuda(c) => cuda::log_softmax_gather(c, logits, targets, temperature, out, m),
    }
}

/// The top-k log-probs of rows 0..temps.len() of logits (·, V), row i at temperature temps[i]
/// (≤ 0: 1): ids (m·k) in descending probability (ties: lower id first) and
/// lps (m·k) = log_softmax(z/T)[id]. Score centering's target (seed 000 App. B.1) is built from
/// these. On CUDA the rows are copied to the host and ranked there (centering only).
pub fn topk_logprobs(
    dev: &Device,
    logits: &Tensor,
    temps: &[f32],
    k: usize,
    ids: &mut Vec<u32>,
    lps: &mut Vec<f32>,
) -> Result<()> {
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
    cpu::topk_rows(dev, z, v, temps, k, ids, lps);
    Ok(())
}
