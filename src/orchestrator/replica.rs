//! One device's share of the job, owned by that device's worker thread: its student replica
//! (the compute weights the engines read, the trainer with its optimizer shard — or, on a split
//! placement's generator, the weights alone), its standard and rollout engines with their
//! quantized/stale/noisy buffers, and its teacher replica, sized by the memory plan. The
//! coordinator (`coordinator.rs`) sends it commands; it sees other devices only through the
//! collectives inside `Trainer::step` and, for asynchronous schedules, the shared queue, the
//! [`Board`] of completions and the [`GenLink`] weight mailbox (`mailbox.rs`).
//!
//! Owns: [`Replica`] and its memory [`Plan`]. May call: engines, the trainer, rollouts, the
//! mailbox, the plan's arithmetic (`memory.rs`). Must not: write run files other than the
//! checkpoint the training lead is asked to write.

use super::holdings::{self, is_standard, kv_block_bytes, Holdings};
use crate::config::{JobConfig, LearnerPrecision, ObjectiveKind, Placement};
use crate::device::{DType, Device};
use crate::engine::rollout::{self, Rollout, WorkQueue};
use crate::engine::rollout_weights::{EngineSpec, RolloutWeights, ViewCheck};
use crate::engine::{Completion, Engine, EngineConfig};
use crate::model::calib::Calibration;
use crate::model::{LoadedModel, ModelWeights};
use crate::reward::scorer::Scorer;
use crate::train::dp::Dp;
use crate::train::trainer::{StepOut, Trainer};
use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

pub use super::mailbox::{queue, Board, GenLink, Posted};

/// Where a run's models are: the student's and the teacher's directories, `builtin:` names
/// already resolved (`orchestrator::run` does that, at the config boundary).
#[derive(Clone, Debug)]
pub struct Sources {
    pub student: PathBuf,
    pub teacher: Option<PathBuf>,
}

impl Sources {
    /// The job's model paths taken as directories, as written.
    pub fn plain(job: &JobConfig) -> Sources {
        Sources {
            student: PathBuf::from(&job.model.path),
            teacher: job.teacher.as_ref().map(|t| PathBuf::from(&t.path)),
        }
    }
}

/// What every device needs to build its replica (shared, read-only).
pub struct Setup {
    pub job: JobConfig,
    pub sources: Sources,
    pub spec: EngineSpec,
    pub engine: EngineConfig,
}

/// A device's memory plan line (bytes).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Plan {
    pub device: String,
    pub weights: usize,
    pub trainer: usize,
    pub teacher: usize,
    pub engine_buffers: usize,
    /// Every engine's forward activation buffers (`Engine::buffer_bytes`).
    pub engine_activations: usize,
    /// A split placement's lead trainer on a GPU: the copy of its compute weights it publishes.
    pub snapshot: usize,
    pub kv_cache: usize,
    pub kv_tokens: usize,
    /// The trainer's activation arenas (part of `trainer`), and the teacher's KV cache (part of
    /// `teacher`).
    pub activations: usize,
    pub teacher_kv: usize,
    /// The KV caches are freed for each train phase.
    pub kv_release: bool,
    /// The standard engine's cache takes turns with the rollout engine's (`memory.rs`): one
    /// of them is resident at a time, and `kv_cache` counts the larger.
    pub kv_turns: bool,
    /// The most the device holds at once: [`Plan::total`], or with `kv_release` the larger of
    /// the decode phase (without the activations) and the train phase (without the caches).
    pub peak: usize,
}

impl Plan {
    pub fn total(&self) -> usize {
        self.weights
            + self.trainer
            + self.teacher
            + self.engine_buffers
            + self.engine_activations
            + self.snapshot
            + self.kv_cache
    }

    fn peak_bytes(&self) -> usize {
        let caches = self.kv_cache + self.teacher_kv;
        let resident = self.total() - caches - self.activations;
        resident + if self.kv_release { caches.max(self.activations) } else { caches + self.activations }
    }
}

pub struct Replica {
    pub rank: usize,
    pub dev: Device,
    pub trainer: Trainer,
    pub std_engine: Engine,
    rollout_engine: Option<Engine>,
    rw: Option<RolloutWeights>,
    pub teacher: Option<(ModelWeights, Engine)>,
    pub student_dir: std::path::PathBuf,
    /// The activation bytes the plan reserved for a device trainer (0 on the host path).
    activations: usize,
    /// The published snapshot of a split placement's lead trainer on a GPU (bytes).
    snapshot: usize,
    /// The plan frees the KV caches for each train phase (`memory.rs`).
    kv_release: bool,
    /// The standard engine's cache takes turns with the rollout engine's (`memory.rs`): it is
    /// resident only inside [`Replica::with_standard`] while another engine decodes the rollouts.
    turns: bool,
}

/// Loads the model at `dir` with the dtype of its source (the config's `dtype`; default F32
/// on CPU, BF16 on CUDA).
pub fn load(src: &crate::config::ModelSource, dir: &std::path::Path, dev: &Device) -> Result<LoadedModel> {
    let dtype = match src.dtype.as_deref() {
        Some(d) => DType::parse(d)?,
        None if dev.is_cpu() => DType::F32,
        None => DType::BF16,
    };
    LoadedModel::load(dir, dev, dtype)
}

impl Replica {
    /// Device `rank`'s replica; `dp: None` for a device that only generates (its trainer holds
    /// the compute weights alone).
    pub fn new(rank: usize, dev: Device, s: &Setup, dp: Option<Dp>) -> Result<Replica> {
        let job = &s.job;
        let student = load(&job.model, &s.sources.student, &dev)
            .with_context(|| format!("loading the student '{}'", job.model.path))?;
        // The memory plan, in order: the weights, the trainer's state (master/Adam shard,
        // gradients, activation arenas), the teacher, the engine buffers; the KV caches get what
        // is left when rollout.kv_cache_mb = 0.
        // Split placement: generators sample and teacher-score, trainers only train, and the
        // training lead evaluates (held-out KL needs the teacher); the other trainers need
        // neither a teacher nor a rollout engine.
        let split = job.schedule.placement == Placement::Split;
        let lead_or_all = !split || dp.as_ref().map(|d| d.rank == 0).unwrap_or(true);
        let generates = !split || dp.is_none();
        let teacher = match &job.teacher {
            Some(t) if job.objective.kind == ObjectiveKind::Opd && lead_or_all => {
                let dir = s.sources.teacher.as_deref().context("the teacher's directory")?;
                let tm = load(t, dir, &dev).with_context(|| format!("loading the teacher '{}'", t.path))?;
                if tm.cfg.vocab_size != student.cfg.vocab_size {
                    bail!(
                        "student {} and teacher {} have different vocabularies ({} vs {} tokens); OPD needs one vocabulary",
                        student.dir.display(),
                        tm.dir.display(),
                        student.cfg.vocab_size,
                        tm.cfg.vocab_size
                    );
                }
                Some(tm)
            }
            _ => None,
        };
        let cfg = student.cfg.clone();
        let dtype = student.weights.dtype();
        let trainer = match dp {
            Some(dp) => Trainer::new_dp(&cfg, student.weights, job, dp)?,
            None => Trainer::weights_only(&cfg, student.weights, job)?,
        };
        let budget = job.run.memory_budget_mb.map(|m| m << 20).or(dev.memory_budget());
        if s.engine.kv_cache_bytes == 0 && budget.is_none() {
            bail!("device {rank} ({}): rollout.kv_cache_mb = 0 sizes the KV caches from what is left of the device's memory, but a CPU device has no budget of its own: set run.memory_budget_mb", dev.name());
        }
        let planned = holdings::plan(&Holdings {
            job,
            spec: &s.spec,
            engine: &s.engine,
            trainer: &trainer,
            teacher: teacher.as_ref().map(|t| (&t.cfg, &t.weights)),
            cpu: dev.is_cpu(),
            split,
            generates,
            lead_or_all,
            budget,
        });
        let (need, parts) = (&planned.need, &planned.parts);
        let (standard, activations, snapshot) = (planned.standard, planned.activations, planned.snapshot);
        let mut std_ec = s.engine.clone();
        let mut roll_ec = planned.rollout_ec.clone();
        // The teacher's engine scores whole responses: LM-head chunks of SCORE_ROWS rows.
        let mut teacher_ec = s.engine.scoring();
        let sizing = super::memory::size(need, &format!("device {rank} ({})", dev.name()), parts)?;
        if let Some(blocks) = sizing.blocks {
            for ec in [&mut std_ec, &mut roll_ec, &mut teacher_ec] {
                ec.kv_blocks = Some(blocks);
            }
        }
        let teacher = match teacher {
            Some(tm) => {
                let e = Engine::new(&dev, &tm.cfg, tm.weights.dtype(), &teacher_ec, None)?;
                Some((tm.weights, e))
            }
            None => None,
        };
        let mut std_engine = Engine::new(&dev, &cfg, dtype, &std_ec, student.text.clone())?;
        let turns = need.turns && !standard;
        if turns {
            // Its cache lies in the room the rollout engine's takes next.
            park(&mut std_engine, &dev)?;
        }
        let rollout_engine =
            if standard { None } else { Some(Engine::new(&dev, &cfg, dtype, &roll_ec, student.text.clone())?) };
        Ok(Replica {
            rank,
            dev,
            trainer,
            std_engine,
            rollout_engine,
            rw: None,
            teacher,
            student_dir: student.dir,
            activations,
            snapshot,
            kv_release: sizing.release,
            turns,
        })
    }

    /// The standard engine's cache is released while the rollout engine decodes (they take
    /// turns, and the rollout engine is another).
    fn std_parked(&self) -> bool {
        self.turns && self.rollout_engine.is_some()
    }

    /// Runs `f` with the standard engine's cache resident: where it takes turns with the
    /// rollout engine's, that one is released first (it holds no sequence between steps of
    /// the synchronous schedule) and the two swap back after, whatever `f` returns (its error
    /// first, the swap-back's as its context). A swap-in that fails gives the rollout engine
    /// its cache back. The swap maps and zero-fills the cache (`Engine::commit_cache`):
    /// calibration and held-out evaluation pay it, the rollouts never.
    pub fn with_standard<T>(&mut self, f: impl FnOnce(&mut Replica) -> Result<T>) -> Result<T> {
        if !self.std_parked() {
            return f(self);
        }
        if let Some(e) = self.rollout_engine.as_mut() {
            park(e, &self.dev).context("handing the rollout engine's KV cache to the standard engine")?;
        }
        let swap_in = self.std_engine.commit_cache();
        let out = match swap_in {
            Ok(()) => f(self),
            Err(e) => Err(e.context("committing the standard engine's KV cache")),
        };
        let back = park(&mut self.std_engine, &self.dev)
            .and_then(|_| self.rollout_engine.as_mut().map(|e| e.commit_cache()).unwrap_or(Ok(())))
            .context("handing the KV cache back to the rollout engine");
        match (out, back) {
            (Ok(v), Ok(())) => Ok(v),
            (Ok(_), Err(b)) => Err(b),
            (Err(e), Ok(())) => Err(e),
            (Err(e), Err(b)) => Err(e.context(format!("{b:#}"))),
        }
    }

    /// The calibration pass on the standard engine (one device runs it; all use the result).
    pub fn calibrate(&mut self, job: &JobConfig, prompts: &[crate::data::dataset::PromptItem]) -> Result<Calibration> {
        let cfg = self.trainer.cfg.clone();
        self.with_standard(|r| {
            crate::train::calibrate::calibrate(
                &mut r.std_engine,
                &r.trainer.weights,
                &cfg,
                prompts,
                &super::plan::sampling_of(job),
                job.run.seed,
            )
        })
    }

    /// Builds the rollout engine's buffers (and the NVFP4 learner's scales) from `calib`.
    pub fn init_rollout(&mut self, s: &Setup, calib: Option<&Calibration>) -> Result<()> {
        let rw = RolloutWeights::new(
            &self.dev,
            &s.spec,
            &self.trainer.cfg,
            &self.trainer.weights,
            calib,
            self.trainer.version,
        )?;
        if s.job.learner.precision == LearnerPrecision::Nvfp4 {
            let mut lq = crate::model::learner_quant::LearnerQuant::new(
                &s.job.learner.linears,
                s.spec.recipe.nvfp4,
                self.trainer.cfg.num_layers,
            )?;
            if let Some(q) = &rw.quant {
                lq.take_engine_scales(q);
            }
            self.trainer.set_learner_quant(Some(lq))?;
        }
        self.rw = Some(rw);
        Ok(())
    }

    fn rw(&self) -> Result<&RolloutWeights> {
        self.rw.as_ref().context("the rollout engine is not initialized")
    }

    /// Generates from the shared queue with the rollout engine on the current weights, posting
    /// each completion to the reward service as it finishes.
    pub fn generate(&mut self, queue: &WorkQueue, inflight: usize, scorer: &Scorer) -> Result<Vec<Completion>> {
        let rw = self.rw.as_ref().context("the rollout engine is not initialized")?;
        let engine = self.rollout_engine.as_mut().unwrap_or(&mut self.std_engine);
        engine.set_version(rw.version);
        rollout::run_queue_with(engine, rw.view(&self.trainer.weights), queue, inflight, &mut |c| scorer.completed(c))
    }

    /// The asynchronous schedule's generation: pulls from the shared queue and reports every
    /// completion to `board` until it holds `need` complete prompt groups. Sequences still
    /// running stay in this device's engine and resume under the next weights (each token
    /// records the version it was sampled with).
    pub fn generate_until(
        &mut self,
        queue: &WorkQueue,
        board: &Board,
        need: usize,
        inflight: usize,
        scorer: &Scorer,
    ) -> Result<()> {
        let rw = self.rw.as_ref().context("the rollout engine is not initialized")?;
        let w = rw.view(&self.trainer.weights);
        let engine = self.rollout_engine.as_mut().unwrap_or(&mut self.std_engine);
        engine.set_version(rw.version);
        let dev = engine.device().clone();
        dev.install(|| -> Result<()> {
            while board.complete() < need {
                rollout::top_up(engine, queue, inflight)?;
                if !engine.has_work() {
                    // Nothing queued, nothing running here: the other devices finish the rest.
                    return Ok(());
                }
                for c in engine.step(w)? {
                    scorer.completed(&c)?;
                    board.post(c, None)?;
                }
            }
            Ok(())
        })
    }

    /// A generator of the split placement, until `link.stop`: pulls requests from the shared
    /// queue, keeps up to `inflight` sequences decoding, posts completions to the board, and
    /// between engine steps loads newer published weights in place (sequences in flight go on
    /// under them; every token records its version). Requests popped after a publication are
    /// always started under it, so a request queued after weights v is never sampled older.
    /// If it fails or panics (or stops with a broadcast round posted that it did not join), it
    /// wakes a lead waiting for it in a broadcast round with its error; a clean stop aborts
    /// nothing (no round is posted after the stop, and the other generators may still be
    /// finishing the last round's call).
    pub fn generate_forever(&mut self, link: &GenLink, slot: usize, inflight: usize) -> Result<()> {
        /// (link, which generator, why it leaves: the abort's reason, None on a clean stop).
        struct Leaving<'a>(&'a GenLink, String, Option<String>);
        impl Drop for Leaving<'_> {
            fn drop(&mut self) {
                if let Some(why) = self.2.take() {
                    self.0.abort(&format!("{}: {why}", self.1));
                }
            }
        }
        // Until the loop returns, leaving means a panic.
        let mut leaving = Leaving(link, format!("generator {slot} on {}", self.dev.name()), Some("it panicked".into()));
        let mut rounds = 0;
        let out = self.generate_loop(link, slot, inflight, &mut rounds);
        leaving.2 = match &out {
            Err(e) => Some(format!("{e:#}")),
            Ok(()) => link.unjoined(rounds).then(|| "it stopped before joining a posted round".into()),
        };
        out
    }

    /// `generate_forever`'s loop; `rounds`: the broadcast rounds joined.
    fn generate_loop(&mut self, link: &GenLink, slot: usize, inflight: usize, rounds: &mut u64) -> Result<()> {
        let rw = self.rw.as_mut().context("the rollout engine is not initialized")?;
        let engine = self.rollout_engine.as_mut().unwrap_or(&mut self.std_engine);
        let trainer = &mut self.trainer;
        let mut teacher = self.teacher.as_mut().filter(|_| link.teacher_temperature.is_some());
        let dev = engine.device().clone();
        engine.set_version(rw.version);
        let mut loaded = trainer.version;
        dev.install(|| -> Result<()> {
            let mut popped: Vec<crate::engine::Request> = Vec::new();
            // Prompts of requests in flight (for teacher scoring): id -> (tokens, samples left).
            let mut prompts: std::collections::HashMap<u64, (Vec<u32>, usize)> = Default::default();
            while !link.stop.load(Ordering::SeqCst) {
                {
                    let mut q = link
                        .queue
                        .lock()
                        .map_err(|_| anyhow::anyhow!("the rollout queue was poisoned by a failed device"))?;
                    while engine.num_unfinished() + popped.len() < inflight.max(1) {
                        match q.pop_front() {
                            Some(r) => popped.push(r),
                            None => break,
                        }
                    }
                }
                // `loaded`: the newest published version taken in; the engine stamps tokens with
                // what its view reads (a stale engine's ring lags `loaded` by its staleness).
                if let Some(v) = link.load_newer(slot, loaded, rounds, trainer)? {
                    rw.sync(&trainer.weights, v)?;
                    engine.set_version(rw.version);
                    loaded = v;
                }
                for r in popped.drain(..) {
                    if teacher.is_some() {
                        prompts.entry(r.id).or_insert_with(|| (r.prompt.clone(), 0)).1 += 1;
                    }
                    engine.add(r)?;
                }
                if !engine.has_work() {
                    std::thread::sleep(Duration::from_micros(200));
                    continue;
                }
                let t = Instant::now();
                let done = engine.step(rw.view(&trainer.weights))?;
                let scores = match (&mut teacher, link.teacher_temperature) {
                    (Some((tw, te)), Some(temp)) if !done.is_empty() => {
                        let ps: Vec<&[u32]> =
                            done.iter().map(|c| prompts.get(&c.id).map(|p| p.0.as_slice()).unwrap_or(&[])).collect();
                        Some(rollout::score_completions(te, tw, &ps, &done, temp)?)
                    }
                    _ => None,
                };
                let mut scores = scores.map(|v| v.into_iter());
                for c in done {
                    if let Some(p) = prompts.get_mut(&c.id) {
                        p.1 -= 1;
                        if p.1 == 0 {
                            prompts.remove(&c.id);
                        }
                    }
                    let lp = scores.as_mut().and_then(|s| s.next());
                    link.scorer.completed(&c)?;
                    link.board.post(c, lp)?;
                }
                link.busy_ns[slot].fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
            }
            Ok(())
        })
    }

    /// Teacher-scores requests from the shared queue.
    pub fn score(&mut self, queue: &WorkQueue, inflight: usize) -> Result<Vec<Completion>> {
        let (w, e) = self.teacher.as_mut().context("no teacher on this device")?;
        rollout::run_queue(e, &*w, queue, inflight)
    }

    /// The training step; with the plan's KV release, the engines' caches are freed before it
    /// and allocated again after it. The step's report and the seconds the release and the
    /// commit took (0 without).
    pub fn train(&mut self, rollouts: &[Rollout]) -> Result<(StepOut, f64)> {
        if !self.kv_release {
            return Ok((self.trainer.step(rollouts)?, 0.0));
        }
        // Each timer starts once the device has run what was queued before it, so neither the
        // rollout's kernels nor the trainer's count as the switch.
        self.dev.synchronize()?;
        let t = Instant::now();
        if let Err(e) = self.release_caches() {
            // The engines released so far get their caches back; the release's error stands.
            let _ = self.commit_caches();
            return Err(e);
        }
        let mut switch = t.elapsed().as_secs_f64();
        let out = self.trainer.step(rollouts);
        let done = self.dev.synchronize();
        let t = Instant::now();
        // The activation arenas went back to the allocator's cache: to the driver with them,
        // so the caches take their room instead of adding to it.
        let commit = self.dev.release_cached().and_then(|_| self.commit_caches());
        switch += t.elapsed().as_secs_f64();
        let out = out?;
        done?;
        commit?;
        Ok((out, switch))
    }

    /// The engines on this device (standard, rollout, teacher).
    fn engines_mut(&mut self) -> impl Iterator<Item = &mut Engine> {
        std::iter::once(&mut self.std_engine)
            .chain(self.rollout_engine.as_mut())
            .chain(self.teacher.as_mut().map(|t| &mut t.1))
    }

    /// Frees every engine's KV cache and hands the memory to the driver (the trainer's
    /// activations, cuBLAS and the collectives can take it); the bytes freed.
    pub fn release_caches(&mut self) -> Result<usize> {
        let mut freed = 0;
        for e in self.engines_mut() {
            freed += e.release_cache()?;
        }
        self.dev.release_cached()?;
        Ok(freed)
    }

    /// Allocates every engine's KV cache again (the standard engine's not where it is parked:
    /// [`Replica::with_standard`]), and waits until the zero fill is done (so the switch time
    /// reported is the whole cost).
    pub fn commit_caches(&mut self) -> Result<()> {
        let skip = self.std_parked() as usize;
        for e in self.engines_mut().skip(skip) {
            e.commit_cache()?;
        }
        self.dev.synchronize()
    }

    /// The engine's resync after an update: a standard engine reads the trainer's weights in
    /// place (nothing to do); the others rewrite their preallocated buffers (a quantized one
    /// from the amax the device optimizer reduced, when one GPU trains on the device; with
    /// several, ZeRO-1 writes no per-parameter amax and the requantize runs its own pass).
    pub fn resync(&mut self) -> Result<()> {
        let v = self.trainer.version;
        let rw = self.rw.as_mut().context("the rollout engine is not initialized")?;
        rw.sync_with_amax(&self.trainer.weights, v, self.trainer.weight_amax())
    }

    /// The guard's cheap check: (the version the rollout engine last synced from, the
    /// trainer's version).
    pub fn view_versions(&self) -> Result<(u64, u64)> {
        Ok((self.rw()?.synced_version(), self.trainer.version))
    }

    /// The guard's consistency check of this device's rollout engine against its trainer's
    /// weights (quantized weights at `rows` sampled rows each).
    pub fn check_view(&self, rows: usize) -> Result<ViewCheck> {
        self.rw()?.check(&self.trainer.weights, self.trainer.version, rows)
    }

    /// Repairs a stale or corrupted view: a resync that rewrites every buffer (a stale engine's
    /// newest slot too) from the trainer's weights.
    pub fn repair_view(&mut self) -> Result<()> {
        let v = self.trainer.version;
        let rw = self.rw.as_mut().context("the rollout engine is not initialized")?;
        rw.repair(&self.trainer.weights, v)
    }

    /// Fault hook of the guard's tests: a resync that moves the view's counters and nothing
    /// else.
    pub fn mark_synced_for_test(&mut self) -> Result<()> {
        let v = self.trainer.version;
        self.rw.as_mut().context("the rollout engine is not initialized")?.mark_synced_for_test(v);
        Ok(())
    }

    /// Fault hook of the guard's tests (see [`RolloutWeights::corrupt_for_test`]).
    pub fn corrupt_view(&mut self) -> Result<String> {
        self.rw.as_mut().context("the rollout engine is not initialized")?.corrupt_for_test()
    }

    /// Why the rollout engine of `spec` would not fit this device where the current one is
    /// (None: it fits). The plan of [`Replica::new`] with the new engine (and the KV release
    /// decided when the run started, kept as it is): the weights, the
    /// trainer's state where it lives here, the teacher and its cache, the standard engine's
    /// cache and the new engine's buffers and KV cache (as many tokens as the standard
    /// engine's; where the two caches take turns, the larger),
    /// every engine's forward buffers, and with `rollout.kv_cache_mb = 0` the tenth of the
    /// budget kept free.
    pub fn switch_fits(&self, s: &Setup, spec: &EngineSpec) -> Result<Option<String>> {
        let budget = s.job.run.memory_budget_mb.map(|m| m << 20).or(self.dev.memory_budget());
        let Some(budget) = budget else { return Ok(None) };
        let (new_buffers, new_kv) = self.engine_bytes(s, spec);
        // Every engine's forward buffers after the switch: the standard engine's, the teacher's
        // and the new rollout engine's.
        let fwd = self.std_engine.buffer_bytes()
            + self.teacher.as_ref().map(|(_, e)| e.buffer_bytes()).unwrap_or(0)
            + if is_standard(spec) {
                0
            } else {
                let (w, ec) = (&self.trainer.weights, self.rollout_config(s, spec));
                Engine::plan_buffer_bytes(&self.trainer.cfg, w.dtype(), &ec, !self.dev.is_cpu())
            };
        let t = &self.trainer;
        let trainer_here = if self.dev.is_cpu() || t.on_device() { t.state_bytes() + self.activations } else { 0 };
        let (teacher_w, teacher_kv) =
            self.teacher.as_ref().map(|(w, e)| (w.size_bytes(), e.cache.size_bytes())).unwrap_or((0, 0));
        let reserve = if s.engine.kv_cache_bytes == 0 { budget / 10 } else { 0 };
        // With the caches freed for training, the larger of the two phases (`memory.rs`).
        let act = if self.kv_release && trainer_here > 0 { self.activations } else { 0 };
        let std_kv = self.std_engine.cache.size_bytes();
        let caches = teacher_kv + if self.turns { std_kv.max(new_kv) } else { std_kv + new_kv };
        let resident =
            t.weights.size_bytes() + trainer_here - act + teacher_w + new_buffers + fwd + self.snapshot + reserve;
        let after = resident + if self.kv_release { caches.max(act) } else { caches + act };
        let mib = |b: usize| b as f64 / (1 << 20) as f64;
        Ok((after > budget).then(|| {
            format!(
                "device {} ({}): engine buffers {:.0} MiB + KV cache {:.0} MiB (with every engine's activations, {:.0} MiB) would bring the plan to {:.0} MiB of a {:.0} MiB budget",
                self.rank,
                self.dev.name(),
                mib(new_buffers),
                mib(new_kv),
                mib(fwd),
                mib(after),
                mib(budget)
            )
        }))
    }

    /// The buffers and KV cache bytes of a rollout engine for `spec` here (0, 0: the standard
    /// engine serves).
    fn engine_bytes(&self, s: &Setup, spec: &EngineSpec) -> (usize, usize) {
        if is_standard(spec) {
            return (0, 0);
        }
        let w = &self.trainer.weights;
        let ec = self.rollout_config(s, spec);
        let block = kv_block_bytes(&self.trainer.cfg, w.dtype(), &ec, ec.block_size);
        // (The decode graphs' padding block on CUDA, as `Engine::new` adds it.)
        let pad = (ec.cuda_graphs && !self.dev.is_cpu()) as usize;
        (RolloutWeights::estimate_extra_bytes(spec, w), block * (ec.kv_blocks.unwrap_or(0) + pad))
    }

    /// The rollout engine's config for `spec`: its KV dtypes, and as many KV blocks as the
    /// standard engine's cache holds (the same capacity in tokens).
    fn rollout_config(&self, s: &Setup, spec: &EngineSpec) -> EngineConfig {
        let blocks = self.std_engine.cache.capacity_tokens() / s.engine.block_size.max(1);
        EngineConfig { kv_blocks: Some(blocks.max(1)), ..holdings::rollout_engine_config(spec, &s.engine) }
    }

    /// Switches the rollout engine to `spec` in place, between steps: the current engine's
    /// buffers and KV cache are freed, then the new ones built from the trainer's current
    /// weights (`calib`: the run's calibrated scales, for a recipe that needs them). A stale
    /// engine's ring of older versions moves to the new engine as it is.
    pub fn switch_engine(&mut self, s: &Setup, spec: &EngineSpec, calib: Option<&Calibration>) -> Result<()> {
        let ring = self.rw.take().map(|rw| rw.into_ring()).unwrap_or_default();
        self.rollout_engine = None;
        if is_standard(spec) {
            // The standard engine decodes the rollouts now: its cache stays resident.
            self.dev.release_cached()?;
            self.std_engine.commit_cache()?;
        } else {
            if self.turns {
                park(&mut self.std_engine, &self.dev)?;
            }
            let ec = self.rollout_config(s, spec);
            let text = self.std_engine.text();
            self.rollout_engine =
                Some(Engine::new(&self.dev, &self.trainer.cfg, self.trainer.weights.dtype(), &ec, text)?);
        }
        self.rw = Some(RolloutWeights::with_ring(
            &self.dev,
            spec,
            &self.trainer.cfg,
            &self.trainer.weights,
            calib,
            self.trainer.version,
            ring,
        )?);
        Ok(())
    }

    /// The stale engine's older versions for a checkpoint (None without staleness).
    pub fn ring_file(&self) -> Result<Option<Vec<u8>>> {
        self.rw()?.ring_file()
    }

    /// Puts a checkpoint's older versions back (after the restore and resync).
    pub fn restore_ring(&mut self, bytes: &[u8], what: &str) -> Result<()> {
        let rw = self.rw.as_mut().context("the rollout engine is not initialized")?;
        rw.restore_ring(bytes, what, &self.trainer.weights)
    }

    pub fn rollout_version(&self) -> Result<u64> {
        Ok(self.rw()?.version)
    }

    /// This device's memory plan.
    pub fn plan(&self) -> Result<Plan> {
        let e = self.rollout_engine.as_ref().unwrap_or(&self.std_engine);
        let mut kv = e.cache.size_bytes();
        if self.rollout_engine.is_some() {
            let std_kv = self.std_engine.cache.size_bytes();
            kv = if self.turns { kv.max(std_kv) } else { kv + std_kv };
        }
        let teacher_kv = self.teacher.as_ref().map(|(_, e)| e.cache.size_bytes()).unwrap_or(0);
        let mut p = Plan {
            device: self.dev.name(),
            weights: self.trainer.weights.size_bytes(),
            trainer: self.trainer.state_bytes() + self.activations,
            activations: self.activations,
            teacher: self.teacher.as_ref().map(|(w, _)| w.size_bytes()).unwrap_or(0) + teacher_kv,
            teacher_kv,
            engine_buffers: self.rw()?.extra_bytes(),
            engine_activations: self.std_engine.buffer_bytes()
                + self.rollout_engine.as_ref().map(|e| e.buffer_bytes()).unwrap_or(0)
                + self.teacher.as_ref().map(|(_, e)| e.buffer_bytes()).unwrap_or(0),
            snapshot: self.snapshot,
            kv_cache: kv,
            kv_tokens: e.cache.capacity_tokens(),
            kv_release: self.kv_release,
            kv_turns: self.std_parked(),
            peak: 0,
        };
        p.peak = p.peak_bytes();
        Ok(p)
    }
}

/// Releases `e`'s KV cache and hands its memory to the driver, for another engine's cache.
fn park(e: &mut Engine, dev: &Device) -> Result<()> {
    e.release_cache()?;
    dev.release_cached()?;
    Ok(())
}

/// Merges the devices' completions into one list in request order (deterministic whatever
/// device drew what).
pub fn merge(parts: Vec<Vec<Completion>>) -> Vec<Completion> {
    let mut all: Vec<Completion> = parts.into_iter().flatten().collect();
    all.sort_by_key(|c| (c.id, c.sample));
    all
}
