//! What a job reports: one JSON line per step ([`StepMetrics`]), the phase times, and the
//! end-of-run summary table.
//!
//! Owns: the metric types. May call: serde. Must not: compute anything but formatting.

use super::eval::EvalResult;
use crate::mismatch::monitor::RlMetrics;
use crate::mismatch::StepMismatch;
use serde::Serialize;
use std::path::PathBuf;

#[derive(Clone, Debug, Default, Serialize)]
pub struct PhaseSeconds {
    pub rollout: f64,
    pub teacher: f64,
    pub reward: f64,
    pub train: f64,
    pub resync: f64,
    /// The trainer's wait for generation and teacher scoring (synchronous: their sum).
    pub wait: f64,
    pub total: f64,
    /// Seconds the reward service spent scoring the step's responses, mostly while the engines
    /// generated (off the critical path; `reward` is what the step waited for).
    pub reward_busy: f64,
    /// The training lead's seconds inside the gradient and weight collectives (part of `train`).
    pub collectives: f64,
    /// The step's seconds outside every phase: the orchestrator's turn between decoding and
    /// training. No memory moves at a switch (weights, trainer state and KV caches stay
    /// resident) unless the memory plan frees the KV caches for training: `kv_release`.
    pub switch: f64,
    /// The part of `switch` spent freeing the KV caches before the train phase and allocating
    /// them again after it (0 when the plan holds both; see `orchestrator::memory`).
    pub kv_release: f64,
}

impl PhaseSeconds {
    pub fn add(&mut self, o: &PhaseSeconds) {
        self.rollout += o.rollout;
        self.teacher += o.teacher;
        self.reward += o.reward;
        self.train += o.train;
        self.resync += o.resync;
        self.wait += o.wait;
        self.total += o.total;
        self.reward_busy += o.reward_busy;
        self.collectives += o.collectives;
        self.switch += o.switch;
        self.kv_release += o.kv_release;
    }
    pub fn scaled(&self, f: f64) -> PhaseSeconds {
        PhaseSeconds {
            rollout: self.rollout * f,
            teacher: self.teacher * f,
            reward: self.reward * f,
            train: self.train * f,
            resync: self.resync * f,
            wait: self.wait * f,
            total: self.total * f,
            reward_busy: self.reward_busy * f,
            collectives: self.collectives * f,
            switch: self.switch * f,
            kv_release: self.kv_release * f,
        }
    }
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct StepMetrics {
    pub step: u64,
    pub version: u64,
    pub time: PhaseSeconds,
    pub gen_tokens: usize,
    /// Tokens the trainers ran (prompt + response of every response trained), and the model
    /// FLOPs of the train phase by the 6·N·T convention (forward and backward of N parameters
    /// over T tokens, attention not counted; the MFU of `colotrain bench node`).
    pub train_tokens: usize,
    pub train_flops: f64,
    pub tokens_per_s: f64,
    pub updates_per_hour: f64,
    pub loss: f64,
    pub grad_norm: f64,
    pub lr: f64,
    pub entropy: f64,
    pub response_len: f64,
    pub length_cap_rate: f64,
    pub reward: Option<f64>,
    /// How the step's responses were rewarded: extraction failures of the built-in rule (no
    /// boxed answer, undecidable), truncations, the scorer's busy seconds, plug-in restarts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reward_stats: Option<crate::reward::RewardStats>,
    pub mismatch: StepMismatch,
    /// The same mean / max |log q − log p_θ| under the name other trainers log.
    pub sampling_logp_difference: LogpDifference,
    /// Optimizer updates this step (minibatches × updates per step, less skipped ones).
    pub updates: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rl: Option<RlMetrics>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub triage: Option<crate::objective::triage::TriageStats>,
    pub skipped: bool,
    pub skipped_steps: u64,
    /// Devices of the run and each one's busy share of the step's wall time.
    pub devices: usize,
    pub utilization: Vec<f64>,
    /// Bytes that crossed PCIe during the step (every CUDA device of the process; zero on CPU).
    pub transfer: Transfer,
    /// The most device memory (allocated and cached) one CUDA device held during the step;
    /// absent on CPU devices.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mem_peak_bytes: Option<u64>,
    /// The launch ledger of the step per phase (CUDA devices, GPU or simulated; absent on
    /// CPU): launches, FLOPs and bytes as the launches declare them from their shapes, and
    /// the roofline seconds of the slowest device on an H200 and a B300 (a model of the
    /// work, not a measurement: `device/cuda/ledger.rs`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ledger: Option<std::collections::BTreeMap<String, crate::device::cuda::ledger::PhaseSummary>>,
    /// Asynchronous schedule: versions between the oldest trained token's weights and the
    /// trainer's, and tokens left out for being older than the staleness bound.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_lag: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stale_tokens_masked: Option<usize>,
    /// Asynchronous schedule: the largest version lag of any token of the batch, trained or
    /// not (how far generation ran ahead; above `max_lag` only when tokens were masked).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_token_age: Option<u64>,
    /// FNV-1a of the batch's responses (prompt id, sample, tokens; in that order), hex: equal
    /// digests mean the same samples, whatever the devices or the schedule's timing.
    pub samples_digest: String,
    /// The mismatch guard: the recipe serving, the statistic against its line, what it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub guard: Option<crate::mismatch::guard::GuardMetrics>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub heldout_kl: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub heldout_acc: Option<f64>,
}

#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Transfer {
    pub h2d_bytes: u64,
    pub d2h_bytes: u64,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct LogpDifference {
    pub mean: f64,
    pub max: f64,
}

/// What a finished job reports.
#[derive(Clone, Debug, Default)]
pub struct JobSummary {
    pub out_dir: PathBuf,
    pub steps: u64,
    pub seconds: f64,
    pub evals: Vec<EvalResult>,
    pub last: Option<StepMetrics>,
    pub mean_time: PhaseSeconds,
    pub skipped_steps: u64,
    pub guard: Option<GuardSummary>,
}

/// What the mismatch guard did over the run (the summary table's line).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GuardSummary {
    pub serving: String,
    /// (step, from, to) of each fall-back; steps whose stale view was repaired; breaches.
    pub fallbacks: Vec<(u64, String, String)>,
    pub repairs: Vec<u64>,
    pub breaches: u64,
}

impl GuardSummary {
    pub fn new(serving: &str) -> GuardSummary {
        GuardSummary { serving: serving.to_string(), ..Default::default() }
    }

    /// Counts step `step`'s events.
    pub fn add(&mut self, step: u64, g: &crate::mismatch::guard::GuardMetrics) {
        use crate::mismatch::guard::Event;
        self.serving = g.state.clone();
        for e in &g.events {
            match e {
                Event::Breach { .. } => self.breaches += 1,
                Event::StaleView { .. } => self.repairs.push(step),
                Event::Fallback { from, to } => self.fallbacks.push((step, from.clone(), to.clone())),
                Event::SkipRung { .. } | Event::LastRung { .. } => {}
            }
        }
    }

    /// A resumed run: the events of the metrics log's steps up to `upto` (the run before the
    /// resume), so that the summary covers the whole run.
    pub fn read_back(&mut self, metrics: &std::path::Path, upto: u64) -> anyhow::Result<()> {
        let Ok(text) = std::fs::read_to_string(metrics) else { return Ok(()) };
        let mut before = GuardSummary::new(&self.serving);
        for line in text.lines() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else { continue };
            let step = v.get("step").and_then(|s| s.as_u64()).unwrap_or(0);
            if step > upto {
                break;
            }
            let Some(events) = v.pointer("/guard/events") else { continue };
            if let Ok(events) = serde_json::from_value::<Vec<crate::mismatch::guard::Event>>(events.clone()) {
                let state = before.serving.clone();
                before.add(step, &crate::mismatch::guard::GuardMetrics { state, events, ..Default::default() });
            }
        }
        before.fallbacks.append(&mut self.fallbacks);
        before.repairs.append(&mut self.repairs);
        (self.fallbacks, self.repairs) = (before.fallbacks, before.repairs);
        self.breaches += before.breaches;
        Ok(())
    }
}

/// The end-of-run table.
pub fn summary_table(s: &JobSummary) -> String {
    let mut t = String::new();
    let first = s.evals.first();
    let last = s.evals.last();
    t.push_str(&format!("run            {}\n", s.out_dir.display()));
    t.push_str(&format!("steps          {} in {:.1} s ({} skipped)\n", s.steps, s.seconds, s.skipped_steps));
    if let (Some(a), Some(b)) = (first, last) {
        if !a.teacher.is_empty() {
            let rel = if a.kl != 0.0 { (b.kl / a.kl - 1.0) * 100.0 } else { 0.0 };
            t.push_str(&format!(
                "held-out KL    {:.4} (step {}) -> {:.4} (step {})  {:+.1}%\n",
                a.kl, a.step, b.kl, b.step, rel
            ));
        }
        t.push_str(&format!("accuracy       {:.1}% -> {:.1}%\n", a.accuracy * 100.0, b.accuracy * 100.0));
    }
    if let Some(m) = &s.last {
        t.push_str(&format!(
            "last step      loss {:.4}  entropy {:.3}  d_n {:.2e}  response {:.1} tokens",
            m.loss, m.entropy, m.mismatch.d_n, m.response_len
        ));
        if let Some(r) = m.reward {
            t.push_str(&format!("  reward {r:.3}"));
        }
        if let Some(tr) = &m.triage {
            t.push_str(&format!(
                "  gated {} tokens, repair {}/{} segments",
                tr.gated_tokens, tr.repair_active, tr.repair_segments
            ));
        }
        t.push('\n');
    }
    if let Some(g) = &s.guard {
        let falls: Vec<String> = g.fallbacks.iter().map(|(st, a, b)| format!("{a} -> {b} at step {st}")).collect();
        t.push_str(&format!(
            "guard          serving {}; {} breach(es); fall-backs: {}; stale views repaired: {}\n",
            g.serving,
            g.breaches,
            if falls.is_empty() { "none".to_string() } else { falls.join(", ") },
            if g.repairs.is_empty() {
                "none".to_string()
            } else {
                format!("at step {}", g.repairs.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", "))
            }
        ));
    }
    let p = &s.mean_time;
    t.push_str(&format!(
        "seconds/step   total {:.3} = rollout {:.3} + teacher {:.3} + reward {:.3} + train {:.3} + resync {:.3} + switch {:.3}\n",
        p.total, p.rollout, p.teacher, p.reward, p.train, p.resync, p.switch
    ));
    t
}
