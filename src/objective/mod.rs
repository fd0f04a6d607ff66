//! Objectives: token statistics → one coefficient c_t per response token, such that the
//! loss gradient is Σ_t −c_t·∇log p_θ(y_t) (the logits gradient −c_t·(e_y − softmax(z/T))/T is
//! then produced by the fused LM-head pass, `ops::lm_head::grad::grad`). An objective is a cheap
//! pass over the step's tokens; it never sees logits.
//!
//! Owns: [`ObjectiveKind`], [`LossAgg`], the aggregation weights and each objective's
//! coefficients and reported loss. May call: arithmetic, and `crate::mismatch`'s segment
//! statistics (TRIAGE's repair). Must not: run models.

pub mod advantage;
pub mod grpo;
pub mod opd;
pub mod sft;
pub mod triage;

use anyhow::{bail, Result};

crate::str_enum! {
    /// How token losses are aggregated into the step's loss (`objective.loss_agg`).
    pub enum LossAgg("objective.loss_agg", "unknown loss aggregation '{s}': expected {expected}") {
        TokenMean = "token-mean",
        SeqMeanTokenMean = "seq-mean-token-mean",
        SeqMeanTokenSum = "seq-mean-token-sum",
    }
}

crate::str_enum! {
    /// What a step trains toward (`objective.kind`).
    pub enum ObjectiveKind("objective.kind", "unknown objective '{s}': expected {expected}") {
        /// On-policy distillation (seed 000 Eq. 1).
        Opd = "opd",
        /// Supervised fine-tuning on reference responses.
        Sft = "sft",
        /// GRPO (seed 004 Eq. 1).
        Grpo = "grpo",
        Reinforce = "reinforce",
        /// GRPO + TIS + the TRIAGE gate and repair (seed 004 App. C).
        Triage = "triage",
    }
}

impl ObjectiveKind {
    /// The RL objectives (rewards, group advantages).
    pub fn is_rl(self) -> bool {
        matches!(self, ObjectiveKind::Grpo | ObjectiveKind::Reinforce | ObjectiveKind::Triage)
    }
}

/// Per-token inputs of one training step. Response tokens of all sequences, concatenated in
/// sequence order; `seq_lens[i]` tokens belong to sequence i.
pub struct TokenStats<'a> {
    pub seq_lens: &'a [usize],
    /// log p_θ(y_t) at the trainer's current weights (temperature-scaled like the sampler).
    pub logp: &'a [f32],
    /// log π_old(y_t): the learner's log-probs at the start of the step (the ratio's
    /// denominator); None means the current ones (one update per step: ratio 1).
    pub logp_old: Option<&'a [f32]>,
    /// The engine's log q(y_t).
    pub sampler: Option<&'a [f32]>,
    /// The teacher's log p_T(y_t).
    pub teacher: Option<&'a [f32]>,
    /// Per-token advantages (RL: the response's advantage on each of its tokens).
    pub advantages: Option<&'a [f64]>,
    /// 1 = train on this token, 0 = skip (e.g. too stale).
    pub mask: Option<&'a [bool]>,
}

impl<'a> TokenStats<'a> {
    /// The statistics of responses of `seq_lens` tokens with log-probs `logp` and nothing else
    /// (no old, sampler or teacher log-probs, advantages or mask): a base for struct update.
    pub fn of(seq_lens: &'a [usize], logp: &'a [f32]) -> TokenStats<'a> {
        TokenStats { seq_lens, logp, logp_old: None, sampler: None, teacher: None, advantages: None, mask: None }
    }
    pub fn len(&self) -> usize {
        self.logp.len()
    }
    pub fn is_empty(&self) -> bool {
        self.logp.is_empty()
    }
    pub fn check(&self) -> Result<()> {
        let n: usize = self.seq_lens.iter().sum();
        if n != self.logp.len() {
            bail!("objective: {} log-probs for {} response tokens", self.logp.len(), n);
        }
        for (name, v) in [("sampler", self.sampler), ("teacher", self.teacher), ("old", self.logp_old)] {
            if let Some(v) = v {
                if v.len() != n {
                    bail!("objective: {} {name} log-probs for {n} response tokens", v.len());
                }
            }
        }
        if let Some(a) = self.advantages {
            if a.len() != n {
                bail!("objective: {} advantages for {n} tokens", a.len());
            }
        }
        if let Some(m) = self.mask {
            if m.len() != n {
                bail!("objective: mask of {} for {n} tokens", m.len());
            }
        }
        Ok(())
    }
    fn active(&self, t: usize) -> bool {
        self.mask.map(|m| m[t]).unwrap_or(true)
    }
}

/// Loss aggregation weights w_t (Σ_t w_t·ℓ_t is the step's loss), over active tokens:
/// token-mean 1/N (N active tokens of the batch); seq-mean-token-mean 1/(B·n_i);
/// seq-mean-token-sum 1/B (B sequences with at least one active token, n_i their active tokens).
/// Each is 1 / [`agg_denominators`]'s integer, divided in f64 (0 for an inactive token).
pub fn agg_weights(s: &TokenStats, agg: LossAgg) -> Vec<f64> {
    agg_denominators(s, agg).iter().map(|&d| if d == 0 { 0.0 } else { 1.0 / d as f64 }).collect()
}

/// The integer d_t with w_t = 1/d_t ([`agg_weights`]), 0 for an inactive token: what the
/// device's one-pass loss (`ops::lm_head::Coef::Rule`) uploads and divides itself, to the
/// same bits.
pub fn agg_denominators(s: &TokenStats, agg: LossAgg) -> Vec<u64> {
    let mut d = vec![0; s.len()];
    let mut counts = Vec::with_capacity(s.seq_lens.len());
    let mut t = 0;
    for &n in s.seq_lens {
        counts.push((t..t + n).filter(|&i| s.active(i)).count() as u64);
        t += n;
    }
    let total: u64 = counts.iter().sum();
    let b = counts.iter().filter(|&&c| c > 0).count() as u64;
    let mut t = 0;
    for (&n, &c) in s.seq_lens.iter().zip(&counts) {
        for i in t..t + n {
            if s.active(i) {
                d[i] = match agg {
                    LossAgg::TokenMean => total,
                    LossAgg::SeqMeanTokenMean => b * c,
                    LossAgg::SeqMeanTokenSum => b,
                };
            }
        }
        t += n;
    }
    d
}

/// What an objective returns.
#[derive(Clone, Debug, Default)]
pub struct Coefficients {
    /// c_t per response token.
    pub coef: Vec<f32>,
    /// The objective's reported loss (its own definition, see each objective).
    pub loss: f64,
}
