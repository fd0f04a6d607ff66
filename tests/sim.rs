//! The CUDA path on the simulated GPU (`cuda-sim`, src/device/cuda/sim.rs) against the CPU
//! backend: the same glue, launches and kernels that a GPU would run, executed on the host.
//! Tolerances: F32 weights |Δ log p| ≤ 1e-4 + 1e-4·|ref| (the CPU and the kernels sum in
//! different orders); greedy and sampled tokens identical (the same Philox draws from logits
//! that agree to rounding); BF16 weights |Δ log p| ≤ 5e-2 + 5e-2·|ref| (the CUDA linears round
//! their f32 inputs to BF16, the CPU keeps them in f32). Both architecture profiles run: sm_90a
//! (H200) on cuda-sim:0, sm_100a (B300) on cuda-sim:1; the jobs use ordinals 2, 3, 5, 6 and 7,
//! the decode graphs 4.

mod common;

use colotrain::device::{CudaDevice, DType, Device};
use colotrain::engine::{Completion, Engine, EngineConfig, Request, SamplingConfig};
use colotrain::model::LoadedModel;
use common::*;
use std::sync::Arc;

fn sims() -> Vec<Device> {
    vec![
        Device::Cuda(CudaDevice::sim_arch(0, Some("sm_90a")).expect("cuda-sim:0")),
        Device::Cuda(CudaDevice::sim_arch(1, Some("sm_100a")).expect("cuda-sim:1")),
    ]
}

/// Every request run to completion on `dev`, sorted by (id, sample).
fn run(dev: &Device, lm: &LoadedModel, dtype: DType, reqs: &[Request]) -> Vec<Completion> {
    let ec = EngineConfig { max_tokens_per_step: 24, ..Default::default() };
    let mut e = Engine::new(dev, &lm.cfg, dtype, &ec, None).unwrap();
    for r in reqs {
        e.add(r.clone()).unwrap();
    }
    let mut done = e.run_to_completion(&lm.weights, |_| {}).unwrap();
    done.sort_by_key(|c| (c.id, c.sample));
    done
}

fn requests(vocab: usize, sampling: SamplingConfig, score: bool) -> Vec<Request> {
    let s = Arc::new(sampling);
    (0..3u64)
        .map(|id| Request {
            id,
            sample: 0,
            prompt: (0..(5 + 9 * id as usize) as u32).map(|x| (x * 11 + id as u32 * 3) % vocab as u32).collect(),
            sampling: s.clone(),
            prompt_logprobs: score,
        })
        .collect()
}

#[test]
fn scoring_and_generation_on_the_simulator_equal_the_cpu() {
    let cpu = Device::cpu(2).unwrap();
    for name in FIXTURE_MODELS {
        let lm_cpu = load_fixture(name, &cpu, DType::F32);
        let v = lm_cpu.cfg.vocab_size;
        let cases = [
            ("score", SamplingConfig { max_new_tokens: 0, ..Default::default() }, true),
            (
                "greedy",
                SamplingConfig { temperature: 0.0, max_new_tokens: 12, ignore_eos: true, ..Default::default() },
                false,
            ),
            (
                "sampled",
                SamplingConfig {
                    temperature: 1.0,
                    max_new_tokens: 12,
                    ignore_eos: true,
                    seed: 5,
                    ..Default::default()
                },
                false,
            ),
            (
                "top-k top-p",
                SamplingConfig {
                    temperature: 0.8,
                    top_k: 20,
                    top_p: 0.9,
                    max_new_tokens: 12,
                    ignore_eos: true,
                    seed: 6,
                    ..Default::default()
                },
                false,
            ),
        ];
        for (what, sampling, score) in cases {
            let reqs = requests(v, sampling, score);
            let want = run(&cpu, &lm_cpu, DType::F32, &reqs);
            for dev in sims() {
                let lm = load_fixture(name, &dev, DType::F32);
                let got = run(&dev, &lm, DType::F32, &reqs);
                for (g, w) in got.iter().zip(&want) {
                    let at = format!("{name} {what} request {} on {}", g.id, dev.name());
                    assert_eq!(g.tokens, w.tokens, "{at}: tokens");
                    assert_close(&format!("{at}: log-probs"), &g.logprobs, &w.logprobs, 1e-4, 1e-4);
                    assert_close(
                        &format!("{at}: prompt log-probs"),
                        &g.prompt_logprobs,
                        &w.prompt_logprobs,
                        1e-4,
                        1e-4,
                    );
                }
            }
        }
    }
}

#[test]
fn bf16_weights_on_the_simulator_stay_within_bf16_rounding_of_the_cpu() {
    let cpu = Device::cpu(2).unwrap();
    let name = "qwen2_tied_sharded";
    let lm_cpu = load_fixture(name, &cpu, DType::BF16);
    let reqs = requests(lm_cpu.cfg.vocab_size, SamplingConfig { max_new_tokens: 0, ..Default::default() }, true);
    let want = run(&cpu, &lm_cpu, DType::BF16, &reqs);
    let dev = Device::parse("cuda-sim:0").unwrap();
    let lm = load_fixture(name, &dev, DType::BF16);
    assert_eq!(lm.weights.dtype(), DType::BF16);
    let got = run(&dev, &lm, DType::BF16, &reqs);
    for (g, w) in got.iter().zip(&want) {
        assert_close(&format!("bf16 request {}", g.id), &g.prompt_logprobs, &w.prompt_logprobs, 5e-2, 5e-2);
    }
}

#[test]
fn the_simulated_device_is_named_and_bounded() {
    let e = format!("{:#}", Device::parse("cuda-sim:99").unwrap_err());
    assert!(e.contains("cuda-sim:99") && e.contains("COLOTRAIN_SIM_DEVICES"), "{e}");
    let e = format!("{:#}", Device::parse("cuda-sim:x").unwrap_err());
    assert!(e.contains("expected cuda-sim:<ordinal>"), "{e}");
    let d = Device::parse("cuda-sim").unwrap();
    assert!(d.name().starts_with("cuda-sim:0") && d.name().contains("simulated"), "{}", d.name());
}

/// Every rollout engine built, synced in place twice (the weights move between the syncs) and
/// scoring on the simulator, against the CPU engine of the same recipe on the same weights.
/// The BF16 engines (standard, noisy, stale) within the F32 tolerance (1e-4 + 1e-4·|ref|). The
/// quantized engines run the simulator's emulated low-precision path (no CUTLASS there): the
/// same codes and products as the CPU's fake quantization, summed in another order, so an
/// activation that lies within rounding of a quantization boundary can take the other code in
/// a later layer; hence a mean bound (5e-3) and a max bound (0.1) in nats per token.
#[test]
fn every_rollout_engine_on_the_simulator_scores_like_its_cpu_twin() {
    use colotrain::engine::rollout_weights::{EngineSpec, RolloutWeights};
    use colotrain::model::calib::Calibration;
    use colotrain::model::ModelWeights;
    use colotrain::quant::recipe::{KvScale, Recipe};
    let cpu = Device::cpu(2).unwrap();
    let sim = Device::parse("cuda-sim:0").unwrap();
    let lm = load_fixture("llama_gqa", &cpu, DType::F32);
    let c = lm.cfg.clone();
    let layers = c.num_layers;
    let mut cal = Calibration::new(Calibration::fingerprint(&c), layers);
    for l in 0..layers {
        cal.input_amax[l] = [4.0; 4];
        cal.k_amax[l] = 6.0;
        cal.v_amax[l] = 3.0;
    }
    let prompt: Vec<u32> = (0..30).map(|i| (i * 7 % c.vocab_size) as u32).collect();
    let s = Arc::new(SamplingConfig { max_new_tokens: 0, ..Default::default() });
    let engines: [(&str, &[&str], f64, usize); 7] = [
        ("bf16", &[], 0.0, 0),
        ("fp8", &[], 0.0, 0),
        ("nvfp4", &[], 0.0, 0),
        ("fp8-kv", &[], 0.0, 0),
        ("fp8", &["first-layer", "last-layer"], 0.0, 0),
        ("bf16", &[], 0.05, 0),
        ("bf16", &[], 0.0, 2),
    ];
    for (recipe, keep, noise, staleness) in engines {
        let keep: Vec<String> = keep.iter().map(|k| k.to_string()).collect();
        let spec = EngineSpec {
            recipe: Recipe::preset(recipe, layers, &keep, KvScale::Calibrated, Default::default()).unwrap(),
            noise_sigma: noise,
            noise_seed: 3,
            staleness,
        };
        let what = format!("{recipe} keep {keep:?} noise {noise} staleness {staleness}");
        let mut scores = Vec::new();
        for dev in [&cpu, &sim] {
            let mut w = ModelWeights::random(&c, dev, DType::F32, 11, 0.15).unwrap();
            let mut rw = RolloutWeights::new(dev, &spec, &c, &w, Some(&cal), 0).unwrap();
            // Move the weights and resync in place, twice (the stale ring advances).
            for v in 1..=2u64 {
                let mut g = w.layers[0].gate_proj.to_f32_vec().unwrap();
                g.iter_mut().for_each(|x| *x *= 1.0 + 0.1 * v as f32);
                w.layers[0].gate_proj.write_f32(&g).unwrap();
                rw.sync(&w, v).unwrap();
            }
            let ec = EngineConfig { kv_fp8: spec.recipe.kv_layers(), ..Default::default() };
            let mut e = Engine::new(dev, &c, DType::F32, &ec, None).unwrap();
            e.add(Request { id: 0, sample: 0, prompt: prompt.clone(), sampling: s.clone(), prompt_logprobs: true })
                .unwrap();
            scores.push(e.run_to_completion(rw.view(&w), |_| {}).unwrap()[0].prompt_logprobs.clone());
        }
        let (want, got) = (&scores[0], &scores[1]);
        assert_eq!(got.len(), prompt.len() - 1, "{what}");
        let d: Vec<f64> = got.iter().zip(want).map(|(a, b)| (a - b).abs() as f64).collect();
        let (mean, max) = (d.iter().sum::<f64>() / d.len() as f64, d.iter().cloned().fold(0.0, f64::max));
        eprintln!("{what}: mean |Δ log p| {mean:.2e}, max {max:.2e}");
        if spec.recipe.name == "bf16" {
            assert_close(&what, got, want, 1e-4, 1e-4);
        } else {
            assert!(mean <= 5e-3 && max <= 0.1, "{what}: mean |Δ log p| {mean:.2e}, max {max:.2e}");
        }
    }
}

/// The tiny OPD job with its engines (student, teacher) and its trainer on one and on two
/// simulated GPUs: 2 steps of 2 prompts × 2 samples. The first step's samples are the
/// CPU run's (the same digest: the same Philox draws from logits that agree to rounding), and
/// its loss, gradient norm and mismatch agree within 1e-3 relative (the engines' log-probs
/// differ from the CPU's at the 1e-6 level), the entropy within 1e-4 + 1e-3 relative (below).
#[test]
fn the_tiny_opd_job_runs_with_its_engines_on_the_simulator() {
    use colotrain::config::JobConfig;
    use colotrain::orchestrator::{self as job, JobOptions};
    let t = TempDir::new("sim-job");
    let run_on = |device: &str, devices: usize| {
        let mut j = JobConfig::from_toml(include_str!("../configs/tiny-opd.toml"), "tiny-opd.toml").unwrap();
        j.run.out_dir = Some(t.path().join(format!("{}-{devices}", device.replace(':', "-"))));
        (j.run.steps, j.run.device, j.run.devices) = (2, device.into(), devices);
        (j.eval.every, j.data.heldout_size) = (0, 2);
        (j.rollout.prompts_per_step, j.rollout.samples_per_prompt) = (2, 2);
        j.validate("test").unwrap();
        job::run(&j, &JobOptions::default()).unwrap();
        let text = std::fs::read_to_string(j.out_dir().join("metrics.jsonl")).unwrap();
        text.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()).collect::<Vec<_>>()
    };
    // One simulated GPU (training on the device), and two (cuda-sim:2 and :3: data parallel
    // with ZeRO-1 on the devices, the peer-copy device collective), against one CPU
    // device. Each job has ordinals of its own: the transfer counters are per device.
    let cpu = run_on("cpu:2", 1);
    let first = |m: &[serde_json::Value]| m.iter().find(|l| l["step"] == 1).cloned().expect("step 1");
    let a = first(&cpu);
    for (device, n) in [("cuda-sim:6", 1), ("cuda-sim:2", 2)] {
        let sim = run_on(device, n);
        let b = first(&sim);
        assert_eq!(a["samples_digest"], b["samples_digest"], "{device} × {n}: the same samples");
        // The entropy's absolute term: the CPU twin sums H = lse − Σ p·z in f32 (the device in
        // f64), and the two terms nearly cancel on these peaked rows (H ≈ 0.04 nats a token),
        // so its error is about √V·ε·max|z| ≈ √320 · 6e-8 · 30 ≈ 3e-5 a token, whatever H is;
        // the CPU twin's result differs between machines (5e-5 from the device's on an Intel
        // Xeon with AVX-512, within 1e-3·H on an AMD EPYC).
        for (key, atol) in [("loss", 1e-6), ("grad_norm", 1e-6), ("entropy", 1e-4)] {
            let (x, y) = (a[key].as_f64().unwrap(), b[key].as_f64().unwrap());
            assert!((x - y).abs() <= atol + 1e-3 * x.abs(), "{device} × {n}: {key}: cpu {x}, cuda-sim {y}");
        }
        let (x, y) = (a["mismatch"]["abs_mean"].as_f64().unwrap(), b["mismatch"]["abs_mean"].as_f64().unwrap());
        assert!(x < 1e-4 && y < 1e-4, "{device} × {n}: the standard engine agrees with the trainer: cpu {x}, sim {y}");
        assert_eq!(sim.iter().filter(|l| l.get("loss").is_some()).count(), 2);
        // Step 2 starts from the weights each run's optimizer wrote (on the device for one
        // simulated GPU): where it drew the same samples, its loss tracks the CPU run's.
        let second = |m: &[serde_json::Value]| m.iter().find(|l| l["step"] == 2).cloned().expect("step 2");
        let (a2, b2) = (second(&cpu), second(&sim));
        eprintln!(
            "{device} × {n}: step 2 loss cpu {} sim {}, same samples: {}",
            a2["loss"],
            b2["loss"],
            a2["samples_digest"] == b2["samples_digest"]
        );
        // Step 2's weights differ by the first update's rounding (the device sums in another
        // order), which moves each token's log-prob by about 1e-6; the loss is a token mean of
        // gaps that can nearly cancel (−2.9e-4 on an Intel Xeon, where the two differed by
        // 3e-6), so it gets an absolute floor of 1e-5 beside the relative 1e-3.
        if a2["samples_digest"] == b2["samples_digest"] {
            let (x, y) = (a2["loss"].as_f64().unwrap(), b2["loss"].as_f64().unwrap());
            assert!((x - y).abs() <= 1e-5 + 1e-3 * x.abs(), "{device} × {n}: step 2 loss: cpu {x}, cuda-sim {y}");
        }
        assert_eq!(b["utilization"].as_array().map(|u| u.len()), Some(n), "{device} × {n}");
        // The simulated GPUs train on the device (two of them ZeRO-1 over the device
        // collective): no weights cross in a step (the tiny student's are 3.3 MiB in f32),
        // only token ids, the engine's per-step metadata and per-token numbers.
        for l in sim.iter().filter(|l| l.get("loss").is_some()) {
            let (h2d, d2h) =
                (l["transfer"]["h2d_bytes"].as_u64().unwrap(), l["transfer"]["d2h_bytes"].as_u64().unwrap());
            eprintln!("{device} × {n}: step {}: {h2d} B up, {d2h} B down", l["step"]);
            assert!(h2d < 1_000_000 && d2h < 1_000_000, "{device} × {n}: step {}: {h2d} B up, {d2h} B down", l["step"]);
        }
    }
}

/// Training on one simulated GPU resumes exactly: 4 steps straight and 2 + 2 with a resume in
/// between give the same master weights and moments, bit for bit, and the same metrics lines
/// but their measurements (timings, transfers, the memory peak: a resumed run opens the device
/// afresh).
#[test]
fn training_on_the_simulator_resumes_exactly() {
    use colotrain::config::{CheckpointDtype, JobConfig};
    use colotrain::orchestrator::{self as job, JobOptions};
    use colotrain::train::checkpoint;
    let t = TempDir::new("sim-resume");
    let make = |dir: &str, steps: u64| {
        let mut j = JobConfig::from_toml(include_str!("../configs/tiny-opd.toml"), "tiny-opd.toml").unwrap();
        j.run.out_dir = Some(t.path().join(dir));
        (j.run.steps, j.run.device, j.run.devices) = (4, "cuda-sim:5".into(), 1);
        (j.eval.every, j.data.heldout_size) = (0, 2);
        (j.rollout.prompts_per_step, j.rollout.samples_per_prompt) = (2, 2);
        (j.checkpoint.every, j.checkpoint.keep, j.checkpoint.dtype) = (2, 0, CheckpointDtype::F32);
        j.validate("test").unwrap();
        let fixed = j.clone();
        j.run.steps = steps;
        (j, fixed)
    };
    let (a, _) = make("straight", 4);
    job::run(&a, &JobOptions::default()).unwrap();
    let (b2, b4) = make("resumed", 2);
    job::run(&b2, &JobOptions::default()).unwrap();
    job::run(&b4, &JobOptions { resume: b4.run.out_dir.clone(), ..Default::default() }).unwrap();
    let state = |j: &JobConfig| {
        let dir = j.run.out_dir.clone().unwrap().join(checkpoint::dir_name(4));
        let (_, m, ea, eb) = checkpoint::load(&dir, j).unwrap();
        (m, ea, eb)
    };
    assert!(state(&a) == state(&b4), "the optimizer state differs after a resume on cuda-sim");
    let raw = |j: &JobConfig| -> Vec<serde_json::Value> {
        let text = std::fs::read_to_string(j.run.out_dir.clone().unwrap().join("metrics.jsonl")).unwrap();
        text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    };
    // The launch ledger: a resumed run launches what the straight run launched, step by step
    // (its decode graphs are captured afresh: their replays count as the eager steps do); only
    // the first training step after the start uploads its one-time tables (the optimizer's chunk
    // table), as the straight run's step 1 does.
    for (x, y) in raw(&a).iter().zip(raw(&b4)).filter(|(x, _)| x.get("ledger").is_some()) {
        for phase in ["rollout", "teacher", "train"] {
            if phase == "train" && x["step"] == 3 {
                continue;
            }
            assert_eq!(x["ledger"][phase], y["ledger"][phase], "step {}: the {phase} ledger after a resume", x["step"]);
        }
    }
    let lines = |j: &JobConfig| -> Vec<serde_json::Value> {
        raw(j)
            .into_iter()
            .map(|mut v| {
                for k in [
                    "time",
                    "tokens_per_s",
                    "updates_per_hour",
                    "utilization",
                    "transfer",
                    "mem_peak_bytes",
                    "ledger",
                    "heldout_kl",
                    "heldout_acc",
                ] {
                    v.as_object_mut().unwrap().remove(k);
                }
                v
            })
            .collect()
    };
    assert_eq!(lines(&a), lines(&b4), "a metrics line differs after a resume on cuda-sim");
}

/// Twelve BF16 training steps of the tiny OPD job on one simulated GPU (so the whole step runs
/// on the device trainer: its tensor-core attention, the fused loss and the optimizer) and on
/// the CPU, on the same rollouts: 4 prompts × 4 samples that the CPU student drew once, written
/// to a rollout file (`rollout.source = "file"`: every step trains on that batch), AdamW 3e-4.
/// The same data on both sides leaves only the device's BF16 rounding of GEMM activations
/// between them, so: step 1's loss within 2e-3 + 2e-2 relative of the CPU's (a token mean of
/// log-prob gaps of order 1 that cancel to a few hundredths), every later step's within 5e-3
/// (they also carry the runs' weight difference; the loss moves by 0.05 to 0.2 a step in the
/// first steps), and after 12 steps the two runs' master weights lie closer to each other than
/// a quarter of the distance the CPU's moved from step 1 to step 12 (a device optimizer that
/// stood still or stepped elsewhere fails it).
/// On an AMD EPYC: losses 0.2736 → 0.0311 (CPU) and 0.2736 → 0.0317 (cuda-sim), at most
/// 9e-4 apart; the CPU moved 1.53, the runs end 0.063 apart (4%). With the student of step 600
/// of that machine's SFT (KL 0.114, as near the teacher as the CI's): at most 2.1e-3 apart
/// (step 8), the CPU moved 1.00, the runs end 0.065 apart.
/// Whether training lowers the held-out KL is `tests/train_job.rs`'s (300 CPU steps; the
/// simulator's F32 steps equal the CPU's, above). Over 12 sampled steps it is noise: the tiny
/// student is made by SFT on the machine that runs the tests, and on some machines it already
/// sits so near the teacher that 12 steps of 16 samples raise its KL as often as they lower it.
#[test]
fn twelve_bf16_steps_on_the_simulator_train_as_the_cpu_does() {
    use colotrain::config::{CheckpointDtype, JobConfig, RolloutSource};
    use colotrain::data::dataset::Dataset;
    use colotrain::engine::rollout;
    use colotrain::orchestrator::{self as job, tiny, JobOptions};
    use colotrain::train::checkpoint;
    let t = TempDir::new("sim-bf16-steps");
    // The batch: the CPU student's samples at temperature 1, with their sampler log-probs.
    let cpu = Device::cpu(2).unwrap();
    let student = LoadedModel::load(&tiny::resolve("builtin:tiny-arith-student").unwrap(), &cpu, DType::F32).unwrap();
    let data = Dataset::open("builtin:arith", student.text.clone(), false, student.cfg.vocab_size, 1).unwrap();
    let prompts = data.train_prompts(0, 4).unwrap();
    let mut e = Engine::new(&cpu, &student.cfg, DType::F32, &EngineConfig::default(), None).unwrap();
    let sampling = Arc::new(SamplingConfig { temperature: 1.0, max_new_tokens: 16, seed: 1, ..Default::default() });
    let rollouts = rollout::generate(&mut e, &student.weights, &prompts, 4, &sampling, 0, 0).unwrap();
    let file = t.path().join("rollouts.jsonl");
    let lines: Vec<String> = rollouts
        .iter()
        .map(|r| {
            serde_json::json!({"prompt_tokens": r.prompt, "response_tokens": r.response,
                "sampler_logprobs": r.sampler_logprobs, "group": r.group})
            .to_string()
        })
        .collect();
    std::fs::write(&file, lines.join("\n")).unwrap();
    let run_on = |device: &str| {
        let mut j = JobConfig::from_toml(include_str!("../configs/tiny-opd.toml"), "tiny-opd.toml").unwrap();
        j.run.out_dir = Some(t.path().join(device.replace(':', "-")));
        (j.run.steps, j.run.device, j.run.devices) = (12, device.into(), 1);
        (j.rollout.source, j.rollout.file) = (RolloutSource::File, Some(file.clone()));
        (j.eval.every, j.optimizer.warmup_steps) = (0, 0);
        (j.checkpoint.every, j.checkpoint.keep, j.checkpoint.dtype) = (1, 0, CheckpointDtype::F32);
        j.model.dtype = Some("bf16".into());
        j.teacher.as_mut().unwrap().dtype = Some("bf16".into());
        j.validate("test").unwrap();
        job::run(&j, &JobOptions::default()).unwrap();
        let out = j.out_dir();
        let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        let loss: Vec<f64> = text
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter_map(|l| l.get("loss").and_then(|v| v.as_f64()))
            .collect();
        let master = |step: u64| checkpoint::load(&out.join(checkpoint::dir_name(step)), &j).unwrap().1;
        (loss, master(1), master(12))
    };
    let (lc, c1, c12) = run_on("cpu:2");
    let (ls, s1, s12) = run_on("cuda-sim:7");
    eprintln!("loss per step: cpu {lc:?}\n               cuda-sim {ls:?}");
    assert!(lc.len() == 12 && ls.len() == 12, "one loss per step: cpu {}, cuda-sim {}", lc.len(), ls.len());
    for (i, (x, y)) in lc.iter().zip(&ls).enumerate() {
        // Step 1 runs on the same weights; later steps also carry the runs' weight difference.
        let atol = if i == 0 { 2e-3 } else { 5e-3 };
        assert!((x - y).abs() <= atol + 2e-2 * x.abs(), "step {}: loss cpu {x}, cuda-sim {y}", i + 1);
    }
    assert!(c1.len() == s1.len() && c12.len() == s12.len(), "the runs' master weights differ in length");
    let dist = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum::<f64>().sqrt();
    let (moved, apart, apart1) = (dist(&c12, &c1), dist(&s12, &c12), dist(&s1, &c1));
    eprintln!("master weights: the CPU moved {moved:.4e} from step 1 to 12; cuda-sim vs cpu {apart1:.4e} after step 1, {apart:.4e} after 12");
    assert!(
        moved > 0.0 && apart <= 0.25 * moved,
        "after 12 steps cuda-sim is {apart} from the CPU, which moved {moved}"
    );
}

/// CUDA graphs for decode (issue 21) on cuda-sim:4: an engine that replays one graph per
/// batch-size bucket decodes what the eager engine decodes — tokens and log-probs bit for bit
/// (the padding rows change no other row's arithmetic) — in two rounds with the weights moved
/// in place between them (a resync). BF16 weights (their linears' input casts are the graphs'
/// pooled scratch): the round after the resync only replays the graphs of the first (no new
/// capture: every address stays valid); an FP8 rollout engine freezes its tensor scales into
/// the capture, so its resync captures again. The BF16 engine's decode splits its keys
/// (split-K attention and its merge inside the graphs).
#[test]
fn decode_graph_replays_after_an_in_place_resync_decode_what_eager_steps_decode() {
    use colotrain::engine::rollout_weights::{EngineSpec, RolloutWeights};
    use colotrain::model::calib::Calibration;
    use colotrain::quant::recipe::{KvScale, Recipe};
    let dev = Device::parse("cuda-sim:4").unwrap();
    let c = load_fixture("llama_gqa", &Device::cpu(1).unwrap(), DType::F32).cfg;
    // Five sequences of 4..16 new tokens: decode batches of 5, 4, 3, 2, 1 (buckets 8, 4, 4, 2, 1).
    let reqs = |seed: u64| decode_requests(c.vocab_size, seed);
    let mut cal = Calibration::new(Calibration::fingerprint(&c), c.num_layers);
    for l in 0..c.num_layers {
        cal.input_amax[l] = [4.0; 4];
        cal.k_amax[l] = 6.0;
        cal.v_amax[l] = 3.0;
    }
    for (recipe, dtype) in [("none", DType::BF16), ("fp8", DType::F32)] {
        let mut lm = load_fixture("llama_gqa", &dev, dtype);
        let spec = (recipe != "none").then(|| EngineSpec {
            recipe: Recipe::preset(
                recipe,
                c.num_layers,
                &Vec::<String>::new(),
                KvScale::Calibrated,
                Default::default(),
            )
            .unwrap(),
            noise_sigma: 0.0,
            noise_seed: 0,
            staleness: 0,
        });
        let mut rw = spec.as_ref().map(|s| RolloutWeights::new(&dev, s, &c, &lm.weights, Some(&cal), 0).unwrap());
        // The BF16 engine's block tables hold 1,024 keys (past the model's 256 positions,
        // which its sequences never reach): its decode attention splits each row's keys
        // (split-K), so the graphs capture the merge and its pooled scratch too.
        let max_model_len = (recipe == "none").then_some(1024);
        if let (Some(len), Device::Cuda(cd)) = (max_model_len, &dev) {
            assert!(cd.decode_splits(5, c.num_kv_heads, len) > 1, "a split decode");
        }
        let ec = |graphs: bool| EngineConfig {
            kv_fp8: spec.as_ref().map(|s| s.recipe.kv_layers()).unwrap_or_default(),
            cuda_graphs: graphs,
            max_model_len,
            ..Default::default()
        };
        let mut eager = Engine::new(&dev, &c, dtype, &ec(false), None).unwrap();
        let mut graphed = Engine::new(&dev, &c, dtype, &ec(true), None).unwrap();
        let mut before = graphed.graph_stats();
        let mut same_cache = true;
        for round in 0..3u64 {
            if round == 1 {
                // The resync: the trainer's update written into the same tensors.
                for l in &mut lm.weights.layers {
                    let mut g = l.gate_proj.to_f32_vec().unwrap();
                    g.iter_mut().enumerate().for_each(|(i, x)| *x = *x * 1.3 + 0.01 * ((i % 7) as f32 - 3.0));
                    l.gate_proj.write_f32(&g).unwrap();
                }
                if let Some(rw) = rw.as_mut() {
                    rw.sync(&lm.weights, 1).unwrap();
                }
            }
            if round == 2 {
                // The KV release of a plan that cannot hold both phases: the cache's memory goes
                // back to the driver, another phase writes NaNs over what it can get, the cache
                // is mapped again at its addresses (one reservation), so its graphs replay.
                same_cache = release_and_commit(&dev, &mut graphed);
                assert!(same_cache, "{recipe}: the KV cache keeps its addresses across a release");
                // Only an idle engine frees its cache, and a released one does not decode.
                let mut busy = Engine::new(&dev, &c, dtype, &ec(false), None).unwrap();
                busy.add(reqs(9).remove(0)).unwrap();
                let e = format!("{:#}", busy.release_cache().unwrap_err());
                assert!(e.contains("1 sequence(s) in flight"), "{e}");
                let mut away = Engine::new(&dev, &c, dtype, &ec(false), None).unwrap();
                away.release_cache().unwrap();
                away.add(reqs(9).remove(0)).unwrap();
                let view = match &rw {
                    Some(rw) => rw.view(&lm.weights),
                    None => (&lm.weights).into(),
                };
                let e = format!("{:#}", away.step(view).unwrap_err());
                assert!(e.contains("the KV cache is released"), "{e}");
            }
            let mut out = Vec::new();
            for e in [&mut eager, &mut graphed] {
                for r in reqs(round + 1) {
                    e.add(r).unwrap();
                }
                let view = match &rw {
                    Some(rw) => rw.view(&lm.weights),
                    None => (&lm.weights).into(),
                };
                let mut done = e.run_to_completion(view, |_| {}).unwrap();
                done.sort_by_key(|c| c.id);
                out.push(done);
            }
            let what = format!("{recipe} round {round}");
            assert_eq!(out[0].len(), 5, "{what}");
            for (a, b) in out[0].iter().zip(&out[1]) {
                assert_eq!(a.tokens, b.tokens, "{what}: request {}: tokens", a.id);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a.logprobs), bits(&b.logprobs), "{what}: request {}: log-probs", a.id);
            }
            let s = graphed.graph_stats();
            eprintln!("{what}: {s:?}");
            assert_eq!(eager.graph_stats(), Default::default(), "{what}: the eager engine");
            // 15 decode steps: 3 each at 5, 4, 3, 2 and 1 sequences (buckets 8, 4, 4, 2, 1).
            // A bucket's first step with new weights' scalars runs eagerly and is captured, the
            // rest replay: 4 captures, 11 replays; after an in-place resync of unquantized
            // weights all 15 replay.
            let d = |a: u64, b: u64| a - b;
            let got = (d(s.captures, before.captures), d(s.eager, before.eager), d(s.replays, before.replays));
            // After the KV release the graphs replay: the cache came back where it was (its
            // addresses are in the fingerprint; a cache elsewhere would capture every bucket again).
            let replays_only = match round {
                1 => recipe == "none",
                2 => same_cache,
                _ => false,
            };
            let want = if replays_only { (0, 0, 15) } else { (4, 4, 11) };
            assert_eq!(got, want, "{what}: (captures, eager steps, replays) of the round");
            assert_eq!(s.failures, 0, "{what}");
            if recipe == "none" {
                assert!(s.pool_bytes > 0, "{what}: the BF16 input casts are the pool's blocks");
            }
            before = s;
        }
        // The split decode's merges ran, most of them replayed from the graphs.
        if let (Some(_), Device::Cuda(cd)) = (max_model_len, &dev) {
            let rows = colotrain::device::cuda::ledger::rows(&cd.take_ledger());
            let m = rows.iter().find(|r| r.op == "ct_attention_merge").expect("merges in the ledger");
            assert!(
                m.replayed > 0 && m.launches > m.replayed,
                "{recipe}: merges {} ({} replayed)",
                m.launches,
                m.replayed
            );
        } else if let Device::Cuda(cd) = &dev {
            cd.take_ledger();
        }
    }
}

/// Frees `e`'s KV cache (it must be idle), checks the memory left the allocator, takes blocks of
/// the layers' sizes, NaN-filled, while the cache is away (the trainer's turn: the host's
/// allocator tends to hand them the layers' old memory), and commits the cache again before
/// freeing them; whether every layer came back at its address (it must: tested by the caller).
fn release_and_commit(dev: &Device, e: &mut Engine) -> bool {
    let Device::Cuda(cd) = dev else { panic!("a simulated GPU") };
    let ptrs = |e: &Engine| e.cache.layers.iter().map(|l| (l.k.data_ptr(), l.v.data_ptr())).collect::<Vec<_>>();
    let before = ptrs(e);
    let bytes = e.cache.size_bytes();
    let sizes: Vec<usize> = e.cache.layers.iter().flat_map(|l| [l.k.size_bytes(), l.v.size_bytes()]).collect();
    let (in_use, ..) = cd.memory();
    assert_eq!(e.release_cache().unwrap(), bytes);
    dev.release_cached().unwrap();
    let (after, cached, ..) = cd.memory();
    // The reservation's whole granules go back (at least the layers' bytes).
    assert!(in_use - after >= bytes && cached == 0, "{bytes} B freed: in use {in_use} -> {after}, {cached} B cached");
    // While it is away, a read of the cache is an illegal address, not stale data.
    let colotrain::device::Storage::Cuda(k) = e.cache.layers[0].k.storage() else { panic!("a cache on the GPU") };
    let fault = format!("{:#}", k.read_raw(&mut [0u8; 4]).unwrap_err());
    assert!(fault.contains("unmapped"), "{fault}");
    let held: Vec<_> = sizes
        .iter()
        .map(|&b| dev.from_f32(DType::F32, &[b.div_ceil(4)], &vec![f32::NAN; b.div_ceil(4)]).unwrap())
        .collect();
    e.commit_cache().unwrap();
    drop(held);
    assert_eq!(e.cache.size_bytes(), bytes);
    let same = ptrs(e) == before;
    eprintln!("the KV cache came back {}", if same { "at its addresses" } else { "elsewhere" });
    same
}
