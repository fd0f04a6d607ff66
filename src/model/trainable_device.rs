//! The transformer for training on any device, op for op the twin of [`super::trainable`]
//! (whose f32 / f64 loops are its reference): the forward over packed sequences saving what
//! the backward needs in device tensors, the LM head's per-token statistics, the fused loss
//! pass and the backward of every layer into gradients in parameter order — built from the op
//! rooms' device-level training ops (`ops::{linear, norm, rope, attention::train, elementwise,
//! lm_head}`), so on a CUDA device nothing but the batch's token ids, the per-token
//! coefficients and the per-token results crosses to the host.
//!
//! The NVFP4 learner (`set_quant`): the chosen MLP linears run on the learner's rounded
//! operands (`ops::quantize::learner_round`): on CUDA on their codes, through the CUTLASS
//! block-scaled W4A4 GEMM where the device has one (sm_100a / sm_103a; the simulator's sm_100a
//! profile), else a BF16 GEMM of the decoded unit values (Hopper); straight-through backward.
//! With BF16 weights on CUDA the learner keeps only the codes and its backward
//! multiplies them again ([`LearnerKeep::Codes`]: BF16 GEMMs in the RHT's rotated domain);
//! with F32 weights, and on the CPU, it keeps the rounded f32 copies and multiplies them in
//! F32, as the CPU twin. The activations come from the caching allocator (blocks reused
//! between steps); the memory plan reserves [`DeviceTrainable::activation_bytes`] for them.
//! With activation checkpointing ([`DeviceTrainable::set_checkpointing`]) the forward keeps
//! each layer's input alone and the backward runs the layer's forward again first
//! (`DeviceTrainable::layer`, one function for both).
//!
//! Owns: [`DeviceTrainable`] (RoPE frequencies and saved activations on the device). May call:
//! the ops' device-level signatures. Must not: own weights or optimizer state.

use super::config::ModelConfig;
use super::learner_quant::{LearnerQuant, DOWN, GATE, UP};
use super::trainable::{indices, Indices, TrainBatch};
use crate::device::{DType, Device, Tensor};
use crate::ops::attention::grad::Shape;
use crate::ops::attention::train::{self as attention, Packed};
use crate::ops::linear::{GradProj, Proj};
use crate::ops::lm_head::{self, Coef, DevCenter, Rows};
use crate::ops::quantize::LearnerCodes;
use crate::ops::{elementwise, linear, norm, quantize, rope};
use crate::quant::nvfp4::Global;

mod operands;
use anyhow::{bail, Result};
pub use operands::{Bf16Operands, LearnerKeep};

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
    codes: Option<LayerCodes>,
}

/// What the forward keeps of one layer for the backward: everything, or with checkpointing
/// ([`DeviceTrainable::set_checkpointing`]) the layer's input alone (N, C).
enum Saved {
    Full(Box<Acts>),
    Input(Tensor),
    /// In the backward's hands for the moment.
    Gone,
}

/// The NVFP4 learner's operands of one layer as codes only ([`LearnerKeep::Codes`]): what its
/// forward multiplied and its backward multiplies again.
struct LayerCodes {
    w: [Option<LearnerCodes>; 3], // gate, up, down weights (I, C), (I, C), (C, I)
    h2: Option<LearnerCodes>,     // (N, C) the gate/up input
    a: Option<LearnerCodes>,      // (N, I) the down input
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
    acts: Vec<Saved>,
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
    /// `LearnerKeep::Rounded` whatever the weights (see [`Self::set_exact_learner`]).
    exact_learner: bool,
    /// Keep each layer's input only, and run the layer again in the backward.
    checkpoint: bool,
    /// On CUDA, the operands that only BF16 GEMMs read (the two norms' outputs, SwiGLU's, and
    /// SwiGLU's gradients) are written in BF16 by their producers instead of f32 rounded by
    /// each GEMM ([`Self::set_bf16_inputs`]).
    bf16_inputs: bool,
}

/// `v` as a u32 tensor on `dev` (no copy on CPU).
fn up(dev: &Device, v: Vec<u32>) -> Result<Tensor> {
    dev.upload(Tensor::from_u32_host(&[v.len()], v)?)
}

impl DeviceTrainable {
    /// Peak device bytes of one micro-batch of `tokens` tokens, the operands `ops` says in
    /// BF16 at 2 bytes a value and the rest f32 ([`Bf16Operands::of`] for the run's weights
    /// and learner: what [`Self::forward`] and the backward then allocate): what
    /// [`Self::forward`] saves (every layer's `Acts`, the final stream, the RoPE tables, the
    /// batch's ids), the backward's working buffers, and the fused loss's chunk of logits with
    /// its gathered rows — what the memory plan reserves before it sizes the KV caches. The
    /// BF16 operand copies of the GEMMs (one (tokens, max(C, I, H·D)) at a time) are counted.
    pub fn activation_bytes(
        cfg: &ModelConfig,
        tokens: usize,
        chunk: usize,
        keep: LearnerKeep,
        checkpoint: bool,
        ops: Bf16Operands,
    ) -> usize {
        let (c, i, h, hkv, d) = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let (qd, kd) = (h * d, hkv * d);
        // Bytes a token of n values: 2 in BF16, else 4.
        let b = |bf16: bool, n: usize| if bf16 { 2 * n } else { 4 * n };
        // Saved per layer: x x2 | qraw q att | kraw k v | rq lse rk | rstd1 rstd2 | g u in f32,
        // h1 h2 a in their dtypes, where qraw, kraw, rq and rk are empty without q/k-norm.
        let nr = cfg.qk_norm as usize;
        let layer = 4 * (2 * c + (2 + nr) * (qd + kd) + h + nr * (h + hkv) + 2 + 2 * i)
            + b(ops.h1, c)
            + b(ops.h2, c)
            + b(ops.a, i);
        // Final stream and norm (xf hf rstdf), RoPE tables (cos sin), tokens positions rows targets.
        let once = 2 * c + 1 + d + 4;
        // Backward: dh dx dh2 dh1 | da | datt dq dqr | dk dv dkr (dqr, dkr: with q/k-norm) in f32,
        // dg du in their dtype.
        let bwd = 4 * (4 * c + i + (2 + nr) * (qd + kd)) + 2 * b(ops.dmlp, i);
        let ls = cfg.num_layers;
        // Layers whose activations are alive at once, and the saved inputs of the others.
        // (The layer alive counts its own input in `layer`.)
        let (full, inputs) = if checkpoint { (1, ls.saturating_sub(1) * c) } else { (ls, 0) };
        let per_token = full * layer + 4 * (inputs + once) + bwd + 2 * c.max(i).max(qd);
        let rows = chunk.min(tokens);
        let values = tokens * (c + i) + 3 * c * i;
        // The learner's scratch (`linear::learner_*`): the products in f32 and the unit values
        // and roundings of dy in BF16, of both widths: freed blocks stay cached for the next
        // request of their size class, so each class counts (per token 4C + 4I for the
        // products, 2C + 2I for the unit values, 2C + 2I for a dy rounding of each width), and
        // the weights' unit values and f32 weight-gradient product.
        let scratch = 8 * tokens * (c + i) + 6 * c * i;
        let learner = match keep {
            LearnerKeep::Off => 0,
            // The rounded weights stay per layer (`qw`); the rounded inputs go with the layer.
            LearnerKeep::Rounded => 4 * (ls * 3 * c * i + full * tokens * (c + i)) + scratch,
            // Codes and block scales, and the amaxes (per token, per tensor).
            LearnerKeep::Codes => full * (values * 9 / 16 + 4 * (2 * tokens + 3)) + scratch,
        };
        // The loss pass's chunk: its logits, gathered rows and their gradient in f32, and with
        // a BF16 head the logits and rows rounded for its GEMMs.
        let head = 4 * rows * (cfg.vocab_size + 2 * c) + if ops.head { 2 * rows * (cfg.vocab_size + c) } else { 0 };
        tokens * per_token + head + learner
    }

    /// With BF16 weights on CUDA, keep the learner's rounded f32 copies and run its
    /// backward in F32 on them (`LearnerKeep::Rounded`, the CPU twin's arithmetic, at 4 bytes
    /// a value and on the CUDA cores) instead of multiplying its codes again in BF16: the
    /// reference the codes' backward is tested against.
    pub fn set_exact_learner(&mut self, on: bool) {
        self.exact_learner = on;
    }

    /// On CUDA (on by default): h1 (q, k, v's input), h2 (gate and up's) and a (down's) are
    /// written in BF16 by `rmsnorm_train` and `swiglu` where every linear that reads them has
    /// BF16 weights and no NVFP4 learner (which quantizes from the f32 values). Those GEMMs,
    /// forward and weight gradient, round their f32 input to BF16 first otherwise: the same
    /// values, so the same bits, without a `ct_cast` launch and its 6 bytes a value per GEMM
    /// and with half the producers' writes. Likewise in the backward, SwiGLU's gradients dg and
    /// du (the gate and up projections' dy) where those are dense BF16 linears without biases.
    /// Off: every activation and gradient f32 (the reference).
    pub fn set_bf16_inputs(&mut self, on: bool) {
        self.bf16_inputs = on;
    }

    /// Activation checkpointing: the forward keeps each layer's input (N, C) alone, and the
    /// backward runs each layer's forward again (without its down projection's output, which
    /// no gradient reads) before its backward. One more forward of the layers; at most one
    /// layer's activations alive ([`Self::activation_bytes`]). The gradients are the same bits.
    pub fn set_checkpointing(&mut self, on: bool) {
        self.checkpoint = on;
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
            exact_learner: false,
            bf16_inputs: true,
            checkpoint: false,
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
        let (c, d) = (cfg.hidden_size, cfg.head_dim);
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
        let mut x = self.uninit(&[n, c])?;
        elementwise::embedding(&dev, p[self.ix.embed], &batch.tokens, &mut x, n)?;
        let mut acts = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let (a, out) = self.layer(p, l, x, &batch, true)?;
            x = out.ok_or_else(|| anyhow::anyhow!("layer {l}: no output"))?;
            // Checkpointed: the layer's input alone; the backward runs the layer again.
            acts.push(if self.checkpoint { Saved::Input(a.x) } else { Saved::Full(Box::new(a)) });
        }
        self.acts = acts;
        self.rstdf = self.uninit(&[n])?;
        self.hf = self.uninit(&[n, c])?;
        norm::rmsnorm_train(&dev, &x, p[self.ix.norm_f], eps, &mut self.hf, &mut self.rstdf, n)?;
        self.xf = x;
        self.batch = Some(batch);
        Ok(())
    }

    /// Layer `l` over the batch from its input `x` (N, C): its saved activations, and with
    /// `out` its output (the next layer's input). The backward of a checkpointed forward
    /// calls it again on the saved input: the same launches on the same values, so the same
    /// bits.
    fn layer(
        &mut self,
        p: &[&Tensor],
        l: usize,
        x: Tensor,
        batch: &DevBatch,
        out: bool,
    ) -> Result<(Acts, Option<Tensor>)> {
        let cfg = &self.cfg;
        let (c, i_dim, h, hkv, d) =
            (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let (qd, kd) = (h * d, hkv * d);
        let (n, eps) = (batch.n, cfg.rms_norm_eps as f32);
        let dev = self.dev.clone();
        let shape = Shape { heads: h, kv_heads: hkv, head_dim: d };
        let li = self.ix.layers[l];
        let lq = self.quant.clone();
        // Every buffer of the layer is written whole by the kernel that first touches it.
        let z = |shape: &[usize]| dev.uninit(DType::F32, shape);
        // With q/k-norm the projections write the raw rows the norms read (and their backward
        // reads again); without, they write q and k themselves, which RoPE rotates in place,
        // and the raw rows are empty (no copy of q and k).
        let qk_norm = matches!((li.qn, li.kn), (Some(_), Some(_)));
        let raw = if qk_norm { n } else { 0 };
        // The GEMM-only inputs in BF16 where every reader is a dense BF16 linear
        // (`set_bf16_inputs`): h1 for q, k, v; h2 for gate and up; a for down.
        let ops = self.bf16_operands(p);
        let dt = |bf16: bool| if bf16 { DType::BF16 } else { DType::F32 };
        let (h1_dt, h2_dt, a_dt) = (dt(ops.h1), dt(ops.h2), dt(ops.a));
        let mut a = Acts {
            x,
            rstd1: z(&[n])?,
            h1: dev.uninit(h1_dt, &[n, c])?,
            qraw: z(&[raw, qd])?,
            kraw: z(&[raw, kd])?,
            rq: z(&[raw * h])?,
            rk: z(&[raw * hkv])?,
            q: z(&[n, qd])?,
            k: z(&[n, kd])?,
            v: z(&[n, kd])?,
            att: z(&[n, qd])?,
            lse: z(&[n, h])?,
            x2: z(&[n, c])?,
            rstd2: z(&[n])?,
            h2: dev.uninit(h2_dt, &[n, c])?,
            g: z(&[n, i_dim])?,
            u: z(&[n, i_dim])?,
            a: dev.uninit(a_dt, &[n, i_dim])?,
            h2q: None,
            aq: None,
            codes: None,
        };
        let bias = |i: Option<usize>| i.map(|i| p[i]);
        norm::rmsnorm_train(&dev, &a.x, p[li.ln1], eps, &mut a.h1, &mut a.rstd1, n)?;
        // q, k, v of one input (on CUDA it is rounded to the weights' dtype once).
        let proj = |w: usize, b: Option<usize>, y| Proj { w: p[w], panels: None, bias: bias(b), y };
        let (yq, yk) = if qk_norm { (&mut a.qraw, &mut a.kraw) } else { (&mut a.q, &mut a.k) };
        linear::linears(&dev, &a.h1, [proj(li.q, li.qb, yq), proj(li.k, li.kb, yk), proj(li.v, li.vb, &mut a.v)], n)?;
        if let (Some(qn), Some(kn)) = (li.qn, li.kn) {
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
        // x2 = x + att·Woᵀ (+ bo): the GEMM reads x and writes x2 (no copy of x).
        linear::linear_residual(&dev, &a.att, p[li.o], bias(li.ob), &a.x, &mut a.x2, n)?;
        norm::rmsnorm_train(&dev, &a.x2, p[li.ln2], eps, &mut a.h2, &mut a.rstd2, n)?;
        // The NVFP4 learner: the chosen MLP linears on rounded weights and inputs — on
        // their codes (written by the same launches as the rounded copies the backward
        // reads) through the CUTLASS W4A4 GEMM or, on Hopper, a BF16 GEMM of the decoded
        // unit values; on the CPU on the rounded copies.
        // With BF16 weights on CUDA only the codes are made (`LearnerKeep::Codes`).
        let mut wc: [Option<quantize::LearnerCodes>; 3] = Default::default();
        let (mut xc, mut ac) = (None, None);
        // `LearnerKeep::of` for the weights of the linears the learner is on (a model's
        // weights share one dtype, which the memory plan reads).
        let bf16 = lq.as_ref().is_some_and(|q| {
            [(GATE, li.gate), (UP, li.up), (DOWN, li.down)]
                .iter()
                .all(|&(i, w)| !q.on(i) || p[w].dtype() == DType::BF16)
        });
        let dtype = if bf16 { DType::BF16 } else { DType::F32 };
        let codes_only =
            !self.exact_learner && LearnerKeep::of(!dev.is_cpu(), dtype, lq.is_some()) == LearnerKeep::Codes;
        if let Some(q) = &lq {
            for (j, (lin, w)) in [(GATE, li.gate), (UP, li.up), (DOWN, li.down)].into_iter().enumerate() {
                self.qw[l][j] = match q.on(lin) {
                    true if codes_only => {
                        wc[j] = Some(quantize::learner_codes(&dev, p[w], p[w].dim(0), Global::Tensor, &q.opts)?);
                        None
                    }
                    true => {
                        let (rows, k) = (p[w].dim(0), p[w].dim(1));
                        let mut t = dev.uninit(DType::F32, &[rows, k])?;
                        let fast = linear::learner_w4a4_here(&dev, rows, k);
                        wc[j] = quantize::learner_round_codes(&dev, p[w], &mut t, rows, Global::Tensor, &q.opts, fast)?;
                        Some(t)
                    }
                    false => None,
                };
            }
            if q.on(GATE) || q.on(UP) {
                let g = q.act_global(l, if q.on(GATE) { GATE } else { UP });
                if codes_only {
                    xc = Some(quantize::learner_codes(&dev, &a.h2, n, g, &q.opts)?);
                } else {
                    let mut t = dev.uninit(DType::F32, &[n, c])?;
                    let fast = wc[0].is_some() || wc[1].is_some();
                    xc = quantize::learner_round_codes(&dev, &a.h2, &mut t, n, g, &q.opts, fast)?;
                    a.h2q = Some(t);
                }
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
        if on(GATE) || on(UP) {
            lin(xg, if on(GATE) { &xc } else { &None }, 0, li.gate, bias(li.gb), &mut a.g, false)?;
            lin(xu, if on(UP) { &xc } else { &None }, 1, li.up, bias(li.ub), &mut a.u, false)?;
        } else {
            let proj = |w: usize, b: Option<usize>, y| Proj { w: p[w], panels: None, bias: bias(b), y };
            linear::linears(&dev, &a.h2, [proj(li.gate, li.gb, &mut a.g), proj(li.up, li.ub, &mut a.u)], n)?;
        }
        elementwise::swiglu(&dev, &a.g, &a.u, &mut a.a, n)?;
        if let (Some(q), true) = (&lq, on(DOWN)) {
            if codes_only {
                ac = Some(quantize::learner_codes(&dev, &a.a, n, q.act_global(l, DOWN), &q.opts)?);
            } else {
                let mut t = dev.uninit(DType::F32, &[n, i_dim])?;
                let (g, fast) = (q.act_global(l, DOWN), wc[2].is_some());
                ac = quantize::learner_round_codes(&dev, &a.a, &mut t, n, g, &q.opts, fast)?;
                a.aq = Some(t);
            }
        }
        // x = x2 + a·Wdᵀ (+ bd): the next layer's input (not needed when the backward runs
        // the layer again).
        let mut x = None;
        if out {
            let mut y = dev.uninit(DType::F32, &[n, c])?;
            if on(DOWN) {
                // The learner's down projection (W4A4 or on its rounded copies) adds to a copy.
                y.copy_from(&a.x2)?;
                lin(a.aq.as_ref().unwrap_or(&a.a), &ac, 2, li.down, bias(li.db), &mut y, true)?;
            } else {
                linear::linear_residual(&dev, &a.a, p[li.down], bias(li.db), &a.x2, &mut y, n)?;
            }
            x = Some(y);
        }
        if codes_only && lq.is_some() {
            a.codes = Some(LayerCodes { w: wc, h2: xc, a: ac });
        }
        Ok((a, x))
    }

    /// Which GEMM-only operands this trainer keeps in BF16 over the weights `p`
    /// ([`Bf16Operands::of`] for the model's dtype and the learner's linears; none with
    /// `set_bf16_inputs(false)` or on the CPU).
    fn bf16_operands(&self, p: &[&Tensor]) -> Bf16Operands {
        let dtype = if p.iter().all(|t| t.dtype() == DType::BF16) { DType::BF16 } else { DType::F32 };
        if !self.bf16_inputs || self.dev.is_cpu() {
            return Bf16Operands { head: dtype == DType::BF16 && !self.dev.is_cpu(), ..Default::default() };
        }
        let on = |i: usize| self.quant.as_ref().is_some_and(|q| q.on(i));
        Bf16Operands::of(&self.cfg, dtype, [on(GATE), on(UP), on(DOWN)])
    }

    /// Whether SwiGLU's gradients dg and du are stored in BF16 under the NVFP4 learner on gate
    /// or up ([`Bf16Operands::of`] says it for dense linears): each of the two a dense BF16
    /// linear or a learner linear on its codes (`LearnerKeep::Codes`) under the engine's fixed
    /// input scale in every layer, whose gradients round dy to BF16 as SwiGLU's store does
    /// (per-token scales multiply the f32 dy first), and no MLP biases. The plan counts them
    /// at 4 bytes: an upper bound (the scales come with the engine's calibration).
    fn learner_takes_bf16_dy(&self, p: &[&Tensor]) -> bool {
        let Some(q) = self.quant.as_ref().filter(|q| q.on(GATE) || q.on(UP)) else { return false };
        if !self.bf16_inputs || self.dev.is_cpu() || self.exact_learner || self.cfg.mlp_bias {
            return false;
        }
        self.ix.layers.iter().enumerate().all(|(l, li)| {
            [(GATE, li.gate), (UP, li.up), (DOWN, li.down)].iter().all(|&(i, w)| {
                p[w].dtype() == DType::BF16 && (i == DOWN || !q.on(i) || matches!(q.act_global(l, i), Global::Fixed(_)))
            })
        })
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
        let pass = lm_head::Pass { coef: Coef::Given(coef), center, temperature: t, chunk, stats: None, loss: true };
        Ok(self.backward_with(p, pass, grads, &mut |_| Ok(()))?.unwrap_or(f64::NAN))
    }

    /// [`Self::backward`] with the loss pass's choices (`lm_head::Pass`: the statistics written
    /// on the way, coefficients it evaluates itself, the loss read back or not: None when not
    /// asked), calling `done(k)` once the
    /// work writing the gradients of the parameters at point k ([`gradient_points`]) has been
    /// queued, k = 0, 1, …, L + 1 in turn: what a bucketed reduce-scatter may start on while
    /// the backward goes on.
    pub fn backward_with(
        &mut self,
        p: &[&Tensor],
        pass: lm_head::Pass<'_, '_>,
        grads: &mut [Tensor],
        done: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<Option<f64>> {
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
        let loss = lm_head::loss_grad_with(&dev, &self.hf, p[head], &r, pass, &mut dh, &mut grads[head])?;
        // Final norm.
        let mut dx = z(&[n, c])?;
        let nf = self.ix.norm_f;
        norm::rmsnorm_bwd(&dev, &dh, &self.xf, p[nf], &self.rstdf, &mut dx, false, &mut grads[nf], n)?;
        done(0)?;
        let shape = Shape { heads: h, kv_heads: hkv, head_dim: d };
        // SwiGLU's gradients dg and du in BF16 where only the dense BF16 gate and up
        // projections' gradient GEMMs read them (`set_bf16_inputs`; no biases, whose gradients
        // sum f32 values, no NVFP4 learner, which rounds dy from f32 itself): the rounding
        // each GEMM applied to the f32 values.
        let mlp_dy = if self.bf16_operands(p).dmlp || self.learner_takes_bf16_dy(p) { DType::BF16 } else { DType::F32 };
        let (mut da, mut dg, mut du) =
            (z(&[n, i_dim])?, dev.uninit(mlp_dy, &[n, i_dim])?, dev.uninit(mlp_dy, &[n, i_dim])?);
        let (mut dh2, mut datt, mut dh1) = (z(&[n, c])?, z(&[n, qd])?, z(&[n, c])?);
        let (mut dq, mut dk, mut dv) = (z(&[n, qd])?, z(&[n, kd])?, z(&[n, kd])?);
        // The gradients of the raw q and k rows, before q/k-norm (empty without it: then the
        // RoPE backward's dq and dk are the projections' gradients themselves).
        let raw = if cfg.qk_norm { n } else { 0 };
        let (mut dqr, mut dkr) = (z(&[raw, qd])?, z(&[raw, kd])?);
        // The weight gradients' operands: BF16 where the compute weight is BF16 (tensor cores,
        // FP32 accumulation: the forward and the data gradients already round their inputs to
        // the weight's dtype), F32 for F32 weights and for the NVFP4 learner's rounded f32
        // copies (not BF16 values; `LearnerKeep::Codes` multiplies the codes instead). At
        // Qwen2.5-7B's shapes F32 weight gradients were 6.8 of a modelled 9.0 s train phase on
        // an H200 (`bench node --model-gpu h200 --ledger`).
        let wgrad =
            |w: &Tensor, rounded: bool| if w.dtype() == DType::BF16 && !rounded { DType::BF16 } else { DType::F32 };
        for l in (0..cfg.num_layers).rev() {
            let li = self.ix.layers[l];
            // A checkpointed layer runs again from its input first.
            let saved = match std::mem::replace(&mut self.acts[l], Saved::Gone) {
                Saved::Input(x) => Saved::Full(Box::new(self.layer(p, l, x, &b, false)?.0)),
                Saved::Gone => bail!("backward: layer {l} has no saved activations"),
                full => full,
            };
            self.acts[l] = saved;
            let Saved::Full(a) = &mut self.acts[l] else { bail!("backward: layer {l} has no saved activations") };
            // MLP: x_out = x2 + down(a). Linears of the NVFP4 learner use their rounded operands
            // (straight-through estimator), as the CPU twin.
            let qw = self.qw.get(l);
            let wq = |j: usize, dense: usize| qw.and_then(|w| w[j].as_ref()).unwrap_or(p[dense]);
            let (rg, ru) = (qw.is_some_and(|w| w[0].is_some()), qw.is_some_and(|w| w[1].is_some()));
            let xg = a.h2q.as_ref().filter(|_| rg).unwrap_or(&a.h2);
            let xu = a.h2q.as_ref().filter(|_| ru).unwrap_or(&a.h2);
            // `LearnerKeep::Codes`: the learner's linears multiply the codes again (BF16 dy).
            // Taken, so freed layer by layer; a second backward of one forward is refused above
            // (the batch is taken too), so it never sees the codes gone.
            let lc = a.codes.take();
            let codes = |j: usize| {
                let x = lc.as_ref().and_then(|c| if j == 2 { c.a.as_ref() } else { c.h2.as_ref() });
                lc.as_ref().and_then(|c| c.w[j].as_ref()).zip(x)
            };
            if let Some((w, x)) = codes(2) {
                linear::learner_grads(&dev, &dx, w, x, &mut da, false, &mut grads[li.down], n)?;
            } else {
                let xd = a.aq.as_ref().unwrap_or(&a.a);
                let gd = GradProj { dy: &dx, w: wq(2, li.down), dw: &mut grads[li.down] };
                linear::linear_grads(&dev, xd, [gd], &mut da, false, n, wgrad(p[li.down], a.aq.is_some()))?;
            }
            if let Some(bi) = li.db {
                linear::bias_grad(&dev, &dx, &mut grads[bi], n)?;
            }
            elementwise::swiglu_bwd(&dev, &da, &a.g, &a.u, &mut dg, &mut du)?;
            let ops = |w: usize, rounded: bool| wgrad(p[w], rounded && a.h2q.is_some());
            if codes(0).is_none() && codes(1).is_none() && rg == ru && ops(li.gate, rg) == ops(li.up, ru) {
                // Both dense, or both on the rounded copies: one input (xg is xu).
                let [gw, uw] = disjoint(grads, [li.gate, li.up])?;
                let gg = GradProj { dy: &dg, w: wq(0, li.gate), dw: gw };
                let gu = GradProj { dy: &du, w: wq(1, li.up), dw: uw };
                linear::linear_grads(&dev, xg, [gg, gu], &mut dh2, false, n, ops(li.gate, rg))?;
            } else {
                for (j, dy, w, x, rounded, acc) in [(0, &dg, li.gate, xg, rg, false), (1, &du, li.up, xu, ru, true)] {
                    match codes(j) {
                        Some((wc, xc)) => linear::learner_grads(&dev, dy, wc, xc, &mut dh2, acc, &mut grads[w], n)?,
                        None => {
                            let g = GradProj { dy, w: wq(j, w), dw: &mut grads[w] };
                            linear::linear_grads(&dev, x, [g], &mut dh2, acc, n, ops(w, rounded))?
                        }
                    }
                }
            }
            if let Some(bi) = li.gb {
                linear::bias_grad(&dev, &dg, &mut grads[bi], n)?;
            }
            if let Some(bi) = li.ub {
                linear::bias_grad(&dev, &du, &mut grads[bi], n)?;
            }
            norm::rmsnorm_bwd(&dev, &dh2, &a.x2, p[li.ln2], &a.rstd2, &mut dx, true, &mut grads[li.ln2], n)?;
            // Attention block: x2 = x + o(att).
            let go = GradProj { dy: &dx, w: p[li.o], dw: &mut grads[li.o] };
            linear::linear_grads(&dev, &a.att, [go], &mut datt, false, n, wgrad(p[li.o], false))?;
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
            if let (Some(qn), Some(kn)) = (li.qn, li.kn) {
                for (g, raw, rs, out, heads, wi) in
                    [(&mut dq, &mut a.qraw, &a.rq, &mut dqr, h, qn), (&mut dk, &mut a.kraw, &a.rk, &mut dkr, hkv, kn)]
                {
                    for t in [&mut *g, &mut *raw, &mut *out] {
                        t.reshape(&[n * heads, d])?;
                    }
                    norm::rmsnorm_bwd(&dev, g, raw, p[wi], rs, out, false, &mut grads[wi], n * heads)?;
                    for t in [g, raw, out] {
                        t.reshape(&[n, heads * d])?;
                    }
                }
            }
            let (gq, gk) = if matches!((li.qn, li.kn), (Some(_), Some(_))) { (&dqr, &dkr) } else { (&dq, &dk) };
            // q, k, v of one input: h1 rounded once for their weight gradients.
            let ops = wgrad(p[li.q], false);
            if [li.k, li.v].iter().any(|&w| wgrad(p[w], false) != ops) {
                bail!("layer {l}: q, k and v weights of different dtypes");
            }
            let [dwq, dwk, dwv] = disjoint(grads, [li.q, li.k, li.v])?;
            let (pq, pk) = (GradProj { dy: gq, w: p[li.q], dw: dwq }, GradProj { dy: gk, w: p[li.k], dw: dwk });
            let pv = GradProj { dy: &dv, w: p[li.v], dw: dwv };
            linear::linear_grads(&dev, &a.h1, [pq, pk, pv], &mut dh1, false, n, ops)?;
            for (bi, g) in [(li.qb, gq), (li.kb, gk), (li.vb, &dv)] {
                if let Some(bi) = bi {
                    linear::bias_grad(&dev, g, &mut grads[bi], n)?;
                }
            }
            norm::rmsnorm_bwd(&dev, &dh1, &a.x, p[li.ln1], &a.rstd1, &mut dx, true, &mut grads[li.ln1], n)?;
            // Checkpointed: back to the input alone (the rest returns to the allocator).
            if self.checkpoint {
                if let Saved::Full(a) = std::mem::replace(&mut self.acts[l], Saved::Gone) {
                    self.acts[l] = Saved::Input(a.x);
                }
            }
            done(cfg.num_layers - l)?;
        }
        let embed = self.ix.embed;
        elementwise::embed_bwd(&dev, &b.tokens, &dx, &mut grads[embed], n, cfg.pad_token_id)?;
        done(cfg.num_layers + 1)?;
        self.batch = Some(b);
        Ok(loss)
    }
}

/// For each parameter (in parameter order), the point of the backward after which its gradient
/// is complete (`DeviceTrainable::backward_with`): 0 for the final norm and an untied LM head,
/// L − l for layer l's parameters, L + 1 for the embedding (a tied head's gradient too).
pub fn gradient_points(cfg: &ModelConfig) -> Vec<usize> {
    let layers = cfg.num_layers;
    super::weights::param_specs(cfg)
        .iter()
        .map(|(name, _)| match name.strip_prefix("model.layers.") {
            Some(rest) => match rest.split('.').next().and_then(|l| l.parse::<usize>().ok()) {
                Some(l) if l < layers => layers - l,
                _ => layers + 1,
            },
            None if name == "model.norm.weight" || name == "lm_head.weight" => 0,
            None => layers + 1,
        })
        .collect()
}

#[cfg(test)]
mod tests;

/// Distinct gradients of one parameter list (the projections of one input).
fn disjoint<const N: usize>(grads: &mut [Tensor], at: [usize; N]) -> Result<[&mut Tensor; N]> {
    grads.get_disjoint_mut(at).map_err(|e| anyhow::anyhow!("gradients {at:?}: {e}"))
}
