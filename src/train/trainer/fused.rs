//! The first update's pass of a device trainer: each micro-batch of this device's share of
//! the first minibatch is scored (π_old's log-probs and entropy), its coefficients evaluated,
//! and its backward run on the activations the scoring forward left, so that minibatch runs
//! one forward of the model where it ran two (score every micro-batch, then forward each
//! again before its backward); the step's other minibatches are scored after it, before any
//! update. The gradient is the unfused pass's bit for bit: the same micro-batches, the same
//! coefficients, the same launches on the same activations.
//!
//! Why the coefficients can be evaluated micro-batch by micro-batch: every objective's
//! coefficient of a token depends on its own response's log-probs and on constants of the
//! whole update batch that come from the lengths and masks alone (the loss aggregation's
//! counts, TRIAGE's repair segment count N_rep). So the whole minibatch is evaluated with the
//! log-probs known so far (the rest 0) and this micro-batch's coefficients are read off;
//! `tests::coefficients_depend_on_their_own_responses_log_probs_alone` checks that
//! separability for each objective. The step's loss, statistics and skip decision still come
//! from the whole batch's evaluation after the log-probs are gathered, exactly as before.
//!
//! One pass, where the objective allows it: at the first update the ratio is 1, and then a
//! token's coefficient is either known before the pass (GRPO and REINFORCE without TIS:
//! c_t = w_t·A_t, evaluated on the host with every log-prob 0) or a function of its own
//! log-prob and of inputs known before the pass (SFT: its aggregation weight; OPD: also the
//! teacher's log-prob and the offset; GRPO and REINFORCE with TIS: w_t·min(exp(log π_old −
//! log π_s), C)·A_t, the sampler's log-prob and the advantage), which the loss pass evaluates
//! on the device (`ops::lm_head::Coef::Rule`). Either way the loss pass's statistics are π_old's, so the
//! statistics pass and its LM-head GEMMs go, and the host reads nothing back (not even the
//! loss pass's loss) until every micro-batch is queued. The same bits again for finite
//! log-probs: the coefficients are the objective's, the rule's f64 operations its own, on the
//! same log-probs. A log-prob that is not finite makes the host's coefficient NaN (ρ =
//! exp(NaN)) where the one pass's may be finite or infinite; the step's evaluation after the
//! pass then skips the update, as it would have. TIS's weight takes the device's f64 exp
//! (within 1 ulp, as the host libm's: on a GPU a coefficient may, rarely, differ in its last
//! f32 bit; the simulator calls the host's libm, the same bits). TRIAGE keeps the two passes:
//! its gate and repair read whole segments of π_old's log-probs.
//!
//! Owns: that pass, [`FirstPass`]. May call: the device state, the objective's evaluation.
//! Must not: apply the update (the step does, after its skip checks).

use super::{StepInputs, Trainer};
use crate::engine::rollout::Rollout;
use crate::objective::agg_denominators;
use crate::train::device_state::OnePassCoef;
use crate::train::step_inputs::OnePass;
use anyhow::{anyhow, Result};
use std::ops::Range;

/// How a device trainer runs the first update's pass (the gradients are the same bits each
/// way; the default is the fastest the objective allows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FirstPass {
    /// Score every micro-batch of the step, then run each forward again before its backward.
    Unfused,
    /// Each micro-batch scored (a statistics pass), its coefficients evaluated on the host,
    /// then its loss pass and backward on the same activations.
    TwoPass,
    /// [`FirstPass::TwoPass`] without the statistics pass where the objective allows it (see
    /// the module's comment).
    OnePass,
}

/// The one pass's coefficients over the first minibatch's tokens: known before it, or the rule's
/// inputs (aggregation denominators, the teacher's log-probs, the advantage offset; TIS's
/// sampler log-probs, advantages and cap).
enum Rule<'a> {
    Known(Vec<f32>),
    /// Denominators, the teacher's log-probs, the offset, TIS's (sampler log-probs,
    /// advantages, cap).
    Device(Vec<u32>, Option<&'a [f32]>, f64, Option<(&'a [f32], &'a [f64], f64)>),
}

impl Trainer {
    /// The step's π_old statistics, the first update's pass fused with them: minibatch `parts[0]`
    /// by [`Self::fused_first`] (its gradient is in the device state afterwards), the others
    /// scored after it, before any update. Returns what [`Trainer::gathered_stats`] returns for
    /// the whole step: every device's log-probs, the entropy sum, this device's micro-batch
    /// count in the first minibatch and its share of that minibatch's responses.
    pub(super) fn first_stats(
        &mut self,
        rollouts: &[Rollout],
        inp: &StepInputs,
        k: u64,
        parts: &[Range<usize>],
    ) -> Result<(Vec<f32>, f64, usize, Range<usize>)> {
        let first = parts.first().cloned().unwrap_or(0..rollouts.len());
        let (mut logp, mut ent, chunks, mine) = self.fused_first(rollouts, inp, k, first.clone())?;
        if first.end < rollouts.len() {
            let (rest, rest_ent, _, _) = self.gathered_stats(rollouts, inp, first.end..rollouts.len())?;
            logp.extend_from_slice(&rest);
            ent += rest_ent;
        }
        Ok((logp, ent, chunks, mine))
    }

    /// The fused first pass over minibatch `part` of `rollouts`: the gradient of this device's
    /// share is in the device state afterwards. Returns what [`Trainer::gathered_stats`]
    /// returns for `part`.
    fn fused_first(
        &mut self,
        rollouts: &[Rollout],
        inp: &StepInputs,
        k: u64,
        part: Range<usize>,
    ) -> Result<(Vec<f32>, f64, usize, Range<usize>)> {
        let mine = self.dp.split(rollouts, part.clone());
        let mbs = self.micro_batches(&rollouts[mine.clone()]);
        // Token indices: `at` and `my` into the step's tokens, `at - base` into the part's.
        let base = inp.tokens(&part).start;
        let m = inp.tokens(&part).len();
        let my = inp.tokens(&mine);
        let (t, chunk) = (self.temperature, self.chunk);
        let rule = self.one_pass_rule(inp, &part, k)?;
        let ds = self.dstate.as_mut().ok_or_else(|| anyhow!("the fused pass needs a device trainer"))?;
        ds.zero_grads()?;
        // Every device's log-probs of the part as far as this device knows them (its own, so far).
        let mut known = vec![0.0f32; m];
        let mut entropy = Vec::with_capacity(my.len());
        let mut at = my.start;
        let center_of = |at: usize, n: usize| {
            inp.center.as_ref().map(|(kk, ids, p)| (*kk, &ids[at * kk..(at + n) * kk], &p[at * kk..(at + n) * kk]))
        };
        if mine.is_empty() {
            ds.no_backward()?;
        } else if let Some(rule) = rule {
            let mut pending = Vec::with_capacity(mbs.len());
            for (i, mb) in mbs.iter().enumerate() {
                let b = Self::batch(&rollouts[mine.start + mb.start..mine.start + mb.end]);
                let n = b.rows.len();
                let rows = at - base..at - base + n;
                let coef = match &rule {
                    Rule::Known(c) => OnePassCoef::Given(&c[rows.clone()]),
                    Rule::Device(den, teacher, offset, tis) => OnePassCoef::Rule {
                        den: &den[rows.clone()],
                        teacher: teacher.map(|t| &t[rows.clone()]),
                        offset: *offset,
                        tis: tis.map(|(s, a, cap)| (&s[rows.clone()], &a[rows.clone()], cap)),
                    },
                };
                let last = i + 1 == mbs.len();
                pending.push((rows, ds.one_pass(&self.weights, &b, coef, center_of(at, n), t, chunk, last)?));
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
                let (n, lo) = (lp.len(), at - base);
                known[lo..lo + n].copy_from_slice(&lp);
                entropy.extend_from_slice(&en);
                // π_old is the current policy: the ratio is 1, as in the unfused first update.
                let ev = super::evaluate(&self.objective, &inp.stats(&part, &known, &known), self.agg, k)?;
                let coef = &ev.coefs.coef[lo..lo + n];
                ds.backward(&self.weights, &b, coef, center_of(at, n), t, chunk, false, i + 1 == mbs.len())?;
                at += n;
            }
        }
        let logp = self.dp.allgather_v(&known[my.start - base..my.end - base], my.start - base, m)?;
        let ent = self.dp.sum_f64(entropy.iter().map(|&x| x as f64).sum())?;
        Ok((logp, ent, mbs.len(), mine))
    }

    /// The one pass's coefficients over minibatch `part`'s tokens, where it runs
    /// ([`Objective::one_pass`](super::Objective::one_pass)): evaluated now at ratio 1 with
    /// every log-prob 0 where they do not depend on the log-probs, else the device rule's
    /// inputs (each token's aggregation denominator, u32: a larger one leaves the step to the
    /// two passes; the teacher's log-probs for OPD; the advantage offset; for TIS the
    /// sampler's log-probs, the advantages and the cap).
    fn one_pass_rule<'a>(&self, inp: &'a StepInputs, part: &Range<usize>, k: u64) -> Result<Option<Rule<'a>>> {
        if self.first_pass != FirstPass::OnePass {
            return Ok(None);
        }
        let Some(how) = self.objective.one_pass() else { return Ok(None) };
        let toks = inp.tokens(part);
        let zeros = vec![0.0f32; toks.len()];
        let s = inp.stats(part, &zeros, &zeros);
        Ok(match how {
            OnePass::Known => Some(Rule::Known(super::evaluate(&self.objective, &s, self.agg, k)?.coefs.coef)),
            OnePass::Rule { teacher, offset, tis } => {
                let teacher = match teacher {
                    true => match inp.teacher.as_deref() {
                        Some(t) => Some(&t[toks.clone()]),
                        None => return Ok(None), // the host evaluation says what is missing
                    },
                    false => None,
                };
                let tis = match (tis, inp.adv_tokens.as_deref()) {
                    (Some(cap), Some(a)) => Some((&inp.sampler[toks.clone()], &a[toks.clone()], cap)),
                    (Some(_), None) => return Ok(None), // as above
                    (None, _) => None,
                };
                let den =
                    agg_denominators(&s, self.agg).into_iter().map(u32::try_from).collect::<Result<Vec<u32>, _>>();
                den.ok().map(|d| Rule::Device(d, teacher, offset, tis))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::{evaluate, Objective};
    use crate::config::{JobConfig, LossAgg};
    use crate::objective::TokenStats;
    use crate::train::step_inputs::OnePass;

    /// Every objective's coefficients of some responses are the same bits whether the other
    /// responses' log-probs are known or 0 (what the fused pass relies on): SFT, OPD, GRPO with
    /// and without TIS, REINFORCE and TRIAGE, under each loss aggregation, with masked tokens;
    /// TRIAGE with its gate and its repair both active. Where the objective says its
    /// coefficients are known before the pass (`OnePass::Known`: GRPO without TIS, REINFORCE),
    /// they are the same bits with every log-prob 0.
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
            "kind = \"grpo\"\nadvantage_offset = 0.2",
            "kind = \"reinforce\"",
            "kind = \"triage\"",
        ];
        let mut known_before = 0;
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
                if o.one_pass() == Some(OnePass::Known) {
                    known_before += 1;
                    assert_eq!(stats(&vec![0.0; m]), full, "{obj} {agg:?}: known before the pass");
                }
                for (a, b) in [(0, 2), (2, 3), (3, 6)] {
                    let r = offsets[a]..offsets[b];
                    let mut known = vec![0.0f32; m];
                    known[r.clone()].copy_from_slice(&logp[r.clone()]);
                    assert_eq!(stats(&known)[r.clone()], full[r.clone()], "{obj} {agg:?}: responses {a}..{b}");
                }
            }
        }
        assert_eq!(known_before, 6, "GRPO without TIS and REINFORCE, three aggregations each");
    }

    /// The one-pass loss's device rule (`ops::lm_head::Coef::Rule`) against the objective's
    /// code: the pass's log-probs and entropies are `lm_head::stats`'s bit for bit, and its
    /// gradients and loss are those of a loss pass given the coefficients `objective::opd`
    /// (advantage offset 0.15), `objective::sft` or `objective::grpo` with TIS (C = 2, some
    /// weights capped, advantages of both signs) evaluates on those log-probs, under
    /// seq-mean-token-mean with two masked tokens (w = 0), centered and not, F32 and BF16
    /// heads, in chunks of 5 of 13 rows; on the CPU arm and on the simulated GPU.
    fn one_pass_loss(dev: &crate::device::Device) {
        use crate::device::{DType, Tensor};
        use crate::objective::grpo::{self, PgConfig};
        use crate::objective::{agg_denominators, opd, sft};
        use crate::ops::lm_head::{loss_grad, loss_grad_with, stats, Coef, DevCenter, Pass, Rows, StatsOut, TisRule};
        let (c, v, n_h, k) = (40usize, 1500usize, 23usize, 3usize);
        let mut rng = crate::rand::Stream::new(11, 3);
        let mut data = |n: usize, std: f64| -> Vec<f32> { (0..n).map(|_| (rng.normal() * std) as f32).collect() };
        let rows: Vec<u32> = vec![3, 0, 22, 7, 8, 9, 15, 1, 2, 19, 11, 12, 5];
        let n = rows.len();
        let up = |v: Vec<u32>| dev.upload(Tensor::from_u32_host(&[v.len()], v).unwrap()).unwrap();
        let targets = up((0..n as u32).map(|i| (i * 397 + 11) % v as u32).collect());
        let ids = up((0..(n * k) as u32).map(|i| (i * 131 + 7) % v as u32).collect());
        let probs: Vec<f32> = (0..n * k).map(|i| [0.5, 0.3, 0.2][i % k]).collect();
        let probs = dev.from_f32(DType::F32, &[n * k], &probs).unwrap();
        let h = dev.from_f32(DType::F32, &[n_h, c], &data(n_h * c, 1.0)).unwrap();
        let whv = data(v * c, 0.3);
        let teacher: Vec<f32> = data(n, 0.5).iter().map(|x| x - 1.5).collect();
        // The sampler's log-probs: the head's own plus a gap in [-1, 1] (v = e^-gap, capped
        // at 2 below -ln 2); the advantages of the two responses, of both signs.
        let gap: Vec<f32> = (0..n).map(|i| -1.0 + 2.0 * i as f32 / (n - 1) as f32).collect();
        let adv: Vec<f64> = (0..n).map(|i| if i < 5 { 1.25 } else { -0.625 }).collect();
        let pg = PgConfig { eps_low: 0.2, eps_high: 0.28, tis_cap: Some(2.0) };
        let rows = up(rows);
        let r = Rows { rows: &rows, targets: &targets };
        let mask: Vec<bool> = (0..n).map(|i| i != 2 && i != 9).collect();
        let seq_lens = [5usize, 8];
        let zeros = vec![0.0; n];
        let s = TokenStats { mask: Some(&mask), ..TokenStats::of(&seq_lens, &zeros) };
        let den: Vec<u32> = agg_denominators(&s, LossAgg::SeqMeanTokenMean).iter().map(|&d| d as u32).collect();
        assert!(den.contains(&0) && den.iter().any(|&d| d > 1), "{den:?}");
        let (den_t, teacher_t) = (up(den), dev.from_f32(DType::F32, &[n], &teacher).unwrap());
        let adv_t = up(TisRule::words(&adv));
        let bits = |t: &Tensor| t.to_f32_vec().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
        for wdt in [DType::F32, DType::BF16] {
            let wh = dev.from_f32(wdt, &[v, c], &whv).unwrap();
            let zeros = |shape: &[usize]| dev.zeros(DType::F32, shape).unwrap();
            let (mut lp2, mut en2) = (zeros(&[n]), zeros(&[n]));
            stats(dev, &h, &wh, &r, 0.7, 5, &mut lp2, &mut en2).unwrap();
            let sampler: Vec<f32> = lp2.to_f32_vec().unwrap().iter().zip(&gap).map(|(l, g)| l + g).collect();
            let sampler_t = dev.from_f32(DType::F32, &[n], &sampler).unwrap();
            for (kind, centered) in [("OPD", false), ("OPD", true), ("SFT", false), ("TIS", false), ("TIS", true)] {
                let what = format!("{kind} {} head, centered {centered}", wdt.name());
                let ct = DevCenter { k, ids: &ids, probs: &probs };
                let center = centered.then_some(&ct);
                let (mut dh, mut dwh, mut lp, mut en) = (zeros(&[n_h, c]), zeros(&[v, c]), zeros(&[n]), zeros(&[n]));
                let tis = TisRule { sampler: &sampler_t, adv: &adv_t, cap: 2.0 };
                let coef = Coef::Rule {
                    den: &den_t,
                    teacher: (kind == "OPD").then_some(&teacher_t),
                    offset: 0.15,
                    tis: (kind == "TIS").then_some(tis),
                };
                let out = Some(StatsOut { logp: &mut lp, entropy: &mut en });
                let pass = Pass { coef, center, temperature: 0.7, chunk: 5, stats: out, loss: true };
                let loss =
                    loss_grad_with(dev, &h, &wh, &r, pass, &mut dh, &mut dwh).unwrap().expect("the loss, asked for");
                assert_eq!(bits(&lp), bits(&lp2), "{what}: log-probs");
                assert_eq!(bits(&en), bits(&en2), "{what}: entropies");
                let lpv = lp.to_f32_vec().unwrap();
                let s = TokenStats {
                    teacher: Some(&teacher),
                    mask: Some(&mask),
                    logp_old: Some(&lpv),
                    sampler: Some(&sampler),
                    advantages: Some(&adv),
                    ..TokenStats::of(&seq_lens, &lpv)
                };
                let cf = match kind {
                    "OPD" => opd::coefficients_with_offset(&s, LossAgg::SeqMeanTokenMean, 0.15).unwrap(),
                    "SFT" => sft::coefficients(&s, LossAgg::SeqMeanTokenMean).unwrap(),
                    _ => {
                        let b = grpo::base(&s, LossAgg::SeqMeanTokenMean, &pg).unwrap();
                        assert!(b.tis_mean > 0.0 && b.clipped == 0, "{what}: {}", b.tis_mean);
                        grpo::coefficients(&s, LossAgg::SeqMeanTokenMean, &pg).unwrap()
                    }
                };
                assert_eq!(cf.coef.iter().filter(|&&x| x != 0.0).count(), n - 2, "{what}: {:?}", cf.coef);
                if kind == "TIS" {
                    // Some weights capped at C, some not: both branches of the minimum ran.
                    let v: Vec<f64> = lpv.iter().zip(&sampler).map(|(l, s)| (*l as f64 - *s as f64).exp()).collect();
                    assert!(v.iter().any(|&x| x > 2.0) && v.iter().any(|&x| x < 1.0), "{what}: {v:?}");
                    assert!(cf.coef.iter().any(|&x| x > 0.0) && cf.coef.iter().any(|&x| x < 0.0), "{what}");
                }
                let coef = dev.from_f32(DType::F32, &[n], &cf.coef).unwrap();
                let (mut dh2, mut dwh2) = (zeros(&[n_h, c]), zeros(&[v, c]));
                let loss2 = loss_grad(dev, &h, &wh, &r, &coef, center, 0.7, 5, &mut dh2, &mut dwh2).unwrap();
                assert_eq!(loss.to_bits(), loss2.to_bits(), "{what}: loss");
                assert_eq!(bits(&dh), bits(&dh2), "{what}: dh");
                assert_eq!(bits(&dwh), bits(&dwh2), "{what}: dWh");
            }
        }
    }

    #[test]
    fn one_pass_loss_cpu() {
        one_pass_loss(&crate::device::Device::cpu(2).expect("a CPU device"));
    }

    #[test]
    fn one_pass_loss_sim() {
        one_pass_loss(&crate::device::Device::parse("cuda-sim:0").expect("cuda-sim:0"));
    }
}
