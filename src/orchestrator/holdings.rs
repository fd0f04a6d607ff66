//! What one device holds before its KV caches, in bytes, as the memory plan (`memory.rs`)
//! takes it: the compute weights, the trainer's state and activation arenas where it trains
//! there, the teacher, the rollout engine's buffers, every engine's forward activations, a
//! split lead's published snapshot (if it publishes through one), and the KV block of each
//! engine the device runs. `Replica::new` plans a run's device with it, and
//! `bench node --model-gpu … --ledger` plans GPU 0 of a shipped config at its model's real
//! shapes with it, so the report's memory line is the run's own arithmetic.
//!
//! Owns: the itemization. May call: the trainer's and the engine's byte counts, `memory`.
//! Must not: allocate, or size the caches (`memory::size` does).

use super::memory::Need;
use crate::config::{JobConfig, LearnerPrecision, ScheduleMode};
use crate::device::DType;
use crate::engine::rollout_weights::{EngineSpec, RolloutWeights};
use crate::engine::EngineConfig;
use crate::model::{ModelConfig, ModelWeights};
use crate::train::trainer::Trainer;

/// One device's share of the job, as the plan sees it.
pub struct Holdings<'a> {
    pub job: &'a JobConfig,
    pub spec: &'a EngineSpec,
    /// The run's engine config (`plan::engine_config`).
    pub engine: &'a EngineConfig,
    pub trainer: &'a Trainer,
    /// The teacher's shapes and weights where this device scores with it.
    pub teacher: Option<(&'a ModelConfig, &'a ModelWeights)>,
    /// A CPU device (its trainer's state is always its own memory).
    pub cpu: bool,
    /// A split placement; this device generates; it is the training lead (or colocated).
    pub split: bool,
    pub generates: bool,
    pub lead_or_all: bool,
    /// The device's budget (None: a CPU device without `run.memory_budget_mb`).
    pub budget: Option<usize>,
}

/// The plan's input for one device, with its parts for messages and the plan line.
pub struct Planned {
    pub need: Need,
    /// `need.used` in words ("weights … MiB + trainer … MiB + …").
    pub parts: String,
    /// The trainer's activation arenas (0 where it does not train on this device).
    pub activations: usize,
    /// The trainer's state and activations where it trains here.
    pub trainer_here: usize,
    pub teacher: usize,
    pub engine_buffers: usize,
    /// The forward activation buffers of the engines on this device (standard, rollout when it
    /// is another, the teacher's: `Engine::plan_buffer_bytes`).
    pub engine_activations: usize,
    pub snapshot: usize,
    /// The rollout recipe is the standard engine's (no engine of its own).
    pub standard: bool,
    /// The rollout engine's config (its FP8 KV layers and graph versions).
    pub rollout_ec: EngineConfig,
}

/// Whether `spec` is the standard engine (it reads the trainer's tensors: no engine of its own).
pub fn is_standard(spec: &EngineSpec) -> bool {
    spec.recipe.is_standard() && spec.noise_sigma == 0.0 && spec.staleness == 0
}

/// Decode graphs a rollout engine keeps per batch bucket: one per weight copy its view rotates
/// through (the staleness ring's k + 1), at least the default.
pub fn graph_versions(spec: &EngineSpec) -> usize {
    (spec.staleness + 1).max(EngineConfig::default().graph_versions)
}

/// The rollout engine's config for `spec` over the run's engine config `base`: the recipe's
/// FP8 KV layers and a decode graph per weight copy it rotates through.
pub fn rollout_engine_config(spec: &EngineSpec, base: &EngineConfig) -> EngineConfig {
    EngineConfig { kv_fp8: spec.recipe.kv_layers(), graph_versions: graph_versions(spec), ..base.clone() }
}

/// Bytes of one KV block of an engine with config `ec` over a model of `cfg` in `dtype`
/// (blocks of `block_size` tokens; FP8 layers one byte a value).
pub fn kv_block_bytes(cfg: &ModelConfig, dtype: DType, ec: &EngineConfig, block_size: usize) -> usize {
    crate::engine::kv_cache::KvCache::block_bytes_layers(cfg, block_size, &ec.kv_dtypes(cfg, dtype))
}

/// What the device holds before its caches, in the order the plan lists it.
/// The trainer's state counts on CPU devices and on a CUDA device that trains there (master,
/// moments, gradient, and the activations of one micro-batch — with
/// objective.micro_batch_tokens = 0, of a whole step's responses at max_new_tokens each plus as
/// many prompt tokens, a bound the data does not give before it is read; with several GPUs
/// also the ZeRO-1 buffers). A split placement's lead trainer on a GPU that publishes through a
/// snapshot (COLOTRAIN_DEVICE_COLLECTIVE=peer; the default broadcasts, `GenLink::publish`)
/// also holds it: a copy of its compute weights.
pub fn plan(h: &Holdings) -> Planned {
    let (job, tr) = (h.job, h.trainer);
    let cfg = &tr.cfg;
    let dtype = tr.weights.dtype();
    let standard = is_standard(h.spec) || !h.generates;
    let engine_buffers = RolloutWeights::estimate_extra_bytes(h.spec, &tr.weights);
    let rollout_ec = rollout_engine_config(h.spec, h.engine);
    let step_tokens = 2 * job.rollout.prompts_per_step * job.rollout.samples_per_prompt * job.rollout.max_new_tokens;
    let learner: &[String] = match job.learner.precision {
        LearnerPrecision::Nvfp4 => &job.learner.linears,
        _ => &[],
    };
    let activations = tr.activation_plan_bytes(step_tokens, learner);
    let trainer_here = if h.cpu || tr.on_device() { tr.state_bytes() + activations } else { 0 };
    let teacher = h.teacher.map(|t| t.1.size_bytes()).unwrap_or(0);
    let snapshot =
        if h.split && !h.generates && h.lead_or_all && tr.on_device() && !super::plan::publishes_by_broadcast() {
            tr.weights.size_bytes()
        } else {
            0
        };
    // Every engine's forward buffers: the standard engine, the rollout engine where it is
    // another, the teacher's (it scores in chunks of `EngineConfig::scoring`'s rows).
    let fwd =
        |c: &ModelConfig, dt: DType, ec: &EngineConfig| crate::engine::Engine::plan_buffer_bytes(c, dt, ec, !h.cpu);
    let engine_activations = fwd(cfg, dtype, h.engine)
        + if standard { 0 } else { fwd(cfg, dtype, &rollout_ec) }
        + h.teacher.map(|(tc, tw)| fwd(tc, tw.dtype(), &h.engine.scoring())).unwrap_or(0);
    let used = tr.weights.size_bytes() + trainer_here + teacher + engine_buffers + engine_activations + snapshot;
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    let parts =
        format!(
            "weights {:.0} MiB + trainer {:.0} MiB + teacher {:.0} MiB + engine buffers {:.0} MiB + engine activations {:.0} MiB",
            mib(tr.weights.size_bytes()),
            mib(trainer_here),
            mib(teacher),
            mib(engine_buffers),
            mib(engine_activations)
        ) + &if snapshot > 0 { format!(" + published snapshot {:.0} MiB", mib(snapshot)) } else { String::new() };
    // The engines on this device (the standard one, the rollout engine when it is another,
    // the teacher's) and their KV block sizes.
    let bs = h.engine.block_size;
    let useful =
        |c: &ModelConfig| h.engine.max_seqs * h.engine.max_model_len.unwrap_or(c.max_position_embeddings).div_ceil(bs);
    let mut engines = vec![(kv_block_bytes(cfg, dtype, h.engine, bs), useful(cfg))];
    if !standard {
        engines.push((kv_block_bytes(cfg, dtype, &rollout_ec, bs), useful(cfg)));
    }
    if let Some((tc, tw)) = h.teacher {
        engines.push((kv_block_bytes(tc, tw.dtype(), h.engine, bs), useful(tc)));
    }
    let no_release = if h.split {
        Some("a split placement's devices never switch between decoding and training")
    } else if job.schedule.mode == ScheduleMode::Async {
        Some("the asynchronous schedule keeps sequences in flight across updates")
    } else {
        None
    };
    // The standard engine only calibrates and evaluates, between steps: where a sequence never
    // stays in flight across them, its cache takes turns with the rollout engine's.
    let turns = !standard && no_release.is_none();
    let need = Need {
        used,
        activations: if trainer_here > 0 { activations } else { 0 },
        budget: h.budget,
        budget_source: if job.run.memory_budget_mb.is_some() { "run.memory_budget_mb" } else { "the device's memory" },
        engines,
        turns,
        kv_cache_bytes: h.engine.kv_cache_bytes,
        graph_pad: (h.engine.cuda_graphs && !h.cpu) as usize,
        min_blocks: (job.rollout.max_new_tokens + 1).div_ceil(bs.max(1)),
        policy: job.rollout.kv_release,
        no_release,
    };
    Planned {
        need,
        parts,
        activations,
        trainer_here,
        teacher,
        engine_buffers,
        engine_activations,
        snapshot,
        standard,
        rollout_ec,
    }
}
