//! Optimizers over FP32 master weights: AdamW with PyTorch's semantics and plain SGD, global
//! gradient-norm clipping (torch.nn.utils.clip_grad_norm_), and the learning-rate schedule.
//! Parameters are one flat f32 vector (so a device can own a contiguous shard, ZeRO-1 style).
//!
//! Owns: master weights, moments, the step counter, clipping and skipping. May call: `config`
//! (its settings and kind), `ops::optim` (the update's element loops). Must not: touch the
//! compute weights' storage (the trainer writes them from `master` after each step).

use crate::config::OptimizerConfig;
pub use crate::config::OptimizerKind as Kind;
use crate::ops::optim::{self, Rule};
use anyhow::{bail, Result};

#[derive(Clone, Debug)]
pub struct Optimizer {
    pub kind: Kind,
    pub cfg: OptimizerConfig,
    /// FP32 master weights (flat, parameter order).
    pub master: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    /// Optimizer steps taken (AdamW's t).
    pub step: u64,
}

/// What one step did.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepInfo {
    pub grad_norm: f64,
    pub clip_coef: f64,
    pub lr: f64,
    /// The step was skipped because the gradient was not finite.
    pub skipped: bool,
}

impl Optimizer {
    pub fn new(cfg: &OptimizerConfig, master: Vec<f32>) -> Result<Optimizer> {
        let kind = cfg.kind;
        let n = master.len();
        let (m, v) = if kind == Kind::AdamW { (vec![0.0; n], vec![0.0; n]) } else { (Vec::new(), Vec::new()) };
        Ok(Optimizer { kind, cfg: cfg.clone(), master, m, v, step: 0 })
    }

    /// Learning rate of optimizer step `t` (1-based): linear warmup, then constant.
    pub fn lr_at(&self, t: u64) -> f64 {
        let w = self.cfg.warmup_steps;
        if w > 0 && t <= w {
            self.cfg.lr * t as f64 / w as f64
        } else {
            self.cfg.lr
        }
    }

    /// One update with gradient `grad` (flat, same layout as master; modified by clipping).
    /// A non-finite gradient skips the update (nothing changes, the step is counted as skipped).
    pub fn update(&mut self, grad: &mut [f32]) -> Result<StepInfo> {
        let norm = sum_sq(grad).sqrt();
        self.update_with_norm(grad, norm)
    }

    /// [`Self::update`] on a shard (ZeRO-1): `master`, the moments and `grad` hold this device's
    /// slice; `norm` is the global gradient norm (every device's shard together), which decides
    /// clipping and skipping identically on every device.
    pub fn update_with_norm(&mut self, grad: &mut [f32], norm: f64) -> Result<StepInfo> {
        if grad.len() != self.master.len() {
            bail!("optimizer: gradient of {} values for {} parameters", grad.len(), self.master.len());
        }
        if !norm.is_finite() {
            return Ok(StepInfo { grad_norm: norm, clip_coef: 0.0, lr: 0.0, skipped: true });
        }
        // torch: clip_coef = max_norm / (total_norm + 1e-6), clamped to 1.
        let clip_coef = if self.cfg.grad_clip > 0.0 { (self.cfg.grad_clip / (norm + 1e-6)).min(1.0) } else { 1.0 };
        let clip = if clip_coef < 1.0 { clip_coef as f32 } else { 1.0 };
        self.step += 1;
        let lr = self.lr_at(self.step);
        let wd = self.cfg.weight_decay;
        // The element loops are the optimizer op's CPU twin (`ops::optim::cpu`), which its
        // CUDA kernel matches bit for bit.
        let rule = match self.kind {
            Kind::Sgd => Rule::sgd(lr, wd),
            Kind::AdamW => Rule::adamw(lr, wd, self.cfg.betas, self.cfg.eps, self.step),
        };
        optim::cpu::update(&mut self.master, &mut self.m, &mut self.v, grad, clip, &rule);
        Ok(StepInfo { grad_norm: norm, clip_coef, lr, skipped: false })
    }
}

/// Σ g² accumulated in f64 (the squared L2 norm of a gradient or of a shard of it).
pub use crate::ops::optim::cpu::sum_sq;

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(kind: Kind) -> OptimizerConfig {
        OptimizerConfig {
            kind,
            lr: 0.1,
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.01,
            grad_clip: 0.0,
            warmup_steps: 0,
        }
    }

    #[test]
    fn adamw_matches_the_torch_formula_over_three_steps() {
        // Reference: the same recurrences in f64 (torch.optim.AdamW, amsgrad=False).
        let mut o = Optimizer::new(&cfg(Kind::AdamW), vec![1.0, -2.0]).unwrap();
        let grads = [[0.5f32, -0.25], [0.1, 0.3], [-0.2, 0.05]];
        let (mut p, mut m, mut v) = ([1.0f64, -2.0], [0.0f64; 2], [0.0f64; 2]);
        for (t, g) in grads.iter().enumerate() {
            o.update(&mut g.clone()).unwrap();
            let t = (t + 1) as i32;
            for i in 0..2 {
                p[i] *= 1.0 - 0.1 * 0.01;
                m[i] = 0.9 * m[i] + 0.1 * g[i] as f64;
                v[i] = 0.999 * v[i] + 0.001 * (g[i] as f64).powi(2);
                let denom = v[i].sqrt() / (1.0 - 0.999f64.powi(t)).sqrt() + 1e-8;
                p[i] -= 0.1 / (1.0 - 0.9f64.powi(t)) * m[i] / denom;
            }
        }
        // f32 arithmetic (as torch's f32 path) vs an f64 reference: |Δ| ≤ 1e-6 + 1e-5·|ref|.
        for i in 0..2 {
            assert!((o.master[i] as f64 - p[i]).abs() <= 1e-6 + 1e-5 * p[i].abs(), "{} vs {}", o.master[i], p[i]);
        }
    }

    #[test]
    fn sgd_clipping_warmup_and_nonfinite_skip() {
        let mut c = cfg(Kind::Sgd);
        c.weight_decay = 0.0;
        c.grad_clip = 1.0;
        c.warmup_steps = 2;
        let mut o = Optimizer::new(&c, vec![0.0, 0.0]).unwrap();
        let mut g = [3.0f32, 4.0]; // norm 5 → scaled by 1/(5 + 1e-6)
        let info = o.update(&mut g).unwrap();
        assert!((info.grad_norm - 5.0).abs() < 1e-12 && (info.lr - 0.05).abs() < 1e-12);
        let s = (1.0 / (5.0 + 1e-6)) as f32;
        assert_eq!(o.master, vec![-0.05 * 3.0 * s, -0.05 * 4.0 * s]);
        let before = o.master.clone();
        let info = o.update(&mut [f32::NAN, 1.0]).unwrap();
        assert!(info.skipped && o.master == before && o.step == 1);
        assert!((o.lr_at(2) - 0.1).abs() < 1e-12 && (o.lr_at(9) - 0.1).abs() < 1e-12);
    }
}
