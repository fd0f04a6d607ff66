//! One training step: rollouts → packed batch → forward with saved activations → per-token
//! statistics → objective coefficients → fused loss pass + backward → optimizer update on the
//! FP32 master → in-place rewrite of the compute weights (the store the engine reads). With
//! several devices every device runs this same step on its share (see `dp.rs`): the optimizer
//! holds this device's ZeRO-1 shard and the weights are all-gathered after each update (in BF16
//! when the compute weights are BF16, else the FP32 master).
//!
//! On CUDA devices the whole step runs there (`device_state.rs`: master, moments and
//! gradients on the device, the model's device twin, the fused optimizer writing the compute
//! weights in place; with several GPUs ZeRO-1 over a device collective). Without a device
//! collective, or with compute weights of mixed dtypes, several GPUs train on the host
//! (reading widened copies of the compute weights).
//!
//! Owns: one device's compute weights, the trainable model, its optimizer shard and gradients.

use super::device_state::DeviceState;
use super::dp::{sum_triage, Dp};
use super::optimizer::sum_sq;
use super::optimizer::{Optimizer, StepInfo};
use super::step_inputs::{evaluate, minibatches, Objective, StepInputs};
use crate::config::{JobConfig, LossAgg, ScheduleMode};
use crate::device::{bf16_rne, DType};
use crate::engine::rollout::Rollout;
use crate::model::learner_quant::LearnerQuant;
use crate::model::trainable::{TrainBatch, Trainable};
use crate::model::{ModelConfig, ModelWeights};
use crate::objective::triage::TriageStats;
use crate::ops::lm_head::grad::Center;
use anyhow::{bail, Result};
use std::borrow::Cow;
use std::ops::Range;

mod fused;
pub use fused::FirstPass;

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
    /// Optimizer updates applied (minibatches × updates per step, less skipped ones).
    pub updates: usize,
    /// Tokens whose ratio was clipped (summed over updates).
    pub clipped: usize,
    /// RL: advantages per response and per token (concatenated like `logp`).
    pub adv_response: Option<Vec<f64>>,
    pub adv_tokens: Option<Vec<f64>>,
    pub seq_lens: Vec<usize>,
    /// TRIAGE's statistics of the step's first pass over its minibatches (summed).
    pub triage: Option<TriageStats>,
    /// Asynchronous schedules: tokens left out as too stale, the largest lag trained on, the
    /// largest lag of any token.
    pub masked: usize,
    pub max_lag: Option<u64>,
    pub max_age: Option<u64>,
    /// Seconds this device spent in the gradient and weight collectives (waits included).
    pub collective_s: f64,
}

pub struct Trainer {
    pub cfg: ModelConfig,
    /// The compute weights: the store the rollout engine reads (no copy).
    pub weights: ModelWeights,
    model: Trainable<f32>,
    /// One CUDA training device: the state lives there and `opt` keeps only the settings and
    /// the step counter (its vectors are empty).
    dstate: Option<DeviceState>,
    /// The optimizer over this device's shard of the flat parameters.
    pub opt: Optimizer,
    ranges: Vec<Range<usize>>,
    grads: Vec<Vec<f32>>,
    flat_grad: Vec<f32>,  // (P) this device's gradient, every parameter
    grad_shard: Vec<f32>, // (P / world) the reduce-scattered sum
    gathered: Gathered,   // (P) all-gathered weights (world > 1)
    n_params: usize,
    /// A generator's copy: compute weights only (see [`Trainer::weights_only`]).
    weights_only: bool,
    pub dp: Dp,
    pub objective: Objective,
    pub agg: LossAgg,
    pub temperature: f32,
    chunk: usize,
    micro_batch_tokens: usize,
    /// `objective.activation_checkpointing` (the device trainer's).
    checkpoint: bool,
    /// How a device trainer runs the first update (`trainer/fused.rs`).
    first_pass: FirstPass,
    centering: bool,
    minibatches: usize,
    updates_per_step: usize,
    /// Weight version: optimizer updates applied so far.
    pub version: u64,
    /// Rollout steps trained so far (TRIAGE's update index k of the next step).
    pub rollout_steps: u64,
    /// Asynchronous schedules: train only tokens at most this many versions old.
    pub max_staleness: Option<u64>,
    pub skipped_steps: u64,
    /// Seconds the last update spent in collectives (waits included).
    last_collective_s: f64,
}

/// The parameters as f32 slices: borrowed when stored in f32, widened otherwise.
pub fn param_slices(w: &ModelWeights) -> Result<Vec<Cow<'_, [f32]>>> {
    w.tensors()
        .into_iter()
        .map(|t| match (t.dtype(), t.storage()) {
            // F32 on the host: the trainer reads the buffer the engine reads.
            (crate::device::DType::F32, crate::device::Storage::Cpu(_)) => Ok(Cow::Borrowed(t.f32s()?)),
            // BF16 / F16, or any weight on a GPU (the trainer runs on the host): a widened copy.
            _ => Ok(Cow::Owned(t.to_f32_vec()?)),
        })
        .collect()
}

impl Trainer {
    pub fn new(cfg: &ModelConfig, weights: ModelWeights, job: &JobConfig) -> Result<Trainer> {
        Self::new_dp(cfg, weights, job, Dp::single()?)
    }

    /// Device `dp.rank` of `dp.world` (its optimizer holds its shard only).
    pub fn new_dp(cfg: &ModelConfig, weights: ModelWeights, job: &JobConfig, dp: Dp) -> Result<Trainer> {
        Self::build(cfg, weights, job, dp, false)
    }

    /// The compute weights alone, for a device that only generates (a split placement's
    /// generator): no master copy, optimizer moments or gradients; the weights change only
    /// through [`Self::load_weights`] and [`Self::restore`].
    pub fn weights_only(cfg: &ModelConfig, weights: ModelWeights, job: &JobConfig) -> Result<Trainer> {
        Self::build(cfg, weights, job, Dp::single()?, true)
    }

    fn build(
        cfg: &ModelConfig,
        mut weights: ModelWeights,
        job: &JobConfig,
        dp: Dp,
        weights_only: bool,
    ) -> Result<Trainer> {
        let objective = Objective::from_job(job)?;
        let on_cuda = weights.tensors().first().map(|t| !t.storage().is_cpu()).unwrap_or(false);
        // Several GPUs train on the device when they have a device collective and one compute
        // dtype to gather; otherwise on the host.
        let zero = match &dp.dcoll {
            Some(c) if dp.world > 1 && DeviceState::compute_dtype(&weights).is_some() => Some((dp.clone(), c.clone())),
            _ => None,
        };
        let dstate = if on_cuda && !weights_only && (dp.world == 1 || zero.is_some()) {
            let mut ds =
                DeviceState::new(cfg, &mut weights, job.optimizer.kind == super::optimizer::Kind::AdamW, zero)?;
            ds.set_checkpointing(job.objective.activation_checkpointing);
            Some(ds)
        } else {
            None
        };
        let host = !weights_only && dstate.is_none();
        let mut ranges = Vec::new();
        let mut master = Vec::new();
        let mut n = 0;
        for t in weights.tensors() {
            ranges.push(n..n + t.numel());
            n += t.numel();
            if host {
                master.extend_from_slice(&t.to_f32_vec()?);
            }
        }
        let grads = ranges.iter().map(|r| vec![0.0; if host { r.len() } else { 0 }]).collect();
        let shard = if weights_only { 0..0 } else { dp.shard(n) };
        let master = if dp.world == 1 || !host { master } else { master[shard.clone()].to_vec() };
        let gathered = Gathered::new(&weights, if dp.world == 1 || !host { 0 } else { n }, shard.len());
        Ok(Trainer {
            cfg: cfg.clone(),
            weights,
            model: Trainable::new(cfg),
            dstate,
            opt: Optimizer::new(&job.optimizer, master)?,
            ranges,
            grads,
            flat_grad: vec![0.0; if host { n } else { 0 }],
            grad_shard: vec![0.0; if host { shard.len() } else { 0 }],
            gathered,
            n_params: n,
            weights_only,
            dp,
            objective,
            agg: job.loss_agg(),
            temperature: job.rollout.temperature,
            chunk: job.objective.chunk_size,
            micro_batch_tokens: job.objective.micro_batch_tokens,
            checkpoint: job.objective.activation_checkpointing,
            first_pass: FirstPass::OnePass,
            centering: job.objective.centering,
            minibatches: job.objective.minibatches,
            updates_per_step: job.objective.updates_per_step,
            version: 0,
            rollout_steps: 0,
            max_staleness: (job.schedule.mode == ScheduleMode::Async).then_some(job.schedule.max_staleness),
            skipped_steps: 0,
            last_collective_s: 0.0,
        })
    }

    /// How a device trainer runs the first update (default
    /// [`FirstPass::OnePass`]; the gradients are the same bits each way).
    pub fn set_first_pass(&mut self, how: FirstPass) {
        self.first_pass = how;
    }

    /// Runs the chosen MLP linears of the learner's forward in NVFP4 (None: off), on the host
    /// model and, for a trainer on the device, on its device twin.
    pub fn set_learner_quant(&mut self, q: Option<LearnerQuant>) -> Result<()> {
        if let Some(ds) = self.dstate.as_mut() {
            ds.set_quant(q.clone());
        }
        self.model.set_quant(q);
        Ok(())
    }

    /// Each parameter's amax of the compute weights as the last device update wrote them
    /// (f32 bits, U32 in parameter order), for a quantized engine's requantize; None on the
    /// host path or before the first update (and after a restore).
    pub fn weight_amax(&self) -> Option<&crate::device::Tensor> {
        self.dstate.as_ref().and_then(|d| d.weight_amax())
    }

    /// Whether the training step runs on a CUDA device (its state there).
    pub fn on_device(&self) -> bool {
        self.dstate.is_some()
    }

    pub fn num_params(&self) -> usize {
        self.n_params
    }

    /// Bytes of this device's trainer state: its FP32 master and Adam shard, gradients (per
    /// tensor, flat and shard), the all-gather buffer, and the activation arenas as they are now
    /// (they grow to the largest micro-batch seen).
    pub fn state_bytes(&self) -> usize {
        let grads: usize = self.grads.iter().map(|g| g.len()).sum();
        4 * (self.opt.master.len()
            + self.opt.m.len()
            + self.opt.v.len()
            + grads
            + self.flat_grad.len()
            + self.grad_shard.len())
            + self.gathered.bytes()
            + self.model.activation_bytes()
            + self.dstate.as_ref().map(|d| d.bytes()).unwrap_or(0)
    }

    /// Bytes the memory plan reserves for the activations of a device trainer: one micro-batch
    /// of `objective.micro_batch_tokens` tokens, or with 0 (the whole step at once) `step_tokens`
    /// (the caller's bound on a step's tokens). 0 on the host path (its arenas are host memory).
    /// `learner`: the linears the NVFP4 learner will run on (`learner.linears`; empty: none):
    /// what it keeps (`LearnerKeep`) and the operands it leaves in f32 are counted (the plan is
    /// made before the learner's scales are calibrated and set).
    pub fn activation_plan_bytes(&self, step_tokens: usize, learner: &[String]) -> usize {
        if self.dstate.is_none() {
            return 0;
        }
        let tokens = if self.micro_batch_tokens == 0 { step_tokens } else { self.micro_batch_tokens };
        use crate::model::trainable_device::{Bf16Operands, DeviceTrainable, LearnerKeep};
        let dtype = self.weights.dtype();
        let keep = LearnerKeep::of(true, dtype, !learner.is_empty()); // a device trainer is on CUDA
        let on = |name: &str| learner.iter().any(|l| l == name);
        let ops = Bf16Operands::of(&self.cfg, dtype, [on("gate_proj"), on("up_proj"), on("down_proj")]);
        DeviceTrainable::activation_bytes(&self.cfg, tokens, self.chunk, keep, self.checkpoint, ops)
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

    /// logp and entropy of every response token of `rollouts` at the current weights, micro-batch
    /// by micro-batch. Leaves the last micro-batch's activations in the model.
    fn token_stats(&mut self, rollouts: &[Rollout]) -> Result<(Vec<f32>, Vec<f32>, usize)> {
        let mbs = self.micro_batches(rollouts);
        let m: usize = rollouts.iter().map(|r| r.response.len()).sum();
        let (mut logp, mut entropy) = (vec![0.0f32; m], vec![0.0f32; m]);
        if rollouts.is_empty() {
            return Ok((logp, entropy, 0));
        }
        if let Some(ds) = self.dstate.as_mut() {
            let mut at = 0;
            for mb in &mbs {
                let b = Self::batch(&rollouts[mb.clone()]);
                let (lp, en) = ds.token_stats(&self.weights, &b, self.temperature, self.chunk)?;
                logp[at..at + lp.len()].copy_from_slice(&lp);
                entropy[at..at + en.len()].copy_from_slice(&en);
                at += lp.len();
            }
            return Ok((logp, entropy, mbs.len()));
        }
        let params = param_slices(&self.weights)?;
        let ps: Vec<&[f32]> = params.iter().map(|c| c.as_ref()).collect();
        let mut at = 0;
        for mb in &mbs {
            let b = Self::batch(&rollouts[mb.clone()]);
            let k = b.rows.len();
            self.model.forward(&ps, &b)?;
            self.model.token_stats(
                &ps,
                &b,
                self.temperature,
                self.chunk,
                &mut logp[at..at + k],
                &mut entropy[at..at + k],
            );
            at += k;
        }
        Ok((logp, entropy, mbs.len()))
    }

    /// The log-probs (and entropy sum) of responses `r` at the current weights: this device
    /// computes its share, the devices exchange them.
    fn gathered_stats(
        &mut self,
        rollouts: &[Rollout],
        inp: &StepInputs,
        r: Range<usize>,
    ) -> Result<(Vec<f32>, f64, usize, Range<usize>)> {
        let mine = self.dp.split(rollouts, r.clone());
        let (lp, en, chunks) = self.token_stats(&rollouts[mine.clone()])?;
        let all = inp.tokens(&r);
        let at = inp.tokens(&mine).start - all.start;
        let logp = self.dp.allgather_v(&lp, at, all.len())?;
        let ent = self.dp.sum_f64(en.iter().map(|&x| x as f64).sum())?;
        Ok((logp, ent, chunks, mine))
    }

    /// One training step on `rollouts`: the step's old log-probs, then `updates_per_step` passes
    /// over its `minibatches`, one optimizer update each (the teacher log-probs must be filled
    /// for OPD, rewards for RL, the sampler's top-k for score centering). With several devices,
    /// every device calls this with the same rollouts.
    pub fn step(&mut self, rollouts: &[Rollout]) -> Result<StepOut> {
        if self.weights_only {
            bail!("this device only generates (split placement): it holds no optimizer state to train with");
        }
        let rollouts: Vec<Rollout> = rollouts.iter().filter(|r| !r.response.is_empty()).cloned().collect();
        if rollouts.is_empty() {
            bail!("training step with no response tokens");
        }
        let inp = StepInputs::build(
            &rollouts,
            &self.objective,
            self.centering,
            self.max_staleness.map(|k| (self.version, k)),
        )?;
        let k = self.rollout_steps;
        self.rollout_steps += 1;
        let parts = minibatches(rollouts.len(), self.minibatches);
        // Pass 1: π_old, the statistics of every response token at the step's start; on a
        // device trainer the first minibatch's fused with the first update's backward.
        let fused = self.first_pass != FirstPass::Unfused && self.dstate.is_some();
        let (logp_old, ent, n_chunks, mine0) = match fused {
            true => self.first_stats(&rollouts, &inp, k, &parts)?,
            false => self.gathered_stats(&rollouts, &inp, 0..rollouts.len())?,
        };
        let m = logp_old.len();
        let mut out = StepOut {
            entropy: ent / m as f64,
            logp: logp_old.clone(),
            tokens: m,
            adv_response: inp.adv_response.clone(),
            adv_tokens: inp.adv_tokens.clone(),
            seq_lens: inp.seq_lens.clone(),
            masked: inp.masked,
            max_lag: inp.mask.is_some().then_some(inp.max_lag),
            max_age: inp.mask.is_some().then_some(inp.max_age),
            ..Default::default()
        };
        let mut losses = Vec::new();
        let mut applied = 0;
        for u in 0..self.updates_per_step {
            for (j, mb) in parts.iter().enumerate() {
                let toks = inp.tokens(mb);
                let first = u == 0 && j == 0;
                // At the first update the weights are π_old's: no new forward is needed, and the
                // activations of pass 1 are still in place when it was a single micro-batch.
                let (logp_now, mine) = if first {
                    let mine = if parts.len() == 1 { mine0.clone() } else { self.dp.split(&rollouts, mb.clone()) };
                    (logp_old[toks.clone()].to_vec(), mine)
                } else {
                    let (lp, _, _, mine) = self.gathered_stats(&rollouts, &inp, mb.clone())?;
                    (lp, mine)
                };
                let stats = inp.stats(mb, &logp_now, &logp_old[toks.clone()]);
                let ev = evaluate(&self.objective, &stats, self.agg, k)?;
                out.clipped += ev.clipped;
                if u == 0 {
                    losses.push(ev.coefs.loss);
                    if let Some(t) = ev.triage {
                        out.triage = Some(match out.triage.take() {
                            None => t,
                            Some(acc) => sum_triage(acc, &t),
                        });
                    }
                }
                // Every device sees the same coefficients: they skip together.
                if !ev.coefs.loss.is_finite() || ev.coefs.coef.iter().any(|c| !c.is_finite()) {
                    tracing::warn!("update skipped: the loss is not finite ({})", ev.coefs.loss);
                    continue;
                }
                let reuse = first && parts.len() == 1 && n_chunks == 1;
                let my = inp.tokens(&mine);
                let (a, b) = (my.start - toks.start, my.end - toks.start);
                let center = inp
                    .center
                    .as_ref()
                    .map(|(k, ids, p)| (*k, &ids[my.start * k..my.end * k], &p[my.start * k..my.end * k]));
                // Fused: the first update's gradient is already in the device state.
                if !(first && fused) {
                    self.backward(&rollouts[mine.clone()], &ev.coefs.coef[a..b], center, reuse)?;
                }
                let info = self.apply()?;
                out.collective_s += self.last_collective_s;
                if first {
                    out.info = info;
                }
                if info.skipped {
                    tracing::warn!("update skipped: the gradient norm is not finite ({})", info.grad_norm);
                    continue;
                }
                self.version += 1;
                applied += 1;
            }
        }
        out.loss = losses.iter().sum::<f64>() / losses.len().max(1) as f64;
        if let Some(t) = &mut out.triage {
            t.mass_moved /= parts.len() as f64;
            t.repair_mass /= parts.len() as f64;
        }
        out.updates = applied;
        if let Some(ds) = self.dstate.as_mut() {
            ds.release();
        }
        if applied == 0 {
            self.skipped_steps += 1;
            out.skipped = true;
        }
        Ok(out)
    }

    /// The fused loss pass and the backward over `rollouts` (micro-batch by micro-batch) into
    /// `flat_grad`; `reuse`: the model still holds these rollouts' activations (one micro-batch).
    fn backward(
        &mut self,
        rollouts: &[Rollout],
        coef: &[f32],
        center: Option<(usize, &[u32], &[f32])>,
        reuse: bool,
    ) -> Result<()> {
        if self.dstate.is_some() {
            let mbs = self.micro_batches(rollouts);
            let (t, chunk) = (self.temperature, self.chunk);
            let Some(ds) = self.dstate.as_mut() else { return Ok(()) };
            ds.zero_grads()?;
            // A device whose token-balanced share is empty (one long response can take a
            // whole share) joins the collectives with a zero gradient.
            if rollouts.is_empty() {
                return ds.no_backward();
            }
            let mut at = 0;
            for (i, mb) in mbs.iter().enumerate() {
                let b = Self::batch(&rollouts[mb.clone()]);
                let k = b.rows.len();
                let ct = center.map(|(kk, ids, p)| (kk, &ids[at * kk..(at + k) * kk], &p[at * kk..(at + k) * kk]));
                let forward = !(reuse && mbs.len() == 1);
                ds.backward(&self.weights, &b, &coef[at..at + k], ct, t, chunk, forward, i + 1 == mbs.len())?;
                at += k;
            }
            return Ok(());
        }
        for g in &mut self.grads {
            g.fill(0.0);
        }
        if !rollouts.is_empty() {
            let mbs = self.micro_batches(rollouts);
            let params = param_slices(&self.weights)?;
            let ps: Vec<&[f32]> = params.iter().map(|c| c.as_ref()).collect();
            let mut at = 0;
            for mb in &mbs {
                let b = Self::batch(&rollouts[mb.clone()]);
                let k = b.rows.len();
                if !(reuse && mbs.len() == 1) {
                    self.model.forward(&ps, &b)?;
                }
                let ct = center.map(|(kk, ids, p)| Center {
                    k: kk,
                    ids: &ids[at * kk..(at + k) * kk],
                    probs: &p[at * kk..(at + k) * kk],
                });
                self.model.backward_centered(
                    &ps,
                    &b,
                    &coef[at..at + k],
                    ct.as_ref(),
                    self.temperature,
                    self.chunk,
                    &mut self.grads,
                )?;
                at += k;
            }
        }
        for (g, r) in self.grads.iter().zip(&self.ranges) {
            self.flat_grad[r.clone()].copy_from_slice(g);
        }
        Ok(())
    }

    /// The optimizer update from `flat_grad`: reduce-scatter over devices, the global norm, this
    /// device's shard of AdamW/SGD, then the all-gather into the compute weights.
    fn apply(&mut self) -> Result<StepInfo> {
        self.last_collective_s = 0.0;
        if let Some(ds) = self.dstate.as_mut() {
            let info = ds.apply(&mut self.opt, &mut self.weights)?;
            self.last_collective_s = ds.last_collective_s;
            return Ok(info);
        }
        let info = if self.dp.world == 1 {
            self.opt.update(&mut self.flat_grad)?
        } else {
            let t = std::time::Instant::now();
            self.dp.coll.reduce_scatter_sum(self.dp.rank, &self.flat_grad, &mut self.grad_shard)?;
            self.last_collective_s += t.elapsed().as_secs_f64();
            let norm = self.dp.sum_f64(sum_sq(&self.grad_shard))?.sqrt();
            self.opt.update_with_norm(&mut self.grad_shard, norm)?
        };
        if !info.skipped {
            let t = std::time::Instant::now();
            if self.dp.world > 1 {
                let (coll, rank) = (&self.dp.coll, self.dp.rank);
                match &mut self.gathered {
                    Gathered::F32(full) => coll.all_gather(rank, &self.opt.master, full)?,
                    Gathered::Bf16 { full, shard } => {
                        shard.clear();
                        shard.extend(self.opt.master.iter().map(|&x| bf16_rne(x).to_bits()));
                        coll.all_gather_u16(rank, shard, full)?;
                    }
                }
                self.last_collective_s += t.elapsed().as_secs_f64();
            }
            self.write_compute_weights()?;
        }
        Ok(info)
    }

    /// Rewrites the compute weights in place from the FP32 master (rounded to their dtype): this
    /// device's own master with one device, the all-gathered weights with several.
    pub fn write_compute_weights(&mut self) -> Result<()> {
        if self.dstate.is_some() {
            bail!("write_compute_weights: on the device the optimizer step writes the compute weights");
        }
        let mut wide = Vec::new();
        for (t, r) in self.weights.tensors_mut().into_iter().zip(&self.ranges) {
            match (self.dp.world, &self.gathered) {
                (1, _) => t.write_f32(&self.opt.master[r.clone()])?,
                (_, Gathered::F32(full)) => t.write_f32(&full[r.clone()])?,
                // BF16 widened to f32 is exact, and rounding it back to BF16 gives the same bits.
                (_, Gathered::Bf16 { full, .. }) => {
                    wide.clear();
                    wide.extend(full[r.clone()].iter().map(|&b| f32::from_bits((b as u32) << 16)));
                    t.write_f32(&wide)?;
                }
            }
        }
        Ok(())
    }

    /// The whole model as of the last update, as f32 (what host trainers publish to a split
    /// placement's generators; GPU trainers publish a device snapshot): this device's FP32
    /// master with one device, the all-gathered
    /// weights with several (the FP32 master, or its BF16 rounding when the compute weights
    /// are BF16: the same compute weights once a generator rounds it).
    pub fn full_weights(&self) -> Result<Vec<f32>> {
        if let Some(ds) = &self.dstate {
            return ds.full_weights();
        }
        Ok(match (self.dp.world, &self.gathered) {
            (1, _) => self.opt.master.clone(),
            (_, Gathered::F32(full)) => full.clone(),
            (_, Gathered::Bf16 { full, .. }) => full.iter().map(|&b| f32::from_bits((b as u32) << 16)).collect(),
        })
    }

    /// A generator's copy of published weights: the compute weights rewritten in place from the
    /// whole master `full` of `version` (its optimizer state is not used).
    pub fn load_weights(&mut self, full: &[f32], version: u64) -> Result<()> {
        if full.len() != self.n_params {
            bail!("published weights have {} values, the model has {} parameters", full.len(), self.n_params);
        }
        for (t, r) in self.weights.tensors_mut().into_iter().zip(&self.ranges) {
            t.write_f32(&full[r.clone()])?;
        }
        self.version = version;
        Ok(())
    }

    /// A flat buffer for the whole model in the compute weights' dtype on this trainer's
    /// device (what [`Self::snapshot_into`] fills).
    pub fn snapshot_buffer(&self) -> Result<crate::device::Tensor> {
        let dtype = DeviceState::compute_dtype(&self.weights)
            .ok_or_else(|| anyhow::anyhow!("a weight snapshot needs one compute dtype for every weight"))?;
        let t = self.weights.tensors();
        let first = t.first().ok_or_else(|| anyhow::anyhow!("a model without parameters"))?;
        crate::device::Device::Cuda(cuda_ptr(first)?.1).zeros(dtype, &[self.n_params])
    }

    /// Copies the compute weights into `buf` (flat, parameter order, same dtype and device),
    /// device to device, and waits for the copies.
    pub fn snapshot_into(&self, buf: &mut crate::device::Tensor) -> Result<()> {
        let (dst, cd) = cuda_ptr(buf)?;
        let es = buf.dtype().size();
        for (t, r) in self.weights.tensors().into_iter().zip(&self.ranges) {
            if t.dtype() != buf.dtype() {
                bail!("snapshot: a {} weight into a {} buffer", t.dtype().name(), buf.dtype().name());
            }
            cd.dtod(dst + (r.start * es) as u64, cuda_ptr(t)?.0, r.len() * es)?;
        }
        cd.synchronize()
    }

    /// A generator's copy of published weights from `snap` (a snapshot on another GPU of this
    /// process): each compute weight rewritten in place by a peer copy, waited for before this
    /// returns (the snapshot may be rewritten afterwards).
    pub fn load_weights_from(&mut self, snap: &crate::device::Tensor, version: u64) -> Result<()> {
        if snap.numel() != self.n_params {
            bail!("published weights have {} values, the model has {} parameters", snap.numel(), self.n_params);
        }
        let (src, peer) = cuda_ptr(snap)?;
        let es = snap.dtype().size();
        let mut dev = None;
        for (t, r) in self.weights.tensors_mut().into_iter().zip(&self.ranges) {
            if t.dtype() != snap.dtype() {
                bail!("published {} weights for a {} model", snap.dtype().name(), t.dtype().name());
            }
            let (dst, cd) = cuda_ptr(t)?;
            cd.peer_copy(dst, &peer, src + (r.start * es) as u64, r.len() * es)?;
            dev = Some(cd);
        }
        if let Some(cd) = dev {
            cd.synchronize()?;
        }
        self.version = version;
        Ok(())
    }

    /// The full optimizer state (every device's shard gathered; call on every device):
    /// (master, exp_avg, exp_avg_sq), the moments empty under SGD.
    pub fn gather_state(&mut self) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        if self.weights_only {
            bail!("this device only generates (split placement): it holds no optimizer state");
        }
        if let Some(ds) = &self.dstate {
            return ds.gather();
        }
        if self.dp.world == 1 {
            return Ok((self.opt.master.clone(), self.opt.m.clone(), self.opt.v.clone()));
        }
        let n = self.n_params;
        let gather = |part: &[f32]| -> Result<Vec<f32>> {
            let mut full = vec![0.0f32; n];
            self.dp.coll.all_gather(self.dp.rank, part, &mut full)?;
            Ok(full)
        };
        let master = gather(&self.opt.master)?;
        // The moments exist on every device or on none (the optimizer kind is global).
        if self.opt.kind == super::optimizer::Kind::AdamW {
            Ok((master, gather(&self.opt.m)?, gather(&self.opt.v)?))
        } else {
            Ok((master, Vec::new(), Vec::new()))
        }
    }

    /// Restores master weights, moments and counters (from a checkpoint), then the compute weights.
    pub fn restore(
        &mut self,
        master: Vec<f32>,
        m: Vec<f32>,
        v: Vec<f32>,
        opt_step: u64,
        version: u64,
        skipped: u64,
        rollout_steps: u64,
    ) -> Result<()> {
        let n = self.n_params;
        if master.len() != n || (self.opt.kind == super::optimizer::Kind::AdamW && (m.len() != n || v.len() != n)) {
            bail!("checkpoint optimizer state has {} values, the model has {n} parameters", master.len());
        }
        if self.weights_only {
            self.load_weights(&master, version)?;
            (self.skipped_steps, self.rollout_steps) = (skipped, rollout_steps);
            return Ok(());
        }
        if let Some(ds) = self.dstate.as_mut() {
            ds.restore(&master, &m, &v)?;
            (self.opt.step, self.version, self.skipped_steps, self.rollout_steps) =
                (opt_step, version, skipped, rollout_steps);
            for (t, r) in self.weights.tensors_mut().into_iter().zip(&self.ranges) {
                t.write_f32(&master[r.clone()])?;
            }
            return Ok(());
        }
        // Each device keeps its shard; the compute weights come from the whole master.
        let shard = self.dp.shard(n);
        if self.dp.world > 1 {
            match &mut self.gathered {
                Gathered::F32(full) => full.copy_from_slice(&master),
                Gathered::Bf16 { full, .. } => {
                    full.iter_mut().zip(&master).for_each(|(o, &x)| *o = bf16_rne(x).to_bits());
                }
            }
        }
        self.opt.master = master[shard.clone()].to_vec();
        if self.opt.kind == super::optimizer::Kind::AdamW {
            self.opt.m = m[shard.clone()].to_vec();
            self.opt.v = v[shard].to_vec();
        }
        self.opt.step = opt_step;
        self.version = version;
        self.skipped_steps = skipped;
        self.rollout_steps = rollout_steps;
        self.write_compute_weights()
    }
}

/// The device address and device of a CUDA tensor.
fn cuda_ptr(t: &crate::device::Tensor) -> Result<(u64, crate::device::CudaDevice)> {
    match t.storage() {
        crate::device::Storage::Cuda(c) => Ok((c.device_ptr() as u64, c.device().clone())),
        crate::device::Storage::Cpu(_) => bail!("a host tensor where a device one is needed"),
    }
}

/// The all-gather buffer of a data-parallel trainer (ZeRO-1): the whole model after each
/// update, in the compute weights' precision. BF16 compute weights gather BF16 (half the bytes
/// and memory of the FP32 master; each device rounds its own shard, which is what writing the
/// FP32 master into BF16 tensors would do); any other dtype gathers the FP32 master.
enum Gathered {
    F32(Vec<f32>),
    /// `shard`: this device's rounded shard, reused across updates.
    Bf16 {
        full: Vec<u16>,
        shard: Vec<u16>,
    },
}

impl Gathered {
    /// For `n` parameters of which this device owns `shard` (n = 0: a single device or a
    /// generator, nothing gathered).
    fn new(weights: &ModelWeights, n: usize, shard: usize) -> Gathered {
        let all_bf16 = weights.tensors().iter().all(|t| t.dtype() == DType::BF16);
        if all_bf16 && n > 0 {
            Gathered::Bf16 { full: vec![0; n], shard: Vec::with_capacity(shard) }
        } else {
            Gathered::F32(vec![0.0; n])
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Gathered::F32(v) => 4 * v.len(),
            Gathered::Bf16 { full, shard } => 2 * (full.len() + shard.capacity()),
        }
    }
}
