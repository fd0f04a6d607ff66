//! The device check's `node` timing: a short colocated OPD job on this GPU, synchronous and
//! asynchronous with staleness 4, side by side in one run, each next to the step-time model's
//! prediction for it: the launch ledger's roofline of the very launches the job made, at this
//! GPU's peak rates (an H200's for a GPU of the Hopper class, a B300's for Blackwell; the
//! simulator stands for the GPU its architecture names). On a GPU the student and teacher are
//! random Qwen2-1.5B-shaped BF16 models written to a temporary folder; on the simulator a tiny
//! shape of the same kind, so the glue runs in CI's reach. Both carry the byte-level tiny
//! tokenizer, whose 259 ids are fewer than the model's vocabulary (as the 1.5B's are): a
//! random model samples ids the tokenizer does not know, which decoding skips.
//!
//! Owns: the job and its model folder (removed afterwards). May call: `bench_node::measure`,
//! the tiny model writer. Must not: change the card's settings.

use crate::cli::bench_node::{measure, NodeReport};
use crate::config::{JobConfig, ScheduleMode};
use crate::device::{CudaDevice, DType, Device};
use crate::model::tiny::{tiny_config, write_model_dir, TinySpec};
use crate::model::ModelWeights;
use anyhow::{Context, Result};
use serde::Serialize;

/// One schedule's measurement and the model's prediction for it.
#[derive(Debug, Serialize)]
pub struct NodeRow {
    pub schedule: String,
    pub steps_measured: usize,
    pub updates_per_hour: f64,
    /// Mean seconds per step, measured.
    pub step_s: f64,
    pub rollout_s: f64,
    pub teacher_s: f64,
    pub train_s: f64,
    pub wait_s: f64,
    pub switch_s: f64,
    /// The launch ledger's roofline seconds per step at this GPU's peaks (the model).
    pub model_step_s: f64,
    pub gen_tokens_per_s: f64,
}

/// The shape: Qwen2-1.5B on a GPU, a tiny one on the simulator.
fn spec(sim: bool) -> TinySpec {
    let (layers, hidden, heads, kv_heads, intermediate, vocab) =
        if sim { (2, 64, 4, 2, 128, 1024) } else { (28, 1536, 12, 2, 8960, 151936) };
    TinySpec {
        arch: "qwen2".into(),
        layers,
        hidden,
        heads,
        kv_heads,
        head_dim: None,
        intermediate: Some(intermediate),
        vocab,
        max_position: 4096,
        tie: true,
    }
}

/// Runs the two jobs on `d` and prints them: on a GPU 6 steps each, the first 2 left out (the
/// pair fits the device check's group limit); on the simulator 3 steps of 2 × 4 rollouts, the
/// first left out.
pub fn node(d: &CudaDevice) -> Result<Vec<NodeRow>> {
    let (steps, warmup) = if d.is_sim() { (3, 1) } else { (6, 2) };
    let dir = std::env::temp_dir().join(format!("colotrain-node-timing-{}", std::process::id()));
    let out = run_both(d, &dir, steps, warmup);
    let _ = std::fs::remove_dir_all(&dir);
    let rows = out?;
    println!(
        "{:<22} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>11} {:>9}",
        "node, 1 GPU, colocated",
        "upd/h",
        "step s",
        "model s",
        "rollout",
        "teacher",
        "train",
        "wait",
        "gen tok/s",
        "switch"
    );
    for r in &rows {
        println!(
            "{:<22} {:>8.0} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>11.0} {:>9}",
            r.schedule,
            r.updates_per_hour,
            secs(r.step_s),
            secs(r.model_step_s),
            secs(r.rollout_s),
            secs(r.teacher_s),
            secs(r.train_s),
            secs(r.wait_s),
            r.gen_tokens_per_s,
            secs(r.switch_s)
        );
    }
    if let [sync, asynch] = &rows[..] {
        println!(
            "{:<22} {:>8.2} (seed 000 Table 8: 1.62x with split placement on 8 GPUs)",
            "async / sync upd/h",
            asynch.updates_per_hour / sync.updates_per_hour.max(1e-9)
        );
    }
    Ok(rows)
}

/// Seconds to 3 decimals, or 3 significant digits below 10 ms (the simulator's model, a switch).
fn secs(s: f64) -> String {
    if s != 0.0 && s.abs() < 0.01 {
        format!("{s:.2e}")
    } else {
        format!("{s:.3}")
    }
}

fn run_both(d: &CudaDevice, dir: &std::path::Path, steps: u64, warmup: u64) -> Result<Vec<NodeRow>> {
    let sim = d.is_sim();
    let model = dir.join("model");
    std::fs::create_dir_all(&model).with_context(|| format!("cannot create {}", model.display()))?;
    let cfg = tiny_config(&spec(sim))?;
    let w = ModelWeights::random(&cfg, &Device::cpu(1)?, DType::BF16, 7, 0.02)?;
    write_model_dir(&model, &cfg, &w, DType::BF16).context("writing the random model")?;
    drop(w);
    let mut rows = Vec::new();
    for (name, mode, k) in [("sync", ScheduleMode::Sync, 0), ("async k=4", ScheduleMode::Async, 4)] {
        let mut j = JobConfig::from_toml(crate::cli::train::TINY_OPD, "built-in configs/tiny-opd.toml")?;
        for m in [&mut j.model.path, &mut j.teacher.as_mut().context("the tiny job has a teacher")?.path] {
            *m = model.display().to_string();
        }
        j.model.dtype = Some("bf16".into());
        if let Some(t) = j.teacher.as_mut() {
            t.dtype = Some("bf16".into());
        }
        let device = format!("{}:{}", if sim { "cuda-sim" } else { "cuda" }, d.ordinal());
        (j.run.device, j.run.devices, j.run.steps) = (device, 1, steps);
        j.run.out_dir = Some(dir.join(name.replace([' ', '='], "-")));
        (j.rollout.prompts_per_step, j.rollout.samples_per_prompt) = if sim { (2, 4) } else { (8, 8) };
        j.rollout.max_new_tokens = if sim { 8 } else { 256 };
        (j.schedule.mode, j.schedule.max_staleness) = (mode, k);
        j.optimizer.warmup_steps = 0;
        let (r, _) = measure(&mut j, name, warmup, None).with_context(|| format!("the {name} job"))?;
        rows.push(row(name, &r, d.compute_capability().0 < 10));
    }
    Ok(rows)
}

/// `r` as a row; `hopper`: read the ledger's H200 column (else the B300's).
fn row(name: &str, r: &NodeReport, hopper: bool) -> NodeRow {
    let p = &r.phases;
    NodeRow {
        schedule: name.into(),
        steps_measured: r.steps_measured,
        updates_per_hour: r.updates_per_hour,
        step_s: p.total,
        rollout_s: p.rollout,
        teacher_s: p.teacher,
        train_s: p.train,
        wait_s: p.wait,
        switch_s: p.switch,
        model_step_s: r.ledger.iter().map(|l| if hopper { l.h200_s } else { l.b300_s }).sum(),
        gen_tokens_per_s: r.gen_tokens_per_s_per_gpu,
    }
}
