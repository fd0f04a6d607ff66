//! The trainer's state on a CUDA device (one training device): the flat FP32 master, Adam
//! moments and gradient (one allocation each; the backward writes per-parameter views of the
//! gradient), each parameter's amax of its compute weights, and the model's device twin
//! ([`DeviceTrainable`]). The forward and the backward read the compute weights in place (the
//! very tensors the rollout engine reads), and the optimizer op (`ops::optim`) rewrites them in
//! place from the new master, in one multi-tensor launch that also reduces the amax a
//! quantized engine's requantize needs: in a step only token ids, per-token coefficients and
//! per-token results cross PCIe (see the `transfer` metrics).
//!
//! With several training GPUs (ZeRO-1, [`Zero`]): every device keeps the whole gradient, but
//! only its shard of the master and the moments. The gradient is reduce-scattered on the
//! communication stream (`device_coll::DeviceCollective`), in buckets where the collective
//! takes them (NCCL): the last micro-batch's backward starts the bucket of the LM head and
//! final norm, then one per layer as each layer's backward has been queued, then the
//! embedding's, each NCCL call ordered after the compute stream's work so far, so the
//! reduction of later layers runs while earlier layers' backward does. The compute stream waits
//! on the last bucket's (or the whole collective's) event, takes the global norm (one f64 per
//! device over the host), updates its shard and writes the rounded shard into the flat buffer
//! of the compute weights (they are its views, made so when the state is built), which is
//! all-gathered in place: after the gather's event the weights hold the update, with no copy.
//! Only per-token numbers and one norm per update cross PCIe.
//!
//! Owns: the device tensors of one trainer. May call: `model::trainable_device`, `ops::optim`.
//! Must not: decide clipping, skipping or the learning rate (`super::optimizer` does).

use super::device_coll::DeviceCollective;
use super::optimizer::{Kind, Optimizer, StepInfo};
use crate::device::{DType, Device, Tensor};
use crate::model::trainable::TrainBatch;
use crate::model::trainable_device::DeviceTrainable;
use crate::model::{ModelConfig, ModelWeights};
use crate::ops::lm_head::{Coef, DevCenter, Pass, StatsOut, TisRule};
use crate::ops::optim::{self, Compute, Layout, Rule, State};
use anyhow::{bail, Result};
use std::ops::Range;
use std::sync::Arc;

/// A device trainer's share of data parallelism over several GPUs (ZeRO-1).
pub(super) struct Zero {
    dp: super::dp::Dp,
    coll: Arc<dyn DeviceCollective>,
    /// This device's shard of the flat parameters.
    shard: Range<usize>,
    /// (S) the reduce-scattered gradient of the shard.
    grad_shard: Tensor,
    /// (world, c) the pieces of the shard's gradient while they are summed (c from the
    /// collective: 1 for NCCL, which needs none).
    staging: Tensor,
    /// (P) the whole model in the compute weights' dtype, whose views the compute weights
    /// are: each device writes its shard, the all-gather fills in the rest.
    gathered: Tensor,
    /// The shard as one tensor (the optimizer's layout; no per-parameter amax).
    layout: Layout,
    /// Each parameter's (offset, length) in the flat order.
    spans: Vec<(usize, usize)>,
    /// The buckets of the reduce-scatter: for each point of the backward
    /// (`trainable_device::gradient_points`), the flat ranges whose gradients are complete
    /// there, merged. Started in turn as the last micro-batch's backward passes each point.
    buckets: Vec<Vec<Range<usize>>>,
    /// Buckets started in this update, and the event after the last one (None: none started,
    /// or a collective that reduces whole gradients only).
    started: usize,
    bucketed: Option<crate::device::cuda::Event>,
}

impl Zero {
    /// Starts every bucket up to point `upto` not started yet (in order: every rank starts the
    /// same buckets in the same order). A collective without buckets starts none.
    fn start_buckets(&mut self, grad: &Tensor, upto: usize) -> Result<()> {
        while self.started < self.buckets.len() && self.started <= upto {
            let k = self.started;
            self.started += 1;
            if self.buckets[k].is_empty() {
                continue;
            }
            match self.coll.reduce_scatter_ranges(self.dp.rank, grad, &mut self.grad_shard, &self.buckets[k])? {
                Some(e) => self.bucketed = Some(e),
                None => {
                    self.started = self.buckets.len();
                    self.bucketed = None;
                }
            }
        }
        Ok(())
    }
}

/// For each point of the backward, the merged flat ranges of the parameters whose gradients are
/// complete there (`spans`: each parameter's (offset, length), `points`: each one's point).
fn buckets_of(spans: &[(usize, usize)], points: &[usize]) -> Vec<Vec<Range<usize>>> {
    let mut out: Vec<Vec<Range<usize>>> = vec![Vec::new(); points.iter().max().map_or(0, |m| m + 1)];
    for (&(off, len), &k) in spans.iter().zip(points) {
        match out[k].last_mut() {
            Some(r) if r.end == off => r.end += len,
            _ => out[k].push(off..off + len),
        }
    }
    out
}

/// The coefficients of a one-pass loss ([`DeviceState::one_pass`]), per scored row of the
/// micro-batch: known before the pass, or the pass's own rule (`lm_head::Coef::Rule`: the
/// aggregation denominators, the teacher's log-probs, the offset; or TIS's sampler log-probs,
/// advantages and cap).
pub(super) enum OnePassCoef<'a> {
    Given(&'a [f32]),
    Rule { den: &'a [u32], teacher: Option<&'a [f32]>, offset: f64, tis: Option<(&'a [f32], &'a [f64], f64)> },
}

pub(super) struct DeviceState {
    dev: Device,
    model: DeviceTrainable,
    /// Flat FP32 (n): the master, the Adam moments (empty under SGD), the gradient.
    master: Tensor,
    m: Option<Tensor>,
    v: Option<Tensor>,
    grad: Tensor,
    /// One view of `grad` per parameter, of its shape (what the backward writes).
    grads: Vec<Tensor>,
    layout: Layout,
    /// Each parameter's amax of its compute weights as the last update wrote them (f32 bits,
    /// U32 per tensor): what a quantized engine's requantize reads instead of its own amax
    /// pass. `amax_valid`: an update wrote it, and nothing rewrote the weights since.
    amax: Tensor,
    amax_valid: bool,
    /// Several training GPUs: the ZeRO-1 buffers (the master and moments above are the shard).
    zero: Option<Zero>,
    /// Seconds the last update spent in the collectives, waits for their events included.
    pub last_collective_s: f64,
}

impl DeviceState {
    /// The state for `weights` (on a CUDA device), the master initialized from them: each
    /// flat buffer one allocation, the gradient's per-parameter tensors views of it.
    /// `zero`: the data-parallel group and its device collective, when several GPUs train.
    pub fn new(
        cfg: &ModelConfig,
        weights: &mut ModelWeights,
        adam: bool,
        zero: Option<(super::dp::Dp, Arc<dyn DeviceCollective>)>,
    ) -> Result<DeviceState> {
        let dev = match weights.tensors().first() {
            Some(t) => match t.storage() {
                crate::device::Storage::Cuda(s) => Device::Cuda(s.device().clone()),
                _ => bail!("device trainer state: the compute weights are not on a CUDA device"),
            },
            None => bail!("device trainer state: a model without parameters"),
        };
        let mut spans = Vec::new();
        let mut n = 0;
        for t in weights.tensors() {
            spans.push((n, t.numel()));
            n += t.numel();
        }
        let shard = match &zero {
            Some((dp, _)) => dp.shard(n),
            None => 0..n,
        };
        // The master is the compute weights' value: each parameter's part of the shard goes
        // through the host one tensor at a time (the host holds one parameter, not the model:
        // 2.2 GB for a 7B model's embedding, not its 30 GB in f32 on every GPU's thread).
        let master = dev.uninit(DType::F32, &[shard.len()])?;
        for (t, &(off, len)) in weights.tensors().iter().zip(&spans) {
            let (lo, hi) = (off.max(shard.start), (off + len).min(shard.end));
            if lo < hi {
                let v = t.to_f32_vec()?;
                master.view(lo - shard.start, &[hi - lo])?.write_f32(&v[lo - off..hi - off])?;
            }
        }
        let moment = || if adam { dev.zeros(DType::F32, &[shard.len()]).map(Some) } else { Ok(None) };
        let (m, v) = (moment()?, moment()?);
        let grad = dev.zeros(DType::F32, &[n])?;
        // One view of `flat` per parameter, of its shape.
        let views_of = |flat: &Tensor, weights: &ModelWeights| -> Result<Vec<Tensor>> {
            weights.tensors().iter().zip(&spans).map(|(t, &(off, _))| flat.view(off, t.shape())).collect()
        };
        let grads = views_of(&grad, weights)?;
        let amax = dev.upload(Tensor::from_u32_host(&[spans.len()], vec![0; spans.len()])?)?;
        let zero = match zero {
            Some((dp, coll)) => {
                let dtype = Self::compute_dtype(weights).ok_or_else(|| {
                    anyhow::anyhow!("device data parallelism needs one compute dtype for every weight")
                })?;
                let s = shard.len();
                // The whole model in the compute dtype: each parameter copied in, device to
                // device (the same dtype by `compute_dtype`); then the compute weights become
                // its views, so the all-gather lands in them and the model is held once (15 GB
                // a GPU for a 7B model). Their old buffers go back to the allocator.
                let gathered = dev.uninit(dtype, &[n])?;
                for (t, &(off, len)) in weights.tensors().iter().zip(&spans) {
                    gathered.view(off, &[len])?.copy_from(t)?;
                }
                *weights = ModelWeights::from_ordered(cfg, views_of(&gathered, weights)?)?;
                Some(Zero {
                    grad_shard: dev.zeros(DType::F32, &[s])?,
                    staging: dev.zeros(DType::F32, &[dp.world, coll.staging_columns(s)])?,
                    gathered,
                    layout: Layout::new(vec![(0, s)])?,
                    buckets: buckets_of(&spans, &crate::model::trainable_device::gradient_points(cfg)),
                    started: 0,
                    bucketed: None,
                    spans: spans.clone(),
                    shard: shard.clone(),
                    dp,
                    coll,
                })
            }
            None => None,
        };
        Ok(DeviceState {
            model: DeviceTrainable::new(cfg, &dev)?,
            dev,
            master,
            m,
            v,
            grad,
            grads,
            layout: Layout::new(spans)?,
            amax,
            amax_valid: false,
            zero,
            last_collective_s: 0.0,
        })
    }

    /// The dtype every compute weight shares (F32, BF16 or F16), if they share one: what a
    /// data-parallel device trainer gathers.
    pub fn compute_dtype(weights: &ModelWeights) -> Option<DType> {
        let ts = weights.tensors();
        let d = ts.first()?.dtype();
        (ts.iter().all(|t| t.dtype() == d) && [DType::F32, DType::BF16, DType::F16].contains(&d)).then_some(d)
    }

    /// Bytes held on the device: master, moments, gradient (and with several GPUs the
    /// gradient shard, the staging of its pieces and the gathered weights).
    pub fn bytes(&self) -> usize {
        let moments = [&self.m, &self.v].iter().filter_map(|t| t.as_ref()).map(|t| t.numel()).sum::<usize>();
        // The gathered buffer is the compute weights' memory (counted with the weights).
        let zero = self.zero.as_ref().map_or(0, |z| 4 * (z.grad_shard.numel() + z.staging.numel()));
        4 * (self.master.numel() + moments + self.grad.numel() + self.amax.numel()) + zero
    }

    /// Each parameter's amax of its compute weights (f32 bits, U32 per tensor in parameter
    /// order), when the last update wrote both and nothing rewrote the weights since.
    pub fn weight_amax(&self) -> Option<&Tensor> {
        self.amax_valid.then_some(&self.amax)
    }

    /// logp, entropy of `b`'s scored rows at the current weights (the forward's activations stay
    /// on the device for a following backward).
    pub fn token_stats(
        &mut self,
        weights: &ModelWeights,
        b: &TrainBatch,
        t: f32,
        chunk: usize,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let p = weights.tensors();
        self.model.forward(&p, b)?;
        let m = b.rows.len();
        let (mut lp, mut en) = (self.dev.uninit(DType::F32, &[m])?, self.dev.uninit(DType::F32, &[m])?);
        self.model.token_stats(&p, t, chunk, &mut lp, &mut en)?;
        Ok((lp.to_f32_vec()?, en.to_f32_vec()?))
    }

    /// The NVFP4 learner's forward on the device twin (None: off).
    pub fn set_quant(&mut self, q: Option<crate::model::learner_quant::LearnerQuant>) {
        self.model.set_quant(q);
    }

    /// Keeps each layer's input alone and runs the layer again in the backward
    /// (`objective.activation_checkpointing`; `DeviceTrainable::set_checkpointing`).
    pub fn set_checkpointing(&mut self, on: bool) {
        self.model.set_checkpointing(on);
    }

    /// Frees the saved activations (the step is over).
    pub fn release(&mut self) {
        self.model.release();
    }

    pub fn zero_grads(&mut self) -> Result<()> {
        if let Some(z) = self.zero.as_mut() {
            (z.started, z.bucketed) = (0, None);
        }
        self.grad.fill_zero()
    }

    /// A device with no responses in this update (its gradient stays zero): starts the buckets
    /// of the reduce-scatter at once, as the others start theirs in their backward.
    pub fn no_backward(&mut self) -> Result<()> {
        match self.zero.as_mut() {
            Some(z) => z.start_buckets(&self.grad, usize::MAX),
            None => Ok(()),
        }
    }

    /// The fused loss pass and the backward of micro-batch `b` into the gradients (`forward`:
    /// run the forward first; false when the model still holds `b`'s activations). `last`: the
    /// update's last micro-batch, whose backward starts the reduce-scatter's buckets as the
    /// gradients they hold are complete (several GPUs).
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &mut self,
        weights: &ModelWeights,
        b: &TrainBatch,
        coef: &[f32],
        center: Option<(usize, &[u32], &[f32])>,
        t: f32,
        chunk: usize,
        forward: bool,
        last: bool,
    ) -> Result<()> {
        if forward {
            self.model.forward(&weights.tensors(), b)?;
        }
        let c = self.dev.from_f32(DType::F32, &[coef.len()], coef)?;
        self.loss_and_backward(weights, Coef::Given(&c), center, t, chunk, None, last)
    }

    /// Micro-batch `b`'s forward, then its loss pass and backward in one pass: the loss pass
    /// takes coefficients known before it or evaluates each scored row's from its own log-prob
    /// ([`OnePassCoef`]), and writes its log-probs and entropies (π_old's at the step's first
    /// update), which it returns on the device (M each, f32): nothing is read back, so the
    /// host queues the next micro-batch without waiting for this one.
    #[allow(clippy::too_many_arguments)]
    pub fn one_pass(
        &mut self,
        weights: &ModelWeights,
        b: &TrainBatch,
        coef: OnePassCoef<'_>,
        center: Option<(usize, &[u32], &[f32])>,
        t: f32,
        chunk: usize,
        last: bool,
    ) -> Result<(Tensor, Tensor)> {
        self.model.forward(&weights.tensors(), b)?;
        let m = b.rows.len();
        let up = |x: &[f32]| self.dev.from_f32(DType::F32, &[x.len()], x);
        // The host's per-row numbers, uploaded.
        let words = |v: Vec<u32>| self.dev.upload(Tensor::from_u32_host(&[v.len()], v)?);
        struct RuleUp {
            den: Tensor,
            teacher: Option<Tensor>,
            offset: f64,
            /// The sampler's log-probs, the advantages' words, the cap.
            tis: Option<(Tensor, Tensor, f64)>,
        }
        enum Uploaded {
            Given(Tensor),
            Rule(Box<RuleUp>),
        }
        let on_device = match coef {
            OnePassCoef::Given(c) => Uploaded::Given(up(c)?),
            OnePassCoef::Rule { den, teacher, offset, tis } => {
                let tis = match tis {
                    Some((s, a, cap)) => Some((up(s)?, words(TisRule::words(a))?, cap)),
                    None => None,
                };
                let (den, teacher) = (words(den.to_vec())?, teacher.map(up).transpose()?);
                Uploaded::Rule(Box::new(RuleUp { den, teacher, offset, tis }))
            }
        };
        let coef = match &on_device {
            Uploaded::Given(c) => Coef::Given(c),
            Uploaded::Rule(r) => Coef::Rule {
                den: &r.den,
                teacher: r.teacher.as_ref(),
                offset: r.offset,
                tis: r.tis.as_ref().map(|(sampler, adv, cap)| TisRule { sampler, adv, cap: *cap }),
            },
        };
        let (mut lp, mut en) = (self.dev.uninit(DType::F32, &[m])?, self.dev.uninit(DType::F32, &[m])?);
        let stats = StatsOut { logp: &mut lp, entropy: &mut en };
        self.loss_and_backward(weights, coef, center, t, chunk, Some(stats), last)?;
        Ok((lp, en))
    }

    /// The loss pass of the micro-batch whose activations the model holds, then its backward.
    #[allow(clippy::too_many_arguments)]
    fn loss_and_backward(
        &mut self,
        weights: &ModelWeights,
        coef: Coef<'_>,
        center: Option<(usize, &[u32], &[f32])>,
        temperature: f32,
        chunk: usize,
        stats: Option<StatsOut<'_>>,
        last: bool,
    ) -> Result<()> {
        let p = weights.tensors();
        let ct = match center {
            Some((k, ids, probs)) => Some((
                k,
                self.dev.upload(Tensor::from_u32_host(&[ids.len()], ids.to_vec())?)?,
                self.dev.from_f32(DType::F32, &[probs.len()], probs)?,
            )),
            None => None,
        };
        let dc = ct.as_ref().map(|(k, ids, probs)| DevCenter { k: *k, ids, probs });
        // The trainer never uses the loss pass's loss (the objective reports its own): not
        // reading it back keeps the host from waiting on the device at every micro-batch.
        let pass = Pass { coef, center: dc.as_ref(), temperature, chunk, stats, loss: false };
        let (zero, grad) = (&mut self.zero, &self.grad);
        let mut done = |k: usize| match zero.as_mut() {
            Some(z) if last => z.start_buckets(grad, k),
            _ => Ok(()),
        };
        self.model.backward_with(&p, pass, &mut self.grads, &mut done)?;
        Ok(())
    }

    /// The optimizer update on the device: the global norm (one f64 reduction of the flat
    /// gradient, read back), clipping and skipping decided by `opt` as on the host, then one
    /// multi-tensor step that rewrites every parameter's compute weights in place and reduces
    /// each one's amax of them while it writes them.
    pub fn apply(&mut self, opt: &mut Optimizer, weights: &mut ModelWeights) -> Result<StepInfo> {
        if self.zero.is_some() {
            return self.apply_zero(opt, weights);
        }
        let norm = optim::sum_sq(&self.dev, &self.grad)?.sqrt();
        if !norm.is_finite() {
            return Ok(StepInfo { grad_norm: norm, clip_coef: 0.0, lr: 0.0, skipped: true });
        }
        let (clip_coef, clip, rule) = Self::rule(opt, norm);
        let mut st = State { master: &mut self.master, m: self.m.as_mut(), v: self.v.as_mut(), layout: &self.layout };
        let mut ws = weights.tensors_mut();
        self.amax_valid = false;
        optim::step(
            &self.dev,
            &mut st,
            &mut self.grad,
            clip,
            &rule,
            Some(Compute { weights: &mut ws, amax: Some(&mut self.amax) }),
        )?;
        self.amax_valid = true;
        Ok(StepInfo { grad_norm: norm, clip_coef, lr: opt.lr_at(opt.step), skipped: false })
    }

    /// Clipping and the update rule for gradient norm `norm` (finite); advances the step.
    fn rule(opt: &mut Optimizer, norm: f64) -> (f64, f32, Rule) {
        let cfg = &opt.cfg;
        let clip_coef = if cfg.grad_clip > 0.0 { (cfg.grad_clip / (norm + 1e-6)).min(1.0) } else { 1.0 };
        let clip = if clip_coef < 1.0 { clip_coef as f32 } else { 1.0 };
        opt.step += 1;
        let lr = opt.lr_at(opt.step);
        let rule = match opt.kind {
            Kind::Sgd => Rule::sgd(lr, cfg.weight_decay),
            Kind::AdamW => Rule::adamw(lr, cfg.weight_decay, cfg.betas, cfg.eps, opt.step),
        };
        (clip_coef, clip, rule)
    }

    /// The ZeRO-1 update over several GPUs (see the module comment). Every device reaches the
    /// same decision to skip: the norm is global.
    fn apply_zero(&mut self, opt: &mut Optimizer, weights: &mut ModelWeights) -> Result<StepInfo> {
        let Some(z) = self.zero.as_mut() else { bail!("apply_zero without data parallelism") };
        let Device::Cuda(cd) = &self.dev else { bail!("device trainer state off a CUDA device") };
        self.amax_valid = false;
        let rank = z.dp.rank;
        let t = std::time::Instant::now();
        // The buckets the backward did not start (all of them after a backward that was not
        // the update's last micro-batch's), then the last one's event; or the whole gradient.
        z.start_buckets(&self.grad, usize::MAX)?;
        let reduced = match z.bucketed.take() {
            Some(e) => e,
            None => z.coll.reduce_scatter(rank, &self.grad, &mut z.staging, &mut z.grad_shard)?,
        };
        // The compute stream reads the shard only after the communication stream wrote it.
        cd.wait_event(&reduced)?;
        let local = optim::sum_sq(&self.dev, &z.grad_shard)?;
        self.last_collective_s = t.elapsed().as_secs_f64();
        let norm = z.dp.sum_f64(local)?.sqrt();
        if !norm.is_finite() {
            return Ok(StepInfo { grad_norm: norm, clip_coef: 0.0, lr: 0.0, skipped: true });
        }
        let (clip_coef, clip, rule) = Self::rule(opt, norm);
        let mut st = State { master: &mut self.master, m: self.m.as_mut(), v: self.v.as_mut(), layout: &z.layout };
        let mut mine = z.gathered.view(z.shard.start, &[z.shard.len()])?;
        optim::step(
            &self.dev,
            &mut st,
            &mut z.grad_shard,
            clip,
            &rule,
            Some(Compute { weights: &mut [&mut mine], amax: None }),
        )?;
        let t = std::time::Instant::now();
        let gathered = z.coll.all_gather_in_place(rank, &mut z.gathered)?;
        cd.wait_event(&gathered)?;
        self.last_collective_s += t.elapsed().as_secs_f64();
        // The compute weights are views of the gathered buffer (`new`); a weight that is not
        // (replaced since) is copied from it.
        let es = z.gathered.dtype().size();
        let base = ptr_of(&z.gathered)?;
        for (t, &(off, len)) in weights.tensors_mut().into_iter().zip(&z.spans) {
            let (dst, src) = (ptr_of(t)?, base + (off * es) as u64);
            if dst != src {
                cd.dtod(dst, src, len * es)?;
            }
        }
        Ok(StepInfo { grad_norm: norm, clip_coef, lr: opt.lr_at(opt.step), skipped: false })
    }

    /// The whole model as of the last update, in f32 (several GPUs: the gathered compute
    /// weights, rounded as they are; one: the master).
    pub fn full_weights(&self) -> Result<Vec<f32>> {
        match &self.zero {
            Some(z) => z.gathered.to_f32_vec(),
            None => self.master.to_f32_vec(),
        }
    }

    /// (master, exp_avg, exp_avg_sq) as host vectors in parameter order (moments empty under
    /// SGD). With several GPUs every device must call it (the shards are all-gathered).
    pub fn gather(&self) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let host = |t: &Option<Tensor>| t.as_ref().map(|t| t.to_f32_vec()).unwrap_or(Ok(Vec::new()));
        let (master, m, v) = (self.master.to_f32_vec()?, host(&self.m)?, host(&self.v)?);
        let Some(z) = &self.zero else { return Ok((master, m, v)) };
        let n = self.grad.numel();
        let all = |part: &[f32]| -> Result<Vec<f32>> {
            let mut full = vec![0.0f32; n];
            z.dp.coll.all_gather(z.dp.rank, part, &mut full)?;
            Ok(full)
        };
        // Whether moments exist is the same on every device (a shard may be empty: n < world).
        if self.m.is_none() {
            return Ok((all(&master)?, Vec::new(), Vec::new()));
        }
        Ok((all(&master)?, all(&m)?, all(&v)?))
    }

    /// Restores the master and the moments from host vectors in parameter order (the whole
    /// model; a data-parallel device keeps its shard). The caller rewrites the compute weights:
    /// their amax is stale until the next update.
    pub fn restore(&mut self, master: &[f32], m: &[f32], v: &[f32]) -> Result<()> {
        self.amax_valid = false;
        let shard = match &mut self.zero {
            Some(z) => {
                z.gathered.write_f32(master)?;
                z.shard.clone()
            }
            None => 0..master.len(),
        };
        self.master.write_f32(&master[shard.clone()])?;
        if let (Some(mt), Some(vt)) = (self.m.as_mut(), self.v.as_mut()) {
            mt.write_f32(&m[shard.clone()])?;
            vt.write_f32(&v[shard])?;
        }
        Ok(())
    }
}

/// The device address of a CUDA tensor.
fn ptr_of(t: &Tensor) -> Result<u64> {
    match t.storage() {
        crate::device::Storage::Cuda(c) => Ok(c.device_ptr() as u64),
        crate::device::Storage::Cpu(_) => bail!("device trainer state: a host tensor"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::cuda::CudaDevice;
    use crate::model::tiny::{tiny_config, TinySpec};

    /// With ZeRO-1 the compute weights become views of the gathered buffer (one copy of the
    /// model on the device, the all-gather lands in them), with their values unchanged, and
    /// the state's bytes no longer count a second copy.
    #[test]
    fn zero_1_compute_weights_are_the_gathered_buffer() {
        let spec = TinySpec {
            arch: "qwen2".into(),
            layers: 2,
            hidden: 32,
            heads: 4,
            kv_heads: 2,
            head_dim: Some(8),
            intermediate: Some(64),
            vocab: 300,
            max_position: 32,
            tie: true,
        };
        let cfg = tiny_config(&spec).unwrap();
        let dev = Device::Cuda(CudaDevice::sim_unshared_arch(89, "sm_90a"));
        let mut w = ModelWeights::random(&cfg, &dev, DType::BF16, 5, 0.1).unwrap();
        let before: Vec<Vec<f32>> = w.tensors().iter().map(|t| t.to_f32_vec().unwrap()).collect();
        let n: usize = before.iter().map(|v| v.len()).sum();
        let coll: Arc<dyn crate::parallel::Collective> = Arc::new(crate::parallel::InProcess::new(2).unwrap());
        let dcoll: Arc<dyn DeviceCollective> = Arc::new(super::super::device_coll::PeerCopy::new(2).unwrap());
        let dp = super::super::dp::Dp { rank: 0, world: 2, coll, dcoll: Some(dcoll.clone()) };
        let st = DeviceState::new(&cfg, &mut w, true, Some((dp, dcoll))).unwrap();
        let z = st.zero.as_ref().unwrap();
        let base = ptr_of(&z.gathered).unwrap();
        let mut off = 0;
        for (i, t) in w.tensors().iter().enumerate() {
            assert_eq!(ptr_of(t).unwrap(), base + 2 * off as u64, "parameter {i} is a view of the gathered buffer");
            assert_eq!(t.to_f32_vec().unwrap(), before[i], "parameter {i} keeps its values");
            off += t.numel();
        }
        assert_eq!(off, n);
        let s = n.div_ceil(2);
        // master, m, v of the shard; the gradient; amax; the gradient shard and its staging.
        let want = 4 * (3 * s + n + w.tensors().len()) + 4 * (s + 2 * s);
        assert_eq!(st.bytes(), want);
    }
}
