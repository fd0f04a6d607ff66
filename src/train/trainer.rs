//! One training step: rollouts → packed batch → forward with saved activations → per-token
//! statistics → objective coefficients → fused loss pass + backward → optimizer update on the
//! FP32 master → in-place rewrite of the compute weights (the store the engine reads).
//!
//! Owns: the student's compute weights, the trainable model, the optimizer and gradients.

use super::optimizer::{Optimizer, StepInfo};
use super::rollout::Rollout;
use crate::config::{JobConfig, LossAgg};
use crate::model::trainable::{TrainBatch, Trainable};
use crate::model::{ModelConfig, ModelWeights};
use crate::objective::{self, TokenStats};
use anyhow::{bail, Result};
use std::borrow::Cow;
use std::ops::Range;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ObjectiveKind {
    Sft,
    Opd,
}

/// What a step measured.
#[derive(Clone, Debug, Default)]
pub struct StepOut {
    /// The objective's reported loss.
    pub loss: f64,
    pub info: StepInfo,
    /// Token-mean entropy of the trainer's distribution over response tokens.
    pub entropy: f64,
    /// The trainer's log p_θ(y_t) per response token (concatenated in rollout order).
    pub logp: Vec<f32>,
    /// The step was not applied (non-finite loss or gradient).
    pub skipped: bool,
    pub tokens: usize,
}

pub struct Trainer {
    pub cfg: ModelConfig,
    /// The compute weights: the store the rollout engine reads (no copy).
    pub weights: ModelWeights,
    model: Trainable<f32>,
    pub opt: Optimizer,
    ranges: Vec<Range<usize>>,
    grads: Vec<Vec<f32>>,
    flat_grad: Vec<f32>,
    pub objective: ObjectiveKind,
    pub agg: LossAgg,
    pub temperature: f32,
    chunk: usize,
    micro_batch_tokens: usize,
    /// Weight version: optimizer updates applied so far.
    pub version: u64,
    pub skipped_steps: u64,
}

/// The parameters as f32 slices: borrowed when stored in f32, widened otherwise.
pub fn param_slices(w: &ModelWeights) -> Result<Vec<Cow<'_, [f32]>>> {
    w.tensors()
        .into_iter()
        .map(|t| match t.dtype() {
            crate::device::DType::F32 => Ok(Cow::Borrowed(t.f32s()?)),
            _ => Ok(Cow::Owned(t.to_f32_vec()?)),
        })
        .collect()
}

impl Trainer {
    pub fn new(cfg: &ModelConfig, weights: ModelWeights, job: &JobConfig) -> Result<Trainer> {
        let objective = match job.objective.kind.as_str() {
            "sft" => ObjectiveKind::Sft,
            "opd" => ObjectiveKind::Opd,
            k => bail!("objective '{k}' is not available in the trainer"),
        };
        let mut ranges = Vec::new();
        let mut master = Vec::new();
        for t in weights.tensors() {
            let v = t.to_f32_vec()?;
            ranges.push(master.len()..master.len() + v.len());
            master.extend_from_slice(&v);
        }
        let grads = ranges.iter().map(|r| vec![0.0; r.len()]).collect();
        let n = master.len();
        Ok(Trainer {
            cfg: cfg.clone(),
            weights,
            model: Trainable::new(cfg),
            opt: Optimizer::new(&job.optimizer, master)?,
            ranges,
            grads,
            flat_grad: vec![0.0; n],
            objective,
            agg: job.loss_agg()?,
            temperature: job.rollout.temperature,
            chunk: job.objective.chunk_size,
            micro_batch_tokens: job.objective.micro_batch_tokens,
            version: 0,
            skipped_steps: 0,
        })
    }

    pub fn num_params(&self) -> usize {
        self.opt.master.len()
    }

    /// Bytes of the trainer's own state: FP32 master, Adam moments, gradients, activations.
    pub fn state_bytes(&self) -> usize {
        4 * (self.opt.master.len() + self.opt.m.len() + self.opt.v.len() + 2 * self.flat_grad.len()) + self.model.activation_bytes()
    }

    /// Micro-batches (rollout index ranges) of at most `micro_batch_tokens` tokens each.
    fn micro_batches(&self, rollouts: &[Rollout]) -> Vec<Range<usize>> {
        let cap = if self.micro_batch_tokens == 0 { usize::MAX } else { self.micro_batch_tokens };
        let mut out = Vec::new();
        let (mut start, mut toks) = (0, 0);
        for (i, r) in rollouts.iter().enumerate() {
            let n = r.prompt.len() + r.response.len();
            if i > start && toks + n > cap {
                out.push(start..i);
                start = i;
                toks = 0;
            }
            toks += n;
        }
        out.push(start..rollouts.len());
        out
    }

    fn batch(rollouts: &[Rollout]) -> TrainBatch {
        let mut b = TrainBatch::default();
        for r in rollouts {
            b.push(&r.prompt, &r.response);
        }
        b
    }

    /// One optimizer step on `rollouts` (the teacher log-probs must be filled for OPD).
    pub fn step(&mut self, rollouts: &[Rollout]) -> Result<StepOut> {
        let rollouts: Vec<&Rollout> = rollouts.iter().filter(|r| !r.response.is_empty()).collect();
        let rollouts: Vec<Rollout> = rollouts.into_iter().cloned().collect();
        if rollouts.is_empty() {
            bail!("training step with no response tokens");
        }
        let mbs = self.micro_batches(&rollouts);
        let t = self.temperature;
        let chunk = self.chunk;
        // Pass 1: statistics of every response token under the current weights.
        let m: usize = rollouts.iter().map(|r| r.response.len()).sum();
        let (mut logp, mut entropy) = (vec![0.0f32; m], vec![0.0f32; m]);
        {
            let params = param_slices(&self.weights)?;
            let ps: Vec<&[f32]> = params.iter().map(|c| c.as_ref()).collect();
            let mut at = 0;
            for mb in &mbs {
                let b = Self::batch(&rollouts[mb.clone()]);
                let k = b.rows.len();
                self.model.forward(&ps, &b)?;
                self.model.token_stats(&ps, &b, t, chunk, &mut logp[at..at + k], &mut entropy[at..at + k]);
                at += k;
            }
        }
        let seq_lens: Vec<usize> = rollouts.iter().map(|r| r.response.len()).collect();
        let sampler: Vec<f32> = rollouts.iter().flat_map(|r| r.sampler_logprobs.iter().copied()).collect();
        let teacher: Option<Vec<f32>> = match self.objective {
            ObjectiveKind::Opd => {
                let mut v = Vec::with_capacity(m);
                for r in &rollouts {
                    match &r.teacher_logprobs {
                        Some(t) if t.len() == r.response.len() => v.extend_from_slice(t),
                        _ => bail!("opd: rollout (prompt {}, sample {}) has no teacher log-probs", r.prompt_id, r.sample),
                    }
                }
                Some(v)
            }
            ObjectiveKind::Sft => None,
        };
        let stats = TokenStats { seq_lens: &seq_lens, logp: &logp, logp_old: None, sampler: Some(&sampler), teacher: teacher.as_deref(), advantages: None, mask: None };
        let coefs = match self.objective {
            ObjectiveKind::Sft => objective::sft::coefficients(&stats, self.agg)?,
            ObjectiveKind::Opd => objective::opd::coefficients(&stats, self.agg)?,
        };
        let ent = entropy.iter().map(|&x| x as f64).sum::<f64>() / m as f64;
        let mut out = StepOut { loss: coefs.loss, entropy: ent, logp, tokens: m, ..Default::default() };
        if !coefs.loss.is_finite() || coefs.coef.iter().any(|c| !c.is_finite()) {
            tracing::warn!("step skipped: the loss is not finite ({})", coefs.loss);
            self.skipped_steps += 1;
            out.skipped = true;
            return Ok(out);
        }
        // Pass 2: the fused loss pass and the backward, micro-batch by micro-batch.
        for g in &mut self.grads {
            g.fill(0.0);
        }
        {
            let params = param_slices(&self.weights)?;
            let ps: Vec<&[f32]> = params.iter().map(|c| c.as_ref()).collect();
            let mut at = 0;
            for mb in &mbs {
                let b = Self::batch(&rollouts[mb.clone()]);
                let k = b.rows.len();
                if mbs.len() > 1 {
                    self.model.forward(&ps, &b)?;
                }
                self.model.backward(&ps, &b, &coefs.coef[at..at + k], t, chunk, &mut self.grads)?;
                at += k;
            }
        }
        for (g, r) in self.grads.iter().zip(&self.ranges) {
            self.flat_grad[r.clone()].copy_from_slice(g);
        }
        let info = self.opt.update(&mut self.flat_grad)?;
        out.info = info;
        if info.skipped {
            tracing::warn!("step skipped: the gradient norm is not finite ({})", info.grad_norm);
            self.skipped_steps += 1;
            out.skipped = true;
            return Ok(out);
        }
        self.write_compute_weights()?;
        self.version += 1;
        Ok(out)
    }

    /// Rewrites the compute weights in place from the FP32 master (rounded to their dtype).
    pub fn write_compute_weights(&mut self) -> Result<()> {
        for (t, r) in self.weights.tensors_mut().into_iter().zip(&self.ranges) {
            t.write_f32(&self.opt.master[r.clone()])?;
        }
        Ok(())
    }

    /// Restores master weights, moments and counters (from a checkpoint), then the compute weights.
    pub fn restore(&mut self, master: Vec<f32>, m: Vec<f32>, v: Vec<f32>, opt_step: u64, version: u64, skipped: u64) -> Result<()> {
        let n = self.opt.master.len();
        if master.len() != n || (self.opt.kind == super::optimizer::Kind::AdamW && (m.len() != n || v.len() != n)) {
            bail!("checkpoint optimizer state has {} values, the model has {n} parameters", master.len());
        }
        self.opt.master = master;
        if self.opt.kind == super::optimizer::Kind::AdamW {
            self.opt.m = m;
            self.opt.v = v;
        }
        self.opt.step = opt_step;
        self.version = version;
        self.skipped_steps = skipped;
        self.write_compute_weights()
    }
}
