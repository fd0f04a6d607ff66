//! The learner's native NVFP4 forward (seed 004 §5.1, App. B.1: W4A4 on the sampler *and* the
//! learner). Chosen MLP linears of the trainable model run on fake-quantized weights and
//! activations — the engine's quantizer bit for bit: the same global scale rule (the amax of the
//! values that get quantized, /2688), the same 16-value E4M3 block scales, the same RHT signs and
//! stochastic-rounding keys for weights, and the engine's calibrated activation scales when the
//! engine quantizes that linear's input (else a per-token global scale, as the paper's kernels
//! use). The backward is straight-through: gradients flow to the FP32 master as if the rounding
//! were the identity, through the quantized operands (dx = dy·Q(W), dW = dyᵀ·Q(x)).
//!
//! Owns: [`LearnerQuant`]. May call: `crate::quant::nvfp4`. Must not: touch weights in place
//! (quantized copies live in the trainable model's arenas).

use crate::ops::real::Real;
use crate::quant::nvfp4::{self, Global, Nvfp4Opts, BLOCK};
use anyhow::{bail, Result};

/// Index of the MLP linears in `quant::recipe::LINEARS` order.
pub const GATE: usize = 4;
pub const UP: usize = 5;
pub const DOWN: usize = 6;

#[derive(Clone, Debug, PartialEq)]
pub struct LearnerQuant {
    /// Which linears run in NVFP4, in `quant::recipe::LINEARS` order (MLP ones only).
    pub linears: [bool; 7],
    pub opts: Nvfp4Opts,
    /// Per layer and linear: the engine's calibrated global scale of that linear's input, or
    /// None for a per-token scale.
    pub act_global: Vec<[Option<f32>; 7]>,
}

impl LearnerQuant {
    /// From config names; only the MLP projections are supported (attention, norms, embeddings
    /// and the LM head stay in the compute dtype, as in the paper's recipe).
    pub fn new(names: &[String], opts: Nvfp4Opts, layers: usize) -> Result<LearnerQuant> {
        let mut linears = [false; 7];
        for n in names {
            match crate::quant::recipe::LINEARS.iter().position(|l| l == n) {
                Some(i) if i >= GATE => linears[i] = true,
                Some(_) => bail!("learner.linears: '{n}' is an attention projection; the NVFP4 learner forward covers the MLP (gate_proj, up_proj, down_proj)"),
                None => bail!("learner.linears: unknown linear '{n}'"),
            }
        }
        Ok(LearnerQuant { linears, opts, act_global: vec![[None; 7]; layers] })
    }

    /// The engine's calibrated input scales where it quantizes the same linears in NVFP4 (the
    /// learner then rounds those inputs under a fixed global scale, as the engine does).
    pub fn take_engine_scales(&mut self, q: &crate::model::quant_state::QuantState) {
        for (l, ql) in q.layers.iter().enumerate() {
            for (i, a) in ql.act.iter().enumerate() {
                if let (crate::ops::quantize::ActQuant::Nvfp4 { global, .. }, Some(g)) =
                    (a, self.act_global.get_mut(l).and_then(|x| x.get_mut(i)))
                {
                    *g = Some(*global);
                }
            }
        }
    }

    pub fn on(&self, linear: usize) -> bool {
        self.linears[linear]
    }

    /// out = Q(w) for a weight (rows, k), as the engine's `ops::quantize::requantize` rounds it.
    pub fn weight<T: Real>(&self, w: &[T], k: usize, out: &mut Vec<T>) -> Result<()> {
        let mut x: Vec<f32> = w.iter().map(|v| Real::to_f64(*v) as f32).collect();
        check_k(k)?;
        let amax = nvfp4::learner_round(&mut x, k, Global::Tensor, &self.opts);
        if !amax.is_finite() {
            bail!("learner NVFP4: a weight holds NaN or Inf values");
        }
        out.clear();
        out.extend(x.iter().map(|&v| T::from_f64(v as f64)));
        Ok(())
    }

    /// How linear `linear` of layer `layer` scales its input: the engine's calibrated global,
    /// or each token's own.
    pub fn act_global(&self, layer: usize, linear: usize) -> Global {
        match self.act_global.get(layer).and_then(|a| a[linear]) {
            Some(g) => Global::Fixed(g),
            None => Global::Row,
        }
    }

    /// Fake-quantizes activation rows x (n, k) in place for linear `linear` of layer `layer`.
    pub fn act<T: Real>(&self, layer: usize, linear: usize, x: &mut [T], k: usize) -> Result<()> {
        check_k(k)?;
        let mut v: Vec<f32> = x.iter().map(|a| Real::to_f64(*a) as f32).collect();
        nvfp4::learner_round(&mut v, k, self.act_global(layer, linear), &self.opts);
        for (a, b) in x.iter_mut().zip(&v) {
            *a = T::from_f64(*b as f64);
        }
        Ok(())
    }
}

fn check_k(k: usize) -> Result<()> {
    if k == 0 || k % BLOCK != 0 {
        bail!("learner NVFP4: the reduction dimension {k} is not a multiple of {BLOCK}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{DType, Device};
    use crate::quant::qtensor::{QFormat, QTensor};

    /// Q(x)·Q(w) in the learner's (unrotated) domain equals the engine's rotated-domain product
    /// of its quantized weight and fake-quantized activations.
    #[test]
    fn weights_round_like_the_engine_and_dot_products_match() {
        let dev = Device::cpu(2).unwrap();
        let (rows, k) = (8, 64);
        let mut rng = crate::rand::Stream::new(9, 0);
        let w: Vec<f32> = (0..rows * k).map(|_| rng.normal() as f32 * 0.05).collect();
        let x: Vec<f32> = (0..k).map(|_| rng.normal() as f32).collect();
        for opts in [
            Nvfp4Opts::default(),
            Nvfp4Opts { rht: Some(3), stochastic: None },
            Nvfp4Opts { rht: Some(3), stochastic: Some(5) },
        ] {
            let lq = LearnerQuant {
                linears: [false, false, false, false, true, true, true],
                opts,
                act_global: vec![[Some(0.01); 7]],
            };
            let mut qw = Vec::new();
            lq.weight(&w, k, &mut qw).unwrap();
            let mut qt = QTensor::alloc(QFormat::Nvfp4, rows, k, opts).unwrap();
            crate::ops::quantize::requantize(&dev, &dev.from_f32(DType::F32, &[rows, k], &w).unwrap(), &mut qt, "w")
                .unwrap();
            let engine_w = qt.dequantize(); // rotated domain under the RHT
            let mut qx = x.clone();
            lq.act(0, GATE, &mut qx, k).unwrap();
            let mut ex = x.clone();
            if let Some(seed) = opts.rht {
                let s = nvfp4::rht_signs(seed);
                ex.chunks_mut(BLOCK).for_each(|b| nvfp4::rht_block(b, &s));
            }
            nvfp4::fake_quantize_rows(&mut ex, k, 0.01, &Nvfp4Opts { rht: None, ..opts });
            for r in 0..rows {
                let a: f64 = (0..k).map(|j| qw[r * k + j] as f64 * qx[j] as f64).sum();
                let b: f64 = (0..k).map(|j| engine_w[r * k + j] as f64 * ex[j] as f64).sum();
                // Same rounded operands, rotated back: f32 rounding of the rotation only.
                assert!((a - b).abs() <= 1e-5 + 1e-4 * b.abs(), "{opts:?} row {r}: {a} vs {b}");
            }
            if opts.rht.is_none() {
                assert_eq!(qw, engine_w, "without the RHT the learner's weight is the engine's dequantized weight");
            }
        }
    }

    #[test]
    fn only_mlp_linears_and_multiples_of_16() {
        assert!(LearnerQuant::new(&["q_proj".into()], Nvfp4Opts::default(), 1)
            .unwrap_err()
            .to_string()
            .contains("attention"));
        let lq = LearnerQuant::new(&["down_proj".into()], Nvfp4Opts::default(), 1).unwrap();
        assert!(lq.on(DOWN) && !lq.on(GATE));
        let mut x = vec![1.0f32; 24];
        assert!(lq.act(0, DOWN, &mut x, 24).is_err());
    }
}
