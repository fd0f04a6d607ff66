//! Training on the simulated GPU against the PyTorch-autograd references the CPU trainer
//! matches (scripts/make_fixtures.py, sections grads and rl): one SGD step (lr 1, no decay, no
//! clipping, F32 weights) from a rollout file, with the trainer's state on the device
//! (`Trainer::on_device`), moves every parameter by −∇L of the configured objective — OPD
//! (seed 000 Eq. 1) under three loss aggregations, GRPO + TIS (seed 004 Eqs. 1, 3), TRIAGE with
//! its gate and repair active (App. C: Eqs. 16, 19) and REINFORCE with score centering (seed
//! 000 App. B.1, the top-k target on the device).
//! Criteria: F32 — per tensor ‖Δθ − ∇L‖/‖∇L‖ ≤ 1e-4 (as on the CPU: f32 vs f32, different
//! summation orders). BF16 compute weights — against the CPU trainer's step on the same BF16
//! weights: every new weight within one BF16 ulp of the CPU's plus 5% of the tensor's largest
//! update (the device's GEMMs round their activations to BF16, the CPU keeps them in f32: the
//! updates differ by 1–3% in norm; a norm criterion on the rounded weights would measure the
//! rounding where an update is below one ulp, as for RMSNorm gains near 1).
//! Both profiles: sm_90a on cuda-sim:0, sm_100a on cuda-sim:1.

mod common;

use colotrain::config::JobConfig;
use colotrain::device::{CudaDevice, DType, Device};
use colotrain::engine::rollout::read_file;
use colotrain::model::weights::param_specs;
use colotrain::train::trainer::Trainer;
use common::*;

const SGD: &str = "[optimizer]\nkind = \"sgd\"\nlr = 1.0\nweight_decay = 0.0\ngrad_clip = 0.0\n";

fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((*x - *y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    num.sqrt() / den.sqrt().max(1e-30)
}

/// One case: the fixture model, its rollout file, the job's TOML, the fixture's gradient key.
#[derive(Clone)]
struct Case {
    model: &'static str,
    rollouts: std::path::PathBuf,
    toml: String,
    grads: std::path::PathBuf,
    key: String,
}

fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    for (model, obj, agg) in [
        ("llama_gqa", "opd_token_mean", "token-mean"),
        ("qwen2_tied_sharded", "opd_seq_mean_token_mean", "seq-mean-token-mean"),
        ("qwen3_headdim", "opd_seq_mean_token_sum", "seq-mean-token-sum"),
    ] {
        out.push(Case {
            model,
            rollouts: fixtures().join("grads").join(format!("{model}_rollouts.jsonl")),
            toml: format!(
                "[model]\npath = \"unused\"\n[teacher]\npath = \"unused\"\n[objective]\nkind = \"opd\"\nloss_agg = \"{agg}\"\n{SGD}"
            ),
            grads: fixtures().join("grads").join(format!("{model}.safetensors")),
            key: obj.into(),
        });
    }
    let rl = fixtures().join("rl");
    for (obj, section) in [
        ("grpo_tis", "kind = \"grpo\"\ntis = true\ntis_cap = 2.0\n".to_string()),
        ("triage", format!("kind = \"triage\"\ntis_cap = 2.0\n{TRIAGE}")),
        ("reinforce_centered", "kind = \"reinforce\"\nadvantage_offset = 0.15\ncentering = true\n".to_string()),
    ] {
        out.push(Case {
            model: "qwen3_headdim",
            rollouts: rl.join("rollouts.jsonl"),
            toml: format!(
                "[model]\npath = \"unused\"\n{SGD}[rollout]\nsource = \"file\"\nfile = \"unused\"\n[objective]\nloss_agg = \"seq-mean-token-mean\"\n{section}"
            ),
            grads: rl.join("qwen3_headdim.safetensors"),
            key: obj.into(),
        });
    }
    out
}

/// The weights before and after one step of `c` on `dev` in `dtype`, and whether the trainer
/// kept its state on the device.
fn step(c: &Case, dev: &Device, dtype: DType) -> (Vec<Vec<f32>>, Vec<Vec<f32>>, bool) {
    let lm = load_fixture(c.model, dev, dtype);
    let before: Vec<Vec<f32>> = lm.weights.tensors().iter().map(|t| t.to_f32_vec().unwrap()).collect();
    let rollouts = read_file(&c.rollouts, lm.cfg.vocab_size).unwrap();
    let job = JobConfig::from_toml(&c.toml, "inline").unwrap();
    let mut tr = Trainer::new(&lm.cfg, lm.weights, &job).unwrap();
    let out = tr.step(&rollouts).unwrap();
    assert!(!out.skipped && out.updates == 1, "{} {}", c.model, c.key);
    if c.key == "triage" {
        let st = out.triage.expect("triage statistics");
        // The gate and the repair are active on the fixture batch (the CPU test's counts).
        assert_eq!((st.repair_segments, st.gated_responses), (11, 2), "triage on {dev:?}");
    }
    let after = tr.weights.tensors().iter().map(|t| t.to_f32_vec().unwrap()).collect();
    (before, after, tr.on_device())
}

/// On sm_100a with activation checkpointing (each layer run again in the backward), against
/// the same PyTorch gradients.
#[test]
fn one_sgd_step_on_the_simulator_is_theta_minus_grad() {
    for (ordinal, arch) in [(0, "sm_90a"), (1, "sm_100a")] {
        let dev = Device::Cuda(CudaDevice::sim_arch(ordinal, Some(arch)).unwrap());
        for mut c in cases() {
            if arch == "sm_100a" {
                c.toml = c.toml.replace("[objective]\n", "[objective]\nactivation_checkpointing = true\n");
                assert!(c.toml.contains("activation_checkpointing"), "{}", c.toml);
            }
            let (before, after, on_device) = step(&c, &dev, DType::F32);
            assert!(on_device, "{arch} {}: the trainer keeps its state on the device", c.key);
            let r = Ref::open(&c.grads);
            let specs = param_specs(&load_fixture(c.model, &Device::cpu(1).unwrap(), DType::F32).cfg);
            for (((pname, _), b), a) in specs.iter().zip(&before).zip(&after) {
                let (_, g) = r.f32(&format!("grad.{}.{pname}", c.key));
                let delta: Vec<f32> = b.iter().zip(a).map(|(x, y)| x - y).collect();
                let e = rel_err(&delta, &g);
                assert!(e <= 1e-4, "{arch} {} {} {pname}: update vs −∇L relative error {e:e}", c.model, c.key);
            }
        }
    }
}

/// The fused first pass (each micro-batch scored and backpropagated at once,
/// `train/trainer/fused.rs`), in two passes and in one, steps to the same weights, bit for bit,
/// with the same loss and π_old, as scoring every micro-batch first and running each forward
/// again before its backward: every case (OPD under three aggregations, GRPO with TIS, TRIAGE,
/// centered REINFORCE) plus OPD with an advantage offset, SFT and GRPO without TIS, in
/// micro-batches of at most 16 tokens (3 of the OPD fixture batch, 4 of the RL one), BF16
/// weights with checkpointing on sm_90a. The one pass runs where the objective allows it
/// (all but TRIAGE): one LM-head GEMM per chunk and one ct_lm_stats fewer than the
/// two passes, the same count for those two. With two minibatches (OPD, GRPO, TRIAGE) the
/// first is fused and the second scored after it: the same bits again, over two updates.
#[test]
fn the_fused_first_pass_steps_like_score_then_backward() {
    use colotrain::device::cuda::ledger::rows;
    use colotrain::train::trainer::FirstPass;
    let cd = CudaDevice::sim_arch(4, Some("sm_90a")).unwrap(); // its own: the test reads its ledger
    let dev = Device::Cuda(cd.clone());
    let mut all = cases();
    let opd = all[0].toml.clone();
    let extra = [("opd_offset", "kind = \"opd\"\nadvantage_offset = 0.15"), ("sft", "kind = \"sft\"")];
    for (key, kind) in extra {
        all.push(Case { key: key.into(), toml: opd.replace("kind = \"opd\"", kind), ..cases().remove(0) });
    }
    let grpo = all.iter().find(|c| c.key == "grpo_tis").map(|c| c.toml.replace("tis = true", "tis = false"));
    all.push(Case { key: "grpo".into(), toml: grpo.unwrap(), ..cases().remove(3) });
    // Two minibatches: the first fused, the second scored after it and trained after the first
    // update.
    for (key, from) in [("opd_mb2", "opd_token_mean"), ("grpo_mb2", "grpo"), ("triage_mb2", "triage")] {
        let c = all.iter().find(|c| c.key == from).unwrap();
        let toml = c.toml.replace("[objective]\n", "[objective]\nminibatches = 2\n");
        let (model, rollouts, grads) = (c.model, c.rollouts.clone(), c.grads.clone());
        all.push(Case { key: key.into(), toml, model, rollouts, grads });
    }
    let mut most_chunks = 0;
    for c in all {
        let toml =
            c.toml.replace("[objective]\n", "[objective]\nmicro_batch_tokens = 16\nactivation_checkpointing = true\n");
        let job = JobConfig::from_toml(&toml, "inline").unwrap();
        let run = |how: FirstPass| {
            let lm = load_fixture(c.model, &dev, DType::BF16);
            let rollouts = read_file(&c.rollouts, lm.cfg.vocab_size).unwrap();
            let mut tr = Trainer::new(&lm.cfg, lm.weights, &job).unwrap();
            tr.set_first_pass(how);
            cd.take_ledger();
            let out = tr.step(&rollouts).unwrap();
            let l = cd.take_ledger();
            let count = |op: &str| rows(&l).iter().filter(|r| r.op == op).map(|r| r.launches).sum::<u64>();
            let updates = if c.key.ends_with("_mb2") { 2 } else { 1 };
            assert!(!out.skipped && out.updates == updates, "{}", c.key);
            let w: Vec<u32> =
                tr.weights.tensors().iter().flat_map(|t| t.to_f32_vec().unwrap()).map(|x| x.to_bits()).collect();
            (w, out.loss, out.logp, rollouts.len(), [count("ct_lm_stats"), count("gemm bf16 nt")])
        };
        let (one, two, unfused) = (run(FirstPass::OnePass), run(FirstPass::TwoPass), run(FirstPass::Unfused));
        for (how, r) in [("one pass", &one), ("two passes", &two)] {
            assert_eq!(r.2, unfused.2, "{} {how}: π_old", c.key);
            assert_eq!(r.1.to_bits(), unfused.1.to_bits(), "{} {how}: loss", c.key);
            assert!(r.0 == unfused.0, "{} {how}: the weights after the step", c.key);
        }
        // The two passes run ct_lm_stats twice per chunk of scored rows.
        let [stats, fwd] = two.4;
        assert!(stats >= 2 && stats % 2 == 0, "{}: statistics launches {:?}", c.key, two.4);
        most_chunks = most_chunks.max(stats / 2);
        // TRIAGE needs whole segments of π_old's log-probs for its coefficients: two passes.
        let two_pass = c.key.starts_with("triage");
        if c.key.ends_with("_mb2") {
            // Only the first minibatch's chunks lose their statistics pass.
            let saved = stats - one.4[0];
            assert!((saved > 0) != two_pass, "{}: {:?} vs {:?}", c.key, one.4, two.4);
            assert_eq!(fwd - one.4[1], saved, "{}: one LM-head GEMM fewer per statistics launch", c.key);
            continue;
        }
        let saved = if two_pass { 0 } else { stats / 2 };
        assert_eq!(one.4, [stats - saved, fwd - saved], "{}: the one pass's LM-head launches", c.key);
    }
    assert!(most_chunks >= 4, "micro-batches of 16 tokens: {most_chunks} chunks at most");
}

#[test]
fn bf16_compute_weights_on_the_simulator_step_like_the_cpu() {
    let sim = Device::Cuda(CudaDevice::sim_arch(0, Some("sm_90a")).unwrap());
    let cpu = Device::cpu(2).unwrap();
    let bf16_ulp = |x: f32| 2f32.powi(x.abs().max(f32::MIN_POSITIVE).log2().floor() as i32 - 7);
    for c in cases() {
        let (b_sim, a_sim, on_device) = step(&c, &sim, DType::BF16);
        assert!(on_device, "{}: the trainer keeps its state on the device", c.key);
        let (b_cpu, a_cpu, _) = step(&c, &cpu, DType::BF16);
        let specs = param_specs(&load_fixture(c.model, &cpu, DType::F32).cfg);
        for (i, (pname, _)) in specs.iter().enumerate() {
            assert_eq!(b_sim[i], b_cpu[i], "{pname}: the same BF16 weights before the step");
            let d_sim: Vec<f32> = b_sim[i].iter().zip(&a_sim[i]).map(|(x, y)| x - y).collect();
            let d_cpu: Vec<f32> = b_cpu[i].iter().zip(&a_cpu[i]).map(|(x, y)| x - y).collect();
            let dmax = d_cpu.iter().fold(0f32, |m, d| m.max(d.abs())) as f64;
            let moved = |d: &[f32]| d.iter().filter(|x| **x != 0.0).count();
            assert_eq!(
                moved(&d_sim) == 0,
                moved(&d_cpu) == 0,
                "{} {} {pname}: moved on one device only",
                c.model,
                c.key
            );
            for (j, (s, w)) in a_sim[i].iter().zip(&a_cpu[i]).enumerate() {
                let tol = bf16_ulp(*w) as f64 + 0.05 * dmax;
                assert!(
                    ((s - w) as f64).abs() <= tol,
                    "{} {} {pname}[{j}]: sim {s} vs cpu {w} (tolerance {tol:e})",
                    c.model,
                    c.key
                );
            }
        }
    }
}

/// The fused amax end to end: after a device update (AdamW, BF16 compute weights), an FP8 and an
/// NVFP4 rollout engine resynced from the optimizer's amax (`Trainer::weight_amax`) hold the
/// very codes, block scales and scales of an engine that requantizes with its own amax pass;
/// given twice that amax, its scales double (the amax it is given is the one it uses).
#[test]
fn a_quantized_engine_resyncs_from_the_optimizers_amax() {
    use colotrain::engine::rollout_weights::{EngineSpec, RolloutWeights};
    use colotrain::model::calib::Calibration;
    use colotrain::quant::recipe::{KvScale, Recipe};
    let sim = Device::Cuda(CudaDevice::sim_arch(0, Some("sm_90a")).unwrap());
    let c = &cases()[0];
    let lm = load_fixture(c.model, &sim, DType::BF16);
    let cfg = lm.cfg.clone();
    let rollouts = read_file(&c.rollouts, cfg.vocab_size).unwrap();
    let toml = c.toml.replace("kind = \"sgd\"\nlr = 1.0", "kind = \"adamw\"\nlr = 1e-3");
    let mut tr = Trainer::new(&cfg, lm.weights, &JobConfig::from_toml(&toml, "inline").unwrap()).unwrap();
    assert!(tr.weight_amax().is_none(), "no amax before the first update");
    tr.step(&rollouts).unwrap();
    let amax = tr.weight_amax().expect("the device update's amax");
    let mut cal = Calibration::new(Calibration::fingerprint(&cfg), cfg.num_layers);
    for l in 0..cfg.num_layers {
        (cal.input_amax[l], cal.k_amax[l], cal.v_amax[l]) = ([4.0; 4], 6.0, 3.0);
    }
    for recipe in ["fp8", "nvfp4"] {
        let spec = EngineSpec {
            recipe: Recipe::preset(recipe, cfg.num_layers, &[], KvScale::Fixed(1.0), Default::default()).unwrap(),
            noise_sigma: 0.0,
            noise_seed: 0,
            staleness: 0,
        };
        let mut fused = RolloutWeights::new(&sim, &spec, &cfg, &tr.weights, Some(&cal), 0).unwrap();
        let mut plain = RolloutWeights::new(&sim, &spec, &cfg, &tr.weights, Some(&cal), 0).unwrap();
        fused.sync_with_amax(&tr.weights, 1, Some(amax)).unwrap();
        plain.sync(&tr.weights, 1).unwrap();
        let (fq, pq) = (fused.quant.as_ref().unwrap(), plain.quant.as_ref().unwrap());
        let mut checked = 0;
        for (fl, pl) in fq.layers.iter().zip(&pq.layers) {
            for (f, p) in fl.w.iter().zip(&pl.w) {
                let (Some(f), Some(p)) = (f, p) else { continue };
                assert_eq!(f.scale.to_bits(), p.scale.to_bits(), "{recipe}: scale");
                let raw = |t: &colotrain::device::Tensor| match t.storage() {
                    colotrain::device::Storage::Cuda(s) => {
                        let mut b = vec![0u8; t.numel()];
                        s.read_raw(&mut b).unwrap();
                        b
                    }
                    _ => panic!("engine buffers on the device"),
                };
                assert_eq!(raw(&f.codes), raw(&p.codes), "{recipe}: codes");
                if recipe == "nvfp4" {
                    assert_eq!(raw(&f.block_scales), raw(&p.block_scales), "{recipe}: block scales");
                }
                checked += 1;
            }
        }
        assert_eq!(checked, 7 * cfg.num_layers, "{recipe}: every linear quantized and compared");
        // The view reads the amax it is given (no pass of its own): twice the optimizer's gives
        // twice the scales.
        let doubled: Vec<u32> =
            amax.to_u32_vec().unwrap().into_iter().map(|b| (2.0 * f32::from_bits(b)).to_bits()).collect();
        let doubled = sim.upload(colotrain::device::Tensor::from_u32_host(&[doubled.len()], doubled).unwrap()).unwrap();
        fused.sync_with_amax(&tr.weights, 2, Some(&doubled)).unwrap();
        let fq = fused.quant.as_ref().unwrap();
        for (fl, pl) in fq.layers.iter().zip(&pq.layers) {
            for (f, p) in fl.w.iter().zip(&pl.w) {
                if let (Some(f), Some(p)) = (f, p) {
                    assert_eq!(f.scale, 2.0 * p.scale, "{recipe}: the given amax is the one used");
                }
            }
        }
    }
}

/// The NVFP4 learner trains on the device (`[learner] precision = "nvfp4"`, the emulated W4A4
/// path): one SGD step (lr 1, F32) of OPD with the MLP linears in NVFP4 (RHT on) moves every
/// parameter like the CPU trainer's NVFP4 step, within 1e-3 relative norm per tensor (f32 in
/// other orders; a value at an NVFP4 decision boundary may round the other way), with the
/// trainer's state on the device.
#[test]
fn the_nvfp4_learner_steps_on_the_simulator_like_the_cpu() {
    use colotrain::model::learner_quant::LearnerQuant;
    use colotrain::quant::nvfp4::Nvfp4Opts;
    let sim = Device::Cuda(CudaDevice::sim_arch(1, Some("sm_100a")).unwrap());
    let cpu = Device::cpu(2).unwrap();
    // llama_gqa: C and I multiples of 16 (NVFP4 blocks along K).
    let c = &cases()[0];
    let mut moved = Vec::new();
    for dev in [&cpu, &sim] {
        let lm = load_fixture(c.model, dev, DType::F32);
        let before: Vec<Vec<f32>> = lm.weights.tensors().iter().map(|t| t.to_f32_vec().unwrap()).collect();
        let rollouts = read_file(&c.rollouts, lm.cfg.vocab_size).unwrap();
        let job = JobConfig::from_toml(&c.toml, "inline").unwrap();
        let layers = lm.cfg.num_layers;
        let mut tr = Trainer::new(&lm.cfg, lm.weights, &job).unwrap();
        let names: Vec<String> = ["gate_proj", "up_proj", "down_proj"].iter().map(|s| s.to_string()).collect();
        let lq = LearnerQuant::new(&names, Nvfp4Opts { rht: Some(1), stochastic: None }, layers).unwrap();
        tr.set_learner_quant(Some(lq)).unwrap();
        assert_eq!(tr.on_device(), !dev.is_cpu(), "{}: where the state lives", dev.name());
        tr.step(&rollouts).unwrap();
        let after = tr.weights.tensors().iter().map(|t| t.to_f32_vec().unwrap()).collect::<Vec<_>>();
        moved.push(
            before
                .iter()
                .zip(&after)
                .map(|(b, a)| b.iter().zip(a).map(|(x, y)| x - y).collect())
                .collect::<Vec<Vec<f32>>>(),
        );
    }
    let specs = param_specs(&load_fixture(c.model, &cpu, DType::F32).cfg);
    for ((pname, _), (d_cpu, d_sim)) in specs.iter().zip(moved[0].iter().zip(&moved[1])) {
        let e = rel_err(d_sim, d_cpu);
        assert!(e <= 1e-3, "nvfp4 learner {pname}: update vs the CPU's, relative error {e:e}");
    }
}

/// A device collective that records, for each call, its name and how many launches its
/// device had queued by then (what tells a bucket started during the backward).
struct Watch {
    inner: std::sync::Arc<dyn colotrain::train::device_coll::DeviceCollective>,
    calls: std::sync::Mutex<Vec<Vec<(&'static str, u64)>>>,
}

impl Watch {
    fn note(&self, rank: usize, t: &colotrain::device::Tensor, what: &'static str) {
        if let colotrain::device::Storage::Cuda(c) = t.storage() {
            let launched = c.device().take_ledger().entries().map(|(_, e)| e.launches).sum::<u64>();
            let mut calls = self.calls.lock().unwrap();
            let before = calls[rank].last().map_or(0, |c| c.1);
            calls[rank].push((what, before + launched));
        }
    }
}

impl colotrain::train::device_coll::DeviceCollective for Watch {
    fn world(&self) -> usize {
        self.inner.world()
    }
    fn staging_columns(&self, shard: usize) -> usize {
        self.inner.staging_columns(shard)
    }
    fn reduce_scatter(
        &self,
        rank: usize,
        send: &colotrain::device::Tensor,
        staging: &mut colotrain::device::Tensor,
        recv: &mut colotrain::device::Tensor,
    ) -> anyhow::Result<colotrain::device::cuda::Event> {
        self.note(rank, send, "whole");
        self.inner.reduce_scatter(rank, send, staging, recv)
    }
    fn reduce_scatter_ranges(
        &self,
        rank: usize,
        send: &colotrain::device::Tensor,
        recv: &mut colotrain::device::Tensor,
        ranges: &[std::ops::Range<usize>],
    ) -> anyhow::Result<Option<colotrain::device::cuda::Event>> {
        self.note(rank, send, "bucket");
        self.inner.reduce_scatter_ranges(rank, send, recv, ranges)
    }
    fn all_gather_in_place(
        &self,
        rank: usize,
        buf: &mut colotrain::device::Tensor,
    ) -> anyhow::Result<colotrain::device::cuda::Event> {
        self.note(rank, buf, "gather");
        self.inner.all_gather_in_place(rank, buf)
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
}

/// The weights before a step, after it, and after a second step on a single response.
type Weights = Vec<Vec<f32>>;

/// The fixture's first case, two SGD steps data-parallel on simulated GPUs 2 and 3 over
/// `dcoll`: (before, after the step, after a step on its first response alone) per rank.
fn two_rank_steps(
    c: &Case,
    dcoll: std::sync::Arc<dyn colotrain::train::device_coll::DeviceCollective>,
) -> Vec<(Weights, Weights, Weights)> {
    use colotrain::parallel::InProcess;
    use colotrain::train::dp::Dp;
    use std::sync::Arc;
    let coll = Arc::new(InProcess::new(2).unwrap());
    let ranks: Vec<_> = [2usize, 3]
        .into_iter()
        .enumerate()
        .map(|(rank, ordinal)| {
            let (c, coll, dcoll) = (c.clone(), coll.clone(), dcoll.clone());
            std::thread::spawn(move || {
                let run = || -> anyhow::Result<(Weights, Weights, Weights)> {
                    let dev = Device::Cuda(CudaDevice::sim_arch(ordinal, Some("sm_90a"))?);
                    let lm = load_fixture(c.model, &dev, DType::F32);
                    let weights = |w: &colotrain::model::ModelWeights| -> anyhow::Result<Vec<Vec<f32>>> {
                        w.tensors().iter().map(|t| t.to_f32_vec()).collect()
                    };
                    let before = weights(&lm.weights)?;
                    let rollouts = read_file(&c.rollouts, lm.cfg.vocab_size)?;
                    let job = JobConfig::from_toml(&c.toml, "inline")?;
                    let dp = Dp { rank, world: 2, coll: coll.clone(), dcoll: Some(dcoll.clone()) };
                    let mut tr = Trainer::new_dp(&lm.cfg, lm.weights, &job, dp)?;
                    anyhow::ensure!(tr.on_device(), "rank {rank}: the trainer keeps its shard on the device");
                    let out = tr.step(&rollouts)?;
                    anyhow::ensure!(!out.skipped && out.updates == 1, "rank {rank}: one update");
                    let after = weights(&tr.weights)?;
                    tr.step(&rollouts[..1])?;
                    Ok((before, after, weights(&tr.weights)?))
                };
                // A rank that fails wakes the other out of the collectives (as the job's
                // failure hook does), so a failure is reported instead of hanging.
                run().inspect_err(|e| {
                    use colotrain::parallel::Collective;
                    coll.abort(&format!("{e:#}"));
                    dcoll.abort(&format!("{e:#}"));
                })
            })
        })
        .collect();
    ranks
        .into_iter()
        .enumerate()
        .map(|(r, h)| h.join().expect("rank thread").unwrap_or_else(|e| panic!("rank {r}: {e:#}")))
        .collect()
}

/// The same SGD step data-parallel on two simulated GPUs (ZeRO-1 over the device collective,
/// each rank with its token-balanced share) still moves every parameter by −∇L, on both
/// ranks; then a step on a single response, which leaves rank 1's share empty: that rank
/// joins the collectives with a zero gradient and both ranks end with the same weights. Over
/// NCCL (the default) the reduce-scatter goes in buckets started during the backward, one per
/// layer and one each for the head and the embedding, and the weights are those of the
/// in-process collective's whole reduce-scatter, bit for bit.
#[test]
fn a_data_parallel_step_on_two_simulated_gpus_is_theta_minus_grad() {
    use colotrain::train::device_coll::PeerCopy;
    use colotrain::train::device_nccl::NcclDevice;
    use std::sync::Arc;
    let c = cases().remove(0);
    let out = two_rank_steps(&c, Arc::new(PeerCopy::new(2).unwrap()));
    let r = Ref::open(&c.grads);
    let cfg = load_fixture(c.model, &Device::cpu(1).unwrap(), DType::F32).cfg;
    let specs = param_specs(&cfg);
    for (rank, (before, after, _)) in out.iter().enumerate() {
        for (((pname, _), b), a) in specs.iter().zip(before).zip(after) {
            let (_, g) = r.f32(&format!("grad.{}.{pname}", c.key));
            let delta: Vec<f32> = b.iter().zip(a).map(|(x, y)| x - y).collect();
            let e = rel_err(&delta, &g);
            assert!(e <= 1e-4, "rank {rank} {pname}: update vs −∇L relative error {e:e}");
        }
    }
    assert_eq!(out[0].2, out[1].2, "both ranks hold the same weights after the step with an empty share");
    assert_ne!(out[0].2, out[0].1, "the single-response step moved the weights");
    let devs: Vec<CudaDevice> = [2, 3].iter().map(|&o| CudaDevice::sim_arch(o, Some("sm_90a")).unwrap()).collect();
    let watch = Arc::new(Watch { inner: Arc::new(NcclDevice::new(&devs).unwrap()), calls: Default::default() });
    *watch.calls.lock().unwrap() = vec![Vec::new(); 2];
    let nccl = two_rank_steps(&c, watch.clone());
    for rank in 0..2 {
        assert_eq!(nccl[rank], out[rank], "rank {rank}: NCCL's bucketed steps vs the whole reduce-scatter");
    }
    let buckets = cfg.num_layers + 2;
    for (rank, calls) in watch.calls.lock().unwrap().iter().enumerate() {
        let names: Vec<&str> = calls.iter().map(|c| c.0).collect();
        let update: Vec<&str> = std::iter::repeat_n("bucket", buckets).chain(["gather"]).collect();
        assert_eq!(names, [update.clone(), update].concat(), "rank {rank}: two updates");
        // Rank 0's first update: the backward queued kernels between its first bucket and its
        // last (the buckets started while it ran), and nothing after the last but the update.
        if rank == 0 {
            assert!(calls[buckets - 1].1 > calls[0].1, "rank 0: buckets started during the backward: {calls:?}");
        }
    }
}
