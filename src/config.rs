//! The job config (TOML): every section, its defaults, and validation up front with errors that
//! name the file, the key and what was expected (unknown keys included).
//!
//! Owns: [`JobConfig`] and the modes only a job has ([`ScheduleMode`], [`Placement`],
//! [`RolloutSource`], [`LearnerPrecision`], [`OptimizerKind`], [`CheckpointDtype`]). May call:
//! serde/toml, and the types it validates from the layers below (`DeviceSpec`, the objective's
//! modes, the engine's recipe, the monitor's settings). Must not: open models or devices, or be
//! imported by the layers it validates.

pub use crate::objective::{LossAgg, ObjectiveKind};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct JobConfig {
    #[serde(default)]
    pub run: RunConfig,
    pub model: ModelSource,
    #[serde(default)]
    pub teacher: Option<ModelSource>,
    #[serde(default)]
    pub data: DataConfig,
    #[serde(default)]
    pub rollout: RolloutConfig,
    #[serde(default)]
    pub objective: ObjectiveConfig,
    #[serde(default)]
    pub optimizer: OptimizerConfig,
    #[serde(default)]
    pub checkpoint: CheckpointConfig,
    #[serde(default)]
    pub eval: EvalConfig,
    #[serde(default)]
    pub engine: EngineSection,
    #[serde(default)]
    pub learner: LearnerConfig,
    #[serde(default)]
    pub monitor: crate::mismatch::monitor::MonitorConfig,
    /// Left out of the written config while it is the default, so that the fingerprints of
    /// runs made before `[guard]` existed stay what they were.
    #[serde(default, skip_serializing_if = "crate::mismatch::guard::GuardConfig::is_default")]
    pub guard: crate::mismatch::guard::GuardConfig,
    #[serde(default)]
    pub schedule: ScheduleConfig,
    #[serde(default)]
    pub reward: RewardConfig,
}

/// How responses are rewarded: the built-in math rule (`data::answer`: the last `\boxed{}`
/// against the prompt's reference answer) or a plug-in command (`reward::plugin`).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RewardConfig {
    /// The plug-in's command line (program and arguments), started once per run; empty: the
    /// built-in rule.
    pub command: Vec<String>,
    /// Seconds a plug-in may take to answer one batch.
    pub timeout_s: f64,
    /// Responses per batch sent to the plug-in (also the bound on responses waiting for it).
    pub batch: usize,
}

impl Default for RewardConfig {
    fn default() -> Self {
        RewardConfig { command: Vec::new(), timeout_s: 60.0, batch: 64 }
    }
}

/// How rollout and training share the devices (seed 000 §5.4, App. C.5).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ScheduleConfig {
    /// "sync": rollout, then training, then resync, every step. "async": generation runs ahead
    /// of training; a token is trained only if its weights are at most `max_staleness` versions
    /// old.
    pub mode: ScheduleMode,
    pub max_staleness: u64,
    /// "colocated" (every device generates and trains) or "split" (`rollout_devices` devices
    /// generate, the others train).
    pub placement: Placement,
    pub rollout_devices: usize,
}

impl Default for ScheduleConfig {
    fn default() -> Self {
        ScheduleConfig {
            mode: ScheduleMode::Sync,
            max_staleness: 1,
            placement: Placement::Colocated,
            rollout_devices: 1,
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    pub name: String,
    /// Where metrics, checkpoints and the resolved config go (default runs/<name>).
    pub out_dir: Option<PathBuf>,
    pub seed: u64,
    pub steps: u64,
    /// cpu, cpu:<threads> (threads per device), cuda, cuda:<k> (the first GPU).
    pub device: String,
    /// Devices (workers) of the run; 0: all visible GPUs on CUDA, 1 on CPU.
    pub devices: usize,
    /// Memory per device the plan must fit in (MiB); checked before the run starts.
    pub memory_budget_mb: Option<usize>,
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig {
            name: "run".into(),
            out_dir: None,
            seed: 1,
            steps: 100,
            device: "cpu".into(),
            devices: 0,
            memory_budget_mb: None,
        }
    }
}

/// A model directory, or a built-in tiny model (`builtin:tiny-arith-student` / `-teacher`).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelSource {
    pub path: String,
    /// Compute-weight dtype in memory: f32 or bf16 (default f32 on CPU, bf16 on CUDA).
    #[serde(default)]
    pub dtype: Option<String>,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// `builtin:arith` (the synthetic addition task) or a JSONL of prompts
    /// ({"prompt"|"messages"|"tokens", "answer"?}).
    pub train: String,
    /// Held-out prompts for evaluation (same formats); `builtin:arith` draws a fixed set.
    pub heldout: Option<String>,
    /// Render text prompts with the chat template.
    pub chat: bool,
    /// Held-out problems drawn for `builtin:arith`.
    pub heldout_size: usize,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig { train: "builtin:arith".into(), heldout: None, chat: false, heldout_size: 128 }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RolloutConfig {
    /// "engine" (sample with the current weights) or "file" (precomputed rollouts).
    pub source: RolloutSource,
    pub file: Option<PathBuf>,
    pub prompts_per_step: usize,
    pub samples_per_prompt: usize,
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: u32,
    pub max_new_tokens: usize,
    pub max_seqs: usize,
    pub max_tokens_per_step: usize,
    /// Each engine's KV cache (MiB); 0: sized from what the memory plan leaves of the device's
    /// budget (`run.memory_budget_mb`, or a GPU's free memory), the same capacity in tokens for
    /// every engine.
    pub kv_cache_mb: usize,
    /// CUDA: replay each decode step as a CUDA graph captured per batch-size bucket (false:
    /// launch every kernel eagerly). No effect on CPU devices.
    pub cuda_graphs: bool,
    /// Whether a device's KV caches are freed for the train phase and allocated again after it
    /// (synchronous colocated schedule only): `auto` when the memory plan cannot hold the
    /// caches and the trainer's activations at once, `always`, or `never` (such a plan is
    /// refused).
    pub kv_release: KvRelease,
}

impl Default for RolloutConfig {
    fn default() -> Self {
        RolloutConfig {
            source: RolloutSource::Engine,
            file: None,
            prompts_per_step: 8,
            samples_per_prompt: 8,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            max_new_tokens: 1024,
            max_seqs: 64,
            max_tokens_per_step: 2048,
            kv_cache_mb: 512,
            cuda_graphs: true,
            kv_release: KvRelease::Auto,
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ObjectiveConfig {
    /// "opd", "sft", "grpo", "reinforce" or "triage" (GRPO + TIS + the TRIAGE gate and repair).
    pub kind: ObjectiveKind,
    /// "token-mean", "seq-mean-token-mean" or "seq-mean-token-sum" (default: token-mean for
    /// opd/sft, seq-mean-token-mean for the RL objectives).
    pub loss_agg: Option<LossAgg>,
    /// Rows of logits held at once by the fused LM-head loss.
    pub chunk_size: usize,
    /// Tokens per micro-batch of the backward (activation memory bound); 0: the whole step.
    pub micro_batch_tokens: usize,
    /// A trainer on a GPU keeps each layer's input alone and runs each layer's forward again
    /// in the backward: about a layer's activations per token instead of every layer's, for
    /// one more forward pass of the layers. The gradients are the same bits. (The host
    /// trainer keeps everything.)
    pub activation_checkpointing: bool,
    /// PPO-style ratio clipping [1 − clip_low, 1 + clip_high] (grpo, triage).
    pub clip_low: f64,
    pub clip_high: f64,
    /// Truncated importance sampling × min(π_old/π_sampler, tis_cap) (default: on for triage).
    pub tis: Option<bool>,
    pub tis_cap: f64,
    /// GRPO's group std with n (population) instead of n − 1.
    pub population_std: bool,
    /// Constant b added to every advantage (seed 000 App. B.1).
    pub advantage_offset: f64,
    /// Score centering: the score's target becomes the engine's normalized top-k distribution.
    pub centering: bool,
    pub centering_top_k: u32,
    /// Optimizer updates per step: the step's rollouts split into `minibatches`, each pass over
    /// them repeated `updates_per_step` times (ratios against the step's old log-probs).
    pub minibatches: usize,
    pub updates_per_step: usize,
    pub triage: crate::objective::triage::TriageConfig,
}

impl Default for ObjectiveConfig {
    fn default() -> Self {
        ObjectiveConfig {
            kind: ObjectiveKind::Opd,
            loss_agg: None,
            chunk_size: 256,
            micro_batch_tokens: 0,
            activation_checkpointing: false,
            clip_low: 0.2,
            clip_high: 0.28,
            tis: None,
            tis_cap: 2.0,
            population_std: false,
            advantage_offset: 0.0,
            centering: false,
            centering_top_k: 128,
            minibatches: 1,
            updates_per_step: 1,
            triage: Default::default(),
        }
    }
}

impl ObjectiveConfig {
    pub fn is_rl(&self) -> bool {
        self.kind.is_rl()
    }
    pub fn tis_enabled(&self) -> bool {
        self.tis.unwrap_or(self.kind == ObjectiveKind::Triage)
    }
}

/// The trainer's forward precision (seed 004 §5.1: native NVFP4 on the learner too).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LearnerConfig {
    /// "bf16" (the compute dtype) or "nvfp4": the chosen linears run with NVFP4 weights and
    /// activations (the engine's quantizer) and a straight-through backward.
    pub precision: LearnerPrecision,
    /// Which linears of every layer (q_proj … down_proj); default: the MLP's.
    pub linears: Vec<String>,
}

impl Default for LearnerConfig {
    fn default() -> Self {
        LearnerConfig {
            precision: LearnerPrecision::Bf16,
            linears: vec!["gate_proj".into(), "up_proj".into(), "down_proj".into()],
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct OptimizerConfig {
    /// "adamw" or "sgd".
    pub kind: OptimizerKind,
    pub lr: f64,
    pub betas: [f64; 2],
    pub eps: f64,
    pub weight_decay: f64,
    /// Max global gradient norm; 0 disables clipping.
    pub grad_clip: f64,
    /// Linear warmup from 0 over this many steps, then constant.
    pub warmup_steps: u64,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig {
            kind: OptimizerKind::AdamW,
            lr: 1e-6,
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.01,
            grad_clip: 1.0,
            warmup_steps: 0,
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    /// Save every N steps (0: only at the end).
    pub every: u64,
    /// Stored weight dtype: bf16 or f32.
    pub dtype: CheckpointDtype,
    /// Checkpoints kept (older ones are removed after a newer one is durable); 0 keeps all.
    pub keep: usize,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig { every: 0, dtype: CheckpointDtype::Bf16, keep: 2 }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EvalConfig {
    /// Held-out evaluation every N steps (0: only before the first and after the last step).
    pub every: u64,
    pub samples_per_prompt: usize,
    pub max_new_tokens: Option<usize>,
    /// Sampling seed of held-out responses: fixed per (problem, sample) and shared by every run
    /// compared with one another.
    pub seed: u64,
}

impl Default for EvalConfig {
    fn default() -> Self {
        EvalConfig { every: 0, samples_per_prompt: 1, max_new_tokens: None, seed: 20261101 }
    }
}

/// The rollout engine: precision recipe (seed 000 Table 3), weight noise, staleness.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EngineSection {
    /// bf16 (the standard engine), fp8, nvfp4 or fp8-kv.
    pub recipe: String,
    /// Exceptions kept in the model's dtype: "first-layer-kv", "first-layer", "last-layer".
    pub keep_bf16: Vec<String>,
    /// FP8 KV-cache scales: "calibrated" or a number (vLLM's default is 1.0).
    pub kv_scale: KvScaleConfig,
    /// Per-layer overrides, applied after the preset.
    pub overrides: Vec<OverrideConfig>,
    /// Weight-noise engine: σ (0 disables).
    pub noise_sigma: f64,
    pub noise_seed: u64,
    /// Rollout weights this many versions behind the trainer's.
    pub staleness: usize,
    /// NVFP4 options: random Hadamard transform and stochastic rounding.
    pub rht: bool,
    pub stochastic_rounding: bool,
    /// Responses of the untrained student for calibrating activation and KV scales.
    pub calibration_samples: usize,
    /// Reuse a calibration file instead of calibrating.
    pub calibration_file: Option<PathBuf>,
}

impl Default for EngineSection {
    fn default() -> Self {
        EngineSection {
            recipe: "bf16".into(),
            keep_bf16: Vec::new(),
            kv_scale: KvScaleConfig::Name("calibrated".into()),
            overrides: Vec::new(),
            noise_sigma: 0.0,
            noise_seed: 20261001,
            staleness: 0,
            rht: false,
            stochastic_rounding: false,
            calibration_samples: 16,
            calibration_file: None,
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(untagged)]
pub enum KvScaleConfig {
    Value(f64),
    Name(String),
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct OverrideConfig {
    pub layers: Vec<usize>,
    /// Linears (q_proj ... down_proj); empty: all seven.
    pub linears: Vec<String>,
    pub weight: Option<String>,
    pub input: Option<String>,
    /// "fp8" or "bf16".
    pub kv: Option<String>,
}

impl EngineSection {
    /// The engine described by this section for a model of `num_layers` layers.
    pub fn spec(&self, num_layers: usize) -> Result<crate::engine::rollout_weights::EngineSpec> {
        use crate::quant::recipe::{KvScale, Override, Precision, Recipe};
        let kv_scale = match &self.kv_scale {
            KvScaleConfig::Name(n) if n == "calibrated" => KvScale::Calibrated,
            KvScaleConfig::Name(n) => bail!("engine.kv_scale: expected \"calibrated\" or a number, got {n:?}"),
            KvScaleConfig::Value(v) if *v > 0.0 && v.is_finite() => KvScale::Fixed(*v as f32),
            KvScaleConfig::Value(v) => bail!("engine.kv_scale: must be positive, got {v}"),
        };
        let opts = crate::quant::nvfp4::Nvfp4Opts {
            rht: self.rht.then_some(0x5248_5400 ^ self.noise_seed),
            stochastic: self.stochastic_rounding.then_some(0x5352_0000 ^ self.noise_seed),
        };
        let mut recipe = Recipe::preset(&self.recipe, num_layers, &self.keep_bf16, kv_scale, opts)
            .map_err(|e| anyhow::anyhow!("engine.recipe: {e}"))?;
        for (i, o) in self.overrides.iter().enumerate() {
            let p = |s: &Option<String>| s.as_deref().map(Precision::parse).transpose();
            let kv_fp8 = match o.kv.as_deref() {
                None => None,
                Some("fp8") => Some(true),
                Some("bf16") | Some("native") => Some(false),
                Some(k) => bail!("engine.overrides[{i}].kv: expected fp8 or bf16, got '{k}'"),
            };
            let ov = Override {
                layers: o.layers.clone(),
                linears: o.linears.clone(),
                weight: p(&o.weight).map_err(|e| anyhow::anyhow!("engine.overrides[{i}].weight: {e}"))?,
                input: p(&o.input).map_err(|e| anyhow::anyhow!("engine.overrides[{i}].input: {e}"))?,
                kv_fp8,
                k_fp8: None,
                v_fp8: None,
            };
            recipe.apply(&ov).map_err(|e| anyhow::anyhow!("engine.overrides[{i}]: {e}"))?;
        }
        if !(self.noise_sigma >= 0.0 && self.noise_sigma.is_finite()) {
            bail!("engine.noise_sigma: must be a finite number >= 0, got {}", self.noise_sigma);
        }
        Ok(crate::engine::rollout_weights::EngineSpec {
            recipe,
            noise_sigma: self.noise_sigma,
            noise_seed: self.noise_seed,
            staleness: self.staleness,
        })
    }
}

crate::str_enum! {
    /// When rollouts are made (`schedule.mode`).
    pub enum ScheduleMode("schedule.mode", "expected {expected}, got '{s}'") {
        /// Rollout, then training, then resync, every step.
        Sync = "sync",
        /// Generation runs ahead of training by at most `max_staleness` versions.
        Async = "async",
    }
}

crate::str_enum! {
    /// Which devices generate and which train (`schedule.placement`).
    pub enum Placement("schedule.placement", "expected {expected}, got '{s}'") {
        /// Every device generates and trains, time-shared.
        Colocated = "colocated",
        /// The first `rollout_devices` devices generate, the others train.
        Split = "split",
    }
}

crate::str_enum! {
    /// Where a step's rollouts come from (`rollout.source`).
    pub enum RolloutSource("rollout.source", "unknown source '{s}': expected {expected}") {
        Engine = "engine",
        /// Precomputed rollouts read from `rollout.file`.
        File = "file",
    }
}

crate::str_enum! {
    /// When the KV caches make room for the train phase (`rollout.kv_release`).
    pub enum KvRelease("rollout.kv_release", "expected {expected}, got '{s}'") {
        /// Only when the memory plan cannot hold the caches and the activations at once.
        Auto = "auto",
        Always = "always",
        Never = "never",
    }
}

crate::str_enum! {
    /// The trainer's forward precision (`learner.precision`).
    pub enum LearnerPrecision("learner.precision", "expected {expected}, got '{s}'") {
        Bf16 = "bf16",
        /// The chosen linears on NVFP4 weights and activations, straight-through backward.
        Nvfp4 = "nvfp4",
    }
}

crate::str_enum! {
    /// The optimizer over the FP32 master weights (`optimizer.kind`).
    pub enum OptimizerKind("optimizer.kind", "unknown optimizer '{s}': expected {expected}") {
        /// AdamW with PyTorch's semantics.
        AdamW = "adamw",
        Sgd = "sgd",
    }
}

crate::str_enum! {
    /// The dtype of a checkpoint's model weights (`checkpoint.dtype`).
    pub enum CheckpointDtype("checkpoint.dtype", "expected {expected}, got '{s}'") {
        Bf16 = "bf16",
        F32 = "f32",
    }
}

impl JobConfig {
    pub fn from_file(path: &Path) -> Result<JobConfig> {
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read config {}", path.display()))?;
        Self::from_toml(&text, &path.display().to_string())
    }

    pub fn from_toml(text: &str, file: &str) -> Result<JobConfig> {
        let cfg: JobConfig = toml::from_str(text).map_err(|e| anyhow::anyhow!("{file}: {e}"))?;
        cfg.validate(file)?;
        Ok(cfg)
    }

    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_default()
    }

    pub fn out_dir(&self) -> PathBuf {
        self.run.out_dir.clone().unwrap_or_else(|| PathBuf::from("runs").join(&self.run.name))
    }

    pub fn loss_agg(&self) -> LossAgg {
        let default = if self.objective.is_rl() { LossAgg::SeqMeanTokenMean } else { LossAgg::TokenMean };
        self.objective.loss_agg.unwrap_or(default)
    }

    /// Whether the mismatch guard acts in this run: enabled, and the run samples tokens (file
    /// rollouts and SFT on reference answers give it nothing to watch; it stands by).
    pub fn guard_active(&self) -> bool {
        self.guard.enabled && self.rollout.source == RolloutSource::Engine && self.objective.kind != ObjectiveKind::Sft
    }

    /// `[guard]`: its own settings, each rung's spelling, and the runs it can act on.
    fn validate_guard(&self, file: &str) -> Result<()> {
        let g = &self.guard;
        g.validate().map_err(|e| anyhow::anyhow!("{file}: {e:#}"))?;
        if !g.enabled {
            return Ok(());
        }
        for (i, r) in g.fallback.iter().enumerate() {
            without_model(crate::mismatch::admit::parse_candidate(r, 1, self.engine.noise_seed)).map_err(|m| {
                anyhow::anyhow!("{file}: guard.fallback[{i}]: '{r}' is not a recipe colotrain admit accepts: {m}")
            })?;
        }
        // (File rollouts and SFT sample nothing: the guard stands by, see `orchestrator::guard`.)
        let why = (self.schedule.mode != ScheduleMode::Sync || self.schedule.placement != Placement::Colocated).then_some(
            "the guard switches the rollout engine between steps, which needs schedule.mode = \"sync\" with colocated placement (an asynchronous or split schedule keeps sequences running in it)",
        );
        if let Some(why) = why {
            bail!("{file}: guard.enabled: {why}; set guard.enabled = false");
        }
        Ok(())
    }

    /// Checks values, not only types; every error names the key.
    pub fn validate(&self, file: &str) -> Result<()> {
        let err = |key: &str, msg: String| -> Result<()> { bail!("{file}: {key}: {msg}") };
        if self.run.name.is_empty() || self.run.name.contains('/') {
            err("run.name", format!("must be a non-empty name without '/', got {:?}", self.run.name))?;
        }
        if self.run.steps == 0 {
            err("run.steps", "must be at least 1".into())?;
        }
        // The spelling only: which devices exist is checked when the run starts.
        crate::device::DeviceSpec::parse(&self.run.device)
            .map(|_| ())
            .or_else(|e| err("run.device", format!("{e:#}")))?;
        match self.objective.kind {
            ObjectiveKind::Opd => {
                if self.teacher.is_none() {
                    err("teacher", "the opd objective needs a [teacher] model".into())?;
                }
            }
            ObjectiveKind::Sft => {}
            ObjectiveKind::Grpo | ObjectiveKind::Triage
                if self.rollout.source == RolloutSource::Engine && self.rollout.samples_per_prompt < 2 =>
            {
                err(
                "rollout.samples_per_prompt",
                format!("{} normalizes rewards within each prompt's group: its standard deviation is undefined with 1 sample per prompt (use at least 2, or objective.kind = \"reinforce\")", self.objective.kind),
                )?
            }
            ObjectiveKind::Grpo | ObjectiveKind::Reinforce | ObjectiveKind::Triage => {}
        }
        let o = &self.objective;
        if !(o.clip_low >= 0.0 && o.clip_low < 1.0) || !(o.clip_high >= 0.0 && o.clip_high.is_finite()) {
            err(
                "objective.clip_low",
                format!("need 0 <= clip_low < 1 and clip_high >= 0, got {} and {}", o.clip_low, o.clip_high),
            )?;
        }
        if !(o.tis_cap > 0.0) {
            err("objective.tis_cap", format!("must be positive, got {}", o.tis_cap))?;
        }
        if !o.advantage_offset.is_finite() {
            err("objective.advantage_offset", "must be finite".into())?;
        }
        if o.centering && o.centering_top_k == 0 {
            err("objective.centering_top_k", "must be at least 1".into())?;
        }
        if o.centering && !(o.is_rl() || o.kind == ObjectiveKind::Opd) {
            err(
                "objective.centering",
                format!(
                    "score centering applies to policy-gradient objectives (opd, grpo, reinforce, triage), not '{}'",
                    o.kind
                ),
            )?;
        }
        if o.minibatches == 0 || o.updates_per_step == 0 {
            err("objective.minibatches", "minibatches and updates_per_step must be at least 1".into())?;
        }
        if o.kind == ObjectiveKind::Triage {
            o.triage.validate().map_err(|e| anyhow::anyhow!("{file}: {e:#}"))?;
        }
        if (self.schedule.mode, self.schedule.placement) == (ScheduleMode::Sync, Placement::Split) {
            err(
                "schedule.placement",
                "the split placement needs schedule.mode = \"async\" (generators run ahead of the trainers)".into(),
            )?;
        }
        if self.schedule.placement == Placement::Split && self.schedule.rollout_devices == 0 {
            err("schedule.rollout_devices", "the split placement needs at least 1 rollout device".into())?;
        }
        if self.schedule.mode == ScheduleMode::Async && self.rollout.source != RolloutSource::Engine {
            err(
                "schedule.mode",
                "the asynchronous schedule generates its rollouts: rollout.source must be \"engine\"".into(),
            )?;
        }
        if self.monitor.segment_len == 0 {
            err("monitor.segment_len", "must be at least 1 token".into())?;
        }
        match self.learner.precision {
            LearnerPrecision::Bf16 => {}
            LearnerPrecision::Nvfp4 => {
                for l in &self.learner.linears {
                    if !crate::quant::recipe::LINEARS.contains(&l.as_str()) {
                        err(
                            "learner.linears",
                            format!("unknown linear '{l}': expected one of {:?}", crate::quant::recipe::LINEARS),
                        )?;
                    }
                }
            }
        }
        if self.objective.chunk_size == 0 {
            err("objective.chunk_size", "must be at least 1".into())?;
        }
        if self.reward.command.first().is_some_and(|p| p.trim().is_empty()) {
            err("reward.command", "the program (its first element) is empty".into())?;
        }
        if !(self.reward.timeout_s > 0.0 && self.reward.timeout_s.is_finite()) {
            err("reward.timeout_s", format!("must be a positive number of seconds, got {}", self.reward.timeout_s))?;
        }
        if self.reward.batch == 0 {
            err("reward.batch", "must be at least 1".into())?;
        }
        if self.rollout.source == RolloutSource::File && self.rollout.file.is_none() {
            err("rollout.file", "rollout.source = \"file\" needs rollout.file".into())?;
        }
        if self.rollout.prompts_per_step == 0 || self.rollout.samples_per_prompt == 0 {
            err("rollout.prompts_per_step", "prompts_per_step and samples_per_prompt must be at least 1".into())?;
        }
        if !(self.rollout.temperature > 0.0 && self.rollout.temperature.is_finite()) {
            err("rollout.temperature", format!("must be positive for training, got {}", self.rollout.temperature))?;
        }
        if !(self.rollout.top_p > 0.0 && self.rollout.top_p <= 1.0) {
            err("rollout.top_p", format!("must be in (0, 1], got {}", self.rollout.top_p))?;
        }
        if self.rollout.max_new_tokens == 0 {
            err("rollout.max_new_tokens", "must be at least 1".into())?;
        }
        if !(self.optimizer.lr >= 0.0 && self.optimizer.lr.is_finite()) {
            err("optimizer.lr", format!("must be a finite number >= 0, got {}", self.optimizer.lr))?;
        }
        for (i, b) in self.optimizer.betas.iter().enumerate() {
            if !(0.0..1.0).contains(b) {
                err(&format!("optimizer.betas[{i}]"), format!("must be in [0, 1), got {b}"))?;
            }
        }
        if !(self.optimizer.eps > 0.0) {
            err("optimizer.eps", "must be positive".into())?;
        }
        if !(self.optimizer.weight_decay >= 0.0) || !(self.optimizer.grad_clip >= 0.0) {
            err("optimizer.weight_decay", "weight_decay and grad_clip must be >= 0".into())?;
        }
        for (key, m) in [("model.dtype", Some(&self.model)), ("teacher.dtype", self.teacher.as_ref())] {
            if let Some(d) = m.and_then(|m| m.dtype.as_deref()) {
                if !matches!(d, "f32" | "bf16") {
                    err(key, format!("expected f32 or bf16, got '{d}'"))?;
                }
            }
        }
        // The recipe itself (names, layer indices) is checked against the model at start; here
        // everything that does not need the model.
        without_model(self.engine.spec(1)).map_err(|m| anyhow::anyhow!("{file}: {m}"))?;
        self.validate_guard(file)?;
        if self.engine.calibration_samples == 0 {
            err("engine.calibration_samples", "must be at least 1".into())?;
        }
        if self.eval.samples_per_prompt == 0 {
            err("eval.samples_per_prompt", "must be at least 1".into())?;
        }
        Ok(())
    }
}

/// A recipe parsed before the model is known (with 1 layer): its error message, unless the error
/// is only a layer index the real model may have (checked against the model at start).
fn without_model<T>(r: Result<T>) -> std::result::Result<(), String> {
    match r {
        Ok(_) => Ok(()),
        Err(e) => {
            let m = format!("{e:#}");
            if m.contains("out of range") {
                Ok(())
            } else {
                Err(m)
            }
        }
    }
}
