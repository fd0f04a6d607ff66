//! The transformer for training: forward over packed sequences saving what the backward needs
//! (in arenas that are resized, never reallocated once large enough), the per-token statistics
//! of the LM head, and the explicit backward of every layer into gradients in parameter order.
//! Generic over the element type (f32 to train, f64 for finite-difference checks).
//!
//! Owns: [`Trainable`] (RoPE frequencies, activation arenas). May call: the training twins of `crate::ops` (`ops::<op>::grad`).
//! Must not: own weights or optimizer state (the trainer passes parameter slices in).

use super::config::ModelConfig;
use super::learner_quant::{LearnerQuant, DOWN, GATE, UP};
use super::weights::param_specs;
use crate::ops::attention::grad as attention;
use crate::ops::elementwise::grad as act;
use crate::ops::linear::grad as mm;
use crate::ops::lm_head::grad as lm_head;
use crate::ops::norm::grad as norm;
use crate::ops::real::Real;
use crate::ops::rope::grad as rope;
use anyhow::{bail, Result};
use std::collections::HashMap;

/// Packed sequences: sequence b occupies rows cu[b]..cu[b+1]; `rows[i]` is a row whose next
/// token `targets[i]` is scored (the response positions).
#[derive(Clone, Debug, Default)]
pub struct TrainBatch {
    pub tokens: Vec<u32>,    // (N)
    pub positions: Vec<u32>, // (N)
    pub cu: Vec<usize>,      // (B+1)
    pub rows: Vec<u32>,      // (M)
    pub targets: Vec<u32>,   // (M)
}

impl TrainBatch {
    /// Adds a sequence; every position t ≥ prompt_len − 1 with t + 1 < len is scored.
    pub fn push(&mut self, prompt: &[u32], response: &[u32]) {
        if self.cu.is_empty() {
            self.cu.push(0);
        }
        let start = self.tokens.len();
        self.tokens.extend_from_slice(prompt);
        self.tokens.extend_from_slice(response);
        let len = prompt.len() + response.len();
        self.positions.extend(0..len as u32);
        for (i, &y) in response.iter().enumerate() {
            self.rows.push((start + prompt.len() + i - 1) as u32);
            self.targets.push(y);
        }
        self.cu.push(start + len);
    }
    pub fn num_seqs(&self) -> usize {
        self.cu.len().saturating_sub(1)
    }
}

/// Indices (into parameter order) of one layer's tensors.
#[derive(Clone, Copy, Debug)]
pub(super) struct LayerIdx {
    pub ln1: usize,
    pub q: usize,
    pub k: usize,
    pub v: usize,
    pub o: usize,
    pub qb: Option<usize>,
    pub kb: Option<usize>,
    pub vb: Option<usize>,
    pub ob: Option<usize>,
    pub qn: Option<usize>,
    pub kn: Option<usize>,
    pub ln2: usize,
    pub gate: usize,
    pub up: usize,
    pub down: usize,
    pub gb: Option<usize>,
    pub ub: Option<usize>,
    pub db: Option<usize>,
}

/// Where each tensor sits in parameter order ([`param_specs`]).
pub(super) struct Indices {
    pub layers: Vec<LayerIdx>,
    pub embed: usize,
    pub norm_f: usize,
    /// The embedding's index for a tied head.
    pub head: usize,
}

pub(super) fn indices(cfg: &ModelConfig) -> Indices {
    let specs = param_specs(cfg);
    let ix: HashMap<&str, usize> = specs.iter().enumerate().map(|(i, (n, _))| (n.as_str(), i)).collect();
    let get = |n: String| ix.get(n.as_str()).copied();
    let req = |n: String| ix[n.as_str()];
    let layers = (0..cfg.num_layers)
        .map(|l| {
            let p = format!("model.layers.{l}");
            LayerIdx {
                ln1: req(format!("{p}.input_layernorm.weight")),
                q: req(format!("{p}.self_attn.q_proj.weight")),
                k: req(format!("{p}.self_attn.k_proj.weight")),
                v: req(format!("{p}.self_attn.v_proj.weight")),
                o: req(format!("{p}.self_attn.o_proj.weight")),
                qb: get(format!("{p}.self_attn.q_proj.bias")),
                kb: get(format!("{p}.self_attn.k_proj.bias")),
                vb: get(format!("{p}.self_attn.v_proj.bias")),
                ob: get(format!("{p}.self_attn.o_proj.bias")),
                qn: get(format!("{p}.self_attn.q_norm.weight")),
                kn: get(format!("{p}.self_attn.k_norm.weight")),
                ln2: req(format!("{p}.post_attention_layernorm.weight")),
                gate: req(format!("{p}.mlp.gate_proj.weight")),
                up: req(format!("{p}.mlp.up_proj.weight")),
                down: req(format!("{p}.mlp.down_proj.weight")),
                gb: get(format!("{p}.mlp.gate_proj.bias")),
                ub: get(format!("{p}.mlp.up_proj.bias")),
                db: get(format!("{p}.mlp.down_proj.bias")),
            }
        })
        .collect();
    let embed = ix["model.embed_tokens.weight"];
    let head = if cfg.tie_word_embeddings { embed } else { ix["lm_head.weight"] };
    Indices { layers, embed, norm_f: ix["model.norm.weight"], head }
}

#[derive(Default)]
struct LayerActs<T> {
    x: Vec<T>,     // (N, C) layer input
    rstd1: Vec<T>, // (N)
    h1: Vec<T>,    // (N, C)
    qraw: Vec<T>,  // (N, H*D) before q-norm (Qwen3) / RoPE
    kraw: Vec<T>,  // (N, Hkv*D)
    rq: Vec<T>,    // (N*H) q-norm rstd
    rk: Vec<T>,    // (N*Hkv)
    qn: Vec<T>,    // (N, H*D) after q-norm, before RoPE
    kn: Vec<T>,    // (N, Hkv*D)
    q: Vec<T>,     // (N, H*D) after RoPE
    k: Vec<T>,     // (N, Hkv*D)
    v: Vec<T>,     // (N, Hkv*D)
    att: Vec<T>,   // (N, H*D)
    lse: Vec<T>,   // (N, H)
    x2: Vec<T>,    // (N, C) after the attention residual
    rstd2: Vec<T>, // (N)
    h2: Vec<T>,    // (N, C)
    g: Vec<T>,     // (N, I)
    u: Vec<T>,     // (N, I)
    a: Vec<T>,     // (N, I)
    h2q: Vec<T>,   // (N, C) NVFP4 learner: Q(h2), the gate/up input
    aq: Vec<T>,    // (N, I) NVFP4 learner: Q(a), the down input
}

pub struct Trainable<T: Real> {
    pub cfg: ModelConfig,
    inv_freq: Vec<f32>,
    layers: Vec<LayerIdx>,
    embed: usize,
    norm_f: usize,
    head: usize,
    acts: Vec<LayerActs<T>>,
    cos: Vec<T>,   // (N, D/2)
    sin: Vec<T>,   // (N, D/2)
    xf: Vec<T>,    // (N, C) final residual stream
    rstdf: Vec<T>, // (N)
    hf: Vec<T>,    // (N, C) final normed hidden states
    n: usize,
    cu: Vec<usize>,
    tokens: Vec<u32>,
    scratch: Option<lm_head::Scratch<T>>,
    /// The native NVFP4 forward of chosen MLP linears, and their quantized weights per layer
    /// (gate, up, down), refreshed by every forward.
    quant: Option<LearnerQuant>,
    qw: Vec<[Vec<T>; 3]>,
}

fn resize<T: Real>(v: &mut Vec<T>, n: usize) {
    v.resize(n, T::zero());
}

impl<T: Real> Trainable<T> {
    pub fn new(cfg: &ModelConfig) -> Trainable<T> {
        let Indices { layers, embed, norm_f, head } = indices(cfg);
        Trainable {
            cfg: cfg.clone(),
            inv_freq: super::rope::inv_freq(&cfg.rope, cfg.head_dim),
            layers,
            embed,
            norm_f,
            head,
            acts: (0..cfg.num_layers).map(|_| LayerActs::default()).collect(),
            cos: Vec::new(),
            sin: Vec::new(),
            xf: Vec::new(),
            rstdf: Vec::new(),
            hf: Vec::new(),
            n: 0,
            cu: Vec::new(),
            tokens: Vec::new(),
            scratch: None,
            quant: None,
            qw: Vec::new(),
        }
    }

    /// Runs the chosen MLP linears in NVFP4 from now on (None: the compute dtype).
    pub fn set_quant(&mut self, q: Option<LearnerQuant>) {
        self.qw = (0..self.cfg.num_layers).map(|_| Default::default()).collect();
        self.quant = q;
    }

    /// Bytes of saved activations for the last forward (the memory plan's trainer arena).
    pub fn activation_bytes(&self) -> usize {
        let per_layer: usize = self
            .acts
            .iter()
            .map(|a| {
                [
                    &a.x, &a.rstd1, &a.h1, &a.qraw, &a.kraw, &a.rq, &a.rk, &a.qn, &a.kn, &a.q, &a.k, &a.v, &a.att,
                    &a.lse, &a.x2, &a.rstd2, &a.h2, &a.g, &a.u, &a.a, &a.h2q, &a.aq,
                ]
                .iter()
                .map(|v| v.capacity())
                .sum::<usize>()
            })
            .sum();
        (per_layer + self.cos.capacity() * 2 + self.xf.capacity() + self.hf.capacity()) * std::mem::size_of::<T>()
    }

    /// Forward over `b` with parameters `p` (in [`param_specs`] order). Saves activations.
    pub fn forward(&mut self, p: &[&[T]], b: &TrainBatch) -> Result<()> {
        let cfg = &self.cfg;
        let specs = param_specs(cfg);
        if p.len() != specs.len() {
            bail!("forward: {} parameter slices for {} parameters", p.len(), specs.len());
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
        self.n = n;
        self.cu.clone_from(&b.cu);
        self.tokens.clone_from(&b.tokens);
        let eps = T::from_f64(cfg.rms_norm_eps);
        resize(&mut self.cos, n * d / 2);
        resize(&mut self.sin, n * d / 2);
        rope::table(&b.positions, &self.inv_freq, &mut self.cos, &mut self.sin);
        let shape = attention::Shape { heads: h, kv_heads: hkv, head_dim: d };
        let mut x: Vec<T> = vec![T::zero(); n * c];
        act::embed_fwd(c, &b.tokens, p[self.embed], &mut x);
        for (l, li) in self.layers.iter().enumerate() {
            let a = &mut self.acts[l];
            for (v, len) in [
                (&mut a.x, n * c),
                (&mut a.rstd1, n),
                (&mut a.h1, n * c),
                (&mut a.qraw, n * qd),
                (&mut a.kraw, n * kd),
                (&mut a.rq, n * h),
                (&mut a.rk, n * hkv),
                (&mut a.qn, n * qd),
                (&mut a.kn, n * kd),
                (&mut a.q, n * qd),
                (&mut a.k, n * kd),
                (&mut a.v, n * kd),
                (&mut a.att, n * qd),
                (&mut a.lse, n * h),
                (&mut a.x2, n * c),
                (&mut a.rstd2, n),
                (&mut a.h2, n * c),
                (&mut a.g, n * i_dim),
                (&mut a.u, n * i_dim),
                (&mut a.a, n * i_dim),
            ] {
                resize(v, len);
            }
            a.x.copy_from_slice(&x);
            norm::fwd(n, c, &a.x, p[li.ln1], eps, &mut a.h1, &mut a.rstd1);
            mm::nt(n, qd, c, &a.h1, p[li.q], &mut a.qraw, false);
            mm::nt(n, kd, c, &a.h1, p[li.k], &mut a.kraw, false);
            mm::nt(n, kd, c, &a.h1, p[li.v], &mut a.v, false);
            if let Some(bi) = li.qb {
                mm::add_bias(n, qd, &mut a.qraw, p[bi]);
            }
            if let Some(bi) = li.kb {
                mm::add_bias(n, kd, &mut a.kraw, p[bi]);
            }
            if let Some(bi) = li.vb {
                mm::add_bias(n, kd, &mut a.v, p[bi]);
            }
            match (li.qn, li.kn) {
                (Some(qn), Some(kn)) => {
                    norm::fwd(n * h, d, &a.qraw, p[qn], eps, &mut a.qn, &mut a.rq);
                    norm::fwd(n * hkv, d, &a.kraw, p[kn], eps, &mut a.kn, &mut a.rk);
                }
                _ => {
                    a.qn.copy_from_slice(&a.qraw);
                    a.kn.copy_from_slice(&a.kraw);
                }
            }
            a.q.copy_from_slice(&a.qn);
            a.k.copy_from_slice(&a.kn);
            rope::fwd(n, h, d, &mut a.q, &self.cos, &self.sin);
            rope::fwd(n, hkv, d, &mut a.k, &self.cos, &self.sin);
            attention::fwd(&shape, &b.cu, &a.q, &a.k, &a.v, &mut a.att, &mut a.lse);
            // x2 = x + att·Woᵀ (+ bo)
            mm::nt(n, c, qd, &a.att, p[li.o], &mut a.x2, false);
            if let Some(bi) = li.ob {
                mm::add_bias(n, c, &mut a.x2, p[bi]);
            }
            act::add_into(&mut a.x2, &a.x);
            norm::fwd(n, c, &a.x2, p[li.ln2], eps, &mut a.h2, &mut a.rstd2);
            let lq = self.quant.as_ref();
            let on = |i: usize| lq.map(|q| q.on(i)).unwrap_or(false);
            if let Some(q) = lq {
                let qw = &mut self.qw[l];
                for (j, (lin, w, k)) in
                    [(GATE, li.gate, c), (UP, li.up, c), (DOWN, li.down, i_dim)].into_iter().enumerate()
                {
                    if q.on(lin) {
                        q.weight(p[w], k, &mut qw[j])?;
                    }
                }
                if q.on(GATE) || q.on(UP) {
                    a.h2q.clone_from(&a.h2);
                    q.act(l, if q.on(GATE) { GATE } else { UP }, &mut a.h2q, c)?;
                }
            }
            let qw = self.qw.get(l);
            let pick = |on: bool, j: usize, dense: usize| {
                if on {
                    &qw.expect("set with the quantizer")[j][..]
                } else {
                    p[dense]
                }
            };
            let (wg, wu, wd) = (pick(on(GATE), 0, li.gate), pick(on(UP), 1, li.up), pick(on(DOWN), 2, li.down));
            let xg = if on(GATE) { &a.h2q } else { &a.h2 };
            let xu = if on(UP) { &a.h2q } else { &a.h2 };
            mm::nt(n, i_dim, c, xg, wg, &mut a.g, false);
            mm::nt(n, i_dim, c, xu, wu, &mut a.u, false);
            if let Some(bi) = li.gb {
                mm::add_bias(n, i_dim, &mut a.g, p[bi]);
            }
            if let Some(bi) = li.ub {
                mm::add_bias(n, i_dim, &mut a.u, p[bi]);
            }
            act::swiglu_fwd(&a.g, &a.u, &mut a.a);
            if let (Some(q), true) = (lq, on(DOWN)) {
                a.aq.clone_from(&a.a);
                q.act(l, DOWN, &mut a.aq, i_dim)?;
            }
            // x = x2 + a·Wdᵀ (+ bd)
            mm::nt(n, c, i_dim, if on(DOWN) { &a.aq } else { &a.a }, wd, &mut x, false);
            if let Some(bi) = li.db {
                mm::add_bias(n, c, &mut x, p[bi]);
            }
            act::add_into(&mut x, &a.x2);
        }
        resize(&mut self.rstdf, n);
        resize(&mut self.hf, n * c);
        self.xf = x;
        norm::fwd(n, c, &self.xf, p[self.norm_f], eps, &mut self.hf, &mut self.rstdf);
        Ok(())
    }

    fn scratch(&mut self, chunk: usize) -> &mut lm_head::Scratch<T> {
        let (c, v) = (self.cfg.hidden_size, self.cfg.vocab_size);
        if self.scratch.as_ref().map(|s| s.chunk() != chunk).unwrap_or(true) {
            self.scratch = Some(lm_head::Scratch::new(chunk.max(1), c, v));
        }
        self.scratch.as_mut().expect("set above")
    }

    /// Bytes of the LM-head chunk scratch (bounded by chunk × vocab, not by the batch).
    pub fn loss_scratch_bytes(&self) -> usize {
        self.scratch.as_ref().map(|s| s.size_bytes()).unwrap_or(0)
    }

    /// logp and entropy (M) of the batch's scored rows at temperature `t`, after [`Self::forward`].
    pub fn token_stats(&mut self, p: &[&[T]], b: &TrainBatch, t: T, chunk: usize, logp: &mut [T], entropy: &mut [T]) {
        let (c, v) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let head = p[self.head];
        let hf = std::mem::take(&mut self.hf);
        lm_head::stats(c, v, &b.rows, &b.targets, &hf, head, t, self.scratch(chunk), logp, entropy);
        self.hf = hf;
    }

    /// The fused loss pass and the backward of every layer: gradients of Σ_i −coef_i·logp_i
    /// accumulated into `grads` (parameter order). Returns that loss value.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &mut self,
        p: &[&[T]],
        b: &TrainBatch,
        coef: &[T],
        t: T,
        chunk: usize,
        grads: &mut [Vec<T>],
    ) -> Result<T> {
        self.backward_centered(p, b, coef, None, t, chunk, grads)
    }

    /// [`Self::backward`] with an optional score-centering target per scored row.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_centered(
        &mut self,
        p: &[&[T]],
        b: &TrainBatch,
        coef: &[T],
        center: Option<&lm_head::Center>,
        t: T,
        chunk: usize,
        grads: &mut [Vec<T>],
    ) -> Result<T> {
        let cfg = self.cfg.clone();
        let (c, i_dim, h, hkv, d, v) =
            (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size);
        let (qd, kd) = (h * d, hkv * d);
        let n = self.n;
        if b.tokens.len() != n || coef.len() != b.rows.len() {
            bail!("backward: batch or coefficients do not match the last forward");
        }
        // LM head + loss.
        let mut dh = vec![T::zero(); n * c]; // (N, C) gradient w.r.t. the final normed hidden
        let hf = std::mem::take(&mut self.hf);
        let head = self.head;
        if let Some(ct) = center {
            if ct.ids.len() != ct.k * coef.len()
                || ct.probs.len() != ct.ids.len()
                || ct.ids.iter().any(|&i| i as usize >= v)
            {
                bail!(
                    "backward: the centering target does not match the batch ({} ids for {} rows of k = {})",
                    ct.ids.len(),
                    coef.len(),
                    ct.k
                );
            }
        }
        let loss = lm_head::grad_centered(
            c,
            v,
            &b.rows,
            &b.targets,
            coef,
            center,
            &hf,
            p[head],
            t,
            self.scratch(chunk),
            &mut dh,
            &mut grads[head],
        );
        self.hf = hf;
        // Final norm.
        let mut dx = vec![T::zero(); n * c]; // (N, C) gradient w.r.t. the residual stream
        norm::bwd(n, c, &dh, &self.xf, p[self.norm_f], &self.rstdf, &mut dx, false, &mut grads[self.norm_f]);
        let shape = attention::Shape { heads: h, kv_heads: hkv, head_dim: d };
        let mut da = vec![T::zero(); n * i_dim];
        let mut dg = vec![T::zero(); n * i_dim];
        let mut du = vec![T::zero(); n * i_dim];
        let mut dh2 = vec![T::zero(); n * c];
        let mut datt = vec![T::zero(); n * qd];
        let (mut dq, mut dk, mut dv) = (vec![T::zero(); n * qd], vec![T::zero(); n * kd], vec![T::zero(); n * kd]);
        let (mut dqr, mut dkr) = (vec![T::zero(); n * qd], vec![T::zero(); n * kd]);
        let mut dh1 = vec![T::zero(); n * c];
        for l in (0..cfg.num_layers).rev() {
            let li = self.layers[l];
            let a = &self.acts[l];
            // MLP: x_out = x2 + down(a); dx flows to x2 directly and through the MLP. Linears
            // of the NVFP4 learner use their quantized operands (straight-through estimator).
            let on = |i: usize| self.quant.as_ref().map(|q| q.on(i)).unwrap_or(false);
            let qw = self.qw.get(l);
            let pick = |on: bool, j: usize, dense: usize| {
                if on {
                    &qw.expect("set with the quantizer")[j][..]
                } else {
                    p[dense]
                }
            };
            let (wg, wu, wd) = (pick(on(GATE), 0, li.gate), pick(on(UP), 1, li.up), pick(on(DOWN), 2, li.down));
            let xg = if on(GATE) { &a.h2q } else { &a.h2 };
            let xu = if on(UP) { &a.h2q } else { &a.h2 };
            mm::nn(n, c, i_dim, &dx, wd, &mut da, false);
            mm::tn(n, c, i_dim, &dx, if on(DOWN) { &a.aq } else { &a.a }, &mut grads[li.down], true);
            if let Some(bi) = li.db {
                mm::bias_grad(n, c, &dx, &mut grads[bi]);
            }
            act::swiglu_bwd(&da, &a.g, &a.u, &mut dg, &mut du);
            mm::nn(n, i_dim, c, &dg, wg, &mut dh2, false);
            mm::nn(n, i_dim, c, &du, wu, &mut dh2, true);
            mm::tn(n, i_dim, c, &dg, xg, &mut grads[li.gate], true);
            mm::tn(n, i_dim, c, &du, xu, &mut grads[li.up], true);
            if let Some(bi) = li.gb {
                mm::bias_grad(n, i_dim, &dg, &mut grads[bi]);
            }
            if let Some(bi) = li.ub {
                mm::bias_grad(n, i_dim, &du, &mut grads[bi]);
            }
            // dx now holds d/dx2 (residual) + the norm's contribution.
            norm::bwd(n, c, &dh2, &a.x2, p[li.ln2], &a.rstd2, &mut dx, true, &mut grads[li.ln2]);
            // Attention block: x2 = x + o(att).
            mm::nn(n, c, qd, &dx, p[li.o], &mut datt, false);
            mm::tn(n, c, qd, &dx, &a.att, &mut grads[li.o], true);
            if let Some(bi) = li.ob {
                mm::bias_grad(n, c, &dx, &mut grads[bi]);
            }
            attention::bwd(&shape, &self.cu, &a.q, &a.k, &a.v, &a.att, &a.lse, &datt, &mut dq, &mut dk, &mut dv);
            rope::bwd(n, h, d, &mut dq, &self.cos, &self.sin);
            rope::bwd(n, hkv, d, &mut dk, &self.cos, &self.sin);
            match (li.qn, li.kn) {
                (Some(qn), Some(kn)) => {
                    norm::bwd(n * h, d, &dq, &a.qraw, p[qn], &a.rq, &mut dqr, false, &mut grads[qn]);
                    norm::bwd(n * hkv, d, &dk, &a.kraw, p[kn], &a.rk, &mut dkr, false, &mut grads[kn]);
                }
                _ => {
                    dqr.copy_from_slice(&dq);
                    dkr.copy_from_slice(&dk);
                }
            }
            mm::nn(n, qd, c, &dqr, p[li.q], &mut dh1, false);
            mm::nn(n, kd, c, &dkr, p[li.k], &mut dh1, true);
            mm::nn(n, kd, c, &dv, p[li.v], &mut dh1, true);
            mm::tn(n, qd, c, &dqr, &a.h1, &mut grads[li.q], true);
            mm::tn(n, kd, c, &dkr, &a.h1, &mut grads[li.k], true);
            mm::tn(n, kd, c, &dv, &a.h1, &mut grads[li.v], true);
            for (bi, g, w) in [(li.qb, &dqr, qd), (li.kb, &dkr, kd), (li.vb, &dv, kd)] {
                if let Some(bi) = bi {
                    mm::bias_grad(n, w, g, &mut grads[bi]);
                }
            }
            norm::bwd(n, c, &dh1, &a.x, p[li.ln1], &a.rstd1, &mut dx, true, &mut grads[li.ln1]);
        }
        act::embed_bwd(c, &self.tokens, &dx, &mut grads[self.embed], cfg.pad_token_id);
        Ok(loss)
    }
}
