//! `colotrain bench node`: the node's throughput report (seed 000 Table 8 / Figure 10's terms).
//! It runs a short job of the given config on every device it names, then reads the run's
//! metrics: updates/hour, generated tokens/s per GPU, the MFU of the train phase, where the
//! step goes (rollout, teacher, reward, train — of which collectives —, resync, wait, switch)
//! and each device's utilization; printed as a table and written as JSON (`node_report.json`
//! in the run directory). On CUDA devices (GPUs or the simulator) it adds the launch ledger:
//! per phase the launches, FLOPs and bytes the step's launches declared and their roofline
//! time on an H200 and a B300, and the costliest operations of the run (`ledger.json`). With
//! `--model-gpu h200|b300` and no `--device` it prints the step-time model of the shipped
//! configs instead (`node_model.rs`): no job runs; `--ledger` adds, per config, the launch
//! ledger of one step at the model's real shapes on dry simulated GPUs (`node_ledger.rs`).
//!
//! Owns: the report's arithmetic over metrics lines. May call: the orchestrator (one job),
//! `node_model`. Must not: time anything itself (the job's phase clocks are the measurements).

use crate::config::JobConfig;
use crate::orchestrator::{self as job, JobOptions};
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct NodeArgs {
    /// Job config (TOML). Default: the built-in tiny OPD job.
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[arg(long, default_value_t = 10)]
    pub steps: u64,
    /// Override run.device.
    #[arg(long)]
    pub device: Option<String>,
    /// Override run.devices (0: every visible GPU).
    #[arg(long)]
    pub devices: Option<usize>,
    /// The run directory (default: runs/bench-node-<unix seconds>).
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
    /// Steps left out of the averages at the start (warm-up: first allocations, caches).
    #[arg(long, default_value_t = 1)]
    pub warmup: u64,
    /// The dense BF16 peak of one device in TFLOP/s for the MFU (default: from the GPU's name;
    /// a simulated GPU counts as the GPU it stands for).
    #[arg(long)]
    pub peak_tflops: Option<f64>,
    /// Without --device: print the step-time model of the config on 8 GPUs of this kind (h200
    /// or b300) instead of running (roofline time per phase from the shapes, the peak rates and
    /// NVLink). With --device (a GPU or cuda-sim): run, and show the launch ledger's roofline
    /// for this GPU only.
    #[arg(long)]
    pub model_gpu: Option<String>,
    /// With --model-gpu: the student's config.json (default: the shape the shipped config
    /// names, see `node_model::known_shape`).
    #[arg(long)]
    pub model_config: Option<PathBuf>,
    /// With --model-gpu and no --device: also launch one GPU's share of the step at the
    /// model's shapes on a dry simulated GPU (no memory, no kernel run) and print its launch
    /// ledger beside the shape model (`node_ledger.rs`; 15 to 30 s per config here).
    #[arg(long)]
    pub ledger: bool,
    /// With --ledger: how many of the costliest operations to print (0: every one).
    #[arg(long, default_value_t = 12)]
    pub ledger_rows: usize,
}

/// The report, as written to JSON.
#[derive(Debug, Serialize)]
pub struct NodeReport {
    pub config: String,
    pub devices: usize,
    pub device_names: Vec<String>,
    pub steps_measured: usize,
    pub updates_per_hour: f64,
    /// Per generating GPU (a split placement's trainers generate nothing).
    pub gen_tokens_per_s_per_gpu: f64,
    /// Model FLOPs of the train phase over (its seconds × training devices × peak); None
    /// without a known peak (CPU devices).
    pub train_mfu: Option<f64>,
    pub peak_tflops: Option<f64>,
    /// Mean seconds per step of each phase.
    pub phases: Phases,
    pub utilization: Vec<f64>,
    /// Mean bytes per step across PCIe, and as a share of the student's weights.
    pub h2d_bytes: f64,
    pub d2h_bytes: f64,
    /// The launch ledger per phase, mean per measured step (CUDA devices only).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ledger: Vec<LedgerPhase>,
    /// The run's costliest operations on an H200 (ledger.json's first rows, every step).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ledger_top: Vec<serde_json::Value>,
}

/// One phase of the launch ledger, mean per measured step.
#[derive(Debug, Default, Serialize, PartialEq)]
pub struct LedgerPhase {
    pub phase: String,
    pub launches: f64,
    pub flops: f64,
    pub bytes: f64,
    pub nvlink_bytes: f64,
    pub pcie_bytes: f64,
    pub h200_s: f64,
    pub b300_s: f64,
}

#[derive(Debug, Default, Serialize)]
pub struct Phases {
    pub rollout: f64,
    pub teacher: f64,
    pub reward: f64,
    pub train: f64,
    pub collectives: f64,
    pub resync: f64,
    pub wait: f64,
    pub switch: f64,
    /// The part of `switch` that freed and re-allocated the KV caches (0 when the memory plan
    /// holds them and the trainer's activations at once).
    pub kv_release: f64,
    pub total: f64,
}

/// The dense BF16 peak (TFLOP/s) of a device by its name (vendor figures, REFERENCES.md).
pub fn peak_of(name: &str) -> Option<f64> {
    let n = name.to_ascii_lowercase();
    if n.contains("h100") || n.contains("h200") || n.contains("h800") || n.contains("sm_90") {
        Some(989.0)
    } else if n.contains("b200") || n.contains("b300") || n.contains("sm_100") || n.contains("sm_103") {
        Some(2250.0)
    } else {
        None
    }
}

pub fn run(a: NodeArgs) -> Result<()> {
    let only = match (&a.model_gpu, &a.device) {
        (Some(gpu), None) => {
            return super::node_model::print(
                a.config.as_deref(),
                a.model_config.as_deref(),
                gpu,
                a.ledger.then_some(a.ledger_rows),
            )
        }
        (Some(gpu), Some(_)) => Some(super::node_model::gpu(gpu)?.name),
        (None, _) => None,
    };
    let mut j = match &a.config {
        Some(p) => JobConfig::from_file(p)?,
        None => JobConfig::from_toml(super::train::TINY_OPD, "built-in configs/tiny-opd.toml")?,
    };
    j.run.steps = a.steps;
    if a.steps <= a.warmup {
        bail!("--steps {} must be above --warmup {} (the averages leave the warm-up out)", a.steps, a.warmup);
    }
    if let Some(d) = &a.device {
        j.run.device = d.clone();
    }
    if let Some(n) = a.devices {
        j.run.devices = n;
    }
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    j.run.out_dir = Some(a.out_dir.clone().unwrap_or_else(|| PathBuf::from(format!("runs/bench-node-{stamp}"))));
    let config = a.config.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "built-in tiny-opd".into());
    let (r, summary) = measure(&mut j, &config, a.warmup, a.peak_tflops)?;
    let dir = summary.out_dir.clone();
    print!("{}", table(&r));
    print!("{}", ledger_table(&r, summary.steps, only));
    let out = dir.join("node_report.json");
    crate::util::write_atomic(&out, serde_json::to_string_pretty(&r)?.as_bytes())?;
    println!("report: {}", out.display());
    Ok(())
}

/// Runs job `j` (no held-out evaluation, no checkpoint before the last step) and reports its
/// steps after `warmup`, with its launch ledger's costliest rows; `peak`: the dense BF16 peak
/// per device for the MFU (default: from the first device's name).
pub fn measure(
    j: &mut JobConfig,
    config: &str,
    warmup: u64,
    peak: Option<f64>,
) -> Result<(NodeReport, job::JobSummary)> {
    // No held-out evaluation: the report is about the steps.
    (j.eval.every, j.data.heldout, j.data.heldout_size) = (0, None, 0);
    j.checkpoint.every = 0;
    j.validate("bench node")?;
    let summary = job::run(j, &JobOptions::default())?;
    let dir = summary.out_dir.clone();
    let names = device_names(&dir)?;
    let peak = peak.or_else(|| names.first().and_then(|n| peak_of(n)));
    let text = std::fs::read_to_string(dir.join("metrics.jsonl"))
        .with_context(|| format!("cannot read {}", dir.join("metrics.jsonl").display()))?;
    let lines: Vec<serde_json::Value> = text
        .lines()
        .enumerate()
        .map(|(i, l)| serde_json::from_str(l).with_context(|| format!("metrics.jsonl line {}", i + 1)))
        .collect::<Result<_>>()?;
    let (train_devs, gen_devs) = roles(j, names.len());
    let mut r = report(config, &names, &lines, warmup, peak, train_devs, gen_devs)?;
    let ledger_path = dir.join("ledger.json");
    if ledger_path.exists() {
        let text =
            std::fs::read_to_string(&ledger_path).with_context(|| format!("cannot read {}", ledger_path.display()))?;
        let rows: Vec<serde_json::Value> =
            serde_json::from_str(&text).with_context(|| format!("{}: not a launch ledger", ledger_path.display()))?;
        r.ledger_top = rows.into_iter().take(12).collect();
    }
    Ok((r, summary))
}

/// How many of `n` devices train and how many generate (colocated: all of them do both).
fn roles(j: &JobConfig, n: usize) -> (usize, usize) {
    match j.schedule.placement {
        crate::config::Placement::Split => {
            (n.saturating_sub(j.schedule.rollout_devices).max(1), j.schedule.rollout_devices.max(1))
        }
        _ => (n, n),
    }
}

/// The device names of the run's plan.json.
fn device_names(dir: &std::path::Path) -> Result<Vec<String>> {
    let p = dir.join("plan.json");
    let text = std::fs::read_to_string(&p).with_context(|| format!("cannot read {}", p.display()))?;
    let plan: Vec<serde_json::Value> =
        serde_json::from_str(&text).with_context(|| format!("{}: not a device plan", p.display()))?;
    Ok(plan.iter().map(|d| d["device"].as_str().unwrap_or("?").to_string()).collect())
}

/// The report over the metrics lines of steps after `warmup`.
pub fn report(
    config: &str,
    names: &[String],
    lines: &[serde_json::Value],
    warmup: u64,
    peak: Option<f64>,
    trainers: usize,
    generators: usize,
) -> Result<NodeReport> {
    let steady: Vec<&serde_json::Value> =
        lines.iter().filter(|l| l.get("loss").is_some() && l["step"].as_u64().unwrap_or(0) > warmup).collect();
    if steady.is_empty() {
        bail!("no step after the {warmup} warm-up step(s) to measure");
    }
    let k = steady.len() as f64;
    let f =
        |l: &serde_json::Value, path: &[&str]| -> f64 { path.iter().fold(l, |v, p| &v[*p]).as_f64().unwrap_or(0.0) };
    let mean = |path: &[&str]| steady.iter().map(|l| f(l, path)).sum::<f64>() / k;
    let t = |p: &str| mean(&["time", p]);
    let phases = Phases {
        rollout: t("rollout"),
        teacher: t("teacher"),
        reward: t("reward"),
        train: t("train"),
        collectives: t("collectives"),
        resync: t("resync"),
        wait: t("wait"),
        switch: t("switch"),
        kv_release: t("kv_release"),
        total: t("total"),
    };
    let devices = names.len().max(1);
    let gen: f64 = steady.iter().map(|l| f(l, &["gen_tokens"])).sum();
    let wall: f64 = steady.iter().map(|l| f(l, &["time", "total"])).sum();
    let flops: f64 = steady.iter().map(|l| f(l, &["train_flops"])).sum();
    let train_s: f64 = steady.iter().map(|l| f(l, &["time", "train"])).sum();
    let utilization = (0..devices)
        .map(|d| steady.iter().map(|l| l["utilization"][d].as_f64().unwrap_or(0.0)).sum::<f64>() / k)
        .collect();
    let mut ledger: Vec<LedgerPhase> = Vec::new();
    for l in &steady {
        let Some(phases) = l.get("ledger").and_then(|v| v.as_object()) else { continue };
        for (name, v) in phases {
            let i = match ledger.iter().position(|p| &p.phase == name) {
                Some(i) => i,
                None => {
                    ledger.push(LedgerPhase { phase: name.clone(), ..Default::default() });
                    ledger.len() - 1
                }
            };
            let p = &mut ledger[i];
            let g = |k: &str| v[k].as_f64().unwrap_or(0.0) / k_steps(steady.len());
            p.launches += g("launches");
            p.flops += g("flops");
            p.bytes += g("bytes");
            p.nvlink_bytes += g("nvlink_bytes");
            p.pcie_bytes += g("pcie_bytes");
            p.h200_s += g("h200_s");
            p.b300_s += g("b300_s");
        }
    }
    Ok(NodeReport {
        config: config.into(),
        devices,
        device_names: names.to_vec(),
        steps_measured: steady.len(),
        updates_per_hour: 3600.0 * k / wall.max(1e-12),
        gen_tokens_per_s_per_gpu: gen / wall.max(1e-12) / generators.max(1) as f64,
        train_mfu: peak.map(|p| flops / (train_s.max(1e-12) * trainers as f64 * p * 1e12)),
        peak_tflops: peak,
        phases,
        utilization,
        h2d_bytes: mean(&["transfer", "h2d_bytes"]),
        d2h_bytes: mean(&["transfer", "d2h_bytes"]),
        ledger,
        ledger_top: Vec::new(),
    })
}

fn k_steps(n: usize) -> f64 {
    n.max(1) as f64
}

/// The launch ledger's part of the printout: per phase (mean per measured step) and the run's
/// costliest operations (all `steps` steps, warm-up included); `only`: one modelled GPU's
/// column instead of both.
pub fn ledger_table(r: &NodeReport, steps: u64, only: Option<&str>) -> String {
    if r.ledger.is_empty() {
        return String::new();
    }
    let cols: Vec<(&str, usize)> =
        [("H200", 0), ("B300", 1)].into_iter().filter(|(g, _)| only.is_none_or(|o| o == *g)).collect();
    let secs = |p: &LedgerPhase, i: usize| if i == 0 { p.h200_s } else { p.b300_s };
    let mut t = String::from(
        "launch ledger (per step: what the launches declare from their shapes, and their roofline time on the \
         slowest device; a model, not a measurement)\n",
    );
    t.push_str("phase                launches   GFLOP      GB HBM   GB NVLink  MB PCIe");
    for (g, _) in &cols {
        t.push_str(&format!("  {g} ms   "));
    }
    t.push('\n');
    let mut total = LedgerPhase { phase: "step".into(), ..Default::default() };
    for p in &r.ledger {
        t.push_str(&format!(
            "{:<20} {:<10.0} {:<10.3} {:<8.4} {:<10.4} {:<8.3}",
            p.phase,
            p.launches,
            p.flops / 1e9,
            p.bytes / 1e9,
            p.nvlink_bytes / 1e9,
            p.pcie_bytes / 1e6
        ));
        for (_, i) in &cols {
            t.push_str(&format!("  {:<10.4}", 1e3 * secs(p, *i)));
        }
        t.push('\n');
        total.h200_s += p.h200_s;
        total.b300_s += p.b300_s;
    }
    t.push_str(&format!("{:<72}", "sum of the phases (nothing overlapped)"));
    for (_, i) in &cols {
        t.push_str(&format!("  {:<10.4}", 1e3 * secs(&total, *i)));
    }
    t.push('\n');
    if !r.ledger_top.is_empty() {
        t.push_str(&format!("costliest operations on an H200 over the run's {steps} steps (ledger.json):\n"));
        for row in &r.ledger_top {
            let s = |k: &str| row[k].as_str().unwrap_or("?").to_string();
            let f = |k: &str| row[k].as_f64().unwrap_or(0.0);
            t.push_str(&format!(
                "  {:<10} {:<13} {:<24} {:>8} launches ({:>7} replayed)  {:>9.3} GFLOP {:>9.4} GB  {:>9.4} ms\n",
                s("phase"),
                s("stream"),
                s("op"),
                f("launches"),
                f("replayed"),
                f("flops") / 1e9,
                f("bytes") / 1e9,
                1e3 * f("h200_s")
            ));
        }
    }
    t
}

/// The report as the table `bench node` prints.
pub fn table(r: &NodeReport) -> String {
    let p = &r.phases;
    let mut t = format!(
        "node report: {} on {} device(s) ({}), {} steps measured\n",
        r.config,
        r.devices,
        r.device_names.join(", "),
        r.steps_measured
    );
    t.push_str(&format!("updates/hour          {:.1}\n", r.updates_per_hour));
    t.push_str(&format!("gen tokens/s per GPU  {:.1}\n", r.gen_tokens_per_s_per_gpu));
    match (r.train_mfu, r.peak_tflops) {
        (Some(m), Some(pk)) => {
            t.push_str(&format!("train MFU             {:.2}% of {pk:.0} TFLOP/s BF16 per device\n", 100.0 * m))
        }
        _ => t.push_str("train MFU             - (no peak rate for this device; --peak-tflops sets one)\n"),
    }
    t.push_str("phase (s/step)        rollout  teacher  reward   train    (coll.)  resync   wait     switch   total\n");
    t.push_str(&format!(
        "                      {:<8.4} {:<8.4} {:<8.4} {:<8.4} {:<8.4} {:<8.4} {:<8.4} {:<8.4} {:<8.4}\n",
        p.rollout, p.teacher, p.reward, p.train, p.collectives, p.resync, p.wait, p.switch, p.total
    ));
    if p.kv_release > 0.0 {
        t.push_str(&format!(
            "KV release            {:.4} s/step of the switch (the plan frees the KV caches for training)\n",
            p.kv_release
        ));
    }
    let u: Vec<String> = r.utilization.iter().map(|u| format!("{:.0}%", 100.0 * u)).collect();
    t.push_str(&format!("utilization           {}\n", u.join(" ")));
    t.push_str(&format!("PCIe per step         {:.0} B up, {:.0} B down\n", r.h2d_bytes, r.d2h_bytes));
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The report's arithmetic on hand-made metrics lines: two steady steps of 2 s and 4 s
    /// after a warm-up step that must not count.
    #[test]
    fn the_report_averages_steady_steps_and_computes_mfu() {
        let line = |step: u64, total: f64, train: f64, gen: u64, flops: f64| {
            serde_json::json!({
                "step": step, "loss": 0.1, "gen_tokens": gen, "train_flops": flops,
                "time": {"rollout": total - train, "teacher": 0.0, "reward": 0.0, "train": train,
                         "collectives": 0.1, "resync": 0.0, "wait": 0.0, "switch": 0.0, "total": total},
                "utilization": [1.0, 0.5], "transfer": {"h2d_bytes": 100, "d2h_bytes": 10}
            })
        };
        let lines = vec![line(1, 100.0, 50.0, 1, 1.0), line(2, 2.0, 1.0, 400, 2e12), line(3, 4.0, 1.0, 800, 4e12)];
        let names = vec!["cuda:0".to_string(), "cuda:1".to_string()];
        let r = report("c", &names, &lines, 1, Some(1.0), 2, 2).unwrap();
        assert_eq!(r.steps_measured, 2);
        // 2 updates in 6 s.
        assert!((r.updates_per_hour - 1200.0).abs() < 1e-9, "{}", r.updates_per_hour);
        // 1200 tokens over 6 s over 2 GPUs.
        assert!((r.gen_tokens_per_s_per_gpu - 100.0).abs() < 1e-9);
        // 6e12 FLOPs over 2 s of training on 2 devices at 1 TFLOP/s each.
        assert!((r.train_mfu.unwrap() - 1.5).abs() < 1e-9);
        assert!((r.phases.train - 1.0).abs() < 1e-12 && (r.phases.total - 3.0).abs() < 1e-12);
        assert_eq!(r.utilization, vec![1.0, 0.5]);
        assert!(report("c", &names, &lines[..1], 1, None, 2, 2).is_err(), "nothing after the warm-up");
        // Split: one of the two generates, so its tokens/s are the whole step's.
        let split = report("c", &names, &lines, 1, Some(1.0), 1, 1).unwrap();
        assert!((split.gen_tokens_per_s_per_gpu - 200.0).abs() < 1e-9);
        assert!((split.train_mfu.unwrap() - 3.0).abs() < 1e-9);
        assert_eq!(peak_of("cuda-sim:0 (simulated H200, sm_90, kernels sm_90a)"), Some(989.0));
        assert_eq!(peak_of("cpu:2"), None);
        // CPU devices keep no ledger: the report has none and prints nothing for it.
        assert!(r.ledger.is_empty() && ledger_table(&r, 3, None).is_empty());
    }

    /// The ledger's part of the report: each phase's mean over the steady steps (the warm-up's
    /// numbers left out), and the table's columns for one modelled GPU or both.
    #[test]
    fn the_report_averages_the_ledger_per_phase() {
        let line = |step: u64, launches: u64, h200: f64| {
            serde_json::json!({
                "step": step, "loss": 0.1, "time": {"total": 1.0, "train": 0.5},
                "ledger": {
                    "train": {"launches": launches, "flops": 4e9, "bytes": 2e9, "nvlink_bytes": 0.0,
                              "pcie_bytes": 1e4, "h200_s": h200, "b300_s": h200 / 2.0},
                    "rollout": {"launches": 10, "flops": 0.0, "bytes": 1e9, "nvlink_bytes": 0.0,
                                "pcie_bytes": 0.0, "h200_s": 2e-4, "b300_s": 1e-4}
                }
            })
        };
        let lines = vec![line(1, 999, 9.0), line(2, 100, 1e-3), line(3, 300, 3e-3)];
        let r = report("c", &["cuda-sim:0".to_string()], &lines, 1, Some(989.0), 1, 1).unwrap();
        let train = r.ledger.iter().find(|p| p.phase == "train").unwrap();
        assert_eq!(train.launches, 200.0);
        assert!((train.h200_s - 2e-3).abs() <= 1e-15 && (train.b300_s - 1e-3).abs() <= 1e-15, "{train:?}");
        assert_eq!((train.flops, train.pcie_bytes), (4e9, 1e4));
        let both = ledger_table(&r, 3, None);
        assert!(both.contains("H200 ms") && both.contains("B300 ms"), "{both}");
        // The phases' sum: 2.2 ms on the H200.
        assert!(both.contains("2.2000"), "{both}");
        let one = ledger_table(&r, 3, Some("B300"));
        assert!(one.contains("B300 ms") && !one.contains("H200 ms"), "{one}");
    }
}
