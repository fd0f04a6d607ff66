//! Where a step's rollouts come from (seed 000 §5.4, App. C.5).
//! - Synchronous: the step's requests go into a shared queue; every device generates from it
//!   with the current weights until it is empty (an idle device takes the next unstarted
//!   request), then training runs.
//! - Asynchronous, colocated: generation runs ahead. The queue holds the requests of this step
//!   and the next k; devices generate until the board holds one step's worth of complete prompt
//!   groups, which are trained on (oldest requests first). Sequences still running stay in their
//!   engines and resume under the updated weights; every token records the version it was
//!   sampled with, and the trainer leaves out tokens more than k versions old.
//! - Asynchronous, split: the first `rollout_devices` devices only generate, the others only
//!   score and train, at the same time. Each generator runs one long command
//!   (`Replica::generate_forever`) that pulls from the queue and posts to the board; after each
//!   update the trainers publish their FP32 master, which the generators load in place between
//!   engine steps. The queue holds this step's and the next k steps' requests, so tokens are
//!   mostly within k versions when trained; the trainer's mask is what enforces the bound (a
//!   version is one optimizer update: several per step with minibatches, and a group that
//!   completes late is trained late).
//!
//! Owns: [`Scheduler`] (prompts in flight, the board, the generators' commands). May call: the
//! worker pool, `coordinator`, `replica`, `plan`, `fault`, and `config`, `data`, `engine`
//! (prompts and rollouts).

use super::coordinator::Coordinator;
use super::fault::Fault;
use super::plan::{reference_rollouts, sampling_of};
use super::replica::{self, GenLink};
use crate::config::{ObjectiveKind, ScheduleMode};
use crate::data::dataset::PromptItem;
use crate::engine::rollout::{self, Rollout};
use crate::parallel::Pending;
use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A step's rollouts and how getting them went.
pub struct Batch {
    pub rollouts: Vec<Rollout>,
    /// Per device: seconds busy generating.
    pub busy: Vec<f64>,
    /// The trainer's wait for this batch (None: the whole rollout phase).
    pub wait: Option<f64>,
}

pub struct Scheduler {
    asynchronous: bool,
    /// Steps with requests not yet turned into rollouts: their prompts (request id =
    /// step·2³² + index) and how many responses are outstanding.
    prompts: BTreeMap<u64, (Arc<Vec<PromptItem>>, usize)>,
    /// The queue, the board and (split placement) the generators' mailbox and counters.
    link: Arc<GenLink>,
    /// Split placement: each generator's long-running command, started at the first step, and
    /// its busy nanoseconds at the last step.
    generators: Vec<Pending<()>>,
    gen_busy: Vec<u64>,
}

impl Scheduler {
    pub fn new(h: &Coordinator, _start: u64) -> Result<Scheduler> {
        Ok(Scheduler {
            asynchronous: h.job.schedule.mode == ScheduleMode::Async,
            prompts: BTreeMap::new(),
            link: Arc::new(GenLink::new(
                h.job.rollout.samples_per_prompt,
                h.generators.len(),
                (h.split() && h.job.objective.kind == ObjectiveKind::Opd && h.job.teacher.is_some())
                    .then_some(h.job.rollout.temperature),
            )),
            generators: Vec::new(),
            gen_busy: vec![0; h.generators.len()],
        })
    }

    /// After an update: colocated engines resync in place; a split placement publishes the
    /// trainers' master for the generators to load.
    pub fn resync(&mut self, h: &Coordinator) -> Result<()> {
        if !h.split() {
            return h.resync();
        }
        let (v, master) =
            h.pool.run_on(h.lead(), "publish", |r| Ok((r.trainer.version, Arc::new(r.trainer.full_weights()?))))?;
        self.link.publish(v, master)
    }

    /// Split placement: starts the generators' commands (once).
    fn start_generators(&mut self, h: &Coordinator) -> Result<()> {
        if !self.generators.is_empty() {
            return Ok(());
        }
        let inflight = h.job.rollout.max_seqs;
        for (slot, &rank) in h.generators.iter().enumerate() {
            let link = self.link.clone();
            self.generators
                .push(h.pool.start_on(rank, "generate", move |r| r.generate_forever(&link, slot, inflight))?);
        }
        Ok(())
    }

    /// Stops the generators and waits for them; the first one's error, if any.
    pub fn finish(&mut self) -> Result<()> {
        self.link.stop.store(true, Ordering::SeqCst);
        let mut first = Ok(());
        for p in self.generators.drain(..) {
            if let (Err(e), true) = (p.wait(), first.is_ok()) {
                first = Err(e);
            }
        }
        first
    }

    /// Queues the requests of `step` (once).
    fn enqueue(&mut self, h: &Coordinator, step: u64) -> Result<()> {
        if self.prompts.contains_key(&step) {
            return Ok(());
        }
        let prompts =
            h.data.as_ref().context("no training data")?.train_prompts(step, h.job.rollout.prompts_per_step)?;
        let sampling = Arc::new(sampling_of(&h.job));
        let reqs = rollout::requests(&prompts, h.job.rollout.samples_per_prompt as u32, &sampling, step);
        let n = reqs.len();
        self.link.queue.lock().map_err(|_| anyhow::anyhow!("the rollout queue was poisoned"))?.extend(reqs);
        self.prompts.insert(step, (Arc::new(prompts), n));
        Ok(())
    }

    /// Rollouts of completions; a step's prompts are dropped once all its responses are out.
    fn rollouts_of(&mut self, done: Vec<replica::Posted>, version: u64) -> Result<Vec<Rollout>> {
        let mut out = Vec::with_capacity(done.len());
        for (c, teacher) in done {
            let step = c.id >> 32;
            let (p, left) = self
                .prompts
                .get_mut(&step)
                .with_context(|| format!("a completion of step {step}, whose prompts are gone"))?;
            let mut r = rollout::from_completion(c, p, version);
            r.teacher_logprobs = teacher;
            out.push(r);
            *left -= 1;
            if *left == 0 {
                self.prompts.remove(&step);
            }
        }
        Ok(out)
    }

    pub fn rollouts(&mut self, h: &Coordinator, step: u64) -> Result<Batch> {
        let n = h.devices();
        let none = |rollouts| Batch { rollouts, busy: vec![0.0; n], wait: None };
        if let Some(f) = &h.file_rollouts {
            return Ok(none(f.clone()));
        }
        if !self.asynchronous && h.job.objective.kind == ObjectiveKind::Sft {
            let prompts =
                h.data.as_ref().context("no training data")?.train_prompts(step, h.job.rollout.prompts_per_step)?;
            if prompts.iter().all(|p| p.response.is_some()) {
                return Ok(none(reference_rollouts(&prompts, h.job.rollout.samples_per_prompt)));
            }
        }
        let inflight = h.job.rollout.max_seqs;
        // The lead's: device 0 may be a generator busy with its long command.
        let version = h.pool.run_on(h.lead(), "stats", |r| r.rollout_version())?;
        if !self.asynchronous {
            self.enqueue(h, step)?;
            let q = self.link.queue.clone();
            let fault = h.fault;
            let parts = h.pool.run_all("rollout", move |rank, r| {
                Fault::check(fault, "rollout", step, rank)?;
                let t = Instant::now();
                Ok((r.generate(&q, inflight)?, t.elapsed().as_secs_f64()))
            })?;
            let busy = parts.iter().map(|p| p.1).collect();
            let done = replica::merge(parts.into_iter().map(|p| p.0).collect());
            let rollouts = self.rollouts_of(done.into_iter().map(|c| (c, None)).collect(), version)?;
            return Ok(Batch { rollouts, busy, wait: None });
        }
        // Asynchronous: keep k steps of requests ahead, then wait for one step's groups.
        let k = h.job.schedule.max_staleness;
        for s in step..=step + k {
            self.enqueue(h, s)?;
        }
        let need = h.job.rollout.prompts_per_step;
        let t0 = Instant::now();
        let busy = if h.split() {
            self.start_generators(h)?;
            self.wait_split(h, need)?
        } else {
            let (q, b) = (self.link.queue.clone(), self.link.board.clone());
            let fault = h.fault;
            h.pool.run_all("rollout", move |rank, r| {
                Fault::check(fault, "rollout", step, rank)?;
                let t = Instant::now();
                r.generate_until(&q, &b, need, inflight)?;
                Ok(t.elapsed().as_secs_f64())
            })?
        };
        let wait = t0.elapsed().as_secs_f64();
        let done = self.link.board.take(need)?;
        let rollouts = self.rollouts_of(done, version)?;
        Ok(Batch { rollouts, busy, wait: Some(wait) })
    }
}

impl Scheduler {
    /// Split placement: waits until the board holds `need` complete groups (a generator that
    /// stops meanwhile ends the wait with its error); every device's seconds spent generating
    /// since the last step.
    fn wait_split(&mut self, h: &Coordinator, need: usize) -> Result<Vec<f64>> {
        while !self.link.board.wait_for(need, Duration::from_millis(20))? {
            if let Some(i) = self.generators.iter_mut().position(|p| p.is_done()) {
                let p = self.generators.remove(i);
                p.wait().with_context(|| format!("generator on device {}", h.generators[i]))?;
                bail!("the generator on device {} stopped before the run ended", h.generators[i]);
            }
        }
        let mut busy = vec![0.0; h.devices()];
        for (slot, &rank) in h.generators.iter().enumerate() {
            let now = self.link.busy_ns[slot].load(Ordering::Relaxed);
            busy[rank] = (now - self.gen_busy[slot]) as f64 * 1e-9;
            self.gen_busy[slot] = now;
        }
        Ok(busy)
    }
}

impl Drop for Scheduler {
    /// The generators' commands must end before the worker pool joins its threads.
    fn drop(&mut self) {
        if let Err(e) = self.finish() {
            tracing::warn!("a generator ended with an error: {e:#}");
        }
    }
}
