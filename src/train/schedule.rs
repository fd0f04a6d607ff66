//! Where a step's rollouts come from (seed 000 §5.4, App. C.5).
//! - Synchronous: the step's requests go into a shared queue; every device generates from it
//!   with the current weights until it is empty (an idle device takes the next unstarted
//!   request), then training runs.
//! - Asynchronous, colocated: generation runs ahead. The queue holds the requests of this step
//!   and the next k; devices generate until the board holds one step's worth of complete prompt
//!   groups, which are trained on (oldest requests first). Sequences still running stay in their
//!   engines and resume under the updated weights; every token records the version it was
//!   sampled with, and the trainer leaves out tokens more than k versions old.
//!
//! Owns: [`Scheduler`] (prompts in flight, the board). May call: the worker pool.

use super::job::{reference_rollouts, sampling_of, Host};
use super::replica::{self, Board};
use super::rollout::{self, Rollout};
use crate::data::dataset::PromptItem;
use anyhow::{Context, Result};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

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
    queue: Arc<rollout::WorkQueue>,
    board: Arc<Board>,
}

impl Scheduler {
    pub fn new(h: &Host, _start: u64) -> Result<Scheduler> {
        Ok(Scheduler {
            asynchronous: h.job.schedule.mode == "async",
            prompts: BTreeMap::new(),
            queue: replica::queue(Vec::new()),
            board: Arc::new(Board::new(h.job.rollout.samples_per_prompt)),
        })
    }

    pub fn trainer_version(&self, h: &Host) -> Result<u64> {
        h.pool.run_on(0, "stats", |r| Ok(r.trainer.version))
    }

    /// Queues the requests of `step` (once).
    fn enqueue(&mut self, h: &Host, step: u64) -> Result<()> {
        if self.prompts.contains_key(&step) {
            return Ok(());
        }
        let prompts = h.data.as_ref().context("no training data")?.train_prompts(step, h.job.rollout.prompts_per_step)?;
        let sampling = Arc::new(sampling_of(&h.job));
        let reqs = rollout::requests(&prompts, h.job.rollout.samples_per_prompt as u32, &sampling, step);
        let n = reqs.len();
        self.queue.lock().map_err(|_| anyhow::anyhow!("the rollout queue was poisoned"))?.extend(reqs);
        self.prompts.insert(step, (Arc::new(prompts), n));
        Ok(())
    }

    /// Rollouts of completions; a step's prompts are dropped once all its responses are out.
    fn to_rollouts(&mut self, done: Vec<crate::engine::Completion>, version: u64) -> Result<Vec<Rollout>> {
        let mut out = Vec::with_capacity(done.len());
        for c in done {
            let step = c.id >> 32;
            let (p, left) = self.prompts.get_mut(&step).with_context(|| format!("a completion of step {step}, whose prompts are gone"))?;
            out.push(rollout::from_completion(c, p, version));
            *left -= 1;
            if *left == 0 {
                self.prompts.remove(&step);
            }
        }
        Ok(out)
    }

    pub fn rollouts(&mut self, h: &Host, step: u64) -> Result<Batch> {
        let n = h.devices();
        let none = |rollouts| Batch { rollouts, busy: vec![0.0; n], wait: None };
        if let Some(f) = &h.file_rollouts {
            return Ok(none(f.clone()));
        }
        if !self.asynchronous && h.job.objective.kind == "sft" {
            let prompts = h.data.as_ref().context("no training data")?.train_prompts(step, h.job.rollout.prompts_per_step)?;
            if prompts.iter().all(|p| p.response.is_some()) {
                return Ok(none(reference_rollouts(&prompts, h.job.rollout.samples_per_prompt)));
            }
        }
        let inflight = h.job.rollout.max_seqs;
        let version = h.pool.run_on(0, "stats", |r| r.rollout_version())?;
        if !self.asynchronous {
            self.enqueue(h, step)?;
            let q = self.queue.clone();
            let parts = h.pool.run_all("rollout", move |_, r| {
                let t = Instant::now();
                Ok((r.generate(&q, inflight)?, t.elapsed().as_secs_f64()))
            })?;
            let busy = parts.iter().map(|p| p.1).collect();
            let done = replica::merge(parts.into_iter().map(|p| p.0).collect());
            let rollouts = self.to_rollouts(done, version)?;
            return Ok(Batch { rollouts, busy, wait: None });
        }
        // Asynchronous: keep k steps of requests ahead, then wait for one step's groups.
        let k = h.job.schedule.max_staleness;
        for s in step..=step + k {
            self.enqueue(h, s)?;
        }
        let need = h.job.rollout.prompts_per_step;
        let t0 = Instant::now();
        let (q, b) = (self.queue.clone(), self.board.clone());
        let busy = h.pool.run_all("rollout", move |_, r| {
            let t = Instant::now();
            r.generate_until(&q, &b, need, inflight)?;
            Ok(t.elapsed().as_secs_f64())
        })?;
        let wait = t0.elapsed().as_secs_f64();
        let done = self.board.take(need)?;
        let rollouts = self.to_rollouts(done, version)?;
        Ok(Batch { rollouts, busy, wait: Some(wait) })
    }
}
