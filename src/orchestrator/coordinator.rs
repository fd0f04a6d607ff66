//! The coordinator of a run: it sets up the devices (one worker thread and replica each), the
//! data, the calibration and a resumed state ([`start`]), and drives every phase of a step
//! through commands to the workers: teacher scoring, rewards, the data-parallel training step,
//! the resync, evaluation and checkpoints. Where rollouts come from is `schedule.rs`'s.
//!
//! Owns: [`Coordinator`]. May call: the worker pool, `replica`, `plan`, `fault`, and the layers
//! below (`train` for checkpoints and evaluation, `engine`, `model`, `data`, `mismatch`). Must
//! not: touch a device's state except through commands to its worker.

use super::fault::{Fault, ViewFault};
use super::plan::{collective, engine_config, plan_devices};
use super::replica::{self, Replica, Setup, Sources};
use crate::config::{JobConfig, Placement, RolloutSource, ScheduleMode};
use crate::data::dataset::{Dataset, PromptItem};
use crate::engine::rollout::{self, Rollout};
use crate::mismatch::monitor::Monitor;
use crate::model::{ModelConfig, TextTools};
use crate::parallel::{Collective, WorkerPool};
use crate::reward::scorer::{Key, Scorer};
use crate::reward::{Job, Outcome};
use crate::train::checkpoint::{self, OptState};
use crate::train::dp::Dp;
use crate::train::eval::{self, EvalResult};
use crate::train::trainer::StepOut;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// The orchestrator's side of a run: the job, data and tokenizer, the worker pool with one
/// replica per device, the collective, and which devices train and which generate.
pub struct Coordinator {
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
    /// The devices' names (`cpu:4`, `cuda:0`, `cuda-sim:1`), in rank order.
    pub names: Vec<String>,
    /// Tests: the fault to inject, and the step running now (which phases compare with it).
    pub fault: Option<Fault>,
    pub step: std::sync::atomic::AtomicU64,
    /// The reward service (the built-in rule or the run's plug-in), scoring as engines finish.
    pub scorer: Arc<Scorer>,
    /// What the replicas were built from, and the run's calibrated scales (the mismatch
    /// guard builds other rollout engines from them).
    pub setup: Arc<Setup>,
    pub calib: Arc<Option<crate::model::calib::Calibration>>,
    /// `[guard]`'s ladder as engine specs (empty without a guard), and the guard's state from
    /// the checkpoint a resumed run started from (its rung already serving).
    pub ladder: Vec<crate::engine::rollout_weights::EngineSpec>,
    pub resumed_guard: Option<crate::mismatch::guard::GuardState>,
    /// Tests of the guard: the view fault to inject, and whether the views are cut off from
    /// the resyncs now (after [`ViewFault::Corrupt`], until a repair).
    pub view_fault: Option<ViewFault>,
    pub detached: std::sync::atomic::AtomicBool,
    /// A split placement on GPUs: the lead trainer and the generators, one NCCL group that
    /// each version is broadcast over (`mailbox::GenLink`).
    pub publish: Option<Arc<crate::train::device_nccl::NcclDevice>>,
}

impl Coordinator {
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

    /// Rewards of every rollout that lacks one: collected from the reward service for those
    /// this run's engines generated (`keys`, scored as they finished), scored now for the rest
    /// (a rollout file). The built-in rule rewards responses to prompts with a reference answer
    /// (0 when cut at the length limit), a plug-in every response. The step's mean reward and
    /// the outcomes of the responses rewarded here.
    pub fn rewards(&self, rollouts: &mut [Rollout], keys: &[Option<Key>]) -> Result<(Option<f64>, Vec<Outcome>)> {
        let posted: Vec<Key> = keys.iter().flatten().copied().collect();
        let mut got = self.scorer.take_posted(&posted)?.into_iter();
        let mut outcomes: Vec<Option<Outcome>> = Vec::with_capacity(rollouts.len());
        let mut later = Vec::new();
        for (i, r) in rollouts.iter().enumerate() {
            let o = match keys.get(i).copied().flatten() {
                Some(_) => got.next().flatten(),
                None => None,
            };
            if o.is_none() && r.reward.is_none() && (r.answer.is_some() || self.scorer.is_plugin()) {
                if let Some(text) = &self.text {
                    later.push((
                        i,
                        Job {
                            response: text.decode(&r.response)?,
                            answer: r.answer.clone(),
                            prompt: self.scorer.is_plugin().then(|| text.decode(&r.prompt)).transpose()?,
                            meta: None,
                            truncated: r.truncated,
                        },
                    ));
                }
            }
            outcomes.push(o);
        }
        let (idx, jobs): (Vec<usize>, Vec<Job>) = later.into_iter().unzip();
        for (i, o) in idx.into_iter().zip(self.scorer.score_now(jobs)?) {
            outcomes[i] = Some(o);
        }
        let mut rewards = Vec::new();
        for (r, o) in rollouts.iter_mut().zip(&outcomes) {
            if r.reward.is_none() {
                r.reward = o.as_ref().and_then(|o| o.reward);
            }
            rewards.extend(r.reward.map(|x| x as f64));
        }
        let mean = (!rewards.is_empty()).then(|| rewards.iter().sum::<f64>() / rewards.len() as f64);
        Ok((mean, outcomes.into_iter().flatten().collect()))
    }

    /// Teacher log-probs for every rollout, scored on the training devices from a shared queue.
    pub fn score_teacher(&self, rollouts: &mut [Rollout]) -> Result<f64> {
        let reqs = rollout::teacher_requests(rollouts, self.job.rollout.temperature);
        let (fault, step) = (self.fault, self.step.load(Ordering::Relaxed));
        if reqs.is_empty() {
            if fault.is_some() {
                // (Tests: the fault still fires on its device, named like any other.)
                self.pool
                    .run_some(&self.trainers, "teacher", move |rank, _| Fault::check(fault, "teacher", step, rank))?;
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

    /// The training step on every training device (the same rollouts everywhere): data-parallel
    /// rank 0's report, every device's seconds busy (0 for generators), and the most seconds a
    /// device spent freeing and re-allocating its KV caches around the step (the plan's
    /// `kv_release`; 0 without).
    pub fn train(&self, rollouts: Vec<Rollout>, step: u64) -> Result<(StepOut, Vec<f64>, f64)> {
        let rs = Arc::new(rollouts);
        let fault = self.fault;
        let parts = self.pool.run_some(&self.trainers, "train", move |rank, r| {
            let t = Instant::now();
            Fault::check(fault, "train", step, rank)?;
            let (out, kv) = r.train(&rs)?;
            Ok((out, t.elapsed().as_secs_f64(), kv))
        })?;
        let mut busy = vec![0.0; self.devices()];
        for (&rank, p) in self.trainers.iter().zip(&parts) {
            busy[rank] = p.1 - p.2;
        }
        let kv = parts.iter().map(|p| p.2).fold(0.0, f64::max);
        let out = parts.into_iter().next().map(|p| p.0).context("no devices")?;
        Ok((out, busy, kv))
    }

    /// The colocated engines' in-place resync (a split placement publishes instead, see
    /// `schedule.rs`).
    pub fn resync(&self) -> Result<()> {
        let (fault, step) = (self.fault, self.step.load(Ordering::Relaxed));
        let skip = self.view_fault == Some(ViewFault::SkipResync { step });
        let detached = self.detached.load(Ordering::SeqCst);
        if skip || detached {
            tracing::debug!("step {step}: the resync does not reach the engines (injected fault)");
        }
        self.pool.run_all("resync", move |rank, r| {
            Fault::check(fault, "resync", step, rank)?;
            match (skip, detached) {
                (true, _) => Ok(()),
                (false, true) => r.mark_synced_for_test(),
                (false, false) => r.resync(),
            }
        })?;
        if self.view_fault == Some(ViewFault::Corrupt { step }) {
            let hit = self.pool.run_all("corrupt", |_, r| r.corrupt_view())?;
            self.detached.store(true, Ordering::SeqCst);
            tracing::debug!("step {step}: zeroed {hit:?} in the engines' views (injected fault)");
        }
        Ok(())
    }

    /// Repairs every engine's view from its trainer's weights (the guard, on a stale view).
    pub fn repair_views(&self) -> Result<()> {
        self.detached.store(false, Ordering::SeqCst);
        self.pool.run_all("repair", |_, r| r.repair_view()).map(|_| ())
    }

    /// The training lead's counters: (weight version, skipped steps).
    pub fn trainer_counters(&self) -> Result<(u64, u64)> {
        self.pool.run_on(self.lead(), "stats", |r| Ok((r.trainer.version, r.trainer.skipped_steps)))
    }

    /// Held-out evaluation on the training lead with its standard engine (its KV cache swapped
    /// in for the rollout engine's where the two take turns: `Replica::with_standard`).
    pub fn evaluate(&self, step: u64) -> Result<EvalResult> {
        let (job, text, heldout) = (self.job.clone(), self.text.clone(), self.heldout.clone());
        let r = self.pool.run_on(self.lead(), "eval", move |rep| {
            let eval_new = job.eval.max_new_tokens.unwrap_or(job.rollout.max_new_tokens);
            let mut r = rep.with_standard(|rep| {
                let te = rep.teacher.as_mut().map(|(w, e)| (e, &*w));
                eval::evaluate(
                    step,
                    (&mut rep.std_engine, &rep.trainer.weights),
                    te,
                    text.as_deref(),
                    &heldout,
                    job.eval.samples_per_prompt as u32,
                    eval_new,
                    job.eval.seed,
                )
            })?;
            r.student = job.model.path.clone();
            r.teacher = job.teacher.as_ref().map(|t| t.path.clone()).unwrap_or_default();
            Ok(r)
        })?;
        crate::util::write_atomic(
            &self.out_dir.join("eval").join(format!("step-{step:06}.json")),
            serde_json::to_string(&r)?.as_bytes(),
        )?;
        Ok(r)
    }

    /// Checkpoint `step`: the optimizer shards gathered, data-parallel rank 0 writes, with the
    /// monitor's state, the guard's, and (colocated) the stale engine's older versions.
    pub fn checkpoint(
        &self,
        step: u64,
        monitor: &Monitor,
        guard: Option<&crate::mismatch::guard::GuardState>,
    ) -> Result<()> {
        let (job, out, lead, split) = (self.job.clone(), self.out_dir.clone(), self.lead(), self.split());
        let mon = serde_json::to_vec(monitor.state())?;
        let guard = guard.map(serde_json::to_vec).transpose()?;
        self.pool.run_some(&self.trainers, "checkpoint", move |rank, r| {
            let (master, m, v) = r.trainer.gather_state()?;
            if rank == lead {
                let mut extra = vec![(checkpoint::MONITOR_FILE, mon.clone())];
                if let Some(g) = &guard {
                    extra.push((checkpoint::GUARD_FILE, g.clone()));
                }
                // Split: the generators' engines are busy and theirs; colocated, every device's
                // ring is the same.
                if let (false, Some(ring)) = (split, r.ring_file()?) {
                    extra.push((checkpoint::RING_FILE, ring));
                }
                checkpoint::save(
                    &out,
                    step,
                    &r.trainer,
                    &OptState { master, m, v },
                    &job,
                    Some(&r.student_dir),
                    &extra,
                )?;
                checkpoint::prune(&out, job.checkpoint.keep)?;
            }
            Ok(())
        })?;
        Ok(())
    }
}

/// Sets up the devices, replicas, data and the calibration of a run.
/// Builds the run: devices, workers, replicas, data. `fault` (tests) is the failure to inject.
pub fn start(
    job: &JobConfig,
    sources: &Sources,
    resume: Option<&Path>,
    out_dir: &Path,
    fault: Option<Fault>,
) -> Result<(Coordinator, u64)> {
    let dir = sources.student.clone();
    if !dir.is_dir() {
        bail!("loading the student '{}': model directory '{}' does not exist", job.model.path, dir.display());
    }
    let cfg = ModelConfig::from_dir(&dir).with_context(|| format!("loading the student '{}'", job.model.path))?;
    // The tokenizer is needed for text data, rewards and accuracy; token-only runs do without.
    let text = if dir.join("tokenizer.json").exists() { Some(Arc::new(TextTools::load(&dir, &cfg)?)) } else { None };
    let file_rollouts = match job.rollout.source {
        RolloutSource::File => {
            Some(rollout::read_file(job.rollout.file.as_deref().context("rollout.file")?, cfg.vocab_size)?)
        }
        RolloutSource::Engine => None,
    };
    // With file rollouts, data is only needed for held-out evaluation, and only if given.
    let data = match (&file_rollouts, &job.data.heldout) {
        (Some(_), None) => None,
        _ => Some(Dataset::open(&job.data.train, text.clone(), job.data.chat, cfg.vocab_size, job.run.seed)?),
    };
    // RL rewards of the built-in rule need every training prompt's answer (checked now, not at
    // the first step); a reward plug-in decides what it needs.
    let rl = job.objective.kind.is_rl();
    if let (true, None, Some(d)) = (rl, &file_rollouts, &data) {
        if let (Some(i), true) = (d.first_without_answer(), job.reward.command.is_empty()) {
            bail!(
                "data.train '{}': prompt #{} (in file order) has no \"answer\": the {} objective rewards the response's last \\boxed{{}} against it (or set [reward] command to a plug-in)",
                job.data.train,
                i + 1,
                job.objective.kind
            );
        }
        if text.is_none() {
            bail!(
                "the {} objective checks answers in the response text, but the student '{}' has no tokenizer.json",
                job.objective.kind,
                job.model.path
            );
        }
    }
    let heldout = match (&job.data.heldout, &data) {
        (Some(h), _) => {
            Dataset::open(h, text.clone(), job.data.chat, cfg.vocab_size, job.run.seed)?.heldout(usize::MAX)?
        }
        (None, Some(d)) => d.heldout(job.data.heldout_size)?,
        (None, None) => Vec::new(),
    };
    let names = plan_devices(&job.run.device, job.run.devices)?;
    let n = names.len();
    // Split placement: the first rollout_devices generate, the others train (data-parallel).
    let gens = if job.schedule.placement == Placement::Split { job.schedule.rollout_devices } else { 0 };
    if gens >= n {
        bail!(
            "schedule.placement = \"split\" with schedule.rollout_devices = {gens} needs at least {} devices (some generate, at least one trains), but the run has {n} (run.devices / --devices)",
            gens + 1
        );
    }
    let spec = job.engine.spec(cfg.num_layers).context("[engine]")?;
    // The guard's ladder, and the rung a resumed run was serving: the engines are built on
    // `[engine]`'s recipe as in the uninterrupted run (the same memory plan, the same NVFP4
    // learner), then switched to that rung before the first step.
    let ladder = if job.guard_active() {
        crate::mismatch::guard::ladder(&job.guard, cfg.num_layers, &spec).context("[guard]")?
    } else {
        Vec::new()
    };
    let resumed_guard = match resume {
        Some(ck) if job.guard_active() => {
            let p = ck.join(checkpoint::GUARD_FILE);
            if p.exists() {
                let text = std::fs::read_to_string(&p).with_context(|| format!("cannot read {}", p.display()))?;
                let g: crate::mismatch::guard::GuardState =
                    serde_json::from_str(&text).with_context(|| format!("{}: not a guard state", p.display()))?;
                if let Some(r) = g.rung.filter(|&r| r >= ladder.len()) {
                    bail!("{}: rung {r} is not on guard.fallback ({} rungs)", p.display(), ladder.len());
                }
                Some(g)
            } else {
                None
            }
        }
        _ => None,
    };
    let setup = Arc::new(Setup { job: job.clone(), sources: sources.clone(), spec, engine: engine_config(job) });
    let coll = collective(&names[gens..])?;
    let on_cpu = matches!(crate::device::DeviceSpec::parse(&job.run.device)?, crate::device::DeviceSpec::Cpu { .. });
    let dcoll = super::plan::device_collective(&names[gens..], on_cpu)?
        .map(|d| super::fault::FaultyCollective::wrap(d, fault.filter(|f| f.phase == "all-gather")));
    // A split placement on GPUs broadcasts each version from the lead into the generators.
    let publish = super::plan::publish_group(&names, gens, on_cpu)?;
    let cores = if on_cpu { crate::parallel::split_cores(n) } else { vec![Vec::new(); n] };
    let (s2, c2, d2, names2) = (setup.clone(), coll.clone(), dcoll.clone(), names.clone());
    let mut pool = WorkerPool::spawn(names.clone(), cores.clone(), move |rank| {
        let dev = match names2[rank].strip_prefix("cpu:") {
            Some(t) => crate::device::Device::Cpu(crate::device::CpuDevice::new(
                t.parse().unwrap_or(1),
                Some(cores[rank].clone()),
            )?),
            None => crate::device::Device::parse(&names2[rank])
                .with_context(|| format!("device {rank} of {} ({}) is not available", names2.len(), names2[rank]))?,
        };
        // A generator keeps the compute weights alone and trains nothing.
        let dp = (rank >= gens).then(|| Dp {
            rank: rank - gens,
            world: names2.len() - gens,
            coll: c2.clone(),
            dcoll: d2.clone(),
        });
        Replica::new(rank, dev, &s2, dp)
    })?;
    // A failed device wakes the others out of their collectives instead of leaving them waiting.
    let (abort, dabort, pabort) = (coll.clone(), dcoll.clone(), publish.clone());
    pool.set_on_failure(move |why| {
        abort.abort(why);
        if let Some(d) = &dabort {
            d.abort(why);
        }
        if let Some(p) = &pabort {
            crate::train::device_coll::DeviceCollective::abort(p.as_ref(), why);
        }
    });
    // Calibrated once for the run: for its recipe, or any the guard may fall back to.
    let calib = if setup.spec.recipe.needs_calibration() || ladder.iter().any(|s| s.recipe.needs_calibration()) {
        let saved = out_dir.join("calibration.json");
        let path = job.engine.calibration_file.clone().or_else(|| saved.exists().then(|| saved.clone()));
        Some(match path {
            Some(p) => crate::model::calib::Calibration::load(&p, &cfg)?,
            None => {
                let prompts = match &data {
                    Some(d) => d.train_prompts(u64::MAX >> 1, job.engine.calibration_samples)?,
                    None => bail!(
                        "[engine] recipe '{}' needs calibration prompts: give data.train or engine.calibration_file",
                        setup.spec.recipe.name
                    ),
                };
                let j = Arc::new(job.clone());
                let c = pool.run_on(0, "calibrate", move |r| r.calibrate(&j, &prompts))?;
                c.save(&saved)?;
                tracing::info!(
                    "calibrated activation and KV scales on {} responses ({} tokens) -> {}",
                    c.samples,
                    c.tokens,
                    saved.display()
                );
                c
            }
        })
    } else {
        None
    };
    let c = Arc::new(calib);
    let (s3, c3) = (setup.clone(), c.clone());
    pool.run_all("init", move |_, r| r.init_rollout(&s3, c3.as_ref().as_ref()))?;
    let mut start = 0;
    if let Some(ck) = resume {
        let (state, master, m, v) = checkpoint::load(ck, job)?;
        let parts = Arc::new((master, m, v));
        let st = state.clone();
        pool.run_all("restore", move |_, r| {
            r.trainer.restore(
                parts.0.clone(),
                parts.1.clone(),
                parts.2.clone(),
                st.optimizer_step,
                st.version,
                st.skipped_steps,
                st.step,
            )
        })?;
        pool.run_all("resync", |_, r| r.resync())?;
        // The guard had fallen back: its rung serves from the first step on.
        if let Some(rung) = resumed_guard.as_ref().and_then(|g| g.rung).map(|r| ladder[r].clone()) {
            if rung != setup.spec {
                let (s4, c4, rung) = (setup.clone(), c.clone(), Arc::new(rung));
                pool.run_all("switch", move |_, r| r.switch_engine(&s4, &rung, c4.as_ref().as_ref()))?;
            }
        }
        let ring = ck.join(checkpoint::RING_FILE);
        if ring.exists() {
            let bytes = Arc::new(std::fs::read(&ring).with_context(|| format!("cannot read {}", ring.display()))?);
            let what = ring.display().to_string();
            pool.run_all("restore", move |_, r| r.restore_ring(&bytes, &what))?;
        }
        start = state.step;
        tracing::info!("resumed from {} at step {start}", ck.display());
    }
    let (trainers, generators) =
        if gens > 0 { ((gens..n).collect(), (0..gens).collect()) } else { ((0..n).collect(), (0..n).collect()) };
    let scorer = Arc::new(Scorer::start(&job.reward, text.clone())?);
    let host = Coordinator {
        scorer,
        job: Arc::new(job.clone()),
        pool,
        coll,
        text,
        cfg,
        data,
        file_rollouts,
        heldout: Arc::new(heldout),
        out_dir: out_dir.to_path_buf(),
        trainers,
        generators,
        names,
        fault,
        step: Default::default(),
        setup,
        calib: c,
        ladder,
        resumed_guard,
        view_fault: None,
        detached: Default::default(),
        publish,
    };
    Ok((host, start))
}

/// Prints the plan: placement and memory per device, and checks it against the budget.
pub fn print_plan(h: &Coordinator) -> Result<()> {
    let plans = h.pool.run_all("plan", |_, r| r.plan())?;
    crate::util::write_atomic(&h.out_dir.join("plan.json"), serde_json::to_string_pretty(&plans)?.as_bytes())?;
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    let job = &h.job;
    eprintln!(
        "plan: {} device(s), {} schedule{}, {}; student {} ({} layers)",
        plans.len(),
        job.schedule.mode,
        if job.schedule.mode == ScheduleMode::Async {
            format!(" (staleness ≤ {})", job.schedule.max_staleness)
        } else {
            String::new()
        },
        if h.split() {
            format!("split: {} generate, {} train", h.generators.len(), h.trainers.len())
        } else {
            "colocated: every device generates and trains".into()
        },
        job.model.path,
        h.cfg.num_layers
    );
    for (i, p) in plans.iter().enumerate() {
        let total = p.peak;
        let end = if p.kv_release {
            format!(
                "sum {:.1} MiB, peak {:.1} MiB (the KV caches are freed for the train phase)",
                mib(p.total()),
                mib(p.peak)
            )
        } else {
            format!("total {:.1} MiB", mib(p.total()))
        };
        let snapshot =
            if p.snapshot > 0 { format!(", published snapshot {:.1} MiB", mib(p.snapshot)) } else { String::new() };
        eprintln!(
            "  device {i} {} ({}): weights {:.1} MiB, trainer {:.1} MiB (master/Adam shard, grads, activations), teacher {:.1} MiB, engine buffers {:.1} MiB, engine activations {:.1} MiB{snapshot}, KV cache {:.1} MiB = {} tokens{}; {end}",
            p.device,
            if !h.split() { "generates, trains" } else if h.trainers.contains(&i) { "trains" } else { "generates" },
            mib(p.weights),
            mib(p.trainer),
            mib(p.teacher),
            mib(p.engine_buffers),
            mib(p.engine_activations),
            mib(p.kv_cache),
            p.kv_tokens,
            if p.kv_turns { " (the standard engine's cache takes turns with the rollout engine's)" } else { "" },
        );
        if let Some(budget) = job.run.memory_budget_mb {
            if total > budget << 20 {
                bail!(
                    "the plan does not fit device {i} ({}): it needs {:.0} MiB (weights {:.0}, trainer {:.0}, teacher {:.0}, engine {:.0} + {:.0} activations, snapshot {:.0}, KV cache {:.0}){} but run.memory_budget_mb = {budget}; lower rollout.kv_cache_mb or objective.micro_batch_tokens, or add devices",
                    p.device,
                    mib(total),
                    mib(p.weights),
                    mib(p.trainer),
                    mib(p.teacher),
                    mib(p.engine_buffers),
                    mib(p.engine_activations),
                    mib(p.snapshot),
                    mib(p.kv_cache),
                    if p.kv_release { ", at its peak with the KV caches freed for training," } else { "" }
                );
            }
        }
    }
    Ok(())
}
