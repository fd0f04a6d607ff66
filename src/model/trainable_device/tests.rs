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

/// The NVFP4 learner's test model: a 2-layer qwen3 (C = 32, I = 48), its parameters, the
/// batch, the loss coefficients, and a learner on all MLP linears with RHT and stochastic
/// rounding, per-token scales for gate/up and a fixed scale for down.
struct Nvfp4Case {
    cfg: ModelConfig,
    specs: Vec<(String, Vec<usize>)>,
    params: Vec<Vec<f32>>,
    b: TrainBatch,
    coef: Vec<f32>,
    lq: LearnerQuant,
}

fn nvfp4_case() -> Nvfp4Case {
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
    let coef = data(b.rows.len(), 8, 1.0, 0.0);
    let names: Vec<String> = ["gate_proj", "up_proj", "down_proj"].iter().map(|s| s.to_string()).collect();
    let opts = Nvfp4Opts { rht: Some(3), stochastic: Some(9) };
    let mut lq = LearnerQuant::new(&names, opts, cfg.num_layers).unwrap();
    for l in 0..cfg.num_layers {
        lq.act_global[l][DOWN] = Some(0.002);
    }
    Nvfp4Case { cfg, specs, params, b, coef, lq }
}

/// ‖a − b‖ / ‖b‖.
fn rel(a: &[f32], b: &[f32]) -> f64 {
    let d: f64 = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y as f64).powi(2)).sum::<f64>().sqrt();
    d / b.iter().map(|&y| (y as f64).powi(2)).sum::<f64>().sqrt().max(1e-30)
}

/// The NVFP4 learner on the device twin against the CPU twin (`Trainable<f32>` with the same
/// `LearnerQuant`, itself checked against finite differences in tests/grad_nvfp4.rs): the
/// loss within 1e-4 relative and every gradient within 1e-3 relative norm (f32 against f32
/// in other orders; a value within rounding of an NVFP4 decision boundary may round the
/// other way). The quantized MLP weights' gradients differ from the dense model's by ≥ 5%
/// in norm, so the check sees the learner. All MLP linears, RHT and stochastic rounding,
/// per-token scales for gate/up and a fixed scale for down (`nvfp4_case`).
fn check_nvfp4(dev: &Device) {
    let Nvfp4Case { cfg, specs, params, b, coef, lq } = nvfp4_case();
    let m = b.rows.len();
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

/// A tiny qwen3 of `layers` layers for the memory tests.
fn memory_cfg(layers: usize) -> ModelConfig {
    memory_cfg_arch("qwen3", layers)
}

/// [`memory_cfg`] of `arch` (qwen3 has q/k-norm, qwen2 not).
fn memory_cfg_arch(arch: &str, layers: usize) -> ModelConfig {
    let spec = TinySpec {
        arch: arch.into(),
        layers,
        hidden: 64,
        heads: 4,
        kv_heads: 2,
        head_dim: Some(16),
        intermediate: Some(160),
        vocab: 300,
        max_position: 64,
        tie: false,
    };
    tiny_config(&spec).unwrap()
}

/// 16 sequences of a 5-token prompt and a 15-token response (vocabulary 300).
fn batch_16x20() -> TrainBatch {
    let mut b = TrainBatch::default();
    for i in 0..16u32 {
        b.push(&[1 + i, 2, 3, 4, 5], &(0..15).map(|j| (i * 7 + j * 3) % 300).collect::<Vec<_>>());
    }
    b
}

/// One step (forward, statistics, backward) of 16 sequences of 20 tokens on a fresh simulated
/// sm_90a device `ordinal`: (the allocator's high-water mark beyond the parameters and
/// gradients, the planned activation bytes, the gradients). F32 weights without the learner,
/// BF16 with it on gate, up and down.
fn measure_step(
    cfg: &ModelConfig,
    keep: LearnerKeep,
    checkpoint: bool,
    ordinal: usize,
) -> (usize, usize, Vec<Vec<f32>>) {
    let dtype = if keep == LearnerKeep::Off { DType::F32 } else { DType::BF16 };
    measure_step_with(cfg, keep, dtype, true, checkpoint, ordinal)
}

/// [`measure_step`] with weights of `dtype` and the BF16 operands on or off
/// (`set_bf16_inputs`); the plan counts what `bf16_inputs` gives.
fn measure_step_with(
    cfg: &ModelConfig,
    keep: LearnerKeep,
    dtype: DType,
    bf16_inputs: bool,
    checkpoint: bool,
    ordinal: usize,
) -> (usize, usize, Vec<Vec<f32>>) {
    use crate::device::cuda::CudaDevice;
    let cd = CudaDevice::sim_unshared_arch(ordinal, "sm_90a");
    let dev = Device::Cuda(cd.clone());
    let specs = param_specs(cfg);
    let b = batch_16x20();
    let (n, m, chunk) = (b.tokens.len(), b.rows.len(), 64);
    let names: Vec<String> = ["gate_proj", "up_proj", "down_proj"].iter().map(|s| s.to_string()).collect();
    let opts = crate::quant::nvfp4::Nvfp4Opts { rht: Some(3), stochastic: None };
    let pt: Vec<Tensor> = specs
        .iter()
        .enumerate()
        .map(|(i, (_, s))| dev.from_f32(dtype, s, &data(s.iter().product(), i as u64, 0.1, 0.0)).unwrap())
        .collect();
    let pr: Vec<&Tensor> = pt.iter().collect();
    let mut grads: Vec<Tensor> = specs.iter().map(|(_, s)| dev.zeros(DType::F32, s).unwrap()).collect();
    let coef = dev.from_f32(DType::F32, &[m], &data(m, 1, 1.0, 0.0)).unwrap();
    let (mut lp, mut en) = (dev.zeros(DType::F32, &[m]).unwrap(), dev.zeros(DType::F32, &[m]).unwrap());
    let mut t = DeviceTrainable::new(cfg, &dev).unwrap();
    t.set_checkpointing(checkpoint);
    t.set_bf16_inputs(bf16_inputs);
    if keep != LearnerKeep::Off {
        t.set_quant(Some(LearnerQuant::new(&names, opts, cfg.num_layers).unwrap()));
        t.set_exact_learner(keep == LearnerKeep::Rounded);
    }
    let learner = keep != LearnerKeep::Off;
    let ops = match bf16_inputs {
        true => Bf16Operands::of(cfg, dtype, [learner; 3]),
        false => Bf16Operands { head: dtype == DType::BF16, ..Default::default() },
    };
    let (in_use, cached, _, _) = cd.memory();
    t.forward(&pr, &b).unwrap();
    t.token_stats(&pr, 1.0, chunk, &mut lp, &mut en).unwrap();
    t.backward(&pr, &coef, None, 1.0, chunk, &mut grads).unwrap();
    let used = cd.memory().2 - (in_use + cached);
    let planned = DeviceTrainable::activation_bytes(cfg, n, chunk, keep, checkpoint, ops);
    (used, planned, grads.iter().map(|g| g.to_f32_vec().unwrap()).collect())
}

/// The memory plan's activation reserve covers what a step allocates beyond the weights:
/// the forward's saved state, the loss pass and the backward of 16 sequences of 20 tokens
/// on a device of its own, measured by the allocator's high-water mark; and it is no more
/// than twice that (the plan does not waste the KV cache's room). Without the NVFP4 learner
/// (F32 weights), and with it on BF16 weights keeping its codes or its rounded f32 copies
/// (`set_exact_learner`): the codes' step takes less. Each again with activation
/// checkpointing: less memory than without, still covered by the plan, and the same
/// gradients bit for bit (the layers run again on the same inputs).
#[test]
fn the_planned_activation_bytes_cover_a_step() {
    let cfg = memory_cfg(2);
    let keeps = [LearnerKeep::Off, LearnerKeep::Codes, LearnerKeep::Rounded];
    let mut steps = Vec::new();
    for (checkpoint, base) in [(false, 67), (true, 84)] {
        for (i, keep) in keeps.into_iter().enumerate() {
            let (used, planned, grads) = measure_step(&cfg, keep, checkpoint, base + i);
            let case = format!("{keep:?}, checkpointing {checkpoint}: {used} bytes used, {planned} planned");
            eprintln!("{case}");
            assert!(used <= planned && planned <= 2 * used, "{case}");
            assert!(grads.iter().flatten().any(|&x| x != 0.0), "{case}: some gradient");
            steps.push((used, grads));
        }
    }
    assert!(steps[1].0 < steps[2].0, "the codes' step took {} bytes, the rounded copies' {}", steps[1].0, steps[2].0);
    let bits = |g: &[Vec<f32>]| g.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
    for i in 0..3 {
        assert!(
            steps[i + 3].0 < steps[i].0,
            "{:?}: {} bytes checkpointed, {} not",
            keeps[i],
            steps[i + 3].0,
            steps[i].0
        );
        assert_eq!(bits(&steps[i + 3].1), bits(&steps[i].1), "{:?}: checkpointed gradients", keeps[i]);
    }
}

/// BF16 weights without the learner: the BF16 operands (h1, h2, a, dg, du) take less of a
/// step's memory than the same step in f32 (`set_bf16_inputs(false)`, the reference, which
/// the plan does not size: its f32 operands' casts take more scratch), and the plan, which
/// counts them at 2 bytes, covers the step within a factor of two; it plans less than with
/// f32 operands by 2 bytes a value of them: per token 2·(2C + I) for each layer alive (all,
/// or one checkpointed) and 2·2I for the backward's dg and du.
#[test]
fn bf16_operands_are_planned_at_two_bytes() {
    let cfg = memory_cfg(2);
    let (c, i, tokens) = (cfg.hidden_size, cfg.intermediate_size, 320);
    for (checkpoint, ordinal) in [(false, 107), (true, 109)] {
        let (on, planned_on, g_on) = measure_step_with(&cfg, LearnerKeep::Off, DType::BF16, true, checkpoint, ordinal);
        let (off, planned_off, g_off) =
            measure_step_with(&cfg, LearnerKeep::Off, DType::BF16, false, checkpoint, ordinal + 1);
        let case = format!("checkpointing {checkpoint}: BF16 operands {on} bytes used, {planned_on} planned; f32 {off} used, {planned_off} planned");
        eprintln!("{case}");
        assert!(on < off, "{case}");
        assert!(on <= planned_on && planned_on <= 2 * on, "{case}");
        let alive = if checkpoint { 1 } else { cfg.num_layers };
        assert_eq!(planned_off - planned_on, tokens * (alive * 2 * (2 * c + i) + 2 * 2 * i), "{case}");
        assert_eq!(g_on.len(), g_off.len());
        assert!(g_on.iter().zip(&g_off).all(|(a, b)| a == b), "{case}: the same gradients");
    }
}

/// Without q/k-norm (qwen2) the projections write q and k themselves and a layer keeps no
/// raw rows: against the same shapes with q/k-norm (qwen3) the step's high-water mark is
/// lower by at least the two layers' raw q and k rows, 320 × (64 + 32) f32 each, and the plan
/// still covers it within a factor of two.
#[test]
fn without_qk_norm_a_layer_keeps_no_raw_q_and_k() {
    let (u2, p2, g2) = measure_step(&memory_cfg_arch("qwen2", 2), LearnerKeep::Off, false, 93);
    let (u3, p3, _) = measure_step(&memory_cfg_arch("qwen3", 2), LearnerKeep::Off, false, 94);
    eprintln!("qwen2: {u2} bytes used, {p2} planned; qwen3: {u3} used, {p3} planned");
    assert!(u2 <= p2 && p2 <= 2 * u2, "qwen2: {u2} used, {p2} planned");
    assert!(u3 >= u2 + 2 * 320 * 96 * 4, "qwen3 {u3} bytes, qwen2 {u2}");
    assert!(p3 >= p2 + 2 * 320 * 96 * 4, "planned: qwen3 {p3} bytes, qwen2 {p2}");
    assert!(g2.iter().flatten().any(|&x| x != 0.0), "some gradient");
}

/// Checkpointed, a step's memory grows by each added layer's saved input (N, C): from 2 to 6
/// layers the plan grows as the measured high-water mark does, within a tenth.
#[test]
fn checkpointed_activations_grow_by_the_layers_inputs() {
    let (u2, p2, _) = measure_step(&memory_cfg(2), LearnerKeep::Off, true, 87);
    let (u6, p6, _) = measure_step(&memory_cfg(6), LearnerKeep::Off, true, 88);
    let (du, dp) = ((u6 - u2) as f64, p6 as f64 - p2 as f64);
    assert!(du >= 4.0 * 320.0 * 64.0 * 4.0, "4 more layers' inputs of 320 × 64 f32: {du} bytes");
    assert!((dp - du).abs() <= 0.1 * du, "planned growth {dp} bytes, measured {du}");
}

#[cfg(feature = "cuda")]
#[test]
fn device_twin_cuda() {
    every_arch(&Device::cuda(0).unwrap());
}

/// With BF16 weights on CUDA the NVFP4 learner keeps only its codes and its backward
/// multiplies them again in BF16 (`LearnerKeep::Codes`). Against the same step keeping the
/// rounded f32 copies (`set_exact_learner`: the CPU twin's F32 arithmetic, held to the CPU by
/// `check_nvfp4`), on both profiles: the same
/// forward (the loss bit for bit: both multiply the codes); the MLP weights' gradients within
/// 5e-3 relative norm (the codes' backward rounds dy to BF16, as the dense BF16 linears'
/// backward does: 2⁻⁹ an element; 3e-3 measured), every other gradient within 2e-2 (that
/// rounding then flows back through the layers below, and the q/k-norm gains' sums cancel:
/// 1e-2 measured); the MLP weights' gradients ≥ 5% from the dense model's (the check sees
/// the learner). All MLP linears, RHT and stochastic rounding, per-token scales for
/// gate/up and a fixed scale for down; then the learner on down_proj alone (per-token
/// scales), the other linears dense in the same layers.
#[test]
fn the_learners_codes_backward_is_its_exact_backward_in_bf16_sim() {
    use crate::device::cuda::CudaDevice;
    let Nvfp4Case { cfg, specs, params, b, coef, lq: all } = nvfp4_case();
    let down_only = LearnerQuant::new(&["down_proj".to_string()], all.opts, cfg.num_layers).unwrap();
    let m = b.rows.len();
    // (loss, gradients) with the learner lq (Some(exact)) or without.
    let step = |dev: &Device, lq: &LearnerQuant, exact: Option<bool>| {
        let pt: Vec<Tensor> =
            specs.iter().zip(&params).map(|((_, s), v)| dev.from_f32(DType::BF16, s, v).unwrap()).collect();
        let pr: Vec<&Tensor> = pt.iter().collect();
        let mut grads: Vec<Tensor> = specs.iter().map(|(_, s)| dev.zeros(DType::F32, s).unwrap()).collect();
        let coef_t = dev.from_f32(DType::F32, &[m], &coef).unwrap();
        let mut t = DeviceTrainable::new(&cfg, dev).unwrap();
        t.set_quant(exact.map(|_| lq.clone()));
        t.set_exact_learner(exact == Some(true));
        t.forward(&pr, &b).unwrap();
        let loss = t.backward(&pr, &coef_t, None, 1.0, 4, &mut grads).unwrap();
        (loss, grads.iter().map(|g| g.to_f32_vec().unwrap()).collect::<Vec<_>>())
    };
    let sm100 = Device::Cuda(CudaDevice::sim_arch(7, Some("sm_100a")).unwrap());
    for dev in [Device::parse("cuda-sim:0").unwrap(), sm100] {
        for (lq, on) in [(&all, "mlp"), (&down_only, "down_proj")] {
            let what = format!("{} learner on {on}", dev.name());
            let (loss, g) = step(&dev, lq, Some(false));
            let (loss_x, g_x) = step(&dev, lq, Some(true));
            let (_, g_dense) = step(&dev, lq, None);
            assert_eq!(loss.to_bits(), loss_x.to_bits(), "{what}: the same forward, the same loss");
            let worst = (0..specs.len()).map(|i| rel(&g[i], &g_x[i])).fold(0.0, f64::max);
            eprintln!("{what}: the largest relative gradient difference {worst:e}");
            for (i, (name, _)) in specs.iter().enumerate() {
                let e = rel(&g[i], &g_x[i]);
                let tol = if name.contains("mlp") { 5e-3 } else { 2e-2 };
                assert!(e <= tol, "{what}: {name} relative gradient error {e:e} against the exact backward");
                if name.contains(on) {
                    let e = rel(&g[i], &g_dense[i]);
                    assert!(e >= 0.05, "{what}: {name} is within {e:e} of the dense model's gradient");
                }
            }
        }
    }
}

/// The NVFP4 learner of [`bf16_step`]: off, on down_proj alone (per-token input scales), or on
/// the whole MLP under fixed input scales (an engine's calibration).
#[derive(Clone, Copy, Debug, PartialEq)]
enum StepLearner {
    Off,
    Down,
    MlpFixed,
}

/// One step of 16 sequences of 20 tokens with BF16 weights on a fresh simulated sm_90a device
/// `ordinal`, with `learner`: (the bits of the loss, the token statistics and every gradient;
/// the `ct_cast` launches and the bytes of all launches).
fn bf16_step(cfg: &ModelConfig, ordinal: usize, bf16_inputs: bool, learner: StepLearner) -> (Vec<u32>, u64, f64) {
    use crate::device::cuda::{ledger, CudaDevice};
    let cd = CudaDevice::sim_unshared_arch(ordinal, "sm_90a");
    let dev = Device::Cuda(cd.clone());
    let specs = param_specs(cfg);
    let b = batch_16x20();
    let (m, chunk) = (b.rows.len(), 64);
    let params = random_params(&specs, 5);
    let pt: Vec<Tensor> =
        specs.iter().zip(&params).map(|((_, s), v)| dev.from_f32(DType::BF16, s, v).unwrap()).collect();
    let pr: Vec<&Tensor> = pt.iter().collect();
    let mut grads: Vec<Tensor> = specs.iter().map(|(_, s)| dev.zeros(DType::F32, s).unwrap()).collect();
    let coef = dev.from_f32(DType::F32, &[m], &data(m, 1, 1.0, 0.0)).unwrap();
    let (mut lp, mut en) = (dev.zeros(DType::F32, &[m]).unwrap(), dev.zeros(DType::F32, &[m]).unwrap());
    let mut t = DeviceTrainable::new(cfg, &dev).unwrap();
    t.set_bf16_inputs(bf16_inputs);
    let opts = crate::quant::nvfp4::Nvfp4Opts { rht: Some(3), stochastic: None };
    let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<String>>();
    match learner {
        StepLearner::Off => {}
        StepLearner::Down => {
            t.set_quant(Some(LearnerQuant::new(&names(&["down_proj"]), opts, cfg.num_layers).unwrap()))
        }
        StepLearner::MlpFixed => {
            let mut q =
                LearnerQuant::new(&names(&["gate_proj", "up_proj", "down_proj"]), opts, cfg.num_layers).unwrap();
            // Globals of the order of amax / (448·6) for the step's activations.
            q.act_global = vec![[Some(4e-4); 7]; cfg.num_layers];
            t.set_quant(Some(q));
        }
    }
    cd.take_ledger();
    t.forward(&pr, &b).unwrap();
    t.token_stats(&pr, 1.0, chunk, &mut lp, &mut en).unwrap();
    let loss = t.backward(&pr, &coef, None, 1.0, chunk, &mut grads).unwrap();
    let rows = ledger::rows(&cd.take_ledger());
    let casts = rows.iter().filter(|r| r.op == "ct_cast").map(|r| r.launches).sum();
    let bytes = rows.iter().map(|r| r.bytes).sum();
    let mut bits = vec![(loss as f32).to_bits()];
    for x in [&lp, &en].into_iter().chain(grads.iter()) {
        bits.extend(x.to_f32_vec().unwrap().iter().map(|v| v.to_bits()));
    }
    (bits, casts, bytes)
}

/// BF16 weights on CUDA: the norms and SwiGLU write the inputs that only BF16 GEMMs read in
/// BF16 (`set_bf16_inputs`), which is the rounding each GEMM applied to the f32 values: the
/// loss, the token statistics and every gradient are the same bits as with f32 inputs, for
/// llama, qwen2 and qwen3, and with the NVFP4 learner on down_proj (whose input a stays f32:
/// the learner quantizes from f32), and SwiGLU's backward writes dg and du in BF16 for the
/// gate and up projections' gradients. Each dense layer launches 8 roundings fewer (h1, h2 and
/// a before their forward GEMMs and again before their weight gradients; dg and du before
/// their data and weight gradients' GEMMs, which share one), 6 with the learner on down (its a
/// stays f32), and the step moves fewer bytes. With the learner on the whole MLP under fixed
/// input scales, SwiGLU's backward writes dg and du in BF16 for the learner's gradients
/// (`learner_takes_bf16_dy`): 4 roundings fewer (h1's two, dg's and du's; qwen2's MLP has no
/// biases either), the same bits.
#[test]
fn bf16_inputs_are_the_gemms_own_rounding_sim() {
    for (a, arch) in ["llama", "qwen2", "qwen3"].into_iter().enumerate() {
        let cfg = memory_cfg_arch(arch, 2);
        for learner in [StepLearner::Off, StepLearner::Down, StepLearner::MlpFixed] {
            // Devices of their own (the step reads its ledger): 95..106, then 118..123.
            let ordinal = match learner {
                StepLearner::Off => 95 + 4 * a,
                StepLearner::Down => 97 + 4 * a,
                StepLearner::MlpFixed => 118 + 2 * a,
            };
            let what = format!("{arch}, learner {learner:?}");
            let (off, casts_off, bytes_off) = bf16_step(&cfg, ordinal, false, learner);
            let (on, casts_on, bytes_on) = bf16_step(&cfg, ordinal + 1, true, learner);
            assert_eq!(off.len(), on.len(), "{what}");
            let differ = off.iter().zip(&on).filter(|(a, b)| a != b).count();
            assert_eq!(differ, 0, "{what}: {differ} of {} values differ", off.len());
            let saved_per_layer = match learner {
                StepLearner::Off => 8,
                StepLearner::Down => 6,
                StepLearner::MlpFixed => 4,
            };
            eprintln!("{what}: ct_cast {casts_off} -> {casts_on}, {bytes_off:.0} -> {bytes_on:.0} bytes");
            assert_eq!(casts_off - casts_on, saved_per_layer * cfg.num_layers as u64, "{what}");
            assert!(bytes_on < bytes_off, "{what}: {bytes_on} bytes, {bytes_off} with f32 inputs");
        }
    }
}
