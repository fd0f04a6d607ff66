//! The step loop of the `train` job: per step, rollouts (as the schedule provides them),
//! teacher scoring, rewards, the data-parallel training step (ZeRO-1), the in-place resync,
//! the mismatch guard (`guard`), metrics (one JSON line), periodic held-out evaluation and checkpoints; the run directory's
//! files (metrics.jsonl, config.toml, eval/, and ledger.json: the launch ledger of the steps on
//! CUDA devices).
//!
//! Owns: the run directory. May call: `coordinator`, `guard`, `schedule`, `fault`, `replica` (its
//! `Sources`), and `train`, `mismatch`, `engine` (metrics, checkpoints, digests). Must not:
//! touch a device's state except through the coordinator.

use super::coordinator::{print_plan, start};
use super::fault::Fault;
use super::replica::Sources;
use super::schedule::Scheduler;
use crate::config::{JobConfig, ObjectiveKind};
use crate::device::cuda::ledger::{self, Ledger};
use crate::engine::rollout;
use crate::mismatch;
use crate::mismatch::monitor::Monitor;
use crate::reward::RewardStats;
use crate::train::checkpoint;
use crate::train::metrics::{GuardSummary, JobSummary, LogpDifference, PhaseSeconds, StepMetrics, Transfer};
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
    /// Fault injection for the mismatch guard's tests: the engines' view goes wrong.
    pub view_fault: Option<super::fault::ViewFault>,
}

/// Keeps the lines of metrics.jsonl with step <= `upto` (resume), rewriting it atomically.
fn truncate_metrics(path: &Path, upto: u64) -> Result<()> {
    if !path.exists() {
        return Ok(());
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .ok()
                .and_then(|v| v.get("step").and_then(|s| s.as_u64()))
                .map(|s| s <= upto)
                .unwrap_or(false)
        })
        .collect();
    let mut out = kept.join("\n");
    if !out.is_empty() {
        out.push('\n');
    }
    crate::util::write_atomic(path, out.as_bytes())
}

/// Runs `job`. `resolve` turns its model paths into directories (`orchestrator::sources`
/// builds `builtin:` models; the tiny builder's own SFT run passes `Sources::plain`): called
/// once the run directory is checked, as the devices start.
pub fn run(job: &JobConfig, resolve: &dyn Fn(&JobConfig) -> Result<Sources>, opts: &JobOptions) -> Result<JobSummary> {
    let t_job = Instant::now();
    let out_dir = job.out_dir();
    let metrics_path = out_dir.join("metrics.jsonl");
    let resume = match &opts.resume {
        Some(p) => Some(checkpoint::resolve(p)?),
        None => {
            if metrics_path.exists() || !checkpoint::list(&out_dir)?.is_empty() {
                bail!(
                    "{} already holds a run; resume it with --resume {} or choose another run.name / run.out_dir",
                    out_dir.display(),
                    out_dir.display()
                );
            }
            None
        }
    };
    std::fs::create_dir_all(out_dir.join("eval")).with_context(|| format!("cannot create {}", out_dir.display()))?;
    let (mut host, start) = start(job, &resolve(job)?, resume.as_deref(), &out_dir, opts.fault)?;
    host.view_fault = opts.view_fault;
    if resume.is_some() {
        truncate_metrics(&metrics_path, start)?;
    }
    crate::util::write_atomic(&out_dir.join("config.toml"), job.to_toml().as_bytes())?;
    print_plan(&host)?;
    let mut metrics_file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&metrics_path)
        .with_context(|| format!("cannot open {}", metrics_path.display()))?;
    let mut summary = JobSummary { out_dir: out_dir.clone(), ..Default::default() };
    if resume.is_some() {
        // The summary covers the whole run: the evaluations made before the resume count.
        summary.evals = crate::train::runs::evals_up_to(&out_dir, start)?;
    }
    let evaluate = !host.heldout.is_empty();
    if start == 0 && evaluate {
        let r = host.evaluate(0)?;
        let line = serde_json::json!({"step": 0, "heldout_kl": job.teacher.is_some().then_some(r.kl), "heldout_acc": r.accuracy});
        writeln!(metrics_file, "{line}")?;
        summary.evals.push(r);
    }
    let bar = if opts.progress { indicatif::ProgressBar::new(job.run.steps) } else { indicatif::ProgressBar::hidden() };
    bar.set_style(
        indicatif::ProgressStyle::with_template("{spinner} train [{bar:30}] {pos}/{len} steps {elapsed}<{eta} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_position(start);
    let mut sched = Scheduler::new(&host, start)?;
    let mut monitor = Monitor::new(&job.monitor);
    if let Some(ck) = &resume {
        let p = ck.join(checkpoint::MONITOR_FILE);
        if p.exists() {
            let text = std::fs::read_to_string(&p).with_context(|| format!("cannot read {}", p.display()))?;
            monitor
                .restore(serde_json::from_str(&text).with_context(|| format!("{}: not a monitor state", p.display()))?);
        }
    }
    let mut guard = super::guard::GuardRun::new(&host)?;
    if let Some(g) = &guard {
        summary.guard = Some(GuardSummary::new(&g.state_name()));
        if resume.is_some() {
            if let Some(s) = summary.guard.as_mut() {
                s.read_back(&metrics_path, start)?;
            }
        }
    }
    let mut sum_time = PhaseSeconds::default();
    // The reward service's seconds busy and plug-in restarts at the last step.
    let (mut reward_busy, mut reward_restarts) = host.scorer.counters()?;
    let t_loop = Instant::now();
    let mut last_step = start;
    // The launch ledger of every step, per operation (written as ledger.json at the end).
    let mut run_ledger = Ledger::default();
    for step in start + 1..=job.run.steps {
        let _span = tracing::info_span!("step", step).entered();
        host.step.store(step, Ordering::Relaxed);
        let t_step = Instant::now();
        let moved0 = crate::device::cuda::transfer_bytes_of(&host.names);
        crate::device::cuda::take_memory_peak_of(&host.names);
        // What ran between steps (the setup, evaluations, checkpoints, a split generator's work
        // meanwhile) is not the step's: it goes to the run's ledger only.
        crate::device::cuda::take_ledger_of(&host.names).into_iter().for_each(|l| run_ledger.absorb(l));
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
        let teacher_util = if job.teacher.is_some() && job.objective.kind == ObjectiveKind::Opd {
            Some(phase("teacher").in_scope(|| host.score_teacher(&mut rollouts))?)
        } else {
            None
        };
        time.teacher = t0.elapsed().as_secs_f64();
        // 3. Rewards.
        let t0 = Instant::now();
        let (reward, outcomes) = phase("reward").in_scope(|| host.rewards(&mut rollouts, &batch.keys))?;
        time.reward = t0.elapsed().as_secs_f64();
        let (busy_s, restarts) = host.scorer.counters()?;
        let reward_stats = (!outcomes.is_empty()).then(|| {
            let cut = rollouts.iter().filter(|r| r.truncated && r.reward.is_some()).count();
            RewardStats::of(&outcomes, cut, restarts - reward_restarts)
        });
        if restarts > reward_restarts {
            tracing::warn!("step {step}: the reward plug-in was restarted ({restarts} restarts so far)");
        }
        time.reward_busy = busy_s - reward_busy;
        (reward_busy, reward_restarts) = (busy_s, restarts);
        // 4. Train (data-parallel over the devices).
        let t0 = Instant::now();
        let gen_tokens: usize = rollouts.iter().map(|r| r.response.len()).sum();
        let n_rollouts = rollouts.len();
        let truncated = rollouts.iter().filter(|r| r.truncated).count();
        let samples_digest = rollout::digest(&rollouts);
        let train_tokens: usize =
            rollouts.iter().filter(|r| !r.response.is_empty()).map(|r| r.prompt.len() + r.response.len()).sum();
        let sampler: Vec<f32> = rollouts
            .iter()
            .filter(|r| !r.response.is_empty())
            .flat_map(|r| r.sampler_logprobs.iter().copied())
            .collect();
        let (out, train_busy, kv_release) = phase("train").in_scope(|| host.train(rollouts, step))?;
        // Freeing and re-allocating the KV caches is part of the switch, not of training.
        time.kv_release = kv_release;
        time.train = t0.elapsed().as_secs_f64() - kv_release;
        // 5. Resync.
        let t0 = Instant::now();
        phase("resync").in_scope(|| sched.resync(&host))?;
        time.resync = t0.elapsed().as_secs_f64();
        time.wait = batch.wait.unwrap_or(time.rollout) + time.teacher;
        time.total = t_step.elapsed().as_secs_f64();
        time.collectives = out.collective_s;
        time.switch = (time.total - time.rollout - time.teacher - time.reward - time.train - time.resync).max(0.0);
        let done_steps = (step - start) as f64;
        let utilization: Vec<f64> = batch
            .busy
            .iter()
            .zip(&train_busy)
            .map(|(g, t)| {
                ((g + t + teacher_util.unwrap_or(0.0) * time.teacher / host.devices() as f64) / time.total.max(1e-9))
                    .min(1.0)
            })
            .collect();
        // One round trip to the training lead for its counters.
        let (version, skipped_steps) = host.trainer_counters()?;
        let mut m = StepMetrics {
            step,
            version,
            gen_tokens,
            train_tokens,
            // Every pass over the minibatches runs each token forward and backward once.
            train_flops: 6.0
                * host.cfg.num_params() as f64
                * train_tokens as f64
                * job.objective.updates_per_step.max(1) as f64,
            tokens_per_s: gen_tokens as f64 / time.rollout.max(1e-9),
            updates_per_hour: done_steps * 3600.0 / t_loop.elapsed().as_secs_f64().max(1e-9),
            loss: out.loss,
            grad_norm: out.info.grad_norm,
            lr: out.info.lr,
            entropy: out.entropy,
            response_len: gen_tokens as f64 / n_rollouts.max(1) as f64,
            length_cap_rate: truncated as f64 / n_rollouts.max(1) as f64,
            reward,
            reward_stats,
            mismatch: if host.file_rollouts.is_none() && job.objective.kind != ObjectiveKind::Sft {
                mismatch::step_mismatch(&sampler, &out.logp)
            } else {
                Default::default()
            },
            updates: out.updates,
            rl: out.adv_response.as_ref().map(|a| monitor.observe(a, &out.seq_lens, &out.logp, &sampler, out.clipped)),
            triage: out.triage.clone(),
            skipped: out.skipped,
            skipped_steps: 0,
            devices: host.devices(),
            utilization,
            transfer: {
                let (h, d) = crate::device::cuda::transfer_bytes_of(&host.names);
                Transfer { h2d_bytes: h.saturating_sub(moved0.0), d2h_bytes: d.saturating_sub(moved0.1) }
            },
            mem_peak_bytes: crate::device::cuda::take_memory_peak_of(&host.names),
            max_lag: out.max_lag,
            stale_tokens_masked: out.max_lag.map(|_| out.masked),
            max_token_age: out.max_age,
            samples_digest,
            time,
            ..Default::default()
        };
        m.skipped_steps = skipped_steps;
        m.sampling_logp_difference = LogpDifference { mean: m.mismatch.abs_mean, max: m.mismatch.abs_max };
        // The guard acts at the step boundary: what the next step's rollouts read is settled.
        if let Some(g) = &mut guard {
            let gm = phase("guard").in_scope(|| g.step(&host, step, &m.mismatch))?;
            if let Some(s) = summary.guard.as_mut() {
                s.add(step, &gm);
            }
            m.guard = Some(gm);
        }
        let ledgers = crate::device::cuda::take_ledger_of(&host.names);
        if !ledgers.is_empty() {
            m.ledger = Some(ledger::summarize(&ledgers));
            ledgers.into_iter().for_each(|l| run_ledger.absorb(l));
        }
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
            host.checkpoint(step, &monitor, guard.as_ref().map(|g| g.state()))?;
        }
        summary.skipped_steps = m.skipped_steps;
        summary.last = Some(m);
        last_step = step;
        if stopping {
            tracing::warn!(
                "stopped at step {step} on request; checkpoint written (resume with --resume {})",
                out_dir.display()
            );
            break;
        }
    }
    sched.finish()?;
    bar.finish_and_clear();
    crate::device::cuda::take_ledger_of(&host.names).into_iter().for_each(|l| run_ledger.absorb(l));
    if !run_ledger.is_empty() {
        let rows = serde_json::to_string_pretty(&ledger::rows(&run_ledger))?;
        crate::util::write_atomic(&out_dir.join("ledger.json"), rows.as_bytes())?;
    }
    let n = (last_step.saturating_sub(start)).max(1) as f64;
    summary.mean_time = sum_time.scaled(1.0 / n);
    summary.steps = last_step;
    summary.seconds = t_job.elapsed().as_secs_f64();
    Ok(summary)
}
