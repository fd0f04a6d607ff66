//! The transformer for training on any device, op for op the twin of [`super::trainable`]
//! (whose f32 / f64 loops are its reference): the forward over packed sequences saving what
//! the backward needs in device tensors, the LM head's per-token statistics, the fused loss
//! pass and the backward of every layer into gradients in parameter order — built from the op
//! rooms' device-level training ops (`ops::{linear, norm, rope, attention::train, elementwise,
//! lm_head}`), so on a CUDA device nothing but the batch's token ids, the per-token
//! coefficients and the per-token results crosses to the host.
//!
//! The NVFP4 learner (`set_quant`): the chosen MLP linears run on the learner's rounded
//! operands (`ops::quantize::learner_round`): through the CUTLASS block-scaled W4A4 GEMM where
//! the device has one (sm_100a / sm_103a; the simulator's sm_100a profile), else the emulated
//! path (Hopper: the rounded copies through the BF16/F32 GEMM); straight-through backward —
//! as the CPU twin. The activations come from the caching allocator (blocks reused between
//! steps); the memory plan reserves [`DeviceTrainable::activation_bytes`] for them.
//!
//! Owns: [`DeviceTrainable`] (RoPE frequencies and saved activations on the device). May call:
//! the ops' device-level signatures. Must not: own weights or optimizer state.

use super::config::ModelConfig;
use super::learner_quant::{LearnerQuant, DOWN, GATE, UP};
use super::trainable::{indices, Indices, TrainBatch};
use crate::device::{DType, Device, Tensor};
use crate::ops::attention::grad::Shape;
use crate::ops::attention::train::{self as attention, Packed};
use crate::ops::lm_head::{self, DevCenter, Rows};
use crate::ops::{elementwise, linear, norm, quantize, rope};
use crate::quant::nvfp4::Global;
use anyhow::{bail, Result};

/// One layer's saved activations (device tensors).
struct Acts {
    x: Tensor,           // (N, C) layer input
    rstd1: Tensor,       // (N)
    h1: Tensor,          // (N, C)
    qraw: Tensor,        // (N, H*D) before q-norm / RoPE
    kraw: Tensor,        // (N, Hkv*D)
    rq: Tensor,          // (N*H) q-norm 1/rms
    rk: Tensor,          // (N*Hkv)
    q: Tensor,           // (N, H*D) after RoPE
    k: Tensor,           // (N, Hkv*D)
    v: Tensor,           // (N, Hkv*D)
    att: Tensor,         // (N, H*D)
    lse: Tensor,         // (N, H)
    x2: Tensor,          // (N, C) after the attention residual
    rstd2: Tensor,       // (N)
    h2: Tensor,          // (N, C)
    g: Tensor,           // (N, I)
    u: Tensor,           // (N, I)
    a: Tensor,           // (N, I)
    h2q: Option<Tensor>, // (N, C) NVFP4 learner: Q(h2), the gate/up input
    aq: Option<Tensor>,  // (N, I) NVFP4 learner: Q(a), the down input
}

/// The batch on the device.
struct DevBatch {
    n: usize,
    tokens: Tensor,      // (N) u32
    cu: Tensor,          // (B+1) u32
    cu_host: Vec<usize>, // (B+1) the same offsets, on the host
    rows: Tensor,        // (M) u32
    targets: Tensor,     // (M) u32
}

pub struct DeviceTrainable {
    pub cfg: ModelConfig,
    dev: Device,
    ix: Indices,
    inv_freq: Tensor, // (D/2) f32
    acts: Vec<Acts>,
    cos: Tensor,   // (N, D/2)
    sin: Tensor,   // (N, D/2)
    xf: Tensor,    // (N, C) final residual stream
    rstdf: Tensor, // (N)
    hf: Tensor,    // (N, C) final normed hidden states
    batch: Option<DevBatch>,
    quant: Option<LearnerQuant>,
    /// Per layer, the NVFP4 learner's rounded gate, up, down weights (F32, of the weights'
    /// shapes) as of the last forward.
    qw: Vec<[Option<Tensor>; 3]>,
}

/// `v` as a u32 tensor on `dev` (no copy on CPU).
fn up(dev: &Device, v: Vec<u32>) -> Result<Tensor> {
    dev.upload(Tensor::from_u32_host(&[v.len()], v)?)
}

impl DeviceTrainable {
    /// Peak device bytes of one micro-batch of `tokens` tokens (f32 throughout): what
    /// [`Self::forward`] saves (every layer's `Acts`, the final stream, the RoPE tables, the
    /// batch's ids), the backward's working buffers, and the fused loss's chunk of logits with
    /// its gathered rows — what the memory plan reserves before it sizes the KV caches. The
    /// BF16 operand copies of the GEMMs (one (tokens, max(C, I, H·D)) at a time) are counted.
    /// With the NVFP4 learner (`nvfp4`), its rounded MLP inputs per token and rounded MLP
    /// weights per layer besides.
    pub fn activation_bytes(cfg: &ModelConfig, tokens: usize, chunk: usize, nvfp4: bool) -> usize {
        let (c, i, h, hkv, d) = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let (qd, kd) = (h * d, hkv * d);
        // Saved per layer: x h1 x2 h2 | qraw q att | kraw k v | rq lse rk | rstd1 rstd2 | g u a.
        let layer = 4 * c + 3 * qd + 3 * kd + 2 * h + hkv + 2 + 3 * i;
        // Final stream and norm (xf hf rstdf), RoPE tables (cos sin), tokens positions rows targets.
        let once = 2 * c + 1 + d + 4;
        // Backward: dh dx dh2 dh1 | da dg du | datt dq dqr | dk dv dkr.
        let bwd = 4 * c + 3 * i + 3 * qd + 3 * kd;
        let per_token = 4 * (cfg.num_layers * layer + once + bwd) + 2 * c.max(i).max(qd);
        let rows = chunk.min(tokens);
        let learner = if nvfp4 { cfg.num_layers * 4 * (tokens * (c + i) + 3 * c * i) } else { 0 };
        tokens * per_token + 4 * rows * (cfg.vocab_size + 2 * c) + learner
    }

    /// Runs the chosen MLP linears on the NVFP4 learner's rounded operands (None: off).
    pub fn set_quant(&mut self, q: Option<LearnerQuant>) {
        self.qw = (0..self.cfg.num_layers).map(|_| Default::default()).collect();
        self.quant = q;
    }

    pub fn new(cfg: &ModelConfig, dev: &Device) -> Result<DeviceTrainable> {
        let f = super::rope::inv_freq(&cfg.rope, cfg.head_dim);
        let z = |shape: &[usize]| dev.zeros(DType::F32, shape);
        Ok(DeviceTrainable {
            cfg: cfg.clone(),
            dev: dev.clone(),
            ix: indices(cfg),
            inv_freq: dev.from_f32(DType::F32, &[f.len()], &f)?,
            acts: Vec::new(),
            cos: z(&[1])?,
            sin: z(&[1])?,
            xf: z(&[1])?,
            rstdf: z(&[1])?,
            hf: z(&[1])?,
            batch: None,
            quant: None,
            qw: Vec::new(),
        })
    }

    /// An activation the next kernel writes whole (no memset on a GPU; poison on cuda-sim).
    fn uninit(&self, shape: &[usize]) -> Result<Tensor> {
        self.dev.uninit(DType::F32, shape)
    }

    /// Forward over `b` with parameters `p` (device tensors in `param_specs` order). Saves the
    /// activations.
    pub fn forward(&mut self, p: &[&Tensor], b: &TrainBatch) -> Result<()> {
        let cfg = self.cfg.clone();
        let n_params = super::weights::param_specs(&cfg).len();
        if p.len() != n_params {
            bail!("forward: {} parameter tensors for {n_params} parameters", p.len());
        }
        let (c, i_dim, h, hkv, d) =
            (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let (qd, kd) = (h * d, hkv * d);
        let n = b.tokens.len();
        if n == 0 || b.cu.last() != Some(&n) {
            bail!("forward: malformed batch ({} tokens, cu {:?})", n, b.cu.last());
        }
        if let Some(t) = b.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            bail!("forward: token {t} outside the vocabulary ({})", cfg.vocab_size);
        }
        let dev = self.dev.clone();
        let eps = cfg.rms_norm_eps as f32;
        // The previous micro-batch's activations go back to the allocator first: at most one
        // micro-batch's set is alive.
        self.acts.clear();
        self.batch = None;
        let batch = DevBatch {
            n,
            tokens: up(&dev, b.tokens.clone())?,
            cu: up(&dev, b.cu.iter().map(|&x| x as u32).collect())?,
            cu_host: b.cu.clone(),
            rows: up(&dev, b.rows.clone())?,
            targets: up(&dev, b.targets.clone())?,
        };
        let positions = up(&dev, b.positions.clone())?;
        self.cos = self.uninit(&[n, d / 2])?;
        self.sin = self.uninit(&[n, d / 2])?;
        rope::rope_table(&dev, &positions, &self.inv_freq, &mut self.cos, &mut self.sin, n)?;
        let shape = Shape { heads: h, kv_heads: hkv, head_dim: d };
        let mut x = self.uninit(&[n, c])?;
        elementwise::embedding(&dev, p[self.ix.embed], &batch.tokens, &mut x, n)?;
        let mut acts = Vec::with_capacity(cfg.num_layers);
        let lq = self.quant.clone();
        for li in &self.ix.layers {
            // Every buffer of the layer is written whole by the kernel that first touches it.
            let z = |shape: &[usize]| dev.uninit(DType::F32, shape);
            let mut a = Acts {
                x,
                rstd1: z(&[n])?,
                h1: z(&[n, c])?,
                qraw: z(&[n, qd])?,
                kraw: z(&[n, kd])?,
                rq: z(&[n * h])?,
                rk: z(&[n * hkv])?,
                q: z(&[n, qd])?,
                k: z(&[n, kd])?,
                v: z(&[n, kd])?,
                att: z(&[n, qd])?,
                lse: z(&[n, h])?,
                x2: z(&[n, c])?,
                rstd2: z(&[n])?,
                h2: z(&[n, c])?,
                g: z(&[n, i_dim])?,
                u: z(&[n, i_dim])?,
                a: z(&[n, i_dim])?,
                h2q: None,
                aq: None,
            };
            let bias = |i: Option<usize>| i.map(|i| p[i]);
            norm::rmsnorm_train(&dev, &a.x, p[li.ln1], eps, &mut a.h1, &mut a.rstd1, n)?;
            linear::linear(&dev, &a.h1, p[li.q], bias(li.qb), &mut a.qraw, n, false)?;
            linear::linear(&dev, &a.h1, p[li.k], bias(li.kb), &mut a.kraw, n, false)?;
            linear::linear(&dev, &a.h1, p[li.v], bias(li.vb), &mut a.v, n, false)?;
            match (li.qn, li.kn) {
                (Some(qn), Some(kn)) => {
                    for (raw, out, rs, heads, w) in
                        [(&mut a.qraw, &mut a.q, &mut a.rq, h, p[qn]), (&mut a.kraw, &mut a.k, &mut a.rk, hkv, p[kn])]
                    {
                        raw.reshape(&[n * heads, d])?;
                        out.reshape(&[n * heads, d])?;
                        norm::rmsnorm_train(&dev, raw, w, eps, out, rs, n * heads)?;
                        raw.reshape(&[n, heads * d])?;
                        out.reshape(&[n, heads * d])?;
                    }
                }
                _ => {
                    a.q.copy_from(&a.qraw)?;
                    a.k.copy_from(&a.kraw)?;
                }
            }
            rope::rope(&dev, &mut a.q, &self.cos, &self.sin, n, h)?;
            rope::rope(&dev, &mut a.k, &self.cos, &self.sin, n, hkv)?;
            let packed = Packed { q: &a.q, k: &a.k, v: &a.v, cu: &batch.cu, offsets: &batch.cu_host };
            // Low-precision compute weights: the tensor-core forward and backward (BF16
            // operands, as the linears' GEMMs); F32 weights keep the exact CUDA-core kernels.
            if p[li.q].dtype() != DType::F32 && attention::tensor_cores_fit(&shape) {
                attention::fwd_tensor_cores(&dev, &shape, &packed, &mut a.att, &mut a.lse)?;
            } else {
                attention::fwd(&dev, &shape, &packed, &mut a.att, &mut a.lse)?;
            }
            // x2 = x + att·Woᵀ (+ bo)
            a.x2.copy_from(&a.x)?;
            linear::linear(&dev, &a.att, p[li.o], bias(li.ob), &mut a.x2, n, true)?;
            norm::rmsnorm_train(&dev, &a.x2, p[li.ln2], eps, &mut a.h2, &mut a.rstd2, n)?;
            // The NVFP4 learner: the chosen MLP linears on rounded weights and inputs — on
            // their codes (written by the same launches as the rounded copies the backward
            // reads) through the CUTLASS W4A4 GEMM or, on Hopper, a BF16 GEMM of the decoded
            // unit values; on the CPU on the rounded copies.
            let l = acts.len();
            let mut wc: [Option<quantize::LearnerCodes>; 3] = Default::default();
            let (mut xc, mut ac) = (None, None);
            if let Some(q) = &lq {
                for (j, (lin, w)) in [(GATE, li.gate), (UP, li.up), (DOWN, li.down)].into_iter().enumerate() {
                    self.qw[l][j] = match q.on(lin) {
                        true => {
                            let (rows, k) = (p[w].dim(0), p[w].dim(1));
                            let mut t = dev.uninit(DType::F32, &[rows, k])?;
                            let fast = linear::learner_w4a4_here(&dev, rows, k);
                            wc[j] =
                                quantize::learner_round_codes(&dev, p[w], &mut t, rows, Global::Tensor, &q.opts, fast)?;
                            Some(t)
                        }
                        false => None,
                    };
                }
                if q.on(GATE) || q.on(UP) {
                    let mut t = dev.uninit(DType::F32, &[n, c])?;
                    let g = q.act_global(l, if q.on(GATE) { GATE } else { UP });
                    let fast = wc[0].is_some() || wc[1].is_some();
                    xc = quantize::learner_round_codes(&dev, &a.h2, &mut t, n, g, &q.opts, fast)?;
                    a.h2q = Some(t);
                }
            }
            let qw = &self.qw;
            let wq = |j: usize, dense: usize| qw.get(l).and_then(|w| w[j].as_ref()).unwrap_or(p[dense]);
            let on = |i: usize| lq.as_ref().is_some_and(|q| q.on(i));
            let xg = if on(GATE) { a.h2q.as_ref().unwrap_or(&a.h2) } else { &a.h2 };
            let xu = if on(UP) { a.h2q.as_ref().unwrap_or(&a.h2) } else { &a.h2 };
            // One of the MLP's linears: W4A4 on the codes when both operands have them.
            let lin = |x: &Tensor,
                       xc: &Option<quantize::LearnerCodes>,
                       j: usize,
                       dense: usize,
                       b: Option<&Tensor>,
                       y: &mut Tensor,
                       acc: bool|
             -> Result<()> {
                if let (Some(xc), Some(wc)) = (xc, &wc[j]) {
                    if linear::learner_w4a4(&dev, xc, wc, b, y, acc)? {
                        return Ok(());
                    }
                }
                linear::linear(&dev, x, wq(j, dense), b, y, n, acc)
            };
            lin(xg, if on(GATE) { &xc } else { &None }, 0, li.gate, bias(li.gb), &mut a.g, false)?;
            lin(xu, if on(UP) { &xc } else { &None }, 1, li.up, bias(li.ub), &mut a.u, false)?;
            elementwise::swiglu(&dev, &a.g, &a.u, &mut a.a, n)?;
            if let (Some(q), true) = (&lq, on(DOWN)) {
                let mut t = dev.uninit(DType::F32, &[n, i_dim])?;
                ac = quantize::learner_round_codes(
                    &dev,
                    &a.a,
                    &mut t,
                    n,
                    q.act_global(l, DOWN),
                    &q.opts,
                    wc[2].is_some(),
                )?;
                a.aq = Some(t);
            }
            // x = x2 + a·Wdᵀ (+ bd)
            x = dev.uninit(DType::F32, &[n, c])?;
            x.copy_from(&a.x2)?;
            lin(a.aq.as_ref().unwrap_or(&a.a), &ac, 2, li.down, bias(li.db), &mut x, true)?;
            acts.push(a);
        }
        self.acts = acts;
        self.rstdf = self.uninit(&[n])?;
        self.hf = self.uninit(&[n, c])?;
        norm::rmsnorm_train(&dev, &x, p[self.ix.norm_f], eps, &mut self.hf, &mut self.rstdf, n)?;
        self.xf = x;
        self.batch = Some(batch);
        Ok(())
    }

    /// Returns the saved activations to the allocator (between steps, while the engine decodes).
    pub fn release(&mut self) {
        self.acts.clear();
        self.batch = None;
    }

    fn batch(&self) -> Result<&DevBatch> {
        self.batch.as_ref().ok_or_else(|| anyhow::anyhow!("no forward before the loss pass"))
    }

    /// logp and entropy (M) of the batch's scored rows at temperature `t`, after
    /// [`Self::forward`] (f32 tensors on the device).
    pub fn token_stats(
        &self,
        p: &[&Tensor],
        t: f32,
        chunk: usize,
        logp: &mut Tensor,
        entropy: &mut Tensor,
    ) -> Result<()> {
        let b = self.batch()?;
        let r = Rows { rows: &b.rows, targets: &b.targets };
        lm_head::stats(&self.dev, &self.hf, p[self.ix.head], &r, t, chunk, logp, entropy)
    }

    /// The fused loss pass and the backward of every layer: gradients of Σ_i −coef_i·logp_i
    /// (with `center`: the centered score) accumulated into `grads` (f32 device tensors in
    /// parameter order). Returns that loss value.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &mut self,
        p: &[&Tensor],
        coef: &Tensor,
        center: Option<&DevCenter<'_>>,
        t: f32,
        chunk: usize,
        grads: &mut [Tensor],
    ) -> Result<f64> {
        let cfg = self.cfg.clone();
        let (c, i_dim, h, hkv, d) =
            (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let (qd, kd) = (h * d, hkv * d);
        let dev = self.dev.clone();
        let b = self.batch.take().ok_or_else(|| anyhow::anyhow!("backward: no forward before it"))?;
        let n = b.n;
        // The loss pass scatter-adds into dh (its unscored rows stay zero); every other buffer
        // is written whole by its first kernel of each layer.
        let z = |shape: &[usize]| dev.uninit(DType::F32, shape);
        // LM head + loss.
        let mut dh = dev.zeros(DType::F32, &[n, c])?;
        let r = Rows { rows: &b.rows, targets: &b.targets };
        let head = self.ix.head;
        let loss = lm_head::loss_grad(&dev, &self.hf, p[head], &r, coef, center, t, chunk, &mut dh, &mut grads[head])?;
        // Final norm.
        let mut dx = z(&[n, c])?;
        let nf = self.ix.norm_f;
        norm::rmsnorm_bwd(&dev, &dh, &self.xf, p[nf], &self.rstdf, &mut dx, false, &mut grads[nf], n)?;
        let shape = Shape { heads: h, kv_heads: hkv, head_dim: d };
        let (mut da, mut dg, mut du) = (z(&[n, i_dim])?, z(&[n, i_dim])?, z(&[n, i_dim])?);
        let (mut dh2, mut datt, mut dh1) = (z(&[n, c])?, z(&[n, qd])?, z(&[n, c])?);
        let (mut dq, mut dk, mut dv) = (z(&[n, qd])?, z(&[n, kd])?, z(&[n, kd])?);
        let (mut dqr, mut dkr) = (z(&[n, qd])?, z(&[n, kd])?);
        // The weight gradients' operands: BF16 where the compute weight is BF16 (tensor cores,
        // FP32 accumulation: the forward and the data gradients already round their inputs to
        // the weight's dtype), F32 for F32 weights and for the NVFP4 learner's rounded operands
        // (not BF16 values). At Qwen2.5-7B's shapes F32 weight gradients were 6.8 of a
        // modelled 9.0 s train phase on an H200 (`bench node --model-gpu h200 --ledger`).
        let wgrad =
            |w: &Tensor, rounded: bool| if w.dtype() == DType::BF16 && !rounded { DType::BF16 } else { DType::F32 };
        for l in (0..cfg.num_layers).rev() {
            let li = self.ix.layers[l];
            let a = &mut self.acts[l];
            // MLP: x_out = x2 + down(a). Linears of the NVFP4 learner use their rounded operands
            // (straight-through estimator), as the CPU twin.
            let qw = self.qw.get(l);
            let wq = |j: usize, dense: usize| qw.and_then(|w| w[j].as_ref()).unwrap_or(p[dense]);
            let (rg, ru) = (qw.is_some_and(|w| w[0].is_some()), qw.is_some_and(|w| w[1].is_some()));
            let xg = a.h2q.as_ref().filter(|_| rg).unwrap_or(&a.h2);
            let xu = a.h2q.as_ref().filter(|_| ru).unwrap_or(&a.h2);
            linear::linear_dx(&dev, &dx, wq(2, li.down), &mut da, n, false)?;
            linear::linear_dw(
                &dev,
                &dx,
                a.aq.as_ref().unwrap_or(&a.a),
                &mut grads[li.down],
                n,
                true,
                wgrad(p[li.down], a.aq.is_some()),
            )?;
            if let Some(bi) = li.db {
                linear::bias_grad(&dev, &dx, &mut grads[bi], n)?;
            }
            elementwise::swiglu_bwd(&dev, &da, &a.g, &a.u, &mut dg, &mut du)?;
            linear::linear_dx(&dev, &dg, wq(0, li.gate), &mut dh2, n, false)?;
            linear::linear_dx(&dev, &du, wq(1, li.up), &mut dh2, n, true)?;
            linear::linear_dw(&dev, &dg, xg, &mut grads[li.gate], n, true, wgrad(p[li.gate], rg && a.h2q.is_some()))?;
            linear::linear_dw(&dev, &du, xu, &mut grads[li.up], n, true, wgrad(p[li.up], ru && a.h2q.is_some()))?;
            if let Some(bi) = li.gb {
                linear::bias_grad(&dev, &dg, &mut grads[bi], n)?;
            }
            if let Some(bi) = li.ub {
                linear::bias_grad(&dev, &du, &mut grads[bi], n)?;
            }
            norm::rmsnorm_bwd(&dev, &dh2, &a.x2, p[li.ln2], &a.rstd2, &mut dx, true, &mut grads[li.ln2], n)?;
            // Attention block: x2 = x + o(att).
            linear::linear_dx(&dev, &dx, p[li.o], &mut datt, n, false)?;
            linear::linear_dw(&dev, &dx, &a.att, &mut grads[li.o], n, true, wgrad(p[li.o], false))?;
            if let Some(bi) = li.ob {
                linear::bias_grad(&dev, &dx, &mut grads[bi], n)?;
            }
            let packed = Packed { q: &a.q, k: &a.k, v: &a.v, cu: &b.cu, offsets: &b.cu_host };
            if p[li.q].dtype() != DType::F32 && attention::tensor_cores_fit(&shape) {
                attention::bwd_tensor_cores(&dev, &shape, &packed, &a.att, &a.lse, &datt, &mut dq, &mut dk, &mut dv)?;
            } else {
                attention::bwd(&dev, &shape, &packed, &a.att, &a.lse, &datt, &mut dq, &mut dk, &mut dv)?;
            }
            rope::rope_bwd(&dev, &mut dq, &self.cos, &self.sin, n, h)?;
            rope::rope_bwd(&dev, &mut dk, &self.cos, &self.sin, n, hkv)?;
            match (li.qn, li.kn) {
                (Some(qn), Some(kn)) => {
                    for (g, raw, rs, out, heads, wi) in [
                        (&mut dq, &mut a.qraw, &a.rq, &mut dqr, h, qn),
                        (&mut dk, &mut a.kraw, &a.rk, &mut dkr, hkv, kn),
                    ] {
                        for t in [&mut *g, &mut *raw, &mut *out] {
                            t.reshape(&[n * heads, d])?;
                        }
                        norm::rmsnorm_bwd(&dev, g, raw, p[wi], rs, out, false, &mut grads[wi], n * heads)?;
                        for t in [g, raw, out] {
                            t.reshape(&[n, heads * d])?;
                        }
                    }
                }
                _ => {
                    dqr.copy_from(&dq)?;
                    dkr.copy_from(&dk)?;
                }
            }
            linear::linear_dx(&dev, &dqr, p[li.q], &mut dh1, n, false)?;
            linear::linear_dx(&dev, &dkr, p[li.k], &mut dh1, n, true)?;
            linear::linear_dx(&dev, &dv, p[li.v], &mut dh1, n, true)?;
            linear::linear_dw(&dev, &dqr, &a.h1, &mut grads[li.q], n, true, wgrad(p[li.q], false))?;
            linear::linear_dw(&dev, &dkr, &a.h1, &mut grads[li.k], n, true, wgrad(p[li.k], false))?;
            linear::linear_dw(&dev, &dv, &a.h1, &mut grads[li.v], n, true, wgrad(p[li.v], false))?;
            for (bi, g) in [(li.qb, &dqr), (li.kb, &dkr), (li.vb, &dv)] {
                if let Some(bi) = bi {
                    linear::bias_grad(&dev, g, &mut grads[bi], n)?;
                }
            }
            norm::rmsnorm_bwd(&dev, &dh1, &a.x, p[li.ln1], &a.rstd1, &mut dx, true, &mut grads[li.ln1], n)?;
        }
        let embed = self.ix.embed;
        elementwise::embed_bwd(&dev, &b.tokens, &dx, &mut grads[embed], n, cfg.pad_token_id)?;
        self.batch = Some(b);
        Ok(loss)
    }
}

#[cfg(test)]
mod tests {
    //! The device twin against the f64 reference (`Trainable<f64>` on the same values) on the
    //! CPU and on cuda-sim: token statistics within 1e-4 + 1e-4·|ref|, the loss within 1e-4
    //! relative, and every parameter's gradient within a relative norm error of 1e-4 (f32 ops
    //! in other orders against f64), for llama (llama3 RoPE, untied head), qwen2 (q/k/v biases,
    //! tied head) and qwen3 (q/k norm), with and without score centering.
    use super::*;
    use crate::model::learner_quant::{LearnerQuant, DOWN};
    use crate::model::tiny::{tiny_config, TinySpec};
    use crate::model::trainable::Trainable;
    use crate::model::weights::param_specs;
    use crate::ops::lm_head::grad::Center;

    fn data(n: usize, seed: u64, std: f64, mean: f64) -> Vec<f32> {
        let mut s = crate::rand::Stream::new(seed, 11);
        (0..n).map(|_| (mean + s.normal() * std) as f32).collect()
    }

    /// Random parameters: norm gains near 1, the rest centered, seeded by `seed` + index.
    fn random_params(specs: &[(String, Vec<usize>)], seed: u64) -> Vec<Vec<f32>> {
        specs
            .iter()
            .enumerate()
            .map(|(i, (name, shape))| {
                let n: usize = shape.iter().product();
                if name.ends_with("norm.weight") || name.ends_with("layernorm.weight") {
                    data(n, seed + i as u64, 0.1, 1.0)
                } else {
                    data(n, seed + i as u64, 0.2, 0.0)
                }
            })
            .collect()
    }

    fn batch() -> TrainBatch {
        let mut b = TrainBatch::default();
        b.push(&[5, 17, 3], &[44, 2, 90, 13]);
        b.push(&[7], &[1, 96, 30, 30, 8, 61, 12, 5, 40, 77, 3]);
        b
    }

    fn check(arch: &str, dev: &Device, centered: bool) {
        let spec = TinySpec {
            arch: arch.into(),
            layers: 2,
            hidden: 32,
            heads: 4,
            kv_heads: 2,
            head_dim: Some(8),
            intermediate: Some(48),
            vocab: 300,
            max_position: 64,
            tie: arch == "qwen2",
        };
        let cfg = tiny_config(&spec).unwrap();
        let specs = param_specs(&cfg);
        let params = random_params(&specs, 100);
        let b = batch();
        let m = b.rows.len();
        let coef = data(m, 7, 1.0, 0.0);
        let k = 3;
        let ids: Vec<u32> = (0..(m * k) as u32).map(|i| (i * 37 + 1) % 300).collect();
        let probs: Vec<f32> = (0..m * k).map(|i| [0.6, 0.3, 0.1][i % k]).collect();
        // The f64 reference.
        let p64: Vec<Vec<f64>> = params.iter().map(|v| v.iter().map(|&x| x as f64).collect()).collect();
        let mut r = Trainable::<f64>::new(&cfg);
        let refs: Vec<&[f64]> = p64.iter().map(|v| &v[..]).collect();
        r.forward(&refs, &b).unwrap();
        let (mut lp64, mut en64) = (vec![0.0; m], vec![0.0; m]);
        r.token_stats(&refs, &b, 0.8, 4, &mut lp64, &mut en64);
        let mut g64: Vec<Vec<f64>> = p64.iter().map(|v| vec![0.0; v.len()]).collect();
        let c64: Vec<f64> = coef.iter().map(|&x| x as f64).collect();
        let ct = Center { k, ids: &ids, probs: &probs };
        let loss64 = r.backward_centered(&refs, &b, &c64, centered.then_some(&ct), 0.8, 4, &mut g64).unwrap();
        // The device twin.
        let pt: Vec<Tensor> =
            specs.iter().zip(&params).map(|((_, s), v)| dev.from_f32(DType::F32, s, v).unwrap()).collect();
        let pr: Vec<&Tensor> = pt.iter().collect();
        let mut t = DeviceTrainable::new(&cfg, dev).unwrap();
        t.forward(&pr, &b).unwrap();
        let (mut lp, mut en) = (dev.zeros(DType::F32, &[m]).unwrap(), dev.zeros(DType::F32, &[m]).unwrap());
        t.token_stats(&pr, 0.8, 4, &mut lp, &mut en).unwrap();
        let what = format!("{} {arch} centered {centered}", dev.name());
        for (name, got, want) in [("logp", &lp, &lp64), ("entropy", &en, &en64)] {
            for (i, (&g, &w)) in got.to_f32_vec().unwrap().iter().zip(want).enumerate() {
                assert!((g as f64 - w).abs() <= 1e-4 + 1e-4 * w.abs(), "{what}: {name}[{i}] {g} vs {w}");
            }
        }
        let mut grads: Vec<Tensor> = specs.iter().map(|(_, s)| dev.zeros(DType::F32, s).unwrap()).collect();
        let coef_t = dev.from_f32(DType::F32, &[m], &coef).unwrap();
        let ids_t = up(dev, ids.clone()).unwrap();
        let probs_t = dev.from_f32(DType::F32, &[m * k], &probs).unwrap();
        let dc = DevCenter { k, ids: &ids_t, probs: &probs_t };
        let loss = t.backward(&pr, &coef_t, centered.then_some(&dc), 0.8, 4, &mut grads).unwrap();
        assert!((loss - loss64).abs() <= 1e-4 * loss64.abs().max(1.0), "{what}: loss {loss} vs {loss64}");
        for ((name, _), (g, w)) in specs.iter().zip(grads.iter().zip(&g64)) {
            let g = g.to_f32_vec().unwrap();
            let diff: f64 = g.iter().zip(w).map(|(&a, &b)| (a as f64 - b).powi(2)).sum::<f64>().sqrt();
            let norm: f64 = w.iter().map(|b| b * b).sum::<f64>().sqrt();
            assert!(norm > 0.0, "{what}: {name} has no gradient in the reference");
            assert!(diff <= 1e-4 * norm, "{what}: {name} relative gradient error {:e}", diff / norm);
        }
    }

    /// The NVFP4 learner on the device twin against the CPU twin (`Trainable<f32>` with the same
    /// `LearnerQuant`, itself checked against finite differences in tests/grad_nvfp4.rs): the
    /// loss within 1e-4 relative and every gradient within 1e-3 relative norm (f32 against f32
    /// in other orders; a value within rounding of an NVFP4 decision boundary may round the
    /// other way). The quantized MLP weights' gradients differ from the dense model's by ≥ 5%
    /// in norm, so the check sees the learner. All MLP linears, RHT and stochastic rounding,
    /// per-token scales for gate/up and a fixed scale for down.
    fn check_nvfp4(dev: &Device) {
        use crate::quant::nvfp4::Nvfp4Opts;
        let spec = TinySpec {
            arch: "qwen3".into(),
            layers: 2,
            hidden: 32,
            heads: 4,
            kv_heads: 2,
            head_dim: Some(8),
            intermediate: Some(48),
            vocab: 300,
            max_position: 64,
            tie: false,
        };
        let cfg = tiny_config(&spec).unwrap();
        let specs = param_specs(&cfg);
        let params = random_params(&specs, 200);
        let b = batch();
        let m = b.rows.len();
        let coef = data(m, 8, 1.0, 0.0);
        let names: Vec<String> = ["gate_proj", "up_proj", "down_proj"].iter().map(|s| s.to_string()).collect();
        let opts = Nvfp4Opts { rht: Some(3), stochastic: Some(9) };
        let mut lq = LearnerQuant::new(&names, opts, cfg.num_layers).unwrap();
        for l in 0..cfg.num_layers {
            lq.act_global[l][DOWN] = Some(0.002);
        }
        let refs: Vec<&[f32]> = params.iter().map(|v| &v[..]).collect();
        let cpu_grads = |q: Option<LearnerQuant>| {
            let mut r = Trainable::<f32>::new(&cfg);
            r.set_quant(q);
            r.forward(&refs, &b).unwrap();
            let mut g: Vec<Vec<f32>> = params.iter().map(|v| vec![0.0; v.len()]).collect();
            let loss = r.backward_centered(&refs, &b, &coef, None, 1.0, 4, &mut g).unwrap();
            (loss, g)
        };
        let (loss_ref, g_ref) = cpu_grads(Some(lq.clone()));
        let loss_ref = loss_ref as f64;
        let (_, g_dense) = cpu_grads(None);
        let pt: Vec<Tensor> =
            specs.iter().zip(&params).map(|((_, s), v)| dev.from_f32(DType::F32, s, v).unwrap()).collect();
        let pr: Vec<&Tensor> = pt.iter().collect();
        let mut t = DeviceTrainable::new(&cfg, dev).unwrap();
        t.set_quant(Some(lq));
        t.forward(&pr, &b).unwrap();
        let mut grads: Vec<Tensor> = specs.iter().map(|(_, s)| dev.zeros(DType::F32, s).unwrap()).collect();
        let coef_t = dev.from_f32(DType::F32, &[m], &coef).unwrap();
        let loss = t.backward(&pr, &coef_t, None, 1.0, 4, &mut grads).unwrap();
        let what = format!("{} nvfp4 learner", dev.name());
        assert!((loss - loss_ref).abs() <= 1e-4 * loss_ref.abs().max(1.0), "{what}: loss {loss} vs {loss_ref}");
        let rel = |a: &[f32], b: &[f32]| {
            let d: f64 = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y as f64).powi(2)).sum::<f64>().sqrt();
            d / b.iter().map(|&y| (y as f64).powi(2)).sum::<f64>().sqrt().max(1e-30)
        };
        for (i, (name, _)) in specs.iter().enumerate() {
            let g = grads[i].to_f32_vec().unwrap();
            let e = rel(&g, &g_ref[i]);
            assert!(e <= 1e-3, "{what}: {name} relative gradient error {e:e}");
            if name.contains("mlp") {
                let e = rel(&g, &g_dense[i]);
                assert!(e >= 0.05, "{what}: {name} is within {e:e} of the dense model's gradient");
            }
        }
    }

    #[test]
    fn nvfp4_learner_twin_cpu() {
        check_nvfp4(&Device::cpu(2).unwrap());
    }

    #[test]
    fn nvfp4_learner_twin_sim() {
        check_nvfp4(&Device::parse("cuda-sim:0").unwrap());
    }

    /// On the B300 profile the gate and up linears (K = 32) run on the CUTLASS W4A4 GEMM, the
    /// down linear (K = 48, not a multiple of 32) on a BF16 GEMM of its decoded codes.
    #[test]
    fn nvfp4_learner_twin_sim_cutlass() {
        check_nvfp4(&Device::Cuda(crate::device::cuda::CudaDevice::sim_arch(7, Some("sm_100a")).unwrap()));
    }

    fn every_arch(dev: &Device) {
        for arch in ["llama", "qwen2", "qwen3"] {
            for centered in [false, true] {
                check(arch, dev, centered);
            }
        }
    }

    #[test]
    fn device_twin_cpu() {
        every_arch(&Device::cpu(2).unwrap());
    }

    #[test]
    fn device_twin_sim() {
        every_arch(&Device::parse("cuda-sim:0").unwrap());
    }

    /// The memory plan's activation reserve covers what a step allocates beyond the weights:
    /// the forward's saved state, the loss pass and the backward of 16 sequences of 20 tokens
    /// on a device of its own (cuda-sim:3), measured by the allocator's high-water mark; and it
    /// is no more than twice that (the plan does not waste the KV cache's room).
    #[test]
    fn the_planned_activation_bytes_cover_a_step() {
        // An ordinal no other lib test opens (cuda-sim:7 is the sm_100a one).
        let dev = Device::Cuda(crate::device::cuda::CudaDevice::sim_arch(3, Some("sm_90a")).unwrap());
        let Device::Cuda(cd) = &dev else { panic!("a simulated CUDA device") };
        let spec = TinySpec {
            arch: "qwen3".into(),
            layers: 2,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            head_dim: Some(16),
            intermediate: Some(160),
            vocab: 300,
            max_position: 64,
            tie: false,
        };
        let cfg = tiny_config(&spec).unwrap();
        let specs = param_specs(&cfg);
        let pt: Vec<Tensor> = specs
            .iter()
            .enumerate()
            .map(|(i, (_, s))| dev.from_f32(DType::F32, s, &data(s.iter().product(), i as u64, 0.1, 0.0)).unwrap())
            .collect();
        let pr: Vec<&Tensor> = pt.iter().collect();
        let mut grads: Vec<Tensor> = specs.iter().map(|(_, s)| dev.zeros(DType::F32, s).unwrap()).collect();
        let mut b = TrainBatch::default();
        for i in 0..16u32 {
            b.push(&[1 + i, 2, 3, 4, 5], &(0..15).map(|j| (i * 7 + j * 3) % 300).collect::<Vec<_>>());
        }
        let (n, m, chunk) = (b.tokens.len(), b.rows.len(), 64);
        let coef = dev.from_f32(DType::F32, &[m], &data(m, 1, 1.0, 0.0)).unwrap();
        let (mut lp, mut en) = (dev.zeros(DType::F32, &[m]).unwrap(), dev.zeros(DType::F32, &[m]).unwrap());
        let mut t = DeviceTrainable::new(&cfg, &dev).unwrap();
        let (in_use, cached, _, _) = cd.memory();
        t.forward(&pr, &b).unwrap();
        t.token_stats(&pr, 1.0, chunk, &mut lp, &mut en).unwrap();
        t.backward(&pr, &coef, None, 1.0, chunk, &mut grads).unwrap();
        let used = cd.memory().2 - (in_use + cached);
        let planned = DeviceTrainable::activation_bytes(&cfg, n, chunk, false);
        eprintln!("{n} tokens: {used} bytes used, {planned} planned");
        assert!(used <= planned && planned <= 2 * used, "{n} tokens: {used} bytes used, {planned} planned");
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn device_twin_cuda() {
        every_arch(&Device::cuda(0).unwrap());
    }
}
