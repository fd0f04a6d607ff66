//! The NVFP4 learner's straight-through backward (`[learner] precision = "nvfp4"`, seed 004
//! §5.1; src/model/learner_quant.rs) against f64 central finite differences of an independent
//! reference: every gradient entry of every parameter tensor, on tiny llama (GQA, llama3 rope,
//! all biases), qwen2 (tied head) and qwen3 (q/k norm) models, with all / some MLP linears in
//! NVFP4, with and without the RHT and stochastic rounding, per-token and fixed activation scales.
//!
//! What the STE means, precisely. The forward computes y = Q(x)·Q(W)ᵀ (+ b) for each chosen
//! linear, Q the NVFP4 fake-quantizer. The STE backward takes ∂Q(z)/∂z := I (scales, amax and
//! rounding all treated as constants), so by the chain rule it is *exactly* the gradient, at θ₀,
//! of the smooth surrogate in which every quantizer is replaced by z ↦ z + c_z with the constant
//! c_z = Q(z₀) − z₀ frozen at θ₀ (z₀ the value of that weight / activation at θ₀). Equivalently:
//! dx = dy·Q(W), dW = dyᵀ·Q(x), and the gradient w.r.t. the unquantized x and W is that same
//! dx and dW (identity through Q). For a weight this is the finite difference with the weight
//! perturbed after quantization (W' = Q(W₀) + ε·e_ij); for everything upstream of a quantized
//! activation it also fixes what flows back through it. The surrogate is smooth in every
//! parameter, so finite differences check every tensor, not only the last down_proj.
//!
//! Independence: the reference forward below is written here in plain f64 loops (no
//! `colotrain::ops`, no `Trainable`); from the crate it takes only the parameter layout
//! (`param_specs`), the RoPE inverse frequencies (config-level; `model::rope::inv_freq`), and the
//! quantizer itself (`LearnerQuant::weight` / `act`) to obtain the frozen points Q(z₀): the
//! quantizer is the forward, checked against the engine bit for bit in learner_quant.rs' unit
//! tests; what is under test here is how the backward (src/model/trainable.rs) wires the
//! quantized operands and passes gradients through the quantizers.
//!
//! Checks, per case:
//! 1. the loss `Trainable::backward` returns (its quantized forward) equals the reference's loss
//!    at θ₀ (the surrogate is anchored at the real NVFP4 forward): |a − b| ≤ 1e-10·max(1, |b|);
//! 2. every entry: |g − g_fd| ≤ 1e-7 + 1e-5·|g_fd| (central differences, h = 1e-5, f64);
//! 3. the check discriminates: on every NVFP4 weight, the STE gradient differs from the dense
//!    (unquantized) model's gradient at the same master weights by ≥ 5 % in norm, far above (2).

mod common;

use colotrain::model::config::{Arch, ModelConfig};
use colotrain::model::learner_quant::{LearnerQuant, DOWN, GATE, UP};
use colotrain::model::trainable::{TrainBatch, Trainable};
use colotrain::model::weights::param_specs;
use colotrain::quant::nvfp4::Nvfp4Opts;
use colotrain::rand::Stream;
use std::collections::HashMap;

const H: f64 = 1e-5;
const ATOL: f64 = 1e-7;
const RTOL: f64 = 1e-5;

// NVFP4 blocks are 16 values along the reduction dimension: C and I multiples of 16.
fn cfg(arch: Arch) -> ModelConfig {
    common::grad_cfg(arch, 16, 32, 8)
}

fn batch() -> TrainBatch {
    common::grad_batch()
}

/// The frozen quantization points of the surrogate: c = Q(z₀) − z₀ per quantized weight
/// (by parameter index) and per layer's quantized activations (the gate/up input, the down input).
#[derive(Default)]
struct Frozen {
    w: HashMap<usize, Vec<f64>>,
    h2: Vec<Option<Vec<f64>>>,
    a: Vec<Option<Vec<f64>>>,
}

/// z + c, recording c = Q(z) − z first when `record` (q quantizes its argument in place).
fn ste(z: &[f64], c: &mut Option<Vec<f64>>, record: bool, q: impl FnOnce(&mut Vec<f64>)) -> Vec<f64> {
    if record {
        let mut v = z.to_vec();
        q(&mut v);
        *c = Some(v.iter().zip(z).map(|(q, z)| q - z).collect());
    }
    let c = c.as_ref().expect("recorded at θ₀");
    z.iter().zip(c).map(|(z, c)| z + c).collect()
}

/// y (n, out) = x (n, k) · wᵀ (w: (out, k) row-major) + b.
fn linear(x: &[f64], n: usize, k: usize, w: &[f64], out: usize, b: Option<&[f64]>) -> Vec<f64> {
    let mut y = vec![0.0; n * out];
    for t in 0..n {
        for o in 0..out {
            let mut s = b.map(|b| b[o]).unwrap_or(0.0);
            for j in 0..k {
                s += x[t * k + j] * w[o * k + j];
            }
            y[t * out + o] = s;
        }
    }
    y
}

/// RMSNorm of each row of c values: x·(mean(x²) + eps)^(-1/2)·w.
fn rmsnorm(x: &[f64], c: usize, w: &[f64], eps: f64) -> Vec<f64> {
    let mut y = vec![0.0; x.len()];
    for (yr, xr) in y.chunks_mut(c).zip(x.chunks(c)) {
        let r = 1.0 / (xr.iter().map(|v| v * v).sum::<f64>() / c as f64 + eps).sqrt();
        for j in 0..c {
            yr[j] = xr[j] * r * w[j];
        }
    }
    y
}

/// HF rotate_half RoPE on (n, heads·d), angle = f32(pos·inv_freq) as transformers computes it.
fn rope(x: &mut [f64], heads: usize, d: usize, pos: &[u32], inv_freq: &[f32]) {
    let half = d / 2;
    for (t, &p) in pos.iter().enumerate() {
        for h in 0..heads {
            let v = &mut x[(t * heads + h) * d..(t * heads + h + 1) * d];
            for i in 0..half {
                let ang = (p as f32 * inv_freq[i]) as f64;
                let (c, s) = (ang.cos(), ang.sin());
                let (a, b) = (v[i], v[i + half]);
                v[i] = a * c - b * s;
                v[i + half] = b * c + a * s;
            }
        }
    }
}

/// The reference loss Σ_i −coef_i·log_softmax(z_i/T)[y_i] with the chosen MLP linears on
/// Q(x)·Q(W)ᵀ through the surrogate (z + c). With `record`, c is first taken from the learner's
/// quantizer at these parameters (then the value is the NVFP4 forward's loss).
#[allow(clippy::too_many_arguments)]
fn ref_loss(
    cfg: &ModelConfig,
    p: &[Vec<f64>],
    b: &TrainBatch,
    coef: &[f64],
    t: f64,
    lq: &LearnerQuant,
    fz: &mut Frozen,
    record: bool,
) -> f64 {
    let specs = param_specs(cfg);
    let ix: HashMap<String, usize> = specs.iter().enumerate().map(|(i, (n, _))| (n.clone(), i)).collect();
    let get = |n: &str| ix.get(n).map(|&i| p[i].as_slice());
    let (c, id, nh, nkv, d, vocab) =
        (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size);
    let (qd, kd) = (nh * d, nkv * d);
    let n = b.tokens.len();
    let eps = cfg.rms_norm_eps;
    let inv_freq = colotrain::model::rope::inv_freq(&cfg.rope, d);
    if record {
        *fz = Frozen { w: HashMap::new(), h2: vec![None; cfg.num_layers], a: vec![None; cfg.num_layers] };
    }
    let emb = get("model.embed_tokens.weight").unwrap();
    let mut x: Vec<f64> =
        b.tokens.iter().flat_map(|&tok| emb[tok as usize * c..(tok as usize + 1) * c].to_vec()).collect();
    for l in 0..cfg.num_layers {
        let pre = format!("model.layers.{l}");
        let w = |s: &str| get(&format!("{pre}.{s}")).unwrap();
        let bias = |s: &str| get(&format!("{pre}.{s}"));
        // Attention block (never quantized by the learner).
        let h1 = rmsnorm(&x, c, w("input_layernorm.weight"), eps);
        let mut q = linear(&h1, n, c, w("self_attn.q_proj.weight"), qd, bias("self_attn.q_proj.bias"));
        let mut k = linear(&h1, n, c, w("self_attn.k_proj.weight"), kd, bias("self_attn.k_proj.bias"));
        let v = linear(&h1, n, c, w("self_attn.v_proj.weight"), kd, bias("self_attn.v_proj.bias"));
        if cfg.qk_norm {
            q = rmsnorm(&q, d, w("self_attn.q_norm.weight"), eps);
            k = rmsnorm(&k, d, w("self_attn.k_norm.weight"), eps);
        }
        rope(&mut q, nh, d, &b.positions, &inv_freq);
        rope(&mut k, nkv, d, &b.positions, &inv_freq);
        let mut att = vec![0.0; n * qd];
        for s in 0..b.num_seqs() {
            let (r0, r1) = (b.cu[s], b.cu[s + 1]);
            for i in r0..r1 {
                for h in 0..nh {
                    let kh = h / (nh / nkv);
                    let qi = &q[(i * nh + h) * d..(i * nh + h + 1) * d];
                    let sc: Vec<f64> = (r0..=i)
                        .map(|j| (0..d).map(|e| qi[e] * k[(j * nkv + kh) * d + e]).sum::<f64>() / (d as f64).sqrt())
                        .collect();
                    let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = sc.iter().map(|s| (s - mx).exp()).sum();
                    for (jj, j) in (r0..=i).enumerate() {
                        let pj = (sc[jj] - mx).exp() / z;
                        for e in 0..d {
                            att[(i * nh + h) * d + e] += pj * v[(j * nkv + kh) * d + e];
                        }
                    }
                }
            }
        }
        let o = linear(&att, n, qd, w("self_attn.o_proj.weight"), c, bias("self_attn.o_proj.bias"));
        let x2: Vec<f64> = x.iter().zip(&o).map(|(a, b)| a + b).collect();
        let h2 = rmsnorm(&x2, c, w("post_attention_layernorm.weight"), eps);
        // MLP: each NVFP4 linear multiplies surrogate operands Q(x)₀ + (x − x₀) and Q(W)₀ + (W − W₀).
        let mut weight = |name: &str, lin: usize, k: usize| -> Vec<f64> {
            let pi = ix[&format!("{pre}.mlp.{name}.weight")];
            if !lq.on(lin) {
                return p[pi].clone();
            }
            let mut cw = fz.w.remove(&pi);
            let out = ste(&p[pi], &mut cw, record, |v| {
                let src = v.clone();
                lq.weight(&src, k, v).unwrap()
            });
            fz.w.insert(pi, cw.unwrap());
            out
        };
        let (wg, wu, wd) = (weight("gate_proj", GATE, c), weight("up_proj", UP, c), weight("down_proj", DOWN, id));
        // The learner quantizes the gate/up input once (gate's activation scale when gate is on,
        // as the engine's calibration has one input slot for both) and feeds it to whichever of
        // the two is on; the other reads h2 unquantized.
        let h2q = if lq.on(GATE) || lq.on(UP) {
            let lin = if lq.on(GATE) { GATE } else { UP };
            ste(&h2, &mut fz.h2[l], record, |v| lq.act(l, lin, v, c).unwrap())
        } else {
            h2.clone()
        };
        let xg = if lq.on(GATE) { &h2q } else { &h2 };
        let xu = if lq.on(UP) { &h2q } else { &h2 };
        let g = linear(xg, n, c, &wg, id, bias("mlp.gate_proj.bias"));
        let u = linear(xu, n, c, &wu, id, bias("mlp.up_proj.bias"));
        let a: Vec<f64> = g.iter().zip(&u).map(|(&g, &u)| g / (1.0 + (-g).exp()) * u).collect();
        let aq = if lq.on(DOWN) { ste(&a, &mut fz.a[l], record, |v| lq.act(l, DOWN, v, id).unwrap()) } else { a };
        let down = linear(&aq, n, id, &wd, c, bias("mlp.down_proj.bias"));
        x = x2.iter().zip(&down).map(|(a, b)| a + b).collect();
    }
    let hf = rmsnorm(&x, c, get("model.norm.weight").unwrap(), eps);
    let head = get(if cfg.tie_word_embeddings { "model.embed_tokens.weight" } else { "lm_head.weight" }).unwrap();
    let mut loss = 0.0;
    for ((&r, &y), &cf) in b.rows.iter().zip(&b.targets).zip(coef) {
        let z = linear(&hf[r as usize * c..(r as usize + 1) * c], 1, c, head, vocab, None);
        let z: Vec<f64> = z.iter().map(|v| v / t).collect();
        let mx = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = mx + z.iter().map(|v| (v - mx).exp()).sum::<f64>().ln();
        loss -= cf * (z[y as usize] - lse);
    }
    loss
}

struct Case {
    arch: Arch,
    linears: &'static [&'static str],
    opts: Nvfp4Opts,
    /// A fixed (calibrated-like) activation global scale for every quantized input, or None for
    /// the per-token scale.
    act_global: Option<f32>,
}

fn trainable_grads(
    cfg: &ModelConfig,
    p: &[Vec<f64>],
    b: &TrainBatch,
    coef: &[f64],
    t: f64,
    lq: Option<LearnerQuant>,
) -> (f64, Vec<Vec<f64>>) {
    let mut m = Trainable::<f64>::new(cfg);
    m.set_quant(lq);
    let ps: Vec<&[f64]> = p.iter().map(|v| v.as_slice()).collect();
    m.forward(&ps, b).unwrap();
    let mut grads: Vec<Vec<f64>> = p.iter().map(|v| vec![0.0; v.len()]).collect();
    // Chunk 3 < 7 scored rows: the chunked loss pass runs across chunk boundaries.
    let l = m.backward(&ps, b, coef, t, 3, &mut grads).unwrap();
    (l, grads)
}

#[test]
fn nvfp4_learner_backward_is_the_straight_through_gradient() {
    let cases = [
        Case {
            arch: Arch::Llama,
            linears: &["gate_proj", "up_proj", "down_proj"],
            opts: Nvfp4Opts::default(),
            act_global: None,
        },
        Case {
            arch: Arch::Qwen3,
            linears: &["gate_proj", "up_proj", "down_proj"],
            opts: Nvfp4Opts { rht: Some(3), stochastic: Some(5) },
            act_global: Some(2.5 / 2688.0),
        },
        Case {
            arch: Arch::Qwen2,
            linears: &["down_proj"],
            opts: Nvfp4Opts { rht: Some(7), stochastic: None },
            act_global: None,
        },
        Case {
            arch: Arch::Llama,
            linears: &["up_proj", "down_proj"],
            opts: Nvfp4Opts { rht: None, stochastic: Some(11) },
            act_global: Some(0.5 / 2688.0),
        },
        Case { arch: Arch::Qwen3, linears: &["gate_proj"], opts: Nvfp4Opts::default(), act_global: None },
    ];
    for (ci, case) in cases.iter().enumerate() {
        let cfg = cfg(case.arch);
        let specs = param_specs(&cfg);
        let mut rng = Stream::new(2024, ci as u64);
        let mut p: Vec<Vec<f64>> = common::grad_params(&specs, &mut rng);
        let b = batch();
        let coef: Vec<f64> = (0..b.rows.len()).map(|_| rng.normal()).collect();
        let t = 0.7;
        let names: Vec<String> = case.linears.iter().map(|s| s.to_string()).collect();
        let mut lq = LearnerQuant::new(&names, case.opts, cfg.num_layers).unwrap();
        if let Some(g) = case.act_global {
            for a in lq.act_global.iter_mut() {
                *a = [Some(g); 7];
            }
        }
        let tag =
            format!("case {ci} {:?} {:?} {:?} act_global {:?}", case.arch, case.linears, case.opts, case.act_global);

        let (l0, grads) = trainable_grads(&cfg, &p, &b, &coef, t, Some(lq.clone()));
        let mut fz = Frozen::default();
        let lref = ref_loss(&cfg, &p, &b, &coef, t, &lq, &mut fz, true);
        // (1) The surrogate is anchored at the real NVFP4 forward.
        assert!(
            (l0 - lref).abs() <= 1e-10 * lref.abs().max(1.0),
            "{tag}: loss from the NVFP4 backward {l0} vs the reference NVFP4 forward {lref}"
        );
        // The surrogate at θ₀ with frozen offsets reproduces that loss (z₀ + (Q(z₀) − z₀)).
        let lsur = ref_loss(&cfg, &p, &b, &coef, t, &lq, &mut fz, false);
        assert!((lsur - lref).abs() <= 1e-12 * lref.abs().max(1.0), "{tag}: surrogate {lsur} vs {lref}");

        // (2) Every gradient entry against central differences of the surrogate.
        let mut worst = (0.0f64, String::new());
        for (pi, (name, _)) in specs.iter().enumerate() {
            let mut any = false;
            for i in 0..p[pi].len() {
                let orig = p[pi][i];
                p[pi][i] = orig + H;
                let lp = ref_loss(&cfg, &p, &b, &coef, t, &lq, &mut fz, false);
                p[pi][i] = orig - H;
                let lm = ref_loss(&cfg, &p, &b, &coef, t, &lq, &mut fz, false);
                p[pi][i] = orig;
                let fd = (lp - lm) / (2.0 * H);
                let g = grads[pi][i];
                let err = (g - fd).abs();
                let tol = ATOL + RTOL * fd.abs();
                assert!(err <= tol, "{tag}: {name}[{i}]: STE gradient {g:e} vs surrogate finite difference {fd:e} (|Δ| {err:e} > {tol:e})");
                if err / tol > worst.0 {
                    worst = (err / tol, format!("{name}[{i}]"));
                }
                any |= fd.abs() > 1e-6;
            }
            assert!(any, "{tag}: {name}: zero finite-difference gradient (tensor unused?)");
        }
        eprintln!("{tag}: worst |Δ|/tol {:.3} at {}", worst.0, worst.1);

        // (3) The quantized operands matter: the dense backward at the same master weights is
        // far from the STE gradient on every NVFP4 weight, so (2) could tell them apart.
        let (_, dense) = trainable_grads(&cfg, &p, &b, &coef, t, None);
        for l in 0..cfg.num_layers {
            for name in case.linears {
                let pi = specs.iter().position(|(n, _)| *n == format!("model.layers.{l}.mlp.{name}.weight")).unwrap();
                let diff: f64 = grads[pi].iter().zip(&dense[pi]).map(|(a, b)| (a - b).powi(2)).sum::<f64>().sqrt();
                let norm: f64 = grads[pi].iter().map(|a| a * a).sum::<f64>().sqrt();
                assert!(
                    diff >= 0.05 * norm,
                    "{tag}: layer {l} {name}: STE gradient within {:.3} of the dense one",
                    diff / norm
                );
                eprintln!("{tag}: layer {l} {name}: ‖g_ste − g_dense‖/‖g_ste‖ = {:.3}", diff / norm);
            }
        }
    }
}
