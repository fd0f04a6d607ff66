//! The launch ledger of one GPU's share of a step of a config at its model's real shapes
//! (`bench node --model-gpu h200|b300 --ledger`): the rollout engine, the teacher, the trainer
//! and the resync run on a dry simulated GPU (`CudaDevice::sim_dry`: the glue, the launch
//! checks, the decode graphs and the ledger, with no memory behind the addresses and no kernel
//! run), so the ledger counts what the code launches for a 7B model without the model, a GPU or
//! 15 GB of host memory. Where the shape model (`node_model.rs`) assumes what a phase costs,
//! this counts it launch by launch: the LM head twice in training, the attention's work per key,
//! an NVFP4 engine's dequantize passes, every elementwise kernel.
//!
//! What it cannot know: the values. A dry GPU computes nothing and reads back zeros, so each
//! response runs to its length (EOS ignored, as the shape model assumes), every reward and
//! log-probability is 0 (the launches of a training step do not depend on them), and the
//! activation scales are a stand-in calibration of 1.0 (which the NVFP4 learner takes from the
//! engine, as a run does).
//!
//! GPU 0 of `Workload::gpus`: it decodes and teacher-scores its share of the sequences (one
//! engine, the rollout recipe's, whose cache holds the share at full length: the run's KV
//! sizing is [`plan_gpu0`]'s, which `the_shipped_configs_fit_8_h200s_and_8_b300s` checks
//! holds it), and every GPU trains its share of all the responses as a ZeRO-1 rank
//! over the device collective (NCCL on the dry devices, `train::device_nccl`), so the
//! optimizer covers its shard and the reduce-scatter and all-gather are the ledger's, on the
//! communication stream.
//!
//! Owns: the dry step. May call: the engine, the trainer, the orchestrator's plan helpers, the
//! ledger. Must not: open a real or registered simulated device, or read a model's weights.

use super::node_model::{Row, Workload};
use crate::config::{JobConfig, LearnerPrecision, ObjectiveKind};
use crate::data::dataset::PromptItem;
use crate::device::cuda::ledger::{rows as ledger_rows, Gpu, Ledger, Row as LedgerRow};
use crate::device::cuda::Stream;
use crate::device::{CudaDevice, DType, Device};
use crate::engine::rollout::{generate, score_teacher, Rollout};
use crate::engine::rollout_weights::RolloutWeights;
use crate::engine::{Engine, SamplingConfig};
use crate::model::calib::Calibration;
use crate::model::learner_quant::LearnerQuant;
use crate::model::weights::param_specs;
use crate::model::{ModelConfig, ModelWeights};
use crate::orchestrator::holdings::{self, Holdings, Planned};
use crate::orchestrator::memory::{self, KvSizing};
use crate::parallel::phase::enter_phase;
use crate::train::device_coll::DeviceCollective;
use crate::train::device_nccl::NcclDevice;
use crate::train::dp::Dp;
use crate::train::trainer::Trainer;
use anyhow::{Context, Result};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Weights of `cfg`'s shapes in `dtype` on `dev`, never written (a dry device holds no values).
pub fn dry_weights(cfg: &ModelConfig, dev: &Device, dtype: DType) -> Result<ModelWeights> {
    let ts = param_specs(cfg).iter().map(|(_, shape)| dev.uninit(dtype, shape)).collect::<Result<Vec<_>>>()?;
    ModelWeights::from_ordered(cfg, ts)
}

/// A calibration whose every amax is 1.0 (the scales' values change no launch).
fn unit_calibration(cfg: &ModelConfig) -> Calibration {
    let mut c = Calibration::new(Calibration::fingerprint(cfg), cfg.num_layers);
    for a in c.input_amax.iter_mut() {
        a.fill(1.0);
    }
    c.k_amax.fill(1.0);
    c.v_amax.fill(1.0);
    c
}

/// `n` prompts of `len` tokens (arbitrary ids below `vocab`).
fn prompts(n: usize, len: usize, vocab: usize) -> Vec<PromptItem> {
    (0..n)
        .map(|i| PromptItem {
            id: i as u64,
            tokens: (0..len).map(|t| ((i * 7919 + t * 104_729 + 1) % vocab) as u32).collect(),
            answer: None,
            response: None,
            meta: None,
        })
        .collect()
}

fn dtype_of(d: Option<&str>) -> Result<DType> {
    d.map(DType::parse).transpose().map(|d| d.unwrap_or(DType::BF16))
}

/// How a step's weights come to be on its device: [`dry_weights`], or values for a backed one.
pub type MakeWeights = dyn Fn(&ModelConfig, &Device, DType) -> Result<ModelWeights>;

/// GPU 0's ledger of a synchronous colocated step of `job` (student `student`, teacher
/// `teacher` for OPD) on `w.gpus` dry simulated GPUs of `arch` ("sm_90a" or "sm_100a").
pub fn dry_step(
    job: &JobConfig,
    student: &ModelConfig,
    teacher: Option<&ModelConfig>,
    w: Workload,
    arch: &str,
) -> Result<Ledger> {
    let peers = (1..w.gpus).map(|r| CudaDevice::sim_dry(r, Some(arch))).collect::<Result<Vec<_>>>()?;
    step_on(&CudaDevice::sim_dry(0, Some(arch))?, &peers, job, student, teacher, w, &dry_weights)
}

/// GPU 0's memory plan at the step's shapes: what it holds (`holdings::plan`, the run's own
/// itemization) and the plan's answer for its budget (the sizing, or its refusal in words).
pub struct Memory {
    pub planned: Planned,
    pub sizing: std::result::Result<KvSizing, String>,
}

/// GPU 0's memory plan for `job` on `gpus` training GPUs of `arch` with `budget` bytes, at the
/// models' real shapes on a dry GPU, without running a step: the trainer (rank 0 of the ZeRO-1
/// group), the teacher and the engine's buffers as a run builds them.
pub fn plan_gpu0(
    job: &JobConfig,
    student: &ModelConfig,
    teacher: Option<&ModelConfig>,
    gpus: usize,
    arch: &str,
    budget: usize,
) -> Result<Memory> {
    let devs = (0..gpus.max(1)).map(|k| CudaDevice::sim_dry(k, Some(arch))).collect::<Result<Vec<_>>>()?;
    let dev = Device::Cuda(devs[0].clone());
    let dtype = dtype_of(job.model.dtype.as_deref()).context("[model] dtype")?;
    let spec = job.engine.spec(student.num_layers).context("[engine]")?;
    let coll: Arc<dyn crate::parallel::Collective> = Arc::new(crate::parallel::InProcess::new(gpus)?);
    let dcoll: Arc<dyn DeviceCollective> = Arc::new(NcclDevice::new(&devs)?);
    let dp = Dp { rank: 0, world: gpus, coll, dcoll: (gpus > 1).then_some(dcoll) };
    let tr = Trainer::new_dp(student, dry_weights(student, &dev, dtype)?, job, dp).context("GPU 0's trainer")?;
    let tw = match teacher.filter(|_| job.objective.kind == ObjectiveKind::Opd) {
        Some(tc) => {
            let td = dtype_of(job.teacher.as_ref().and_then(|t| t.dtype.as_deref())).context("[teacher] dtype")?;
            Some((tc, dry_weights(tc, &dev, td)?))
        }
        None => None,
    };
    let base = crate::orchestrator::plan::engine_config(job);
    // A synchronous colocated device that trains, decodes with the job's engine and scores.
    let planned = holdings::plan(&Holdings {
        job,
        spec: &spec,
        engine: &base,
        trainer: &tr,
        teacher: tw.as_ref().map(|(c, w)| (*c, w)),
        cpu: false,
        split: false,
        generates: true,
        lead_or_all: true,
        budget: Some(budget),
    });
    let sizing = memory::size(&planned.need, "GPU 0", &planned.parts).map_err(|e| format!("{e:#}"));
    Ok(Memory { planned, sizing })
}

/// [`dry_step`] on any CUDA device `cd`, with weights from `make`: the ledger of the step,
/// phase by phase (`rollout`, `teacher`, `train` with its collectives on the communication
/// stream, `resync`; what the setup launched is taken out first). With `peers`, `cd` is rank 0
/// of `1 + peers.len()` training GPUs (ZeRO-1 over the device collective, NCCL): each
/// trains its share of every GPU's responses (rank 0's, repeated) and updates its shard.
pub fn step_on(
    cd: &CudaDevice,
    peers: &[CudaDevice],
    job: &JobConfig,
    student: &ModelConfig,
    teacher: Option<&ModelConfig>,
    w: Workload,
    make: &MakeWeights,
) -> Result<Ledger> {
    let dev = Device::Cuda(cd.clone());
    let dtype = dtype_of(job.model.dtype.as_deref()).context("[model] dtype")?;
    let spec = job.engine.spec(student.num_layers).context("[engine]")?;
    let world = 1 + peers.len();
    let host: Arc<dyn crate::parallel::Collective> = Arc::new(crate::parallel::InProcess::new(world)?);
    let all: Vec<CudaDevice> = std::iter::once(cd.clone()).chain(peers.iter().cloned()).collect();
    let coll: Arc<dyn DeviceCollective> = Arc::new(NcclDevice::new(&all)?);
    let trainer = |rank: usize, d: &Device| -> Result<Trainer> {
        let dp = Dp { rank, world, coll: host.clone(), dcoll: (world > 1).then(|| coll.clone()) };
        Trainer::new_dp(student, make(student, d, dtype)?, job, dp).context("the step's trainer")
    };
    let mut tr = trainer(0, &dev)?;
    let mut others =
        peers.iter().enumerate().map(|(i, p)| trainer(i + 1, &Device::Cuda(p.clone()))).collect::<Result<Vec<_>>>()?;
    let calib = spec.recipe.needs_calibration().then(|| unit_calibration(student));
    let rw = RolloutWeights::new(&dev, &spec, student, &tr.weights, calib.as_ref(), tr.version)?;
    // The NVFP4 learner with the engine's input scales, as `Replica::init_rollout` sets it.
    if job.learner.precision == LearnerPrecision::Nvfp4 {
        for t in std::iter::once(&mut tr).chain(others.iter_mut()) {
            let mut lq = LearnerQuant::new(&job.learner.linears, spec.recipe.nvfp4, student.num_layers)?;
            if let Some(q) = &rw.quant {
                lq.take_engine_scales(q);
            }
            t.set_learner_quant(Some(lq))?;
        }
    }
    let mut base = crate::orchestrator::plan::engine_config(job);
    // Caches sized from what is left (rollout.kv_cache_mb = 0; the plan's sizing is
    // `plan_gpu0`'s): each engine holds the GPU's share of sequences at their full length.
    let share = (w.sequences / w.gpus).max(1);
    if base.kv_cache_bytes == 0 {
        base.kv_blocks = Some(share * (w.prompt + w.response + 1).div_ceil(base.block_size.max(1)));
    }
    let ec = holdings::rollout_engine_config(&spec, &base);
    let mut engine = Engine::new(&dev, student, dtype, &ec, None)?;
    let mut teacher = match teacher {
        Some(tc) if job.objective.kind == ObjectiveKind::Opd => {
            let td = dtype_of(job.teacher.as_ref().and_then(|t| t.dtype.as_deref())).context("[teacher] dtype")?;
            Some((make(tc, &dev, td)?, Engine::new(&dev, tc, td, &base.scoring(), None)?))
        }
        _ => None,
    };
    // The GPU's share: `w.sequences / w.gpus` responses, in groups of samples_per_prompt.
    let samples = job.rollout.samples_per_prompt.clamp(1, share);
    let items = prompts(share.div_ceil(samples), w.prompt, student.vocab_size);
    let sampling = Arc::new(SamplingConfig {
        max_new_tokens: w.response,
        ignore_eos: true,
        ..crate::orchestrator::plan::sampling_of(job)
    });
    cd.take_ledger();
    let mut rollouts = {
        let _p = enter_phase("rollout");
        generate(&mut engine, rw.view(&tr.weights), &items, samples as u32, &sampling, 0, tr.version)?
    };
    rollouts.truncate(share);
    if let Some((tw, te)) = teacher.as_mut() {
        let _p = enter_phase("teacher");
        score_teacher(te, tw, &mut rollouts, job.rollout.temperature)?;
    }
    // Rewards are host work: every other response right, so no group is uniform.
    for (i, r) in rollouts.iter_mut().enumerate() {
        r.reward = Some((i % 2) as f32);
    }
    // Every GPU's responses: rank 0's, repeated under other prompt ids.
    let all: Vec<Rollout> = (0..world as u64)
        .flat_map(|r| {
            rollouts.iter().map(move |x| Rollout {
                prompt_id: x.prompt_id + (r << 32),
                group: x.group + (r << 32),
                ..x.clone()
            })
        })
        .collect();
    // A rank that fails or panics wakes the others out of the collectives.
    let step = |t: &mut Trainer| -> Result<()> {
        let _p = enter_phase("train");
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| t.step(&all).map(|_| ())))
            .unwrap_or_else(|_| Err(anyhow::anyhow!("a training rank panicked")));
        r.inspect_err(|e| {
            coll.abort(&format!("{e:#}"));
            host.abort(&format!("{e:#}"));
        })
    };
    std::thread::scope(|s| -> Result<()> {
        let hs: Vec<_> = others.iter_mut().map(|t| s.spawn(|| step(t))).collect();
        let r0 = step(&mut tr);
        for h in hs {
            h.join().map_err(|_| anyhow::anyhow!("a training rank panicked"))??;
        }
        r0
    })?;
    let mut rw = rw;
    {
        let _p = enter_phase("resync");
        rw.sync_with_amax(&tr.weights, tr.version, tr.weight_amax())?;
    }
    cd.synchronize()?;
    Ok(cd.take_ledger())
}

/// The architecture a dry GPU simulates for a GPU of the model (H200: sm_90a, B300: sm_100a)
/// and that GPU's column in the ledger.
fn arch_of(g: &Gpu) -> (&'static str, usize) {
    if g.fp4_tflops.is_some() {
        ("sm_100a", 1)
    } else {
        ("sm_90a", 0)
    }
}

/// Milliseconds of the shape model's rows that stand for a ledger phase.
fn modelled_ms(rows: &[Row], phase: &str) -> f64 {
    let of = |p: &str| -> bool {
        match phase {
            "rollout" => p.starts_with("rollout"),
            "train" => p == "train" || p == "optimizer",
            other => p == other,
        }
    };
    rows.iter().filter(|r| of(r.phase)).map(|r| r.seconds * 1e3).sum()
}

/// One row of the printed table: a phase's launches, FLOPs, bytes by path and roofline
/// seconds on the chosen GPU.
#[derive(Default)]
struct PhaseRow {
    launches: u64,
    replayed: u64,
    flops: f64,
    hbm: f64,
    nvlink: f64,
    pcie: f64,
    seconds: f64,
}

/// The ledger per phase, the communication stream's launches as `collectives` (the train
/// phase's reduce-scatter and all-gather), seconds in column `col` (0: H200, 1: B300).
fn by_phase(l: &Ledger, col: usize) -> BTreeMap<&'static str, PhaseRow> {
    let mut out: BTreeMap<&'static str, PhaseRow> = BTreeMap::new();
    for ((phase, stream, _), e) in l.entries() {
        let r = out.entry(if *stream == Stream::Comm { "collectives" } else { phase }).or_default();
        r.launches += e.launches;
        r.replayed += e.replayed;
        r.flops += e.flops;
        let [hbm, nvlink, pcie] = e.bytes_by_path();
        (r.hbm, r.nvlink, r.pcie) = (r.hbm + hbm, r.nvlink + nvlink, r.pcie + pcie);
        r.seconds += e.seconds[col];
    }
    out
}

/// Prints rank 0's ledger of the dry step of `job` beside the shape model's `rows`, and its
/// costliest operations (the first `top` of them; 0: every one).
pub fn print(
    job: &JobConfig,
    student: &ModelConfig,
    teacher: Option<&ModelConfig>,
    w: Workload,
    g: Gpu,
    rows: &[Row],
    top: usize,
) -> Result<()> {
    let (arch, col) = arch_of(&g);
    let t0 = std::time::Instant::now();
    let l = dry_step(job, student, teacher, w, arch)?;
    println!(
        "\nthe launch ledger of GPU 0 of {} in the same step, its launches at these shapes on dry simulated {}s ({arch}; {:.0} s here): a model, not a measurement",
        w.gpus,
        g.name,
        t0.elapsed().as_secs_f64()
    );
    println!("| phase | launches (replayed) | TFLOP | GB HBM | GB NVLink | GB PCIe | ledger ms | shape model ms |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut total = (0.0, 0.0);
    for (phase, r) in by_phase(&l, col) {
        let (ms, model) = (r.seconds * 1e3, modelled_ms(rows, phase));
        total = (total.0 + ms, total.1 + model);
        println!(
            "| {phase} | {} ({}) | {:.1} | {:.2} | {:.2} | {:.3} | {ms:.1} | {model:.1} |",
            r.launches,
            r.replayed,
            r.flops / 1e12,
            r.hbm / 1e9,
            r.nvlink / 1e9,
            r.pcie / 1e9
        );
    }
    println!("| step | | | | | | {:.1} | {:.1} |", total.0, total.1);
    println!(
        "its costliest operations:\n| phase | operation | launches | TFLOP | GB | ms |\n|---|---|---|---|---|---|"
    );
    let sec = |r: &LedgerRow| if col == 0 { r.h200_s } else { r.b300_s };
    let mut ops = ledger_rows(&l);
    ops.sort_by(|a, b| sec(b).total_cmp(&sec(a)));
    for r in ops.iter().take(if top == 0 { usize::MAX } else { top }) {
        println!(
            "| {} | {} | {} | {:.2} | {:.2} | {:.1} |",
            r.phase,
            r.op,
            r.launches,
            r.flops / 1e12,
            r.bytes / 1e9,
            sec(r) * 1e3
        );
    }
    Ok(())
}

/// Prints GPU 0's memory plan for `job` on `gpus` GPUs like `g` ([`plan_gpu0`]).
pub fn print_memory(
    job: &JobConfig,
    student: &ModelConfig,
    teacher: Option<&ModelConfig>,
    gpus: usize,
    g: Gpu,
) -> Result<()> {
    let m = plan_gpu0(job, student, teacher, gpus, arch_of(&g).0, (g.hbm_gb * 1e9) as usize)?;
    print!("{}", memory_table(&m, job, &g));
    Ok(())
}

/// GPU 0's memory plan as the report prints it: what it holds, its KV caches and its two
/// phases (GB), or the plan's refusal.
fn memory_table(m: &Memory, job: &JobConfig, g: &Gpu) -> String {
    let (p, n) = (&m.planned, &m.planned.need);
    let gb = |b: usize| b as f64 / 1e9;
    let mut out = format!(
        "GPU 0's memory plan on an {} ({} GB; the run's own plan, `holdings.rs` and `memory.rs`):\n\
         | weights | trainer state | activations | teacher | engine buffers | engine activations | KV caches | decode phase | train phase |\n\
         |---|---|---|---|---|---|---|---|---|\n",
        g.name, g.hbm_gb
    );
    let state = p.trainer_here - p.activations;
    let weights = n.used - p.trainer_here - p.teacher - p.engine_buffers - p.engine_activations - p.snapshot;
    let head = format!(
        "| {:.1} | {:.1} | {:.1} ({} tokens) | {:.1} | {:.1} | {:.1} |",
        gb(weights),
        gb(state),
        gb(p.activations),
        job.objective.micro_batch_tokens,
        gb(p.teacher),
        gb(p.engine_buffers),
        gb(p.engine_activations)
    );
    match &m.sizing {
        Ok(s) => {
            let kv = memory::kv_bytes(n, s.blocks);
            let resident = n.used - p.activations;
            let (decode, train) = match s.release {
                true => (resident + kv, n.used),
                false => (n.used + kv, n.used + kv),
            };
            let freed = if s.release { ", freed for training" } else { "" };
            // Each engine's capacity (the same in tokens), and whether the standard engine's
            // cache takes turns with the rollout engine's (`memory.rs`).
            let tokens = match s.blocks {
                Some(b) => format!(
                    " ({}k tokens{})",
                    b * p.rollout_ec.block_size / 1000,
                    if n.turns { ", in turns" } else { "" }
                ),
                None => String::new(),
            };
            out += &format!("{head} {:.1}{tokens}{freed} | {:.1} | {:.1} |\n", gb(kv), gb(decode), gb(train));
        }
        Err(e) => out += &format!("{head} | | |\nDOES NOT FIT: {e}\n"),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::cuda::ledger::Key;
    use crate::model::tiny::{tiny_config, TinySpec};

    fn tiny(arch: &str, hidden: usize, inter: usize) -> ModelConfig {
        let spec = TinySpec {
            arch: arch.into(),
            layers: 2,
            hidden,
            heads: 4,
            kv_heads: 2,
            head_dim: Some(16),
            intermediate: Some(inter),
            vocab: 320,
            max_position: 128,
            tie: arch == "qwen3",
        };
        tiny_config(&spec).unwrap()
    }

    fn job(kind: &str, extra: &str) -> JobConfig {
        let toml = format!(
            "[model]\npath = \"unused\"\ndtype = \"bf16\"\n[teacher]\npath = \"unused\"\ndtype = \"bf16\"\n\
             [rollout]\nprompts_per_step = 1\nsamples_per_prompt = 3\nmax_new_tokens = 9\nmax_seqs = 8\n\
             kv_cache_mb = 1\n[objective]\nkind = \"{kind}\"\nmicro_batch_tokens = 40\nchunk_size = 16\n\
             [optimizer]\nkind = \"adamw\"\n{extra}"
        );
        JobConfig::from_toml(&toml, "inline").unwrap()
    }

    /// (launches, FLOPs, bytes) per (phase, stream, operation).
    fn table(l: &Ledger) -> BTreeMap<Key, (u64, u64, f64, f64)> {
        l.entries().map(|(k, e)| (*k, (e.launches, e.replayed, e.flops, e.bytes))).collect()
    }

    /// With two training GPUs the dry step trains ZeRO-1 over the device collective: rank 0's
    /// communication stream pulls its shard's other half of the FP32 gradient and the other
    /// rank's shard of the BF16 weights over NVLink, exactly (4·s0 + 2·s1 bytes for shards of
    /// s0 and s1 parameters), and trains half the responses of a one-GPU step.
    #[test]
    fn two_dry_gpus_reduce_scatter_and_all_gather_over_nvlink() {
        let cfg = tiny("qwen2", 64, 128);
        let j = job("opd", "[engine]\nrecipe = \"bf16\"\n");
        let w1 = Workload { gpus: 1, sequences: 3, prompt: 7, response: 9 };
        let one = dry_step(&j, &cfg, Some(&cfg), w1, "sm_90a");
        let w2 = Workload { gpus: 2, sequences: 6, prompt: 7, response: 9 };
        let two = dry_step(&j, &cfg, Some(&cfg), w2, "sm_90a");
        let (one, two) = (one.unwrap(), two.unwrap());
        let gemm = |l: &Ledger| -> f64 {
            ledger_rows(l).iter().filter(|r| r.phase == "train" && r.op.starts_with("gemm")).map(|r| r.flops).sum()
        };
        // Rank 0 trains 3 of the 6 responses: the GEMMs of the one-GPU step.
        assert!(gemm(&one) > 0.0);
        assert_eq!(gemm(&one), gemm(&two));
        let (one, two) = (by_phase(&one, 0), by_phase(&two, 0));
        let n = param_specs(&cfg).iter().map(|(_, s)| s.iter().product::<usize>()).sum::<usize>();
        let (s0, s1) = (crate::parallel::shard_range(n, 2, 0).len(), crate::parallel::shard_range(n, 2, 1).len());
        assert_eq!(two["collectives"].nvlink, (4 * s0 + 2 * s1) as f64);
        assert!(!one.contains_key("collectives"));
        assert_eq!(one["rollout"].flops, two["rollout"].flops, "each GPU decodes the same share");
    }

    /// The report's memory plan is the run's: GPU 0's activations are the trainer's planned
    /// bytes for one micro-batch (`DeviceTrainable::activation_bytes`), its state what the
    /// trainer holds, and a budget below the train phase is refused in the plan's words.
    #[test]
    fn gpu_0s_memory_is_planned_as_a_run_plans_it() {
        use crate::model::trainable_device::{Bf16Operands, DeviceTrainable, LearnerKeep};
        let cfg = tiny("qwen2", 64, 128);
        let j = job("opd", "[engine]\nrecipe = \"bf16\"\n");
        let roomy = plan_gpu0(&j, &cfg, Some(&cfg), 2, "sm_90a", 1 << 30).unwrap();
        let p = &roomy.planned;
        let ops = Bf16Operands::of(&cfg, DType::BF16, [false; 3]);
        assert!(ops.h1 && ops.h2 && ops.a && ops.dmlp && ops.head, "BF16 weights, no learner: {ops:?}");
        assert_eq!(p.activations, DeviceTrainable::activation_bytes(&cfg, 40, 16, LearnerKeep::Off, false, ops));
        let weights = 2 * param_specs(&cfg).iter().map(|(_, s)| s.iter().product::<usize>()).sum::<usize>();
        assert_eq!(p.teacher, weights, "a BF16 teacher of the student's shapes");
        assert!(p.trainer_here > p.activations + 4 * weights / 2, "master, gradient and the ZeRO-1 buffers");
        let s = roomy.sizing.as_ref().unwrap();
        assert_eq!((s.blocks, s.release), (None, false), "1 MiB caches fit beside the activations");
        let table = memory_table(&roomy, &j, &crate::device::cuda::ledger::H200);
        assert!(table.contains("(40 tokens)") && !table.contains("DOES NOT FIT"), "{table}");
        let tight = plan_gpu0(&j, &cfg, Some(&cfg), 2, "sm_90a", p.need.used / 2).unwrap();
        let e = tight.sizing.as_ref().unwrap_err();
        assert!(e.contains("its train phase alone needs"), "{e}");
        assert!(memory_table(&tight, &j, &crate::device::cuda::ledger::H200).contains("DOES NOT FIT"));
    }

    /// The shipped 7B and 4B configs fit 8 × H200 and 8 × B300 by the run's own memory plan
    /// at their models' real shapes: the trainer's state, one micro-batch's activations and the
    /// engines' KV caches at once (nothing freed or moved at a switch), caches that hold at
    /// least one whole response per engine, and a micro-batch that holds the longest sequence.
    #[test]
    fn the_shipped_configs_fit_8_h200s_and_8_b300s() {
        use crate::device::cuda::ledger::{B300, H200};
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
        for f in [
            "r1-distill-qwen-7b-opd.toml",
            "r1-distill-qwen-7b-grpo.toml",
            "r1-distill-qwen-7b-reinforce.toml",
            "qwen3-4b-base-grpo-triage-nvfp4.toml",
        ] {
            let j = JobConfig::from_file(&root.join(f)).unwrap();
            let shape = |p: &str| super::super::node_model::known_shape(std::path::Path::new(p)).unwrap();
            let student = shape(&j.model.path);
            let teacher = j.teacher.as_ref().map(|t| shape(&t.path));
            assert!(j.objective.micro_batch_tokens >= j.rollout.max_new_tokens + 1024, "{f}");
            for g in [H200, B300] {
                let m = plan_gpu0(&j, &student, teacher.as_ref(), 8, arch_of(&g).0, (g.hbm_gb * 1e9) as usize).unwrap();
                let s = m.sizing.as_ref().unwrap_or_else(|e| panic!("{f} on {}: {e}", g.name));
                assert!(!s.release, "{f} on {}: the caches are freed for training", g.name);
                let blocks = s.blocks.expect("caches sized from what is left");
                assert!(blocks >= m.planned.need.min_blocks, "{f} on {}: {blocks} KV blocks", g.name);
                // The workload the step-time model assumes (256 + 4,096 tokens a sequence),
                // the GPU's share at once in each engine.
                let bs = crate::orchestrator::plan::engine_config(&j).block_size;
                let share = j.rollout.prompts_per_step * j.rollout.samples_per_prompt / 8;
                let need = share * (256 + j.rollout.max_new_tokens.min(4096) + 1).div_ceil(bs);
                assert!(blocks >= need, "{f} on {}: {blocks} KV blocks, the modelled share needs {need}", g.name);
                // A rollout engine of its own (the 4B's NVFP4) takes turns with the standard
                // engine's cache: with blocks of the same size (BF16 KV) and no teacher, twice
                // the tokens of the two side by side.
                let need = &m.planned.need;
                assert_eq!(need.turns, !m.planned.standard, "{f}: a synchronous colocated config");
                assert!(need.turns || !f.contains("nvfp4"), "{f}");
                let apart = memory::Need { turns: false, ..need.clone() };
                let side_by_side = memory::size(&apart, "GPU 0", "").unwrap().blocks.unwrap();
                match (need.turns, need.engines.as_slice()) {
                    (true, [a, b]) if a.0 == b.0 => {
                        assert!(blocks >= 2 * side_by_side, "{f} on {}: {blocks} vs {side_by_side}", g.name)
                    }
                    (true, _) => assert!(blocks > side_by_side, "{f} on {}", g.name),
                    (false, _) => assert_eq!(blocks, side_by_side, "{f} on {}", g.name),
                }
            }
        }
    }

    /// The dry GPUs launch what backed simulated GPUs launch for the same step, operation by
    /// operation (launches, replays, FLOPs, bytes): the decode of 3 responses of 9 tokens per
    /// GPU with its graphs, the teacher's scoring, two micro-batches of training per GPU and
    /// the resync. That is what makes the ledger at a 7B model's shapes the code's and not a
    /// guess. Three steps: a BF16 engine under OPD on one sm_90a GPU; the NVFP4 engine and
    /// learner under TRIAGE on one sm_100a GPU (CUTLASS W4A4, the kept tiled scales) and on two
    /// sm_90a GPUs (the emulated GEMMs with kept decoded weights, ZeRO-1 and its collectives).
    #[test]
    fn a_dry_step_launches_what_a_backed_step_launches_sim() {
        let random: &MakeWeights = &|c, d, t| ModelWeights::random(c, d, t, 7, 0.05);
        let nvfp4 = "[engine]\nrecipe = \"nvfp4\"\nkeep_bf16 = [\"attention\", \"kv\"]\n[learner]\nprecision = \
                     \"nvfp4\"\nlinears = [\"gate_proj\", \"up_proj\", \"down_proj\"]\n";
        let cases = [
            ("sm_90a", 1, tiny("qwen2", 64, 128), job("opd", "[engine]\nrecipe = \"bf16\"\n")),
            ("sm_100a", 1, tiny("qwen3", 64, 128), job("triage", nvfp4)),
            ("sm_90a", 2, tiny("qwen3", 64, 128), job("triage", nvfp4)),
        ];
        for (i, (arch, gpus, cfg, j)) in cases.iter().enumerate() {
            let w = Workload { gpus: *gpus, sequences: 3 * gpus, prompt: 7, response: 9 };
            let backed = CudaDevice::sim_unshared_arch(76 - 2 * i, arch);
            let peers: Vec<CudaDevice> = (1..*gpus).map(|_| CudaDevice::sim_unshared_arch(75 - 2 * i, arch)).collect();
            let teacher = Some(cfg);
            let a = table(&step_on(&backed, &peers, j, cfg, teacher, w, random).unwrap());
            let b = table(&dry_step(j, cfg, teacher, w, arch).unwrap());
            assert!(a.keys().any(|k| k.0 == "rollout") && a.keys().any(|k| k.0 == "train"), "{arch}: {a:?}");
            assert!(a.values().any(|e| e.1 > 0), "{arch}: some decode steps replay a graph");
            assert_eq!(a.keys().any(|k| k.1 == Stream::Comm), *gpus > 1, "{arch}: collectives with {gpus} GPUs");
            assert_eq!(a.len(), b.len(), "{arch}: the same operations");
            for (k, x) in &a {
                assert_eq!(Some(x), b.get(k), "{arch}: {k:?}");
            }
        }
    }
}
