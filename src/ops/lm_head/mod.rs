//! The LM head fused with the loss, for training: per chunk of rows, the logits
//! z = h · Whᵀ / T (at most `chunk × vocab` of them at once), their log-softmax, the per-token
//! statistics (log p of the target, entropy), and the logits gradient
//! −c_t·(target_t − softmax(z_t / T)) / T folded straight into dh and dWh.
//!
//! Owns: the training twin on slices (`grad.rs`, generic over f32 / f64: the CPU trainer's
//! and the f64 reference), the device-level signatures below with their CPU arm (`cpu.rs`) and
//! CUDA arm (`cuda.rs`: cuBLASLt GEMMs around csrc/kernels/lm_head.cu). There is no forward-only
//! twin here: decoding's LM head is a plain `linear`, and scoring's log-probs are `logprob`.
//! May call: `super::linear`'s training GEMMs, `super::elementwise`. Must not: materialize more
//! than a chunk of logits.

mod cpu;
mod cuda;
pub use cuda::dz_two_ways;
pub mod grad;
#[cfg(test)]
mod tests;

use crate::device::{DType, Device, Tensor};
use anyhow::{bail, Result};

/// The scored rows of one pass: `rows` (n) u32 indices into h's rows (distinct: each position
/// is scored once), `targets` (n) u32 token ids.
pub struct Rows<'a> {
    pub rows: &'a Tensor,
    pub targets: &'a Tensor,
}

/// Score centering's target (seed 000 App. B.1) on the pass's device: the engine's k most likely
/// tokens `ids` (n·k, u32) and their normalized probabilities `probs` (n·k, f32).
pub struct DevCenter<'a> {
    pub k: usize,
    pub ids: &'a Tensor,
    pub probs: &'a Tensor,
}

fn check(h: &Tensor, wh: &Tensor, r: &Rows<'_>, chunk: usize) -> Result<usize> {
    let (c, n) = (wh.dim(1), r.rows.numel());
    if h.dtype() != DType::F32 || h.dim(h.shape().len() - 1) != c {
        bail!("LM head: hidden rows of {:?} {} for a head of width {c}", h.shape(), h.dtype().name());
    }
    if !matches!(wh.dtype(), DType::F32 | DType::BF16) {
        bail!("LM head: an F32 or BF16 head weight, found {}", wh.dtype().name());
    }
    if r.rows.dtype() != DType::U32 || r.targets.dtype() != DType::U32 || r.targets.numel() != n {
        bail!("LM head: {n} u32 row indices need as many u32 targets, found {}", r.targets.numel());
    }
    if chunk == 0 {
        bail!("LM head: a chunk of 0 rows");
    }
    Ok(n)
}

fn check_stats(logp: &Tensor, entropy: &Tensor, n: usize) -> Result<()> {
    for (t, what) in [(logp, "log-probs"), (entropy, "entropies")] {
        if t.numel() != n || t.dtype() != DType::F32 {
            bail!("LM head {what}: {n} f32 values expected, found {} {}", t.numel(), t.dtype().name());
        }
    }
    Ok(())
}

/// logp[i] = log softmax(z_i/T)[y_i] and entropy[i] of softmax(z_i/T), z_i = h[rows[i]]·Whᵀ,
/// `chunk` rows at a time.
#[allow(clippy::too_many_arguments)]
pub fn stats(
    dev: &Device,
    h: &Tensor,
    wh: &Tensor,
    r: &Rows<'_>,
    temperature: f32,
    chunk: usize,
    logp: &mut Tensor,
    entropy: &mut Tensor,
) -> Result<()> {
    let n = check(h, wh, r, chunk)?;
    check_stats(logp, entropy, n)?;
    match dev {
        Device::Cpu(_) => cpu::stats(h, wh, r, temperature, chunk, logp, entropy),
        Device::Cuda(d) => cuda::stats(d, h, wh, r, temperature, chunk, logp, entropy),
    }
}

/// The loss pass's coefficients c_i.
#[derive(Clone, Copy)]
pub enum Coef<'a> {
    /// Given: (n) f32, evaluated before this pass (from a statistics pass, or without one
    /// where they do not depend on the log-probs).
    Given(&'a Tensor),
    /// Computed in this pass from its own log-prob at ratio 1, where the objective needs
    /// nothing else of the batch: the one-pass loss, with no statistics pass before it. In f64,
    /// then rounded to f32, as `objective::opd` and `objective::sft` compute them:
    /// c_i = w_i·((log p_T,i − logp_i) + offset) with `teacher` (OPD, seed 000 Eq. 1, the ratio
    /// ρ = 1), c_i = w_i without (SFT); w_i = 1/den_i (`objective::agg_denominators`, (n)
    /// u32; 0: an inactive token, w_i = 0). `teacher`: (n) f32. With `tis` (and no teacher):
    /// GRPO or REINFORCE with TIS, `objective::grpo::base` at ρ = 1 (never clipped there):
    /// c_i = w_i·v_i·A_i, v_i = min(exp(logp_i − log π_s,i), C) (seed 004 Eq. 3).
    Rule { den: &'a Tensor, teacher: Option<&'a Tensor>, offset: f64, tis: Option<TisRule<'a>> },
}

/// TIS's inputs of a [`Coef::Rule`].
#[derive(Clone, Copy)]
pub struct TisRule<'a> {
    /// (n) f32: the sampler's log-probs log π_s.
    pub sampler: &'a Tensor,
    /// (2n) u32: the advantages A_i, f64 (the host's, exact), as their bits, low word first
    /// ([`TisRule::words`]; tensors have no f64 dtype).
    pub adv: &'a Tensor,
    /// The cap C.
    pub cap: f64,
}

impl TisRule<'_> {
    /// f64 values as the u32 words `adv` holds.
    pub fn words(adv: &[f64]) -> Vec<u32> {
        adv.iter().flat_map(|a| [a.to_bits() as u32, (a.to_bits() >> 32) as u32]).collect()
    }
}

/// The per-row statistics a loss pass may also write ([`stats`]'s, at no extra GEMM): (n) f32
/// each.
pub struct StatsOut<'a> {
    pub logp: &'a mut Tensor,
    pub entropy: &'a mut Tensor,
}

fn check_coef(coef: Coef<'_>, n: usize) -> Result<()> {
    let bad = |what: &str, t: &Tensor, dt: DType| {
        (t.numel() != n || t.dtype() != dt).then(|| {
            anyhow::anyhow!("LM head: {n} {} {what} expected, found {} {}", dt.name(), t.numel(), t.dtype().name())
        })
    };
    let err = match coef {
        Coef::Given(c) => bad("coefficients", c, DType::F32),
        Coef::Rule { den, teacher, tis, .. } => bad("weight denominators", den, DType::U32)
            .or_else(|| teacher.and_then(|t| bad("teacher log-probs", t, DType::F32)))
            .or_else(|| tis.and_then(|t| bad("sampler log-probs", t.sampler, DType::F32)))
            .or_else(|| {
                tis.and_then(|t| {
                    (t.adv.numel() != 2 * n || t.adv.dtype() != DType::U32)
                        .then(|| anyhow::anyhow!("LM head: {n} advantages (as {} u32 words) expected", 2 * n))
                })
            })
            .or_else(|| {
                (teacher.is_some() && tis.is_some()).then(|| anyhow::anyhow!("LM head: a rule with a teacher and TIS"))
            }),
    };
    err.map_or(Ok(()), Err)
}

/// The fused loss pass: dh[rows] += dz·Wh and dWh += dzᵀ·h for dz_i = −coef_i (e_{y_i} − p_i)/T
/// (with `center`: −coef_i (e_{y_i} − q̃_i)/T), `chunk` rows at a time. dh (N, C) and dwh (V, C)
/// are f32 and accumulated into. Returns the surrogate loss Σ_i −coef_i·logp_i (centered: as
/// `grad::grad_centered`). A BF16 head runs its GEMMs on BF16 operands with FP32 accumulation.
#[allow(clippy::too_many_arguments)]
pub fn loss_grad(
    dev: &Device,
    h: &Tensor,
    wh: &Tensor,
    r: &Rows<'_>,
    coef: &Tensor,
    center: Option<&DevCenter<'_>>,
    temperature: f32,
    chunk: usize,
    dh: &mut Tensor,
    dwh: &mut Tensor,
) -> Result<f64> {
    let pass = Pass { coef: Coef::Given(coef), center, temperature, chunk, stats: None, loss: true };
    Ok(loss_grad_with(dev, h, wh, r, pass, dh, dwh)?.unwrap_or(f64::NAN))
}

/// One loss pass's settings besides its operands: the coefficients, score centering's target,
/// the temperature, the rows per chunk, where the pass also writes the rows' statistics, and
/// whether it returns the surrogate loss (on a GPU a read-back, so a synchronization).
pub struct Pass<'a, 'b> {
    pub coef: Coef<'a>,
    pub center: Option<&'a DevCenter<'a>>,
    pub temperature: f32,
    pub chunk: usize,
    pub stats: Option<StatsOut<'b>>,
    pub loss: bool,
}

/// [`loss_grad`] with [`Pass`]'s choices; the loss is None unless asked for. With `stats` the
/// pass is the statistics pass too, its statistics [`stats`]'s to the bit (on CUDA the same
/// launches on the same logits: one LM-head GEMM per chunk where the two passes ran two; the
/// CPU arm, the reference, runs its statistics first), so with coefficients known before it
/// or a [`Coef::Rule`] no statistics pass is needed.
pub fn loss_grad_with(
    dev: &Device,
    h: &Tensor,
    wh: &Tensor,
    r: &Rows<'_>,
    pass: Pass<'_, '_>,
    dh: &mut Tensor,
    dwh: &mut Tensor,
) -> Result<Option<f64>> {
    let n = check(h, wh, r, pass.chunk)?;
    check_coef(pass.coef, n)?;
    if let Some(s) = &pass.stats {
        check_stats(&*s.logp, &*s.entropy, n)?;
    }
    let center = pass.center;
    if let Some(ct) = center {
        if ct.ids.numel() != n * ct.k || ct.probs.numel() != n * ct.k || ct.k == 0 {
            bail!("LM head centering: {n}·k ids and probabilities expected (k = {})", ct.k);
        }
    }
    if dh.numel() != h.numel() || dwh.numel() != wh.numel() || dh.dtype() != DType::F32 || dwh.dtype() != DType::F32 {
        bail!("LM head gradients: f32 tensors of h's and Wh's shapes expected");
    }
    let asked = pass.loss;
    let loss = match dev {
        Device::Cpu(_) => Some(cpu::loss_grad(h, wh, r, pass, dh, dwh)?),
        Device::Cuda(d) => cuda::loss_grad(d, h, wh, r, pass, dh, dwh)?,
    };
    Ok(loss.filter(|_| asked))
}
