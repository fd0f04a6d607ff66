//! The mismatch guard at the step boundary (after the resync, before the next rollouts):
//! every step, the engines' synced versions against the trainers' (free); on a breach of the
//! guard's line or jump rule, a lagging version, or the first step of a resumed run, the
//! consistency check of every engine's view; a stale or corrupted view is repaired by a resync
//! and reported with its tensors; a breach with consistent views counts toward the fall-back,
//! which switches every device's rollout engine to the next rung that fits, in place.
//!
//! Owns: [`GuardRun`]. May call: `coordinator` (the devices' commands), `mismatch::guard` (the
//! decisions). Must not: decide anything itself (the decisions are `mismatch::guard`'s).

use super::coordinator::Coordinator;
use crate::engine::rollout_weights::{EngineSpec, ViewCheck};
use crate::mismatch::guard::{Event, Guard, GuardMetrics, GuardState};
use crate::mismatch::StepMismatch;
use anyhow::Result;
use std::sync::Arc;

/// Rows per quantized weight the consistency check re-quantizes.
const CHECK_ROWS: usize = 8;

pub struct GuardRun {
    guard: Guard,
    ladder: Vec<EngineSpec>,
    /// Run the consistency check at the next step whatever the statistic says (a resume).
    check_next: bool,
}

/// `[engine]`'s recipe as `colotrain admit` spells it (for a recipe not on the ladder).
fn spelling(job: &crate::config::JobConfig) -> String {
    let e = &job.engine;
    if e.noise_sigma > 0.0 && e.recipe == "bf16" && e.keep_bf16.is_empty() {
        return format!("noise={}", e.noise_sigma);
    }
    let mut s = std::iter::once(e.recipe.clone()).chain(e.keep_bf16.iter().cloned()).collect::<Vec<_>>().join("+");
    if e.noise_sigma > 0.0 {
        s.push_str(&format!(" with noise={}", e.noise_sigma));
    }
    s
}

impl GuardRun {
    /// The run's guard (None when `[guard]` is off), on the rung the engines serve: a resumed
    /// run's saved one, else the rung that is `[engine]`'s recipe, if any.
    pub fn new(h: &Coordinator) -> Result<Option<GuardRun>> {
        let job = &h.job;
        if !job.guard.enabled {
            return Ok(None);
        }
        if job.rollout.source == crate::config::RolloutSource::File
            || job.objective.kind == crate::config::ObjectiveKind::Sft
        {
            tracing::warn!(
                "guard: this run samples nothing (file rollouts or SFT on reference answers): the guard stands by"
            );
            return Ok(None);
        }
        let ladder = h.ladder.clone();
        let start = ladder.iter().position(|s| *s == h.setup.spec);
        let mut guard = Guard::new(&job.guard, start, &spelling(job))?;
        let check_next = match &h.resumed_guard {
            Some(g) => {
                guard.restore(g.clone());
                true
            }
            None => false,
        };
        tracing::info!(
            "guard: watching {} against {:.4} nats/token; serving {}, ladder {:?}",
            job.guard.statistic,
            guard.line(),
            guard.serving(),
            job.guard.fallback
        );
        Ok(Some(GuardRun { guard, ladder, check_next }))
    }

    /// The recipe serving now.
    pub fn state_name(&self) -> String {
        self.guard.serving()
    }

    pub fn state(&self) -> &GuardState {
        &self.guard.state
    }

    /// The guard's work at the end of `step` (its statistics `m`); the metrics line's object.
    pub fn step(&mut self, h: &Coordinator, step: u64, m: &StepMismatch) -> Result<GuardMetrics> {
        let obs = self.guard.observe(m);
        let line = self.guard.line();
        let mut events = Vec::new();
        let versions = h.pool.run_all("guard", |_, r| r.view_versions())?;
        let lagging = versions.iter().any(|(e, t)| e != t);
        let resumed = std::mem::take(&mut self.check_next);
        if !(lagging || obs.breach.is_some() || resumed) {
            self.guard.commit(false);
            return Ok(self.metrics(obs.value, obs.windowed, events));
        }
        let checks = h.pool.run_all("guard", |_, r| r.check_view(CHECK_ROWS))?;
        let stale = merge(&checks);
        if let Some(found) = stale {
            h.repair_views()?;
            let after = h.pool.run_all("guard", |_, r| r.check_view(CHECK_ROWS))?;
            let repaired = after.iter().all(|c| c.consistent());
            tracing::warn!(
                "guard: step {step}: the rollout engine's view is stale (engine at version {}, trainer at {}; tensors {:?}){}",
                found.engine_version,
                found.trainer_version,
                found.tensors,
                if repaired { "; repaired by a resync" } else { "; a resync did not repair it" }
            );
            if let Some(by) = obs.breach {
                events.push(Event::Breach { by, value: obs.value, windowed: obs.windowed, line, consistent: false });
            }
            events.push(Event::StaleView {
                engine_version: found.engine_version,
                trainer_version: found.trainer_version,
                tensors: found.tensors,
                repaired,
            });
            if !repaired {
                anyhow::bail!("guard: step {step}: the rollout engine's view stays stale after a resync");
            }
            self.guard.repaired();
            // A breach the stale view caused says nothing about the recipe: its step is
            // forgotten. A view found lagging before any rollout read it leaves the step as is.
            if obs.breach.is_some() {
                self.guard.drop_step();
            } else {
                self.guard.commit(false);
            }
            return Ok(self.metrics(obs.value, obs.windowed, events));
        }
        if resumed {
            tracing::info!("guard: step {step}: the engines' views are consistent after the resume");
        }
        let Some(by) = obs.breach else {
            self.guard.commit(false);
            return Ok(self.metrics(obs.value, obs.windowed, events));
        };
        events.push(Event::Breach { by, value: obs.value, windowed: obs.windowed, line, consistent: true });
        let from = self.guard.serving();
        match self.guard.commit(true) {
            Some(next) => self.fall_back(h, step, next, from, &mut events)?,
            None if self.guard.next_rung().is_none() && self.guard.state.breaches == self.guard.cfg.patience => {
                tracing::warn!("guard: step {step}: {from} breaches the line and is the ladder's last rung");
                events.push(Event::LastRung { rung: from });
            }
            None => {}
        }
        let (value, windowed) = (obs.value, obs.windowed);
        Ok(self.metrics(value, windowed, events))
    }

    /// Switches every device's rollout engine to rung `to`, or the first rung below it whose
    /// engine fits every device (none fits: the engine keeps serving `from`).
    fn fall_back(
        &mut self,
        h: &Coordinator,
        step: u64,
        to: usize,
        from: String,
        events: &mut Vec<Event>,
    ) -> Result<()> {
        for to in to..self.ladder.len() {
            let spec = Arc::new(self.ladder[to].clone());
            let (s, sp) = (h.setup.clone(), spec.clone());
            let why: Vec<String> =
                h.pool.run_all("guard", move |_, r| r.switch_fits(&s, &sp))?.into_iter().flatten().collect();
            let rung = self.guard.cfg.fallback[to].clone();
            if why.is_empty() {
                let (s, c) = (h.setup.clone(), h.calib.clone());
                h.pool.run_all("switch", move |_, r| r.switch_engine(&s, &spec, c.as_ref().as_ref()))?;
                tracing::warn!("guard: step {step}: {from} breached the line; the rollout engine falls back to {rung}");
                events.push(Event::Fallback { from, to: rung });
                self.guard.switched(to);
                return Ok(());
            }
            tracing::warn!("guard: step {step}: passing over {rung}: {}", why.join("; "));
            events.push(Event::SkipRung { rung, why: why.join("; ") });
        }
        tracing::warn!("guard: step {step}: no rung below {from} fits; it keeps serving");
        events.push(Event::LastRung { rung: from });
        Ok(())
    }

    fn metrics(&self, value: f64, windowed: f64, events: Vec<Event>) -> GuardMetrics {
        GuardMetrics { state: self.guard.serving(), value, windowed, line: self.guard.line(), events }
    }
}

/// The devices' checks as one finding (None: every view is consistent): the oldest engine
/// version and every tensor that differs on some device.
fn merge(checks: &[ViewCheck]) -> Option<ViewCheck> {
    let bad: Vec<&ViewCheck> = checks.iter().filter(|c| !c.consistent()).collect();
    let first = bad.first()?;
    let mut out = ViewCheck {
        engine_version: bad.iter().map(|c| c.engine_version).min().unwrap_or(first.engine_version),
        trainer_version: first.trainer_version,
        tensors: Vec::new(),
        checked: first.checked,
    };
    for c in &bad {
        for t in &c.tensors {
            if !out.tensors.contains(t) {
                out.tensors.push(t.clone());
            }
        }
    }
    Some(out)
}
