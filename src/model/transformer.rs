//! The transformer forward over a flat, ragged batch of tokens (prefill and decode rows mixed),
//! reading and writing a paged KV cache. Shared by the decoding engine and scoring.
//!
//! Owns: [`Transformer`] (config + RoPE frequencies) and [`ForwardBuffers`] (every activation,
//! allocated once at capacity). May call: `crate::ops`. Must not: sample or schedule.

use super::config::ModelConfig;
use super::weights::ModelWeights;
use crate::device::{DType, Device, Tensor};
use crate::model::calib::Calibration;
use crate::model::QLayer;
use crate::ops::attention::{self, AttnMeta, Packed};
use crate::ops::linear as matmul;
use crate::ops::linear::Panels;
use crate::ops::linear::Proj;
use crate::ops::quantize::{self, ActQuant};
use crate::ops::{elementwise, norm, rope};
use crate::quant::qtensor::{QFormat, QTensor};
use anyhow::{bail, Result};

/// One layer's paged cache: keys and values, each (num_blocks, Hkv, block_size, D).
#[derive(Debug)]
pub struct KvLayer {
    pub k: Tensor,
    pub v: Tensor,
    /// Scales of an FP8 (u8) cache: stored code = e4m3(x / scale).
    pub k_scale: f32,
    pub v_scale: f32,
}

pub struct Transformer {
    pub cfg: ModelConfig,
    inv_freq: Tensor, // (D/2) f32
}

/// Activations for up to `cap` tokens per forward and `cap_rows` LM-head rows per chunk.
pub struct ForwardBuffers {
    pub cap: usize,
    pub cap_rows: usize,
    pub ids: Tensor,       // (cap) u32
    pub positions: Tensor, // (cap) u32
    pub meta: AttnMeta,
    x: Tensor,          // (cap, C) residual stream
    h: Tensor,          // (cap, C) normed input of a sublayer
    q: Tensor,          // (cap, H*D)
    k: Tensor,          // (cap, Hkv*D)
    v: Tensor,          // (cap, Hkv*D)
    att: Tensor,        // (cap, H*D)
    o: Tensor,          // (cap, C) attention output / MLP output (the pending residual update)
    gate: Tensor,       // (cap, I)
    up: Tensor,         // (cap, I)
    act: Tensor,        // (cap, I) silu(gate) * up
    cos: Tensor,        // (cap, D/2)
    sin: Tensor,        // (cap, D/2)
    pub sel: Tensor,    // (cap_rows) u32 rows of the batch whose logits are wanted
    xs: Tensor,         // (cap_rows, C)
    os: Tensor,         // (cap_rows, C)
    hn: Tensor,         // (cap_rows, C)
    pub logits: Tensor, // (cap_rows, V)
    xq: Tensor,         // (cap · max K) fake-quantized linear input (low-precision engines)
    /// BF16 copies' room for the GEMM-only inputs (CUDA, BF16 weights; else empty): the norms
    /// and SwiGLU write these instead of h and act where every reader is a dense BF16 linear.
    h16: Tensor, // (cap, C) bf16
    /// The attention output in BF16 where o_proj is a dense BF16 linear: the kernels store what
    /// the GEMM would round it to. It shares h16's room (the projections have read h16 before
    /// attention writes it, and o_proj reads it before the next norm writes h16).
    att16: Tensor, // (cap, H·D) bf16
    act16: Tensor,      // (cap, I) bf16
    /// When set, the forward records the max magnitude of every linear input and of the keys and
    /// values (the calibration pass of the low-precision engines).
    pub observe: Option<Calibration>,
}

impl ForwardBuffers {
    /// `bf16_operands`: hold [`ForwardBuffers::h16`]'s (and `att16`'s) and `act16`'s room (a
    /// CUDA device with BF16 weights; ignored on the CPU, which multiplies f32 inputs).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        dev: &Device,
        cfg: &ModelConfig,
        cap: usize,
        cap_rows: usize,
        max_seqs: usize,
        max_blocks: usize,
        block_size: usize,
        bf16_operands: bool,
    ) -> Result<ForwardBuffers> {
        let (c, i, q, kv, d) = (cfg.hidden_size, cfg.intermediate_size, cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
        // CPU activations are written once here, so that the first step (the prefill, where
        // time to first token is measured) does not pay their page faults.
        let f = |shape: &[usize]| -> Result<Tensor> {
            let mut t = dev.zeros(DType::F32, shape)?;
            if let Ok(v) = t.f32s_mut() {
                v.fill(0.0);
            }
            Ok(t)
        };
        let u = |n: usize| dev.zeros(DType::U32, &[n]);
        let bf16_operands = bf16_operands && !dev.is_cpu();
        let half = |cols: usize| dev.zeros(DType::BF16, &[if bf16_operands { cap } else { 0 }, cols]);
        let (h16, att16) = match bf16_operands {
            true => {
                let room = dev.zeros(DType::BF16, &[cap * c.max(q)])?;
                (room.view(0, &[cap, c])?, room.view(0, &[cap, q])?)
            }
            false => (half(c)?, half(q)?),
        };
        Ok(ForwardBuffers {
            cap,
            cap_rows,
            ids: u(cap)?,
            positions: u(cap)?,
            meta: AttnMeta {
                num_seqs: 0,
                num_tokens: 0,
                block_size,
                max_blocks,
                q_start: u(max_seqs + 1)?,
                ctx_len: u(max_seqs)?,
                block_tables: dev.zeros(DType::U32, &[max_seqs, max_blocks])?,
                slot_mapping: u(cap)?,
                attended: 0,
                packed: Packed {
                    offsets: Vec::with_capacity(max_seqs + 1),
                    cu: if dev.is_cpu() { None } else { Some(u(max_seqs + 1)?) },
                    lse: if dev.is_cpu() { None } else { Some(dev.uninit(DType::F32, &[cap, cfg.num_heads])?) },
                    ..Packed::default()
                },
            },
            x: f(&[cap, c])?,
            h: f(&[cap, c])?,
            q: f(&[cap, q])?,
            k: f(&[cap, kv])?,
            v: f(&[cap, kv])?,
            att: f(&[cap, q])?,
            o: f(&[cap, c])?,
            gate: f(&[cap, i])?,
            up: f(&[cap, i])?,
            act: f(&[cap, i])?,
            cos: f(&[cap, d / 2])?,
            sin: f(&[cap, d / 2])?,
            sel: u(cap_rows)?,
            xs: f(&[cap_rows, c])?,
            os: f(&[cap_rows, c])?,
            hn: f(&[cap_rows, c])?,
            logits: f(&[cap_rows, cfg.vocab_size])?,
            xq: f(&[cap, c.max(i).max(q)])?,
            h16,
            att16,
            act16: half(i)?,
            observe: None,
        })
    }

    /// Bytes [`ForwardBuffers::size_bytes`] counts for buffers of these sizes, before they
    /// exist (the device's memory plan): `bf16_operands` as `new` resolves it (false on the CPU).
    /// Like `size_bytes`, it leaves out the step's metadata (ids, positions, block tables, the
    /// packed prefill's offsets and log-sum-exp rows): a few MB at most.
    pub fn plan_bytes(cfg: &ModelConfig, cap: usize, cap_rows: usize, bf16_operands: bool) -> usize {
        let (c, i, q, kv, d) = (cfg.hidden_size, cfg.intermediate_size, cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
        // x, h, o; q, att; k, v; gate, up, act; cos, sin; xq. Then xs, os, hn and the logits.
        let f32s = cap * (3 * c + 2 * q + 2 * kv + 3 * i + 2 * (d / 2) + c.max(i).max(q))
            + cap_rows * (3 * c + cfg.vocab_size);
        let bf16s = if bf16_operands { cap * (c.max(q) + i) } else { 0 }; // h16/att16's room, act16
        4 * f32s + 2 * bf16s
    }

    /// Bytes held by the activation buffers (the metadata apart: see [`ForwardBuffers::plan_bytes`]).
    pub fn size_bytes(&self) -> usize {
        [
            &self.x,
            &self.h,
            &self.q,
            &self.k,
            &self.v,
            &self.att,
            &self.o,
            &self.gate,
            &self.up,
            &self.act,
            &self.cos,
            &self.sin,
            &self.xs,
            &self.os,
            &self.hn,
            &self.logits,
            &self.xq,
            &self.act16,
        ]
        .iter()
        .map(|t| t.size_bytes())
        .sum::<usize>()
            + self.h16.size_bytes().max(self.att16.size_bytes()) // one room, two views
    }
}

impl Transformer {
    pub fn new(dev: &Device, cfg: ModelConfig) -> Result<Transformer> {
        let f = super::rope::inv_freq(&cfg.rope, cfg.head_dim);
        let inv_freq = dev.from_f32(DType::F32, &[f.len()], &f)?;
        Ok(Transformer { cfg, inv_freq })
    }

    /// Runs every layer over the `b.meta.num_tokens` tokens in `b.ids`/`b.positions`, writing
    /// their keys/values into `kv` at `b.meta.slot_mapping`. Leaves the residual stream in the
    /// buffers for [`Transformer::logits`]. With `q`, each layer's linears run in the precision
    /// its [`QLayer`] gives (quantized weights, fake-quantized inputs).
    pub fn forward(
        &self,
        dev: &Device,
        w: &ModelWeights,
        q: Option<&[QLayer]>,
        b: &mut ForwardBuffers,
        kv: &mut [KvLayer],
    ) -> Result<()> {
        let cfg = &self.cfg;
        let m = b.meta.num_tokens;
        if m == 0 || m > b.cap {
            bail!("forward: {m} tokens for buffers of capacity {}", b.cap);
        }
        if kv.len() != cfg.num_layers || q.map(|q| q.len() != cfg.num_layers).unwrap_or(false) {
            bail!("forward: cache or quantization layers do not match the {} model layers", cfg.num_layers);
        }
        let eps = cfg.rms_norm_eps as f32;
        let (h, hkv) = (cfg.num_heads, cfg.num_kv_heads);
        // Linear i of layer l packed once (generate / score), if it was.
        let pan = |l: usize, i: usize| w.panels().map(|p| &p.layers[l][i]);
        elementwise::embedding(dev, &w.embed_tokens, &b.ids, &mut b.x, m)?;
        rope::rope_table(dev, &b.positions, &self.inv_freq, &mut b.cos, &mut b.sin, m)?;
        for (l, (lw, cache)) in w.layers.iter().zip(kv.iter_mut()).enumerate() {
            let ql = q.map(|q| &q[l]);
            // The GEMM-only inputs in BF16 (h16, att16, act16) where every linear that reads
            // them is a dense BF16 one: the norms, attention and SwiGLU store the rounding each
            // GEMM applied to the f32 values (the same bits, without a cast); f32 while
            // calibrating (the observer reads the f32 values) and for quantized linears (they
            // quantize from f32).
            let dense = |i: usize, w: &Tensor| {
                w.dtype() == DType::BF16 && ql.is_none_or(|q| q.w[i].is_none() && q.act[i] == ActQuant::None)
            };
            let on16 = b.h16.numel() > 0 && b.observe.is_none();
            let attn16 = on16 && dense(0, &lw.q_proj) && dense(1, &lw.k_proj) && dense(2, &lw.v_proj);
            let mlp16 = on16 && dense(4, &lw.gate_proj) && dense(5, &lw.up_proj);
            let out16 = on16 && dense(3, &lw.o_proj);
            let down16 = on16 && dense(6, &lw.down_proj);
            // Attention block. b.o holds the previous layer's MLP output, not yet added to x.
            let hy = if attn16 { &mut b.h16 } else { &mut b.h };
            if l == 0 {
                norm::rmsnorm(dev, &b.x, &lw.input_layernorm, eps, hy, m)?;
            } else {
                norm::add_rmsnorm(dev, &mut b.x, &b.o, &lw.input_layernorm, eps, hy, m)?;
            }
            observe(dev, &mut b.observe, l, 0, &b.h, m)?;
            let hx = if attn16 { &b.h16 } else { &b.h };
            // Unquantized: the three projections of one input in one call (x transposed once).
            if ql.is_none() {
                matmul::linears(
                    dev,
                    hx,
                    [
                        Proj { w: &lw.q_proj, panels: pan(l, 0), bias: lw.q_bias.as_ref(), y: &mut b.q },
                        Proj { w: &lw.k_proj, panels: pan(l, 1), bias: lw.k_bias.as_ref(), y: &mut b.k },
                        Proj { w: &lw.v_proj, panels: pan(l, 2), bias: lw.v_bias.as_ref(), y: &mut b.v },
                    ],
                    m,
                )?;
            } else {
                projs(
                    dev,
                    hx,
                    &mut b.xq,
                    ql,
                    [
                        (0, Proj { w: &lw.q_proj, panels: pan(l, 0), bias: lw.q_bias.as_ref(), y: &mut b.q }),
                        (1, Proj { w: &lw.k_proj, panels: pan(l, 1), bias: lw.k_bias.as_ref(), y: &mut b.k }),
                        (2, Proj { w: &lw.v_proj, panels: pan(l, 2), bias: lw.v_bias.as_ref(), y: &mut b.v }),
                    ],
                    m,
                )?;
            }
            let norms = match (&lw.q_norm, &lw.k_norm) {
                (Some(qn), Some(kn)) => Some((qn, kn, eps)),
                _ => None,
            };
            let (ks, vs) = (cache.k_scale, cache.v_scale);
            match &mut b.observe {
                // Per-head norms, RoPE and the cache write: one launch on CUDA.
                None => {
                    let caches = (&mut cache.k, &mut cache.v);
                    attention::qk_rope_kv(
                        dev,
                        &mut b.q,
                        &mut b.k,
                        &b.v,
                        norms,
                        &b.cos,
                        &b.sin,
                        caches,
                        (ks, vs),
                        &b.meta,
                        h,
                    )?;
                }
                // Calibrating: the observer reads the keys between RoPE and the write.
                Some(obs) => {
                    if let Some((qn, kn, eps)) = norms {
                        norm::head_rmsnorm(dev, &mut b.q, qn, eps, m, h)?;
                        norm::head_rmsnorm(dev, &mut b.k, kn, eps, m, hkv)?;
                    }
                    rope::rope(dev, &mut b.q, &b.cos, &b.sin, m, h)?;
                    rope::rope(dev, &mut b.k, &b.cos, &b.sin, m, hkv)?;
                    obs.k_amax[l] = obs.k_amax[l].max(elementwise::amax_rows(dev, &b.k, m)?);
                    obs.v_amax[l] = obs.v_amax[l].max(elementwise::amax_rows(dev, &b.v, m)?);
                    attention::kv_write(dev, &b.k, &b.v, &mut cache.k, &mut cache.v, ks, vs, &b.meta)?;
                }
            }
            let oy = if out16 { &mut b.att16 } else { &mut b.att };
            if !attention::packed_prefill(dev, &b.q, &b.k, &b.v, &cache.k, &cache.v, &mut b.meta, oy, h)? {
                attention::paged_attention(dev, &b.q, &cache.k, &cache.v, ks, vs, &b.meta, oy, h)?;
            }
            observe(dev, &mut b.observe, l, 1, &b.att, m)?;
            let ox = if out16 { &b.att16 } else { &b.att };
            proj(dev, ox, &mut b.xq, &lw.o_proj, pan(l, 3), lw.o_bias.as_ref(), ql, 3, &mut b.o, m)?;
            // MLP block.
            let hy = if mlp16 { &mut b.h16 } else { &mut b.h };
            norm::add_rmsnorm(dev, &mut b.x, &b.o, &lw.post_attention_layernorm, eps, hy, m)?;
            observe(dev, &mut b.observe, l, 2, &b.h, m)?;
            let hx = if mlp16 { &b.h16 } else { &b.h };
            if ql.is_none() {
                matmul::linears(
                    dev,
                    hx,
                    [
                        Proj { w: &lw.gate_proj, panels: pan(l, 4), bias: lw.gate_bias.as_ref(), y: &mut b.gate },
                        Proj { w: &lw.up_proj, panels: pan(l, 5), bias: lw.up_bias.as_ref(), y: &mut b.up },
                    ],
                    m,
                )?;
            } else {
                projs(
                    dev,
                    hx,
                    &mut b.xq,
                    ql,
                    [
                        (4, Proj { w: &lw.gate_proj, panels: pan(l, 4), bias: lw.gate_bias.as_ref(), y: &mut b.gate }),
                        (5, Proj { w: &lw.up_proj, panels: pan(l, 5), bias: lw.up_bias.as_ref(), y: &mut b.up }),
                    ],
                    m,
                )?;
            }
            // A W8A8 / W4A4 down projection quantizes SwiGLU's output as it computes it (not
            // while calibrating: the observer reads that output).
            match ql.and_then(|q| real_lowp(q, 6).map(|w| (w, q.act[6]))).filter(|_| b.observe.is_none()) {
                Some((wq, act)) => {
                    let (gate, up, a) = (&b.gate, &b.up, &mut b.act);
                    matmul::swiglu_linear_act_q(
                        dev,
                        gate,
                        up,
                        a,
                        &mut b.xq,
                        &act,
                        wq,
                        lw.down_bias.as_ref(),
                        &mut b.o,
                        m,
                    )?;
                }
                None => {
                    let ay = if down16 { &mut b.act16 } else { &mut b.act };
                    elementwise::swiglu(dev, &b.gate, &b.up, ay, m)?;
                    observe(dev, &mut b.observe, l, 3, &b.act, m)?;
                    let ax = if down16 { &b.act16 } else { &b.act };
                    proj(dev, ax, &mut b.xq, &lw.down_proj, pan(l, 6), lw.down_bias.as_ref(), ql, 6, &mut b.o, m)?;
                }
            }
        }
        Ok(())
    }

    /// Logits (r, V) in `b.logits` of the r batch rows listed in `b.sel[..r]`: the last residual
    /// update, the final norm and the LM head, on those rows only.
    pub fn logits(&self, dev: &Device, w: &ModelWeights, b: &mut ForwardBuffers, r: usize) -> Result<()> {
        if r > b.cap_rows {
            bail!("logits: {r} rows for a buffer of {}", b.cap_rows);
        }
        let eps = self.cfg.rms_norm_eps as f32;
        elementwise::gather_rows(dev, &b.x, &b.sel, &mut b.xs, r)?;
        elementwise::gather_rows(dev, &b.o, &b.sel, &mut b.os, r)?;
        norm::add_rmsnorm(dev, &mut b.xs, &b.os, &w.norm, eps, &mut b.hn, r)?;
        // (The logits, 4 MB at batch 32, are read once, by sampling or scoring, after the head's
        // whole weight has streamed through the caches.)
        matmul::linear_packed_streamed(dev, &b.hn, w.head(), w.panels().map(|p| &p.head), &mut b.logits, r)
    }
}

/// The projections of one input (linear i of the layer each): where every one is a W8A8 /
/// W4A4 linear with the same input quantization (q, k, v, or gate and up, share their input's
/// calibration), the input is quantized once for all of them (`matmul::linears_act_q`: the
/// same bits as once each); otherwise each is a [`proj`].
fn projs<const N: usize>(
    dev: &Device,
    x: &Tensor,
    xq: &mut Tensor,
    q: Option<&QLayer>,
    group: [(usize, Proj); N],
    m: usize,
) -> Result<()> {
    if let Some(q) = q {
        let act = q.act[group[0].0];
        let real = |i: usize| real_lowp(q, i).filter(|_| q.act[i] == act);
        if let (Some(first), true) = (real(group[0].0), group.iter().all(|(i, _)| real(*i).is_some())) {
            // (On the stack: a decode step allocates nothing. Every `real(i)` is Some here.)
            let mut shared = group.map(|(i, p)| matmul::QProj { w: real(i).unwrap_or(first), bias: p.bias, y: p.y });
            return matmul::linears_act_q(dev, x, xq, &act, &mut shared, m);
        }
    }
    for (i, p) in group {
        proj(dev, x, xq, p.w, p.panels, p.bias, q, i, p.y, m)?;
    }
    Ok(())
}

/// Linear i's quantized weight where its input is quantized in the same format: a W8A8 /
/// W4A4 linear (a real low-precision GEMM on CUDA, its emulation on the CPU).
fn real_lowp(q: &QLayer, i: usize) -> Option<&QTensor> {
    q.w[i].as_ref().filter(|w| {
        matches!((q.act[i], w.format), (ActQuant::Fp8 { .. }, QFormat::Fp8) | (ActQuant::Nvfp4 { .. }, QFormat::Nvfp4))
    })
}

/// One projection: dense, or with a quantized weight and/or a fake-quantized input.
#[allow(clippy::too_many_arguments)]
fn proj(
    dev: &Device,
    x: &Tensor,
    xq: &mut Tensor,
    dense: &Tensor,
    panels: Option<&Panels>,
    bias: Option<&Tensor>,
    q: Option<&QLayer>,
    i: usize,
    y: &mut Tensor,
    m: usize,
) -> Result<()> {
    let (wq, act) = match q {
        Some(q) => (q.w[i].as_ref(), q.act[i]),
        None => (None, ActQuant::None),
    };
    // Both operands quantized in one format: the W8A8 / W4A4 linear (a real low-precision GEMM
    // on CUDA, its emulation on CPU).
    if let Some(wq) = q.and_then(|q| real_lowp(q, i)) {
        return matmul::linear_act_q(dev, x, xq, &act, wq, bias, y, m);
    }
    let input = if act == ActQuant::None {
        x
    } else {
        // xq is a (cap, max K) scratch: view it with this input's row width.
        let k = x.dim(x.shape().len() - 1);
        xq.reshape(&[xq.numel() / k, k])?;
        quantize::fake_quant_rows(dev, x, xq, m, &act)?;
        &*xq
    };
    match wq {
        Some(wq) => matmul::linear_q(dev, input, wq, bias, y, m),
        None => matmul::linear_packed(dev, input, dense, panels, bias, y, m, false),
    }
}

/// Calibration: the running max magnitude of input slot `slot` of layer `l`.
fn observe(dev: &Device, obs: &mut Option<Calibration>, l: usize, slot: usize, x: &Tensor, m: usize) -> Result<()> {
    if let Some(o) = obs {
        let a = elementwise::amax_rows(dev, x, m)?;
        o.input_amax[l][slot] = o.input_amax[l][slot].max(a);
    }
    Ok(())
}
