//! The trainer's state on a CUDA device (one training device): the FP32 master and Adam
//! moments per parameter tensor, the FP32 gradient per tensor, and the model's device twin
//! ([`DeviceTrainable`]). The forward and the backward read the compute weights in place (the
//! very tensors the rollout engine reads), and the optimizer op (`ops::optim`) rewrites them in
//! place from the new master: in a step only token ids, per-token coefficients and per-token
//! results cross PCIe (see the `transfer` metrics).
//!
//! Not yet: data parallelism over several GPUs (their collectives still stage through the
//! host, so `Trainer` keeps the host path there), the NVFP4 learner, arenas from the memory
//! plan.
//!
//! Owns: the device tensors of one trainer. May call: `model::trainable_device`, `ops::optim`.
//! Must not: decide clipping, skipping or the learning rate (`super::optimizer` does).

use super::optimizer::{Kind, Optimizer, StepInfo};
use crate::device::{DType, Device, Tensor};
use crate::model::trainable::TrainBatch;
use crate::model::trainable_device::DeviceTrainable;
use crate::model::{ModelConfig, ModelWeights};
use crate::ops::lm_head::DevCenter;
use crate::ops::optim::{self, Compute, Layout, Rule, State};
use anyhow::{bail, Result};

pub(super) struct DeviceState {
    dev: Device,
    model: DeviceTrainable,
    master: Vec<Tensor>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    grads: Vec<Tensor>,
    layouts: Vec<Layout>,
}

impl DeviceState {
    /// The state for `weights` (on a CUDA device), the master initialized from them.
    pub fn new(cfg: &ModelConfig, weights: &ModelWeights, adam: bool) -> Result<DeviceState> {
        let dev = match weights.tensors().first() {
            Some(t) => match t.storage() {
                crate::device::Storage::Cuda(s) => Device::Cuda(s.device().clone()),
                _ => bail!("device trainer state: the compute weights are not on a CUDA device"),
            },
            None => bail!("device trainer state: a model without parameters"),
        };
        let (mut master, mut m, mut v, mut grads, mut layouts) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for t in weights.tensors() {
            let n = t.numel();
            // One upload at start (the master is the compute weights' value).
            master.push(dev.from_f32(DType::F32, &[n], &t.to_f32_vec()?)?);
            if adam {
                m.push(dev.zeros(DType::F32, &[n])?);
                v.push(dev.zeros(DType::F32, &[n])?);
            }
            grads.push(dev.zeros(DType::F32, t.shape())?);
            layouts.push(Layout::new(vec![(0, n)])?);
        }
        Ok(DeviceState { model: DeviceTrainable::new(cfg, &dev)?, dev, master, m, v, grads, layouts })
    }

    /// Bytes held on the device: master, moments, gradients.
    pub fn bytes(&self) -> usize {
        [&self.master, &self.m, &self.v, &self.grads].iter().flat_map(|v| v.iter()).map(|t| t.numel() * 4).sum()
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
        let (mut lp, mut en) = (self.dev.zeros(DType::F32, &[m])?, self.dev.zeros(DType::F32, &[m])?);
        self.model.token_stats(&p, t, chunk, &mut lp, &mut en)?;
        Ok((lp.to_f32_vec()?, en.to_f32_vec()?))
    }

    /// Frees the saved activations (the step is over).
    pub fn release(&mut self) {
        self.model.release();
    }

    pub fn zero_grads(&mut self) -> Result<()> {
        self.grads.iter_mut().try_for_each(|g| g.fill_zero())
    }

    /// The fused loss pass and the backward of micro-batch `b` into the gradients (`forward`:
    /// run the forward first; false when the model still holds `b`'s activations).
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
    ) -> Result<()> {
        let p = weights.tensors();
        if forward {
            self.model.forward(&p, b)?;
        }
        let c = self.dev.from_f32(DType::F32, &[coef.len()], coef)?;
        let ct = match center {
            Some((k, ids, probs)) => Some((
                k,
                self.dev.upload(Tensor::from_u32_host(&[ids.len()], ids.to_vec())?)?,
                self.dev.from_f32(DType::F32, &[probs.len()], probs)?,
            )),
            None => None,
        };
        let dc = ct.as_ref().map(|(k, ids, probs)| DevCenter { k: *k, ids, probs });
        self.model.backward(&p, &c, dc.as_ref(), t, chunk, &mut self.grads)?;
        Ok(())
    }

    /// The optimizer update on the device: the global norm (per-tensor f64 sums, read back
    /// together and added on the host), clipping and skipping decided by `opt` as on the host, then one fused step per
    /// tensor that rewrites that tensor's compute weights in place.
    pub fn apply(&mut self, opt: &mut Optimizer, weights: &mut ModelWeights) -> Result<StepInfo> {
        let norm = optim::sum_sq_all(&self.dev, &self.grads.iter().collect::<Vec<_>>())?.sqrt();
        if !norm.is_finite() {
            return Ok(StepInfo { grad_norm: norm, clip_coef: 0.0, lr: 0.0, skipped: true });
        }
        let cfg = &opt.cfg;
        let clip_coef = if cfg.grad_clip > 0.0 { (cfg.grad_clip / (norm + 1e-6)).min(1.0) } else { 1.0 };
        let clip = if clip_coef < 1.0 { clip_coef as f32 } else { 1.0 };
        opt.step += 1;
        let lr = opt.lr_at(opt.step);
        let rule = match opt.kind {
            Kind::Sgd => Rule::sgd(lr, cfg.weight_decay),
            Kind::AdamW => Rule::adamw(lr, cfg.weight_decay, cfg.betas, cfg.eps, opt.step),
        };
        let adam = opt.kind == Kind::AdamW;
        for (i, w) in weights.tensors_mut().into_iter().enumerate() {
            let (m, v) = if adam { (self.m.get_mut(i), self.v.get_mut(i)) } else { (None, None) };
            let mut st = State { master: &mut self.master[i], m, v, layout: &self.layouts[i] };
            // The step reads flat tensors: view the weight and its gradient as such.
            let shape = w.shape().to_vec();
            let g = &mut self.grads[i];
            w.reshape(&[w.numel()])?;
            g.reshape(&[g.numel()])?;
            let r = optim::step(&self.dev, &mut st, g, clip, &rule, Some(Compute { weights: w, amax: None }));
            g.reshape(&shape)?;
            w.reshape(&shape)?;
            r?;
        }
        Ok(StepInfo { grad_norm: norm, clip_coef, lr, skipped: false })
    }

    /// (master, exp_avg, exp_avg_sq) as host vectors in parameter order (moments empty under
    /// SGD).
    pub fn gather(&self) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let flat = |ts: &[Tensor]| -> Result<Vec<f32>> {
            let mut out = Vec::new();
            for t in ts {
                out.extend(t.to_f32_vec()?);
            }
            Ok(out)
        };
        Ok((flat(&self.master)?, flat(&self.m)?, flat(&self.v)?))
    }

    /// Restores the master and the moments from host vectors in parameter order.
    pub fn restore(&mut self, master: &[f32], m: &[f32], v: &[f32]) -> Result<()> {
        let mut at = 0;
        for i in 0..self.master.len() {
            let n = self.master[i].numel();
            self.master[i].write_f32(&master[at..at + n])?;
            if !self.m.is_empty() {
                self.m[i].write_f32(&m[at..at + n])?;
                self.v[i].write_f32(&v[at..at + n])?;
            }
            at += n;
        }
        Ok(())
    }
}
