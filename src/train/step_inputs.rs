//! What a training step needs besides the learner's own log-probs, gathered from its rollouts
//! once: response lengths, sampler and teacher log-probs, advantages from rewards (RL), and score
//! centering's normalized top-k targets; and the objective dispatch that turns token statistics
//! into coefficients.
//!
//! Owns: [`Objective`] (the configured objective) and its [`OnePass`] answer, [`StepInputs`]. May call: `crate::objective`.
//! Must not: run models.

use crate::config::{JobConfig, LossAgg, ObjectiveKind};
use crate::engine::rollout::Rollout;
use crate::objective::advantage::{self, Estimator};
use crate::objective::grpo::{self, PgConfig};
use crate::objective::triage::{self, TriageConfig, TriageStats};
use crate::objective::{opd, sft, Coefficients, TokenStats};
use anyhow::{bail, Result};
use std::ops::Range;

/// The configured objective.
#[derive(Clone, Debug, PartialEq)]
pub enum Objective {
    Sft,
    Opd {
        offset: f64,
    },
    /// GRPO / REINFORCE (with TIS when `pg.tis_cap` is set), optionally TRIAGE on top.
    Pg {
        pg: PgConfig,
        est: Estimator,
        offset: f64,
        triage: Option<TriageConfig>,
    },
}

impl Objective {
    pub fn from_job(job: &JobConfig) -> Result<Objective> {
        let o = &job.objective;
        let tis_cap = o.tis_enabled().then_some(o.tis_cap);
        Ok(match o.kind {
            ObjectiveKind::Sft => Objective::Sft,
            ObjectiveKind::Opd => Objective::Opd { offset: o.advantage_offset },
            ObjectiveKind::Grpo | ObjectiveKind::Triage => Objective::Pg {
                pg: PgConfig { eps_low: o.clip_low, eps_high: o.clip_high, tis_cap },
                est: Estimator::Grpo { population_std: o.population_std },
                offset: o.advantage_offset,
                triage: (o.kind == ObjectiveKind::Triage).then(|| o.triage.clone()),
            },
            // REINFORCE: the ratio is never clipped.
            ObjectiveKind::Reinforce => Objective::Pg {
                pg: PgConfig { eps_low: f64::INFINITY, eps_high: f64::INFINITY, tis_cap },
                est: Estimator::Reinforce,
                offset: o.advantage_offset,
                triage: None,
            },
        })
    }

    /// How the device's one-pass loss gets this objective's coefficients at the step's first
    /// update (ratio 1, `train/trainer/fused.rs`); None: from a statistics pass before it
    /// (TRIAGE's gate and repair need whole segments of π_old's log-probs).
    pub fn one_pass(&self) -> Option<OnePass> {
        match self {
            Objective::Sft => Some(OnePass::Rule { teacher: false, offset: 0.0, tis: None }),
            Objective::Opd { offset } => Some(OnePass::Rule { teacher: true, offset: *offset, tis: None }),
            Objective::Pg { pg, triage: None, .. } => match pg.tis_cap {
                None => Some(OnePass::Known),
                Some(cap) => Some(OnePass::Rule { teacher: false, offset: 0.0, tis: Some(cap) }),
            },
            Objective::Pg { .. } => None,
        }
    }

    pub fn needs_teacher(&self) -> bool {
        matches!(self, Objective::Opd { .. })
    }
    pub fn needs_rewards(&self) -> bool {
        matches!(self, Objective::Pg { .. })
    }
}

/// One objective evaluation: coefficients, TRIAGE's statistics, clipped tokens.
pub struct Evaluated {
    pub coefs: Coefficients,
    pub triage: Option<TriageStats>,
    pub clipped: usize,
}

/// Coefficients of `obj` on `s` at rollout-update index `k`.
pub fn evaluate(obj: &Objective, s: &TokenStats, agg: LossAgg, k: u64) -> Result<Evaluated> {
    Ok(match obj {
        Objective::Sft => Evaluated { coefs: sft::coefficients(s, agg)?, triage: None, clipped: 0 },
        Objective::Opd { offset } => {
            Evaluated { coefs: opd::coefficients_with_offset(s, agg, *offset)?, triage: None, clipped: 0 }
        }
        Objective::Pg { pg, triage: None, .. } => {
            let b = grpo::base(s, agg, pg)?;
            let loss = b.weights.iter().zip(&b.token_loss).map(|(w, l)| w * l).sum();
            Evaluated {
                coefs: Coefficients { coef: b.coef.iter().map(|&x| x as f32).collect(), loss },
                triage: None,
                clipped: b.clipped,
            }
        }
        Objective::Pg { pg, triage: Some(tc), .. } => {
            let clipped = grpo::base(s, agg, pg)?.clipped;
            let (coefs, st) = triage::coefficients(s, agg, pg, tc, k)?;
            Evaluated { coefs, triage: Some(st), clipped }
        }
    })
}

/// [`Objective::one_pass`]'s answer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OnePass {
    /// The coefficients do not depend on the log-probs at ratio 1: evaluated on the host before
    /// the pass (GRPO and REINFORCE without TIS: ρ = 1, nothing clipped, c_t = w_t·A_t).
    Known,
    /// Each depends on its token's own log-prob: the pass evaluates them on the device
    /// (`ops::lm_head::Coef::Rule`: OPD with the teacher's log-probs and the offset; SFT; GRPO
    /// and REINFORCE with TIS at cap `tis`, with the sampler's log-probs and the advantages).
    Rule { teacher: bool, offset: f64, tis: Option<f64> },
}

/// Per-step inputs, token-aligned with the concatenated responses.
#[derive(Default)]
pub struct StepInputs {
    pub seq_lens: Vec<usize>,
    /// Token offset of each response (len = responses + 1).
    pub offsets: Vec<usize>,
    pub sampler: Vec<f32>,
    pub teacher: Option<Vec<f32>>,
    /// Per response and per token (RL).
    pub adv_response: Option<Vec<f64>>,
    pub adv_tokens: Option<Vec<f64>>,
    /// Score centering: k, ids (tokens·k) and the normalized probabilities q̃ (tokens·k).
    pub center: Option<(usize, Vec<u32>, Vec<f32>)>,
    /// Asynchronous schedules: tokens trained (false: sampled more than k versions ago), how
    /// many were left out, the largest version lag among the trained ones, and the largest
    /// among all (trained or not: how far generation ran ahead of training).
    pub mask: Option<Vec<bool>>,
    pub masked: usize,
    pub max_lag: u64,
    pub max_age: u64,
}

impl StepInputs {
    /// The token statistics of the responses `part` (their tokens' current log-probs `logp`
    /// and old ones `old`), with the step's inputs sliced to them.
    pub fn stats<'a>(&'a self, part: &Range<usize>, logp: &'a [f32], old: &'a [f32]) -> TokenStats<'a> {
        let toks = self.tokens(part);
        TokenStats {
            seq_lens: &self.seq_lens[part.clone()],
            logp,
            logp_old: Some(old),
            sampler: Some(&self.sampler[toks.clone()]),
            teacher: self.teacher.as_ref().map(|t| &t[toks.clone()]),
            advantages: self.adv_tokens.as_ref().map(|a| &a[toks.clone()]),
            mask: self.mask.as_ref().map(|m| &m[toks.clone()]),
        }
    }

    /// `staleness`: (the trainer's weight version, the bound k) under an asynchronous schedule.
    pub fn build(
        rollouts: &[Rollout],
        obj: &Objective,
        centering: bool,
        staleness: Option<(u64, u64)>,
    ) -> Result<StepInputs> {
        let mut s = StepInputs { offsets: vec![0], ..Default::default() };
        if let Some((now, k)) = staleness {
            let mut mask = Vec::new();
            for r in rollouts {
                for t in 0..r.response.len() {
                    let v = r.token_versions.get(t).map(|&v| v as u64).unwrap_or(r.version);
                    let lag = now.saturating_sub(v);
                    s.max_age = s.max_age.max(lag);
                    let keep = lag <= k;
                    if keep {
                        s.max_lag = s.max_lag.max(lag);
                    } else {
                        s.masked += 1;
                    }
                    mask.push(keep);
                }
            }
            s.mask = Some(mask);
        }
        for r in rollouts {
            s.seq_lens.push(r.response.len());
            s.offsets.push(s.offsets.last().copied().unwrap_or(0) + r.response.len());
            s.sampler.extend_from_slice(&r.sampler_logprobs);
        }
        let who = |r: &Rollout| format!("rollout (prompt {}, sample {})", r.prompt_id, r.sample);
        if obj.needs_teacher() {
            let mut v = Vec::with_capacity(s.sampler.len());
            for r in rollouts {
                match &r.teacher_logprobs {
                    Some(t) if t.len() == r.response.len() => v.extend_from_slice(t),
                    _ => bail!("opd: {} has no teacher log-probs", who(r)),
                }
            }
            s.teacher = Some(v);
        }
        if let Objective::Pg { est, offset, .. } = obj {
            let mut rewards = Vec::with_capacity(rollouts.len());
            for r in rollouts {
                match r.reward {
                    Some(x) => rewards.push(x as f64),
                    None => bail!(
                        "{} has no reward: RL objectives need rewards (an 'answer' in the prompt file for the boxed-answer rule, or a 'reward' in the rollout file)",
                        who(r)
                    ),
                }
            }
            let groups: Vec<u64> = rollouts.iter().map(|r| r.group).collect();
            let a = advantage::advantages(&rewards, &groups, *est, *offset)?;
            s.adv_tokens =
                Some(rollouts.iter().zip(&a).flat_map(|(r, a)| std::iter::repeat_n(*a, r.response.len())).collect());
            s.adv_response = Some(a);
        }
        if centering {
            let mut k = 0;
            let (mut ids, mut probs) = (Vec::new(), Vec::new());
            for r in rollouts {
                let t = match &r.sampler_topk {
                    Some(t) if t.ids.len() == t.k * r.response.len() => t,
                    _ => bail!("score centering: {} has no sampler top-k log-probs (the engine returns them when objective.centering = true; a rollout file needs 'sampler_topk_ids' and 'sampler_topk_logprobs')", who(r)),
                };
                if k == 0 {
                    k = t.k;
                } else if t.k != k {
                    bail!("score centering: {} has top-{} log-probs, others top-{k}", who(r), t.k);
                }
                ids.extend_from_slice(&t.ids);
                // q̃ = the top-k distribution renormalized to 1 (log-sum-exp in f64).
                for row in t.logprobs.chunks(k) {
                    let mx = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
                    let z: f64 = row.iter().map(|&l| (l as f64 - mx).exp()).sum();
                    probs.extend(row.iter().map(|&l| ((l as f64 - mx).exp() / z) as f32));
                }
            }
            s.center = Some((k, ids, probs));
        }
        Ok(s)
    }

    /// Token range of responses `r`.
    pub fn tokens(&self, r: &Range<usize>) -> Range<usize> {
        self.offsets[r.start]..self.offsets[r.end]
    }
}

/// Splits `n` responses into `parts` contiguous minibatches (sizes differ by at most one).
pub fn minibatches(n: usize, parts: usize) -> Vec<Range<usize>> {
    let parts = parts.clamp(1, n.max(1));
    (0..parts).map(|i| (i * n / parts)..((i + 1) * n / parts)).filter(|r| !r.is_empty()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staleness_mask_keeps_tokens_at_most_k_versions_old() {
        // Trainer at version 5, bound k = 1. Response a: all sampled at version 5 (lag 0);
        // response b: interrupted by two updates, tokens at versions 2, 2, 4, 5 (lags 3, 3, 1, 0);
        // response c: no per-token versions, the response's own version 3 (lag 2).
        let r = |version: u64, n: usize, token_versions: Vec<u32>| Rollout {
            response: vec![1; n],
            sampler_logprobs: vec![-1.0; n],
            version,
            token_versions,
            ..Default::default()
        };
        let rollouts = [r(5, 2, vec![]), r(2, 4, vec![2, 2, 4, 5]), r(3, 3, vec![])];
        let s = StepInputs::build(&rollouts, &Objective::Sft, false, Some((5, 1))).unwrap();
        let want = [true, true, false, false, true, true, false, false, false];
        assert_eq!(s.mask.as_deref(), Some(&want[..]));
        assert_eq!(s.masked, 5);
        assert_eq!((s.max_lag, s.max_age), (1, 3));
        // k = 3 keeps everything; the lags are the same.
        let s = StepInputs::build(&rollouts, &Objective::Sft, false, Some((5, 3))).unwrap();
        assert!(s.mask.as_ref().unwrap().iter().all(|&k| k));
        assert_eq!((s.masked, s.max_lag, s.max_age), (0, 3, 3));
        // Synchronous: no mask at all.
        let s = StepInputs::build(&rollouts, &Objective::Sft, false, None).unwrap();
        assert!(s.mask.is_none() && s.masked == 0);
    }
}
