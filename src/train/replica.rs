//! One device's share of the job, owned by that device's worker thread: its student replica
//! (the compute weights the engines read, the trainer with its optimizer shard), its standard
//! and rollout engines with their quantized/stale/noisy buffers, and its teacher replica. The
//! orchestrator (`job.rs`) sends it commands; it never sees another device's state except
//! through the collectives inside `Trainer::step`.
//!
//! Owns: [`Replica`]. May call: engines, the trainer, rollouts. Must not: write run files other
//! than the checkpoint rank 0 is asked to write.

use super::dp::Dp;
use super::rollout::{self, Rollout, WorkQueue};
use super::trainer::{StepOut, Trainer};
use crate::config::JobConfig;
use crate::device::{DType, Device};
use crate::engine::rollout_weights::{EngineSpec, RolloutWeights};
use crate::engine::{Completion, Engine, EngineConfig};
use crate::model::{LoadedModel, ModelWeights};
use crate::quant::calib::Calibration;
use anyhow::{bail, Context, Result};
use std::sync::Arc;

/// Completions posted by every device, grouped by prompt request; counts complete groups
/// (all `samples` responses of a prompt done).
pub struct Board {
    samples: usize,
    groups: std::sync::Mutex<std::collections::BTreeMap<u64, Vec<Completion>>>,
    complete: std::sync::atomic::AtomicUsize,
}

impl Board {
    pub fn new(samples: usize) -> Board {
        Board { samples: samples.max(1), groups: Default::default(), complete: Default::default() }
    }

    pub fn complete(&self) -> usize {
        self.complete.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn post(&self, c: Completion) -> Result<()> {
        let mut g = self.groups.lock().map_err(|_| anyhow::anyhow!("the rollout board was poisoned by a failed device"))?;
        let e = g.entry(c.id).or_default();
        e.push(c);
        if e.len() == self.samples {
            self.complete.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        Ok(())
    }

    /// Removes and returns up to `n` complete groups, oldest request first, each in sample order.
    pub fn take(&self, n: usize) -> Result<Vec<Completion>> {
        let mut g = self.groups.lock().map_err(|_| anyhow::anyhow!("the rollout board was poisoned by a failed device"))?;
        let ids: Vec<u64> = g.iter().filter(|(_, v)| v.len() == self.samples).map(|(k, _)| *k).take(n).collect();
        let mut out = Vec::new();
        for id in ids {
            if let Some(mut v) = g.remove(&id) {
                v.sort_by_key(|c| c.sample);
                out.extend(v);
                self.complete.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
        Ok(out)
    }
}

/// What every device needs to build its replica (shared, read-only).
pub struct Setup {
    pub job: JobConfig,
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
    pub kv_cache: usize,
    pub kv_tokens: usize,
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
}

/// Loads a model source (a directory or a `builtin:` name).
pub fn load(src: &crate::config::ModelSource, dev: &Device) -> Result<LoadedModel> {
    let dir = super::tiny::resolve(&src.path)?;
    let dtype = match src.dtype.as_deref() {
        Some(d) => DType::parse(d)?,
        None if dev.is_cpu() => DType::F32,
        None => DType::BF16,
    };
    LoadedModel::load(&dir, dev, dtype)
}

impl Replica {
    pub fn new(rank: usize, dev: Device, s: &Setup, dp: Dp) -> Result<Replica> {
        let job = &s.job;
        let student = load(&job.model, &dev).with_context(|| format!("loading the student '{}'", job.model.path))?;
        let teacher = match &job.teacher {
            Some(t) if job.objective.kind == "opd" => {
                let tm = load(t, &dev).with_context(|| format!("loading the teacher '{}'", t.path))?;
                if tm.cfg.vocab_size != student.cfg.vocab_size {
                    bail!(
                        "student {} and teacher {} have different vocabularies ({} vs {} tokens); OPD needs one vocabulary",
                        student.dir.display(),
                        tm.dir.display(),
                        student.cfg.vocab_size,
                        tm.cfg.vocab_size
                    );
                }
                let e = Engine::new(&dev, &tm.cfg, tm.weights.dtype(), &s.engine, None)?;
                Some((tm.weights, e))
            }
            _ => None,
        };
        let cfg = student.cfg.clone();
        let dtype = student.weights.dtype();
        let std_engine = Engine::new(&dev, &cfg, dtype, &s.engine, student.text.clone())?;
        let standard = s.spec.recipe.is_standard() && s.spec.noise_sigma == 0.0 && s.spec.staleness == 0;
        let rollout_engine = if standard {
            None
        } else {
            let ec = EngineConfig { kv_fp8: s.spec.recipe.kv_layers(), ..s.engine.clone() };
            Some(Engine::new(&dev, &cfg, dtype, &ec, student.text.clone())?)
        };
        let trainer = Trainer::new_dp(&cfg, student.weights, job, dp)?;
        Ok(Replica { rank, dev, trainer, std_engine, rollout_engine, rw: None, teacher, student_dir: student.dir })
    }

    /// The calibration pass on the standard engine (one device runs it; all use the result).
    pub fn calibrate(&mut self, job: &JobConfig, prompts: &[crate::data::dataset::PromptItem]) -> Result<Calibration> {
        let cfg = self.trainer.cfg.clone();
        super::calibrate::calibrate(&mut self.std_engine, &self.trainer.weights, &cfg, prompts, &super::job::sampling_of(job), job.run.seed)
    }

    /// Builds the rollout engine's buffers (and the NVFP4 learner's scales) from `calib`.
    pub fn init_rollout(&mut self, s: &Setup, calib: Option<&Calibration>) -> Result<()> {
        let rw = RolloutWeights::new(&self.dev, &s.spec, &self.trainer.cfg, &self.trainer.weights, calib, self.trainer.version)?;
        if s.job.learner.precision == "nvfp4" {
            let mut lq = crate::model::learner_quant::LearnerQuant::new(&s.job.learner.linears, s.spec.recipe.nvfp4, self.trainer.cfg.num_layers)?;
            // The engine's calibrated input scales where it quantizes the same linears in NVFP4.
            if let Some(q) = &rw.quant {
                for (l, ql) in q.layers.iter().enumerate() {
                    for (i, a) in ql.act.iter().enumerate() {
                        if let crate::ops::quantize::ActQuant::Nvfp4 { global, .. } = a {
                            lq.act_global[l][i] = Some(*global);
                        }
                    }
                }
            }
            self.trainer.set_learner_quant(Some(lq));
        }
        self.rw = Some(rw);
        Ok(())
    }

    fn rw(&self) -> Result<&RolloutWeights> {
        self.rw.as_ref().context("the rollout engine is not initialized")
    }

    /// Generates from the shared queue with the rollout engine on the current weights.
    pub fn generate(&mut self, queue: &WorkQueue, inflight: usize) -> Result<Vec<Completion>> {
        let rw = self.rw.as_ref().context("the rollout engine is not initialized")?;
        let engine = self.rollout_engine.as_mut().unwrap_or(&mut self.std_engine);
        engine.set_version(rw.version);
        rollout::run_queue(engine, rw.view(&self.trainer.weights), queue, inflight)
    }

    /// The asynchronous schedule's generation: pulls from the shared queue and reports every
    /// completion to `board` until it holds `need` complete prompt groups. Sequences still
    /// running stay in this device's engine and resume under the next weights (each token
    /// records the version it was sampled with).
    pub fn generate_until(&mut self, queue: &WorkQueue, board: &Board, need: usize, inflight: usize) -> Result<()> {
        let rw = self.rw.as_ref().context("the rollout engine is not initialized")?;
        let w = rw.view(&self.trainer.weights);
        let engine = self.rollout_engine.as_mut().unwrap_or(&mut self.std_engine);
        engine.set_version(rw.version);
        let dev = engine.device().clone();
        dev.install(|| -> Result<()> {
            while board.complete() < need {
                while engine.num_unfinished() < inflight.max(1) {
                    let next = queue.lock().map_err(|_| anyhow::anyhow!("the rollout queue was poisoned by a failed device"))?.pop_front();
                    match next {
                        Some(r) => engine.add(r)?,
                        None => break,
                    }
                }
                if !engine.has_work() {
                    // Nothing queued, nothing running here: the other devices finish the rest.
                    return Ok(());
                }
                for c in engine.step(w)? {
                    board.post(c)?;
                }
            }
            Ok(())
        })
    }

    /// Teacher-scores requests from the shared queue.
    pub fn score(&mut self, queue: &WorkQueue, inflight: usize) -> Result<Vec<Completion>> {
        let (w, e) = self.teacher.as_mut().context("no teacher on this device")?;
        rollout::run_queue(e, &*w, queue, inflight)
    }

    pub fn train(&mut self, rollouts: &[Rollout]) -> Result<StepOut> {
        self.trainer.step(rollouts)
    }

    /// The engine's resync after an update: a standard engine reads the trainer's weights in
    /// place (nothing to do); the others rewrite their preallocated buffers.
    pub fn resync(&mut self) -> Result<()> {
        let v = self.trainer.version;
        let rw = self.rw.as_mut().context("the rollout engine is not initialized")?;
        rw.sync(&self.trainer.weights, v)
    }

    pub fn rollout_version(&self) -> Result<u64> {
        Ok(self.rw()?.version)
    }

    /// This device's memory plan.
    pub fn plan(&self) -> Result<Plan> {
        let e = self.rollout_engine.as_ref().unwrap_or(&self.std_engine);
        let mut kv = e.cache.size_bytes();
        if self.rollout_engine.is_some() {
            kv += self.std_engine.cache.size_bytes();
        }
        Ok(Plan {
            device: self.dev.name(),
            weights: self.trainer.weights.size_bytes(),
            trainer: self.trainer.state_bytes(),
            teacher: self.teacher.as_ref().map(|(w, e)| w.size_bytes() + e.cache.size_bytes()).unwrap_or(0),
            engine_buffers: self.rw()?.extra_bytes(),
            kv_cache: kv,
            kv_tokens: e.cache.capacity_tokens(),
        })
    }
}

/// Merges the devices' completions into one list in request order (deterministic whatever
/// device drew what).
pub fn merge(parts: Vec<Vec<Completion>>) -> Vec<Completion> {
    let mut all: Vec<Completion> = parts.into_iter().flatten().collect();
    all.sort_by_key(|c| (c.id, c.sample));
    all
}

/// The shared queue of `reqs`.
pub fn queue(reqs: Vec<crate::engine::Request>) -> Arc<WorkQueue> {
    Arc::new(std::sync::Mutex::new(reqs.into()))
}
