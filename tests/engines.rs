//! The rollout engines of seed 000 (§4.2, App. C): zero-copy standard engine, quantized engines
//! rewritten in place, FP8 KV cache capacity, stale ring, fixed seeded weight noise, bad inputs.

mod common;

use colotrain::config::EngineSection;
use colotrain::device::{DType, Device};
use colotrain::engine::rollout_weights::{EngineSpec, RolloutWeights};
use colotrain::engine::{Engine, EngineConfig, Request, SamplingConfig};
use colotrain::model::calib::Calibration;
use colotrain::model::config::{Arch, ModelConfig, Rope, RopeScaling};
use colotrain::model::ModelWeights;
use colotrain::quant::recipe::{KvScale, Recipe};
use std::sync::Arc;

fn cfg() -> ModelConfig {
    ModelConfig {
        arch: Arch::Qwen2,
        vocab_size: 64,
        hidden_size: 32,
        intermediate_size: 64,
        num_layers: 3,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 8,
        rms_norm_eps: 1e-6,
        rope: Rope { theta: 10000.0, scaling: RopeScaling::None },
        max_position_embeddings: 128,
        tie_word_embeddings: false,
        qkv_bias: true,
        o_bias: false,
        mlp_bias: false,
        qk_norm: false,
        bos_token_id: None,
        eos_token_ids: vec![],
        pad_token_id: None,
        torch_dtype: None,
    }
}

fn spec(recipe: &str, noise: f64, staleness: usize) -> EngineSpec {
    EngineSpec {
        recipe: Recipe::preset(recipe, 3, &[], KvScale::Fixed(1.0), Default::default()).unwrap(),
        noise_sigma: noise,
        noise_seed: 7,
        staleness,
    }
}

fn calib(c: &ModelConfig) -> Calibration {
    let mut k = Calibration::new(Calibration::fingerprint(c), c.num_layers);
    for l in 0..c.num_layers {
        k.input_amax[l] = [4.0; 4];
        k.k_amax[l] = 8.0;
        k.v_amax[l] = 2.0;
    }
    k
}

#[test]
fn standard_engine_reads_the_trainer_buffers() {
    let dev = Device::cpu(1).unwrap();
    let c = cfg();
    let w = ModelWeights::random(&c, &dev, DType::BF16, 1, 0.2).unwrap();
    let rw = RolloutWeights::new(&dev, &spec("bf16", 0.0, 0), &c, &w, None, 0).unwrap();
    let v = rw.view(&w);
    assert!(v.q.is_none());
    for (a, b) in v.w.tensors().iter().zip(w.tensors()) {
        assert_eq!(a.data_ptr(), b.data_ptr(), "the BF16 engine must read the trainer's own buffer");
    }
    assert_eq!(rw.extra_bytes(), 0);
}

#[test]
fn quantized_buffers_are_rewritten_in_place() {
    let dev = Device::cpu(1).unwrap();
    let c = cfg();
    let mut w = ModelWeights::random(&c, &dev, DType::F32, 1, 0.2).unwrap();
    for (r, c0) in [("fp8", 0.3f32), ("nvfp4", 0.75)] {
        let mut rw = RolloutWeights::new(&dev, &spec(r, 0.0, 0), &c, &w, Some(&calib(&c)), 0).unwrap();
        let ptrs: Vec<usize> = rw
            .quant
            .as_ref()
            .unwrap()
            .layers
            .iter()
            .flat_map(|l| l.w.iter().flatten().map(|q| q.codes_ptr()))
            .collect();
        assert_eq!(ptrs.len(), 21);
        let snap = |rw: &RolloutWeights| {
            let q = rw.quant.as_ref().unwrap().layers[1].w[4].as_ref().unwrap();
            (q.codes_bytes().unwrap().to_vec(), q.scales_bytes().unwrap().to_vec(), q.scale)
        };
        let before = snap(&rw);
        w.layers[1].gate_proj.write_f32(&vec![c0; 64 * 32]).unwrap();
        rw.sync(&w, 1).unwrap();
        let q = rw.quant.as_ref().unwrap();
        let after: Vec<usize> = q.layers.iter().flat_map(|l| l.w.iter().flatten().map(|q| q.codes_ptr())).collect();
        assert_eq!(ptrs, after, "{r}: a sync must not reallocate");
        assert!(snap(&rw) != before, "{r}: the sync rewrote the codes and scales");
        // A constant quantizes exactly to its scale: the decoded weight is that constant.
        for v in q.layers[1].w[4].as_ref().unwrap().dequantize() {
            assert!((v - c0).abs() < 1e-6 * c0, "{r}: {v}");
        }
    }
    // A NaN weight is an error naming the tensor.
    let mut rw = RolloutWeights::new(&dev, &spec("fp8", 0.0, 0), &c, &w, Some(&calib(&c)), 0).unwrap();
    let mut vals = w.layers[2].down_proj.to_f32_vec().unwrap();
    vals[3] = f32::NAN;
    w.layers[2].down_proj.write_f32(&vals).unwrap();
    let e = format!("{:#}", rw.sync(&w, 2).unwrap_err());
    assert!(e.contains("model.layers.2.mlp.down_proj.weight") && e.contains("NaN"), "{e}");
}

#[test]
fn fp8_kv_cache_holds_more_tokens_in_the_same_memory() {
    let dev = Device::cpu(1).unwrap();
    let c = cfg();
    let budget = 1 << 20;
    let mk = |fp8: bool, dt: DType| {
        let ec =
            EngineConfig { kv_cache_bytes: budget, kv_fp8: vec![(fp8, fp8); 3], max_seqs: 512, ..Default::default() };
        Engine::new(&dev, &c, dt, &ec, None).unwrap().cache.capacity_tokens()
    };
    // Capacity is whole 16-token blocks of the budget: the ratio is exact up to one block.
    for (dt, ratio) in [(DType::BF16, 2), (DType::F32, 4)] {
        let (q, n) = (mk(true, dt), mk(false, dt));
        assert!(q >= ratio * n && q < ratio * n + ratio * 16, "{dt:?}: {q} vs {n}");
    }
}

#[test]
fn fp8_kv_engine_samples_close_to_the_standard_one() {
    let dev = Device::cpu(2).unwrap();
    let c = cfg();
    let w = ModelWeights::random(&c, &dev, DType::F32, 3, 0.15).unwrap();
    let s = Arc::new(SamplingConfig { temperature: 0.0, max_new_tokens: 0, ..Default::default() });
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7 % 64) as u32).collect();
    // Calibrate on the same prompt with the standard engine (the observer records amaxes).
    let mut std_e = Engine::new(&dev, &c, DType::F32, &EngineConfig::default(), None).unwrap();
    std_e.set_observer(Some(Calibration::new(Calibration::fingerprint(&c), 3)));
    std_e
        .add(Request { id: 0, sample: 0, prompt: prompt.clone(), sampling: s.clone(), prompt_logprobs: true })
        .unwrap();
    std_e.run_to_completion(&w, |_| {}).unwrap();
    let cal = std_e.set_observer(None).unwrap();
    assert!(cal.input_amax.iter().all(|a| a.iter().all(|&x| x > 0.0)) && cal.k_amax.iter().all(|&x| x > 0.0));
    let score = |fp8: bool, recipe: &str| {
        let ec = EngineConfig { kv_fp8: vec![(fp8, fp8); 3], ..Default::default() };
        let mut e = Engine::new(&dev, &c, DType::F32, &ec, None).unwrap();
        let sp = EngineSpec {
            recipe: Recipe::preset(recipe, 3, &[], KvScale::Calibrated, Default::default()).unwrap(),
            noise_sigma: 0.0,
            noise_seed: 0,
            staleness: 0,
        };
        let rw = RolloutWeights::new(&dev, &sp, &c, &w, Some(&cal), 0).unwrap();
        e.add(Request { id: 0, sample: 0, prompt: prompt.clone(), sampling: s.clone(), prompt_logprobs: true })
            .unwrap();
        e.run_to_completion(rw.view(&w), |_| {}).unwrap()[0].prompt_logprobs.clone()
    };
    let base = score(false, "bf16");
    let mut prev = 0.0;
    for (fp8, recipe, tol) in [(true, "fp8-kv", 0.1), (true, "fp8", 0.3), (true, "nvfp4", 1.0)] {
        let q = score(fp8, recipe);
        let mean: f64 = q.iter().zip(&base).map(|(a, b)| (a - b).abs() as f64).sum::<f64>() / base.len() as f64;
        // Quantization changes log-probs, but by a bounded amount (nats per token, a loose
        // sanity bound: these are random weights with std 0.3).
        eprintln!("{recipe}: mean |Δ log p| = {mean}");
        assert!(mean > 0.0 && mean < tol, "{recipe}: mean |Δ log p| = {mean}");
        // Fewer bits, more mismatch: FP8 KV < W8A8 + FP8 KV < W4A4 + FP8 KV.
        assert!(mean > prev, "{recipe}: {mean} not above {prev}");
        prev = mean;
    }
}

#[test]
fn stale_engine_reads_the_version_k_behind() {
    let dev = Device::cpu(1).unwrap();
    let c = cfg();
    let mut w = ModelWeights::random(&c, &dev, DType::F32, 1, 0.2).unwrap();
    let mut rw = RolloutWeights::new(&dev, &spec("bf16", 0.0, 2), &c, &w, None, 0).unwrap();
    let mut history = vec![w.norm.to_f32_vec().unwrap()];
    for v in 1..=5u64 {
        w.norm.write_f32(&[v as f32; 32]).unwrap();
        history.push(w.norm.to_f32_vec().unwrap());
        rw.sync(&w, v).unwrap();
        let want = v.saturating_sub(2);
        assert_eq!(rw.version, want);
        assert_eq!(rw.view(&w).w.norm.to_f32_vec().unwrap(), history[want as usize], "version {v}");
    }
}

#[test]
fn weight_noise_is_fixed_seeded_and_scaled() {
    let dev = Device::cpu(1).unwrap();
    let c = cfg();
    let w = ModelWeights::random(&c, &dev, DType::F32, 1, 0.2).unwrap();
    let mut a = RolloutWeights::new(&dev, &spec("bf16", 0.15, 0), &c, &w, None, 0).unwrap();
    let b = RolloutWeights::new(&dev, &spec("bf16", 0.15, 0), &c, &w, None, 0).unwrap();
    let first = a.view(&w).w.layers[1].up_proj.to_f32_vec().unwrap();
    a.sync(&w, 1).unwrap();
    let again = a.view(&w).w.layers[1].up_proj.to_f32_vec().unwrap();
    assert_eq!(first, again, "ε is fixed across syncs");
    assert_eq!(first, b.view(&w).w.layers[1].up_proj.to_f32_vec().unwrap(), "and across engines (devices)");
    let t = w.layers[1].up_proj.to_f32_vec().unwrap();
    let mean = t.iter().sum::<f32>() / t.len() as f32;
    let s_w = (t.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / t.len() as f32).sqrt();
    let d: Vec<f32> = first.iter().zip(&t).map(|(e, x)| e - x).collect();
    let sd = (d.iter().map(|x| x * x).sum::<f32>() / d.len() as f32).sqrt();
    // 2048 draws: the sample std of N(0, 1) is within 5% with overwhelming probability.
    assert!((sd / (0.15 * s_w) - 1.0).abs() < 0.05, "noise std {sd} vs σ·s_w {}", 0.15 * s_w);
    // Norms and embeddings are untouched; the trainer's weights too.
    assert_eq!(a.view(&w).w.norm.to_f32_vec().unwrap(), w.norm.to_f32_vec().unwrap());
    assert_eq!(w.layers[1].up_proj.to_f32_vec().unwrap(), t);
    let c2 =
        RolloutWeights::new(&dev, &EngineSpec { noise_seed: 8, ..spec("bf16", 0.15, 0) }, &c, &w, None, 0).unwrap();
    assert_ne!(first, c2.view(&w).w.layers[1].up_proj.to_f32_vec().unwrap());
}

#[test]
fn bad_engine_inputs() {
    let c = cfg();
    let parse = |toml: &str| -> String {
        let e: EngineSection = toml::from_str(toml).unwrap();
        format!("{:#}", e.spec(c.num_layers).unwrap_err())
    };
    assert!(parse("recipe = \"int8\"").contains("unknown recipe 'int8'"));
    assert!(parse("recipe = \"fp8\"\nkeep_bf16 = [\"middle\"]").contains("unknown keep_bf16 entry 'middle'"));
    assert!(parse("recipe = \"fp8\"\n[[overrides]]\nlayers = [7]\nweight = \"bf16\"")
        .contains("layer index 7 is out of range"));
    assert!(parse("recipe = \"fp8\"\nkv_scale = -1.0").contains("kv_scale"));
    // NVFP4 needs K divisible by 16.
    let dev = Device::cpu(1).unwrap();
    let mut odd = cfg();
    odd.hidden_size = 24;
    odd.num_heads = 3;
    odd.num_kv_heads = 1;
    let w = ModelWeights::random(&odd, &dev, DType::F32, 1, 0.2).unwrap();
    let r = Recipe::preset("nvfp4", 3, &[], KvScale::Fixed(1.0), Default::default()).unwrap();
    let e = format!(
        "{:#}",
        RolloutWeights::new(
            &dev,
            &EngineSpec { recipe: r, noise_sigma: 0.0, noise_seed: 0, staleness: 0 },
            &odd,
            &w,
            Some(&calib(&odd)),
            0
        )
        .err()
        .unwrap()
    );
    assert!(e.contains("multiple of 16") || e.contains("divisible by 16"), "{e}");
    // A calibration file from another model.
    let t = common::TempDir::new("calib");
    calib(&odd).save(&t.path().join("c.json")).unwrap();
    let e = format!("{:#}", Calibration::load(&t.path().join("c.json"), &cfg()).unwrap_err());
    assert!(e.contains("belong to another model"), "{e}");
}

#[test]
fn modelopt_export_loads_back_as_the_same_engine() {
    use colotrain::model::LoadedModel;
    let t = common::TempDir::new("modelopt");
    let dev = Device::cpu(2).unwrap();
    let c = cfg();
    let w = ModelWeights::random(&c, &dev, DType::F32, 9, 0.15).unwrap();
    let cal = calib(&c);
    for (recipe, keep) in [("fp8", vec!["first-layer".to_string()]), ("nvfp4", vec![])] {
        let sp = EngineSpec {
            recipe: Recipe::preset(recipe, 3, &keep, KvScale::Calibrated, Default::default()).unwrap(),
            noise_sigma: 0.0,
            noise_seed: 0,
            staleness: 0,
        };
        let rw = RolloutWeights::new(&dev, &sp, &c, &w, Some(&cal), 0).unwrap();
        let dir = t.path().join(recipe);
        std::fs::create_dir_all(&dir).unwrap();
        colotrain::model::modelopt::export(&dir, &c, &w, rw.quant.as_ref().unwrap(), DType::F32).unwrap();
        let hq: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("hf_quant_config.json")).unwrap()).unwrap();
        assert_eq!(hq["quantization"]["quant_algo"], recipe.to_uppercase());
        assert_eq!(hq["quantization"]["kv_cache_quant_algo"], "FP8");
        let cj: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
        assert_eq!(cj["quantization_config"]["quant_method"], "modelopt");
        let lm = LoadedModel::load(&dir, &dev, DType::F32).unwrap();
        let q = lm.quant.as_ref().expect("a ModelOpt directory loads as a quantized engine");
        assert_eq!(q.recipe.kv_layers(), sp.recipe.kv_layers());
        // Same codes and scales: the imported engine scores exactly like the in-memory one.
        let s = Arc::new(SamplingConfig { temperature: 0.0, max_new_tokens: 0, ..Default::default() });
        let prompt: Vec<u32> = (0..30).map(|i| (i * 5 % 64) as u32).collect();
        let score = |v: colotrain::engine::View| {
            let ec = EngineConfig { kv_fp8: sp.recipe.kv_layers(), ..Default::default() };
            let mut e = Engine::new(&dev, &c, DType::F32, &ec, None).unwrap();
            e.add(Request { id: 0, sample: 0, prompt: prompt.clone(), sampling: s.clone(), prompt_logprobs: true })
                .unwrap();
            e.run_to_completion(v, |_| {}).unwrap()[0].prompt_logprobs.clone()
        };
        let a = score(rw.view(&w));
        let b = score(colotrain::engine::View { w: &lm.weights, q: Some(&q.layers) });
        assert_eq!(a, b, "{recipe}");
        // The first layer was kept in the model's dtype: its weights are in the file unquantized.
        if recipe == "fp8" {
            assert!(q.layers[0].w.iter().all(|x| x.is_none()));
            assert_eq!(lm.weights.layers[0].q_proj.to_f32_vec().unwrap(), w.layers[0].q_proj.to_f32_vec().unwrap());
        }
    }
}

/// The memory plan's estimate of an engine's buffers (before anything is allocated) equals what
/// the engine then holds, for every kind of engine, on the CPU and on both simulated GPU
/// profiles (where a quantized weight also keeps its GEMM's operand: decoded unit values on
/// sm_90a, tiled NVFP4 scales on sm_100a).
#[test]
fn engine_buffer_estimate_equals_the_allocation() {
    let gpu = |arch| Device::Cuda(colotrain::device::CudaDevice::sim_dry(0, Some(arch)).unwrap());
    let nvfp4: Vec<usize> = [Device::cpu(2).unwrap(), gpu("sm_90a"), gpu("sm_100a")].iter().map(buffers_on).collect();
    // The NVFP4 engine's kept operands: 2 bytes a weight on sm_90a, less on sm_100a.
    assert!(nvfp4[1] > nvfp4[2] && nvfp4[2] > nvfp4[0], "{nvfp4:?}");
}

/// Checks every engine kind on `dev`; returns the plain NVFP4 engine's bytes.
fn buffers_on(dev: &Device) -> usize {
    let dev = dev.clone();
    let lm = common::load_fixture("llama_gqa", &dev, DType::BF16);
    let n = lm.cfg.num_layers;
    let mut cal = Calibration::new(Calibration::fingerprint(&lm.cfg), n);
    cal.input_amax = vec![[4.0; 4]; n];
    cal.k_amax = vec![8.0; n];
    cal.v_amax = vec![8.0; n];
    let spec = |r: &str, keep: &[String], noise: f64, stale: usize| EngineSpec {
        recipe: Recipe::preset(r, n, keep, KvScale::Calibrated, Default::default()).unwrap(),
        noise_sigma: noise,
        noise_seed: 1,
        staleness: stale,
    };
    let first_last = ["first-layer".to_string(), "last-layer".to_string()];
    let mut nvfp4 = 0;
    for s in [
        spec("bf16", &[], 0.0, 0),
        spec("fp8", &[], 0.0, 0),
        spec("fp8", &first_last, 0.0, 0),
        spec("nvfp4", &[], 0.0, 0),
        spec("bf16", &[], 0.15, 0),
        spec("bf16", &[], 0.0, 2),
        spec("nvfp4", &[], 0.1, 1),
    ] {
        let rw = RolloutWeights::new(&dev, &s, &lm.cfg, &lm.weights, Some(&cal), 0).unwrap();
        assert_eq!(
            RolloutWeights::estimate_extra_bytes(&s, &lm.weights),
            rw.extra_bytes(),
            "{} noise {} stale {} on {}",
            s.recipe.name,
            s.noise_sigma,
            s.staleness,
            dev.name()
        );
        if s.recipe.name == "nvfp4" && s.noise_sigma == 0.0 {
            nvfp4 = rw.extra_bytes();
        }
    }
    nvfp4
}
