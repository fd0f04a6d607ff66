//! The `train` job: one process, N devices (worker threads, one per device, each with its own
//! replica), colocated. Per step (synchronous schedule): every device generates from a shared
//! queue of the step's requests (work-balanced), every device teacher-scores from a shared queue,
//! rewards on the host, the data-parallel training step (ZeRO-1), the in-place resync, metrics
//! (one JSON line), periodic held-out evaluation (device 0) and checkpoints. The asynchronous
//! schedule lives in `schedule.rs`.
//!
//! Owns: the orchestration and the run directory's files. May call: the worker pool, replicas.
//! Must not: touch a device's state except through commands to its worker.

pub use super::metrics::{summary_table, JobSummary, LogpDifference, PhaseSeconds, StepMetrics};
use super::checkpoint::{self, OptState};
use super::dp::Dp;
use super::eval::{self, EvalResult};
use super::monitor::Monitor;
use super::replica::{self, Replica, Setup};
use super::rollout::{self, Rollout};
use super::trainer::StepOut;
use crate::config::JobConfig;
use crate::data::answer;
use crate::data::dataset::{Dataset, PromptItem};
use crate::engine::{EngineConfig, SamplingConfig};
use crate::mismatch;
use crate::model::{ModelConfig, TextTools};
use crate::parallel::{Collective, InProcess, WorkerPool};
use anyhow::{bail, Context, Result};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

#[derive(Clone, Debug, Default)]
pub struct JobOptions {
    pub resume: Option<PathBuf>,
    /// Draw a progress bar (stderr).
    pub progress: bool,
    /// Set (e.g. by Ctrl-C) to finish the current step, write a checkpoint and stop.
    pub stop: Option<Arc<AtomicBool>>,
    /// Fault injection for tests of the failure paths: device `rank` fails (or panics) in one
    /// phase of `step`.
    pub fault: Option<Fault>,
}

#[derive(Clone, Copy, Debug)]
pub struct Fault {
    pub step: u64,
    pub rank: usize,
    pub panic: bool,
    /// "rollout" (colocated schedules that generate: not file rollouts or SFT on reference
    /// answers), "teacher", "train" or "resync" (colocated; a split placement publishes instead).
    pub phase: &'static str,
}

impl Fault {
    /// Fails (or panics) when `f` names this phase, step and device.
    pub fn check(f: Option<Fault>, phase: &str, step: u64, rank: usize) -> Result<()> {
        match f {
            Some(f) if f.phase == phase && f.step == step && f.rank == rank => {
                if f.panic {
                    panic!("injected panic at step {step}");
                }
                bail!("injected device error at step {step}")
            }
            _ => Ok(()),
        }
    }
}

pub fn engine_config(job: &JobConfig) -> EngineConfig {
    let r = &job.rollout;
    EngineConfig { max_seqs: r.max_seqs, max_tokens_per_step: r.max_tokens_per_step, kv_cache_bytes: r.kv_cache_mb << 20, ..Default::default() }
}

/// Keeps the lines of metrics.jsonl with step <= `upto` (resume), rewriting it atomically.
fn truncate_metrics(path: &Path, upto: u64) -> Result<()> {
    if !path.exists() {
        return Ok(());
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| serde_json::from_str::<serde_json::Value>(l).ok().and_then(|v| v.get("step").and_then(|s| s.as_u64())).map(|s| s <= upto).unwrap_or(false))
        .collect();
    let mut out = kept.join("\n");
    if !out.is_empty() {
        out.push('\n');
    }
    crate::util::write_atomic(path, out.as_bytes())
}

/// The devices of a run: (name, threads per CPU device or 0 for CUDA) × N. `cpu` splits the
/// cores evenly (an error when there are more devices than cores); `cpu:T` gives each device T
/// threads (oversubscription is the user's choice); `cuda`/`cuda:K` takes N GPUs from K on.
pub fn plan_devices(spec: &str, n: usize) -> Result<Vec<String>> {
    let spec = spec.trim();
    let cores = std::thread::available_parallelism().map(|c| c.get()).unwrap_or(1);
    if spec == "cpu" {
        let n = n.max(1);
        if n > cores {
            bail!("run.devices = {n} CPU devices, but this machine has {cores} cores: a CPU device needs at least one (set run.device = \"cpu:T\" to choose threads per device yourself)");
        }
        return Ok((0..n).map(|_| format!("cpu:{}", cores / n)).collect());
    }
    if let Some(t) = spec.strip_prefix("cpu:") {
        let t: usize = t.parse().map_err(|_| anyhow::anyhow!("run.device '{spec}': expected cpu:<threads>"))?;
        return Ok((0..n.max(1)).map(|_| format!("cpu:{t}")).collect());
    }
    let first = match spec {
        "cuda" => 0,
        s => match s.strip_prefix("cuda:") {
            Some(k) => k.parse().map_err(|_| anyhow::anyhow!("run.device '{spec}': expected cuda:<ordinal>"))?,
            None => bail!("run.device '{spec}': expected cpu, cpu:<threads>, cuda or cuda:<ordinal>"),
        },
    };
    // All visible GPUs (CUDA_VISIBLE_DEVICES decides what is visible) unless N is given; N more
    // than are visible is refused here, naming what is. (Built without CUDA, opening the first
    // device later says so.)
    let visible = || (first..first + 64).take_while(|&k| crate::device::Device::cuda(k).is_ok()).count();
    let n = if n > 0 {
        if cfg!(feature = "cuda") {
            if let Err(e) = crate::device::Device::cuda(first + n - 1) {
                bail!(
                    "run.devices = {n} GPUs from cuda:{first}, but {} visible from there (CUDA_VISIBLE_DEVICES={}): cuda:{} cannot be opened: {e:#}",
                    visible(),
                    std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "unset".into()),
                    first + n - 1
                );
            }
        }
        n
    } else {
        visible().max(1)
    };
    Ok((first..first + n).map(|k| format!("cuda:{k}")).collect())
}

/// The collective of the training devices `names`: in-process (the default: training runs on
/// the host, so host memory needs no copies), or NCCL across their GPUs with
/// COLOTRAIN_COLLECTIVE=nccl (feature `cuda`).
fn collective(names: &[String]) -> Result<Arc<dyn Collective>> {
    match std::env::var("COLOTRAIN_COLLECTIVE").as_deref() {
        Err(_) | Ok("") | Ok("inprocess") => Ok(Arc::new(InProcess::new(names.len())?)),
        Ok("nccl") => {
            let ords: Vec<usize> = names
                .iter()
                .map(|n| n.strip_prefix("cuda:").and_then(|k| k.parse().ok()))
                .collect::<Option<_>>()
                .ok_or_else(|| anyhow::anyhow!("COLOTRAIN_COLLECTIVE=nccl needs CUDA training devices, got {names:?}"))?;
            nccl_group(&ords)
        }
        Ok(other) => bail!("COLOTRAIN_COLLECTIVE='{other}': expected 'inprocess' (the default) or 'nccl'"),
    }
}

#[cfg(feature = "cuda")]
fn nccl_group(ords: &[usize]) -> Result<Arc<dyn Collective>> {
    Ok(Arc::new(crate::parallel::nccl::Nccl::new(ords)?))
}

#[cfg(not(feature = "cuda"))]
fn nccl_group(_ords: &[usize]) -> Result<Arc<dyn Collective>> {
    bail!("COLOTRAIN_COLLECTIVE=nccl: this binary was built without --features cuda")
}

/// The rollout sampling settings of a job.
pub fn sampling_of(job: &JobConfig) -> SamplingConfig {
    SamplingConfig {
        temperature: job.rollout.temperature,
        top_p: job.rollout.top_p,
        top_k: job.rollout.top_k,
        max_new_tokens: job.rollout.max_new_tokens,
        stop: Vec::new(),
        ignore_eos: false,
        seed: job.run.seed,
        topk_logprobs: if job.objective.centering { job.objective.centering_top_k } else { 0 },
    }
}

/// What the host side of a run holds: data, tokenizer, the worker pool.
pub struct Host {
    pub job: Arc<JobConfig>,
    pub pool: WorkerPool<Replica>,
    pub coll: Arc<dyn Collective>,
    pub text: Option<Arc<TextTools>>,
    pub cfg: ModelConfig,
    pub data: Option<Dataset>,
    pub file_rollouts: Option<Vec<Rollout>>,
    pub heldout: Arc<Vec<PromptItem>>,
    pub out_dir: PathBuf,
    /// The devices that train (all of them, colocated) and those that generate (all, colocated;
    /// the first `schedule.rollout_devices`, split). Trainer `trainers[i]` is data-parallel rank i.
    pub trainers: Vec<usize>,
    pub generators: Vec<usize>,
    /// Tests: the fault to inject, and the step running now (which phases compare with it).
    pub fault: Option<Fault>,
    pub step: std::sync::atomic::AtomicU64,
}

impl Host {
    pub fn devices(&self) -> usize {
        self.pool.len()
    }

    /// Whether generation has devices of its own (split placement).
    pub fn split(&self) -> bool {
        self.generators.len() < self.pool.len()
    }

    /// The device of data-parallel rank 0 (it evaluates and writes checkpoints).
    pub fn lead(&self) -> usize {
        self.trainers[0]
    }

    /// Rewards of every rollout that lacks one and has a reference answer (0 when cut at the
    /// length limit); the step's mean reward.
    pub fn rewards(&self, rollouts: &mut [Rollout]) -> Result<Option<f64>> {
        let mut rewards = Vec::new();
        for r in rollouts.iter_mut() {
            if let (None, Some(text)) = (r.reward, &self.text) {
                if let Some(ans) = &r.answer {
                    r.reward = Some(answer::rollout_reward(r.truncated, &text.decode(&r.response)?, ans));
                }
            }
            rewards.extend(r.reward.map(|x| x as f64));
        }
        Ok((!rewards.is_empty()).then(|| rewards.iter().sum::<f64>() / rewards.len() as f64))
    }

    /// Teacher log-probs for every rollout, scored on the training devices from a shared queue.
    pub fn score_teacher(&self, rollouts: &mut [Rollout]) -> Result<f64> {
        let reqs = rollout::teacher_requests(rollouts, self.job.rollout.temperature);
        let (fault, step) = (self.fault, self.step.load(Ordering::Relaxed));
        if reqs.is_empty() {
            if fault.is_some() {
                // (Tests: the fault still fires on its device, named like any other.)
                self.pool.run_some(&self.trainers, "teacher", move |rank, _| Fault::check(fault, "teacher", step, rank))?;
            }
            // Everything already scored (a split placement's generators score as they go).
            return Ok(0.0);
        }
        let q = replica::queue(reqs);
        let inflight = self.job.rollout.max_seqs;
        let t0 = Instant::now();
        let parts = self.pool.run_some(&self.trainers, "teacher", move |rank, r| {
            Fault::check(fault, "teacher", step, rank)?;
            let t = Instant::now();
            Ok((r.score(&q, inflight)?, t.elapsed().as_secs_f64()))
        })?;
        let busy: f64 = parts.iter().map(|p| p.1).sum();
        rollout::store_teacher(rollouts, replica::merge(parts.into_iter().map(|p| p.0).collect()));
        Ok(busy / t0.elapsed().as_secs_f64().max(1e-9))
    }

    /// The training step on every training device (the same rollouts everywhere); data-parallel
    /// rank 0's report and every device's seconds busy (0 for generators).
    pub fn train(&self, rollouts: Vec<Rollout>, step: u64) -> Result<(StepOut, Vec<f64>)> {
        let rs = Arc::new(rollouts);
        let fault = self.fault;
        let parts = self.pool.run_some(&self.trainers, "train", move |rank, r| {
            let t = Instant::now();
            Fault::check(fault, "train", step, rank)?;
            let out = r.train(&rs)?;
            Ok((out, t.elapsed().as_secs_f64()))
        })?;
        let mut busy = vec![0.0; self.devices()];
        for (&rank, p) in self.trainers.iter().zip(&parts) {
            busy[rank] = p.1;
        }
        let out = parts.into_iter().next().map(|p| p.0).context("no devices")?;
        Ok((out, busy))
    }

    /// The colocated engines' in-place resync (a split placement publishes instead, see
    /// `schedule.rs`).
    pub fn resync(&self) -> Result<()> {
        let (fault, step) = (self.fault, self.step.load(Ordering::Relaxed));
        self.pool
            .run_all("resync", move |rank, r| {
                Fault::check(fault, "resync", step, rank)?;
                r.resync()
            })
            .map(|_| ())
    }

    /// The training lead's counters: (weight version, skipped steps).
    pub fn trainer_counters(&self) -> Result<(u64, u64)> {
        self.pool.run_on(self.lead(), "stats", |r| Ok((r.trainer.version, r.trainer.skipped_steps)))
    }

    /// Held-out evaluation on the training lead with its standard engine.
    pub fn evaluate(&self, step: u64) -> Result<EvalResult> {
        let (job, text, heldout) = (self.job.clone(), self.text.clone(), self.heldout.clone());
        let r = self.pool.run_on(self.lead(), "eval", move |rep| {
            let eval_new = job.eval.max_new_tokens.unwrap_or(job.rollout.max_new_tokens);
            let te = rep.teacher.as_mut().map(|(w, e)| (e, &*w));
            let mut r = eval::evaluate(step, (&mut rep.std_engine, &rep.trainer.weights), te, text.as_deref(), &heldout, job.eval.samples_per_prompt as u32, eval_new, job.eval.seed)?;
            r.student = job.model.path.clone();
            r.teacher = job.teacher.as_ref().map(|t| t.path.clone()).unwrap_or_default();
            Ok(r)
        })?;
        crate::util::write_atomic(&self.out_dir.join("eval").join(format!("step-{step:06}.json")), serde_json::to_string(&r)?.as_bytes())?;
        Ok(r)
    }

    /// Checkpoint `step`: the optimizer shards gathered, data-parallel rank 0 writes, with the
    /// monitor's state and (colocated) the stale engine's older versions.
    pub fn checkpoint(&self, step: u64, monitor: &Monitor) -> Result<()> {
        let (job, out, lead, split) = (self.job.clone(), self.out_dir.clone(), self.lead(), self.split());
        let mon = serde_json::to_vec(monitor.state())?;
        self.pool.run_some(&self.trainers, "checkpoint", move |rank, r| {
            let (master, m, v) = r.trainer.gather_state()?;
            if rank == lead {
                let mut extra = vec![(checkpoint::MONITOR_FILE, mon.clone())];
                // Split: the generators' engines are busy and theirs; colocated, every device's
                // ring is the same.
                if let (false, Some(ring)) = (split, r.ring_file()?) {
                    extra.push((checkpoint::RING_FILE, ring));
                }
                checkpoint::save(&out, step, &r.trainer, &OptState { master, m, v }, &job, Some(&r.student_dir), &extra)?;
                checkpoint::prune(&out, job.checkpoint.keep)?;
            }
            Ok(())
        })?;
        Ok(())
    }
}

/// Sets up the devices, replicas, data and the calibration of a run.
pub fn start(job: &JobConfig, resume: Option<&Path>, out_dir: &Path) -> Result<(Host, u64)> {
    let dir = super::tiny::resolve(&job.model.path)?;
    if !dir.is_dir() {
        bail!("loading the student '{}': model directory '{}' does not exist", job.model.path, dir.display());
    }
    let cfg = ModelConfig::from_dir(&dir).with_context(|| format!("loading the student '{}'", job.model.path))?;
    // The tokenizer is needed for text data, rewards and accuracy; token-only runs do without.
    let text = if dir.join("tokenizer.json").exists() { Some(Arc::new(TextTools::load(&dir, &cfg)?)) } else { None };
    let file_rollouts = match job.rollout.source.as_str() {
        "file" => Some(rollout::read_file(job.rollout.file.as_deref().context("rollout.file")?, cfg.vocab_size)?),
        _ => None,
    };
    // With file rollouts, data is only needed for held-out evaluation, and only if given.
    let data = match (&file_rollouts, &job.data.heldout) {
        (Some(_), None) => None,
        _ => Some(Dataset::open(&job.data.train, text.clone(), job.data.chat, cfg.vocab_size, job.run.seed)?),
    };
    // RL rewards need every training prompt's answer (checked now, not at the first step).
    let rl = matches!(job.objective.kind.as_str(), "grpo" | "reinforce" | "triage");
    if let (true, None, Some(d)) = (rl, &file_rollouts, &data) {
        if let Some(i) = d.first_without_answer() {
            bail!(
                "data.train '{}': prompt #{} (in file order) has no \"answer\": the {} objective rewards the response's last \\boxed{{}} against it",
                job.data.train,
                i + 1,
                job.objective.kind
            );
        }
        if text.is_none() {
            bail!("the {} objective checks answers in the response text, but the student '{}' has no tokenizer.json", job.objective.kind, job.model.path);
        }
    }
    let heldout = match (&job.data.heldout, &data) {
        (Some(h), _) => Dataset::open(h, text.clone(), job.data.chat, cfg.vocab_size, job.run.seed)?.heldout(usize::MAX)?,
        (None, Some(d)) => d.heldout(job.data.heldout_size)?,
        (None, None) => Vec::new(),
    };
    let names = plan_devices(&job.run.device, job.run.devices)?;
    let n = names.len();
    // Split placement: the first rollout_devices generate, the others train (data-parallel).
    let gens = if job.schedule.placement == "split" { job.schedule.rollout_devices } else { 0 };
    if gens >= n {
        bail!(
            "schedule.placement = \"split\" with schedule.rollout_devices = {gens} needs at least {} devices (some generate, at least one trains), but the run has {n} (run.devices / --devices)",
            gens + 1
        );
    }
    let spec = job.engine.spec(cfg.num_layers).context("[engine]")?;
    let setup = Arc::new(Setup { job: job.clone(), spec, engine: engine_config(job) });
    let coll = collective(&names[gens..])?;
    let cores = if job.run.device.starts_with("cpu") { crate::parallel::split_cores(n) } else { vec![Vec::new(); n] };
    let (s2, c2, names2) = (setup.clone(), coll.clone(), names.clone());
    let mut pool = WorkerPool::spawn(names.clone(), cores.clone(), move |rank| {
        let dev = match names2[rank].strip_prefix("cpu:") {
            Some(t) => crate::device::Device::Cpu(crate::device::CpuDevice::new(t.parse().unwrap_or(1), Some(cores[rank].clone()))?),
            None => crate::device::Device::parse(&names2[rank]).with_context(|| format!("device {rank} of {} ({}) is not available", names2.len(), names2[rank]))?,
        };
        // A generator keeps the compute weights alone and trains nothing.
        let dp = (rank >= gens).then(|| Dp { rank: rank - gens, world: names2.len() - gens, coll: c2.clone() });
        Replica::new(rank, dev, &s2, dp)
    })?;
    // A failed device wakes the others out of their collectives instead of leaving them waiting.
    let abort = coll.clone();
    pool.set_on_failure(move |why| abort.abort(why));
    let calib = if setup.spec.recipe.needs_calibration() {
        let saved = out_dir.join("calibration.json");
        let path = job.engine.calibration_file.clone().or_else(|| saved.exists().then(|| saved.clone()));
        Some(match path {
            Some(p) => crate::quant::calib::Calibration::load(&p, &cfg)?,
            None => {
                let prompts = match &data {
                    Some(d) => d.train_prompts(u64::MAX >> 1, job.engine.calibration_samples)?,
                    None => bail!("[engine] recipe '{}' needs calibration prompts: give data.train or engine.calibration_file", setup.spec.recipe.name),
                };
                let j = Arc::new(job.clone());
                let c = pool.run_on(0, "calibrate", move |r| r.calibrate(&j, &prompts))?;
                c.save(&saved)?;
                tracing::info!("calibrated activation and KV scales on {} responses ({} tokens) -> {}", c.samples, c.tokens, saved.display());
                c
            }
        })
    } else {
        None
    };
    let c = Arc::new(calib);
    let s3 = setup.clone();
    pool.run_all("init", move |_, r| r.init_rollout(&s3, c.as_ref().as_ref()))?;
    let mut start = 0;
    if let Some(ck) = resume {
        let (state, master, m, v) = checkpoint::load(ck, job)?;
        let parts = Arc::new((master, m, v));
        let st = state.clone();
        pool.run_all("restore", move |_, r| r.trainer.restore(parts.0.clone(), parts.1.clone(), parts.2.clone(), st.optimizer_step, st.version, st.skipped_steps, st.step))?;
        pool.run_all("resync", |_, r| r.resync())?;
        let ring = ck.join(checkpoint::RING_FILE);
        if ring.exists() {
            let bytes = Arc::new(std::fs::read(&ring).with_context(|| format!("cannot read {}", ring.display()))?);
            let what = ring.display().to_string();
            pool.run_all("restore", move |_, r| r.restore_ring(&bytes, &what))?;
        }
        start = state.step;
        tracing::info!("resumed from {} at step {start}", ck.display());
    }
    let (trainers, generators) = if gens > 0 { ((gens..n).collect(), (0..gens).collect()) } else { ((0..n).collect(), (0..n).collect()) };
    let host = Host { job: Arc::new(job.clone()), pool, coll, text, cfg, data, file_rollouts, heldout: Arc::new(heldout), out_dir: out_dir.to_path_buf(), trainers, generators, fault: None, step: Default::default() };
    Ok((host, start))
}

/// Prints the plan: placement and memory per device, and checks it against the budget.
fn print_plan(h: &Host) -> Result<()> {
    let plans = h.pool.run_all("plan", |_, r| r.plan())?;
    crate::util::write_atomic(&h.out_dir.join("plan.json"), serde_json::to_string_pretty(&plans)?.as_bytes())?;
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    let job = &h.job;
    eprintln!(
        "plan: {} device(s), {} schedule{}, {}; student {} ({} layers)",
        plans.len(),
        job.schedule.mode,
        if job.schedule.mode == "async" { format!(" (staleness ≤ {})", job.schedule.max_staleness) } else { String::new() },
        if h.split() { format!("split: {} generate, {} train", h.generators.len(), h.trainers.len()) } else { "colocated: every device generates and trains".into() },
        job.model.path,
        h.cfg.num_layers
    );
    for (i, p) in plans.iter().enumerate() {
        let total = p.weights + p.trainer + p.teacher + p.engine_buffers + p.kv_cache;
        eprintln!(
            "  device {i} {} ({}): weights {:.1} MiB, trainer {:.1} MiB (master/Adam shard, grads, activations), teacher {:.1} MiB, engine buffers {:.1} MiB, KV cache {:.1} MiB = {} tokens; total {:.1} MiB",
            p.device,
            if !h.split() { "generates, trains" } else if h.trainers.contains(&i) { "trains" } else { "generates" },
            mib(p.weights),
            mib(p.trainer),
            mib(p.teacher),
            mib(p.engine_buffers),
            mib(p.kv_cache),
            p.kv_tokens,
            mib(total)
        );
        if let Some(budget) = job.run.memory_budget_mb {
            if total > budget << 20 {
                bail!(
                    "the plan does not fit device {i} ({}): it needs {:.0} MiB (weights {:.0}, trainer {:.0}, teacher {:.0}, engine {:.0}, KV cache {:.0}) but run.memory_budget_mb = {budget}; lower rollout.kv_cache_mb or objective.micro_batch_tokens, or add devices",
                    p.device,
                    mib(total),
                    mib(p.weights),
                    mib(p.trainer),
                    mib(p.teacher),
                    mib(p.engine_buffers),
                    mib(p.kv_cache)
                );
            }
        }
    }
    Ok(())
}

pub fn run(job: &JobConfig, opts: &JobOptions) -> Result<JobSummary> {
    let t_job = Instant::now();
    let out_dir = job.out_dir();
    let metrics_path = out_dir.join("metrics.jsonl");
    let resume = match &opts.resume {
        Some(p) => Some(checkpoint::resolve(p)?),
        None => {
            if metrics_path.exists() || !checkpoint::list(&out_dir)?.is_empty() {
                bail!("{} already holds a run; resume it with --resume {} or choose another run.name / run.out_dir", out_dir.display(), out_dir.display());
            }
            None
        }
    };
    std::fs::create_dir_all(out_dir.join("eval")).with_context(|| format!("cannot create {}", out_dir.display()))?;
    let (mut host, start) = start(job, resume.as_deref(), &out_dir)?;
    host.fault = opts.fault;
    if resume.is_some() {
        truncate_metrics(&metrics_path, start)?;
    }
    crate::util::write_atomic(&out_dir.join("config.toml"), job.to_toml().as_bytes())?;
    print_plan(&host)?;
    let mut metrics_file = std::fs::OpenOptions::new().create(true).append(true).open(&metrics_path).with_context(|| format!("cannot open {}", metrics_path.display()))?;
    let mut summary = JobSummary { out_dir: out_dir.clone(), ..Default::default() };
    let evaluate = !host.heldout.is_empty();
    if start == 0 && evaluate {
        let r = host.evaluate(0)?;
        let line = serde_json::json!({"step": 0, "heldout_kl": job.teacher.is_some().then_some(r.kl), "heldout_acc": r.accuracy});
        writeln!(metrics_file, "{line}")?;
        summary.evals.push(r);
    }
    let bar = if opts.progress { indicatif::ProgressBar::new(job.run.steps) } else { indicatif::ProgressBar::hidden() };
    bar.set_style(indicatif::ProgressStyle::with_template("{spinner} train [{bar:30}] {pos}/{len} steps {elapsed}<{eta} {msg}").unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()));
    bar.set_position(start);
    let mut sched = super::schedule::Scheduler::new(&host, start)?;
    let mut monitor = Monitor::new(&job.monitor);
    if let Some(ck) = &resume {
        let p = ck.join(checkpoint::MONITOR_FILE);
        if p.exists() {
            let text = std::fs::read_to_string(&p).with_context(|| format!("cannot read {}", p.display()))?;
            monitor.restore(serde_json::from_str(&text).with_context(|| format!("{}: not a monitor state", p.display()))?);
        }
    }
    let mut sum_time = PhaseSeconds::default();
    let t_loop = Instant::now();
    let mut last_step = start;
    for step in start + 1..=job.run.steps {
        let _span = tracing::info_span!("step", step).entered();
        host.step.store(step, Ordering::Relaxed);
        let t_step = Instant::now();
        let mut time = PhaseSeconds::default();
        // 1. Rollout (the schedule decides how: synchronous, or ahead of training).
        let t0 = Instant::now();
        // Each phase is a tracing span (an NVTX range of the same name under CUDA).
        let phase = |name: &'static str| tracing::info_span!("phase", name);
        let batch = phase("rollout").in_scope(|| sched.rollouts(&host, step))?;
        let mut rollouts = batch.rollouts;
        time.rollout = t0.elapsed().as_secs_f64();
        // 2. Teacher scoring.
        let t0 = Instant::now();
        let teacher_util = if job.teacher.is_some() && job.objective.kind == "opd" { Some(phase("teacher").in_scope(|| host.score_teacher(&mut rollouts))?) } else { None };
        time.teacher = t0.elapsed().as_secs_f64();
        // 3. Rewards.
        let t0 = Instant::now();
        let reward = phase("reward").in_scope(|| host.rewards(&mut rollouts))?;
        time.reward = t0.elapsed().as_secs_f64();
        // 4. Train (data-parallel over the devices).
        let t0 = Instant::now();
        let gen_tokens: usize = rollouts.iter().map(|r| r.response.len()).sum();
        let n_rollouts = rollouts.len();
        let truncated = rollouts.iter().filter(|r| r.truncated).count();
        let samples_digest = rollout::digest(&rollouts);
        let sampler: Vec<f32> = rollouts.iter().filter(|r| !r.response.is_empty()).flat_map(|r| r.sampler_logprobs.iter().copied()).collect();
        let (out, train_busy) = phase("train").in_scope(|| host.train(rollouts, step))?;
        time.train = t0.elapsed().as_secs_f64();
        // 5. Resync.
        let t0 = Instant::now();
        phase("resync").in_scope(|| sched.resync(&host))?;
        time.resync = t0.elapsed().as_secs_f64();
        time.wait = batch.wait.unwrap_or(time.rollout) + time.teacher;
        time.total = t_step.elapsed().as_secs_f64();
        let done_steps = (step - start) as f64;
        let utilization: Vec<f64> = batch
            .busy
            .iter()
            .zip(&train_busy)
            .map(|(g, t)| ((g + t + teacher_util.unwrap_or(0.0) * time.teacher / host.devices() as f64) / time.total.max(1e-9)).min(1.0))
            .collect();
        // One round trip to the training lead for its counters.
        let (version, skipped_steps) = host.trainer_counters()?;
        let mut m = StepMetrics {
            step,
            version,
            gen_tokens,
            tokens_per_s: gen_tokens as f64 / time.rollout.max(1e-9),
            updates_per_hour: done_steps * 3600.0 / t_loop.elapsed().as_secs_f64().max(1e-9),
            loss: out.loss,
            grad_norm: out.info.grad_norm,
            lr: out.info.lr,
            entropy: out.entropy,
            response_len: gen_tokens as f64 / n_rollouts.max(1) as f64,
            length_cap_rate: truncated as f64 / n_rollouts.max(1) as f64,
            reward,
            mismatch: if host.file_rollouts.is_none() && job.objective.kind != "sft" { mismatch::step_mismatch(&sampler, &out.logp) } else { Default::default() },
            updates: out.updates,
            rl: out.adv_response.as_ref().map(|a| monitor.observe(a, &out.seq_lens, &out.logp, &sampler, out.clipped)),
            triage: out.triage.clone(),
            skipped: out.skipped,
            skipped_steps: 0,
            devices: host.devices(),
            utilization,
            max_lag: out.max_lag,
            stale_tokens_masked: out.max_lag.map(|_| out.masked),
            max_token_age: out.max_age,
            samples_digest,
            time,
            ..Default::default()
        };
        m.skipped_steps = skipped_steps;
        m.sampling_logp_difference = LogpDifference { mean: m.mismatch.abs_mean, max: m.mismatch.abs_max };
        let eval_now = evaluate && (step == job.run.steps || (job.eval.every > 0 && step % job.eval.every == 0));
        if eval_now {
            let r = host.evaluate(step)?;
            m.heldout_kl = job.teacher.is_some().then_some(r.kl);
            m.heldout_acc = Some(r.accuracy);
            summary.evals.push(r);
        }
        writeln!(metrics_file, "{}", serde_json::to_string(&m)?)?;
        metrics_file.flush()?;
        sum_time.add(&m.time);
        bar.set_message(format!(
            "loss {:.4} d_n {:.1e} ent {:.3}{}{}{} | {:.0} tok/s {:.0} upd/h wait {:.2}s",
            m.loss,
            m.mismatch.d_n,
            m.entropy,
            m.reward.map(|r| format!(" reward {r:.3}")).unwrap_or_default(),
            m.heldout_kl.map(|k| format!(" heldout KL {k:.4}")).unwrap_or_default(),
            m.heldout_acc.map(|a| format!(" acc {:.1}%", 100.0 * a)).unwrap_or_default(),
            m.tokens_per_s,
            m.updates_per_hour,
            m.time.wait
        ));
        bar.inc(1);
        let stopping = opts.stop.as_ref().map(|s| s.load(Ordering::SeqCst)).unwrap_or(false);
        if step == job.run.steps || stopping || (job.checkpoint.every > 0 && step % job.checkpoint.every == 0) {
            host.checkpoint(step, &monitor)?;
        }
        summary.skipped_steps = m.skipped_steps;
        summary.last = Some(m);
        last_step = step;
        if stopping {
            tracing::warn!("stopped at step {step} on request; checkpoint written (resume with --resume {})", out_dir.display());
            break;
        }
    }
    sched.finish()?;
    bar.finish_and_clear();
    let n = (last_step.saturating_sub(start)).max(1) as f64;
    summary.mean_time = sum_time.scaled(1.0 / n);
    summary.steps = last_step;
    summary.seconds = t_job.elapsed().as_secs_f64();
    Ok(summary)
}

/// SFT on reference responses (teacher forcing on the dataset's answers).
pub fn reference_rollouts(prompts: &[PromptItem], samples: usize) -> Vec<Rollout> {
    let mut out = Vec::new();
    for p in prompts {
        let resp = p.response.clone().unwrap_or_default();
        for s in 0..samples.max(1) {
            out.push(Rollout {
                prompt_id: p.id,
                sample: s as u32,
                group: p.id,
                prompt: p.tokens.clone(),
                sampler_logprobs: vec![0.0; resp.len()],
                response: resp.clone(),
                answer: p.answer.clone(),
                ..Default::default()
            });
        }
    }
    out
}
