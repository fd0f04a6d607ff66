//! The first update's pass of a device trainer when one minibatch covers the step: each
//! micro-batch of this device's share is scored (π_old's log-probs and entropy), its
//! coefficients evaluated, and its backward run on the activations the scoring forward left,
//! so the step runs one forward of the model where it ran two (score every micro-batch, then
//! forward each again before its backward). The gradient is the unfused pass's bit for bit:
//! the same micro-batches, the same coefficients, the same launches on the same activations.
//!
//! Why the coefficients can be evaluated micro-batch by micro-batch: every objective's
//! coefficient of a token depends on its own response's log-probs and on constants of the
//! whole update batch that come from the lengths and masks alone (the loss aggregation's
//! counts, TRIAGE's repair segment count N_rep). So the whole batch is evaluated with the
//! log-probs known so far (the rest 0) and this micro-batch's coefficients are read off;
//! `objective::tests` checks that separability for each objective. The step's loss,
//! statistics and skip decision still come from the whole batch's evaluation after the
//! log-probs are gathered, exactly as before.
//!
//! One pass, where the objective allows it (SFT and OPD: a token's coefficient at ratio 1 is a
//! function of its own log-prob and of inputs known before the pass, its aggregation weight
//! and the teacher's log-prob): the loss pass evaluates the coefficients itself on the device
//! (`ops::lm_head::Coef::Rule`) and its statistics are π_old's, so the statistics pass and its
//! LM-head GEMMs go, and nothing is read back until every micro-batch is queued. The same
//! bits again: the rule's f64 operations are the objective's, on the same log-probs.
//!
//! Owns: that pass, [`FirstPass`]. May call: the device state, the objective's evaluation.
//! Must not: apply the update (the step does, after its skip checks).

use super::{StepInputs, Trainer};
use crate::engine::rollout::Rollout;
use crate::objective::{agg_denominators, TokenStats};
use anyhow::{anyhow, Result};
use std::ops::Range;

/// How a device trainer with one minibatch runs the first update's pass (the gradients are
/// the same bits each way; the default is the fastest the objective allows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FirstPass {
    /// Score every micro-batch, then run each forward again before its backward.
    Unfused,
    /// Each micro-batch scored (a statistics pass), its coefficients evaluated on the host,
    /// then its loss pass and backward on the same activations.
    TwoPass,
    /// [`FirstPass::TwoPass`], but SFT and OPD evaluate their coefficients in the loss pass.
    OnePass,
}

/// The one pass's inputs over the step's tokens: (aggregation denominators, the teacher's
/// log-probs, the advantage offset).
type Rule<'a> = (Vec<u32>, Option<&'a [f32]>, f64);

impl Trainer {
    /// The fused first pass over all of `rollouts` (one minibatch): the gradient of this
    /// device's share is in the device state afterwards. Returns what
    /// [`Trainer::gathered_stats`] returns for the whole step: every device's log-probs, the
    /// entropy sum, this device's micro-batch count and its share of the responses.
    pub(super) fn fused_first(
        &mut self,
        rollouts: &[Rollout],
        inp: &StepInputs,
        k: u64,
    ) -> Result<(Vec<f32>, f64, usize, Range<usize>)> {
        let all = 0..rollouts.len();
        let mine = self.dp.split(rollouts, all.clone());
        let mbs = self.micro_batches(&rollouts[mine.clone()]);
        let m = inp.tokens(&all).len();
        let my = inp.tokens(&mine);
        let (t, chunk) = (self.temperature, self.chunk);
        let rule = self.one_pass_rule(inp, m);
        let ds = self.dstate.as_mut().ok_or_else(|| anyhow!("the fused pass needs a device trainer"))?;
        ds.zero_grads()?;
        // Every device's log-probs as far as this device knows them (its own, so far).
        let mut known = vec![0.0f32; m];
        let mut entropy = Vec::with_capacity(my.len());
        let mut at = my.start;
        if mine.is_empty() {
            ds.no_backward()?;
        } else if let Some((den, teacher, offset)) = rule {
            let mut pending = Vec::with_capacity(mbs.len());
            for (i, mb) in mbs.iter().enumerate() {
                let b = Self::batch(&rollouts[mine.start + mb.start..mine.start + mb.end]);
                let n = b.rows.len();
                let rows = at..at + n;
                let center = inp
                    .center
                    .as_ref()
                    .map(|(kk, ids, p)| (*kk, &ids[at * kk..(at + n) * kk], &p[at * kk..(at + n) * kk]));
                let rule = (&den[rows.clone()], teacher.map(|t| &t[rows.clone()]), offset);
                pending.push((rows, ds.one_pass(&self.weights, &b, rule, center, t, chunk, i + 1 == mbs.len())?));
                at += n;
            }
            for (rows, (lp, en)) in pending {
                known[rows].copy_from_slice(&lp.to_f32_vec()?);
                entropy.extend_from_slice(&en.to_f32_vec()?);
            }
        } else {
            for (i, mb) in mbs.iter().enumerate() {
                let b = Self::batch(&rollouts[mine.start + mb.start..mine.start + mb.end]);
                let (lp, en) = ds.token_stats(&self.weights, &b, t, chunk)?;
                let n = lp.len();
                known[at..at + n].copy_from_slice(&lp);
                entropy.extend_from_slice(&en);
                // π_old is the current policy: the ratio is 1, as in the unfused first update.
                let stats = TokenStats {
                    seq_lens: &inp.seq_lens,
                    logp: &known,
                    logp_old: Some(&known),
                    sampler: Some(&inp.sampler),
                    teacher: inp.teacher.as_deref(),
                    advantages: inp.adv_tokens.as_deref(),
                    mask: inp.mask.as_deref(),
                };
                let ev = super::evaluate(&self.objective, &stats, self.agg, k)?;
                let center = inp
                    .center
                    .as_ref()
                    .map(|(kk, ids, p)| (*kk, &ids[at * kk..(at + n) * kk], &p[at * kk..(at + n) * kk]));
                let coef = &ev.coefs.coef[at..at + n];
                ds.backward(&self.weights, &b, coef, center, t, chunk, false, i + 1 == mbs.len())?;
                at += n;
            }
        }
        let logp = self.dp.allgather_v(&known[my.clone()], my.start, m)?;
        let ent = self.dp.sum_f64(entropy.iter().map(|&x| x as f64).sum())?;
        Ok((logp, ent, mbs.len(), mine))
    }

    /// The one pass's per-token inputs over the step's `m` tokens, where it runs: each token's
    /// aggregation denominator (u32; a larger one leaves the step to the two passes), the
    /// teacher's log-probs (OPD) and the advantage offset.
    fn one_pass_rule<'a>(&self, inp: &'a StepInputs, m: usize) -> Option<Rule<'a>> {
        if self.first_pass != FirstPass::OnePass {
            return None;
        }
        let (teacher, offset) = self.objective.one_pass_rule()?;
        let teacher = match teacher {
            true => Some(inp.teacher.as_deref()?), // missing: the host evaluation says so
            false => None,
        };
        let zeros = vec![0.0f32; m];
        let s = TokenStats {
            seq_lens: &inp.seq_lens,
            logp: &zeros,
            logp_old: None,
            sampler: None,
            teacher: None,
            advantages: None,
            mask: inp.mask.as_deref(),
        };
        let den =
            agg_denominators(&s, self.agg).into_iter().map(u32::try_from).collect::<Result<Vec<u32>, _>>().ok()?;
        Some((den, teacher, offset))
    }
}

#[cfg(test)]
mod tests {
    use super::super::{evaluate, Objective};
    use crate::config::{JobConfig, LossAgg};
    use crate::objective::TokenStats;

    /// Every objective's coefficients of some responses are the same bits whether the other
    /// responses' log-probs are known or 0 (what the fused pass relies on): SFT, OPD, GRPO with
    /// TIS, REINFORCE and TRIAGE, under each loss aggregation, with masked tokens; TRIAGE with its
    /// gate and its repair both active.
    #[test]
    fn coefficients_depend_on_their_own_responses_log_probs_alone() {
        let lens = [130usize, 70, 200, 64, 150, 90];
        let adv_r = [1.0f64, -1.0, -0.5, 0.5, -1.0, 1.0];
        let m: usize = lens.iter().sum();
        let mut rng = crate::rand::Stream::new(3, 7);
        let sampler: Vec<f32> = (0..m).map(|_| (-0.5 - rng.uniform()) as f32).collect();
        let teacher: Vec<f32> = (0..m).map(|_| (-0.5 - rng.uniform()) as f32).collect();
        // log π_θ below the sampler's (δ < 0) on the negative responses: the gate; a little
        // below on the positive ones: the repair.
        let mut logp = Vec::with_capacity(m);
        let mut adv = Vec::with_capacity(m);
        for (r, &n) in lens.iter().enumerate() {
            for _ in 0..n {
                let shift = if adv_r[r] < 0.0 { -0.6 } else { -0.1 };
                logp.push(sampler[logp.len()] + (shift + 0.3 * rng.normal()) as f32);
                adv.push(adv_r[r]);
            }
        }
        let mask: Vec<bool> = (0..m).map(|i| i % 17 != 3).collect();
        let offsets: Vec<usize> = std::iter::once(0)
            .chain(lens.iter().scan(0, |a, &n| {
                *a += n;
                Some(*a)
            }))
            .collect();
        let objectives = [
            "kind = \"sft\"",
            "kind = \"opd\"\nadvantage_offset = 0.1",
            "kind = \"grpo\"\ntis = true",
            "kind = \"reinforce\"",
            "kind = \"triage\"",
        ];
        for obj in objectives {
            let toml = format!("[model]\npath = \"unused\"\n[teacher]\npath = \"unused\"\n[objective]\n{obj}\n");
            let job = JobConfig::from_toml(&toml, "inline").unwrap();
            let o = Objective::from_job(&job).unwrap();
            for agg in [LossAgg::TokenMean, LossAgg::SeqMeanTokenMean, LossAgg::SeqMeanTokenSum] {
                let stats = |lp: &'_ [f32]| -> Vec<u32> {
                    let s = TokenStats {
                        seq_lens: &lens,
                        logp: lp,
                        logp_old: Some(lp),
                        sampler: Some(&sampler),
                        teacher: Some(&teacher),
                        advantages: Some(&adv),
                        mask: Some(&mask),
                    };
                    let ev = evaluate(&o, &s, agg, 60).unwrap(); // past k_rep: the repair's λ is on
                    if let (true, Some(t)) = (lp == logp.as_slice(), &ev.triage) {
                        assert!(t.gated_segments > 0 && t.repair_mass > 0.0, "{obj}: gate and repair active: {t:?}");
                    }
                    ev.coefs.coef.iter().map(|c| c.to_bits()).collect()
                };
                let full = stats(&logp);
                assert!(full.iter().any(|&c| f32::from_bits(c) != 0.0), "{obj} {agg:?}: some coefficient");
                for (a, b) in [(0, 2), (2, 3), (3, 6)] {
                    let r = offsets[a]..offsets[b];
                    let mut known = vec![0.0f32; m];
                    known[r.clone()].copy_from_slice(&logp[r.clone()]);
                    assert_eq!(stats(&known)[r.clone()], full[r.clone()], "{obj} {agg:?}: responses {a}..{b}");
                }
            }
        }
    }
}
