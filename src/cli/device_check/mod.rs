//! `colotrain device-check`: on a GPU machine (or on the simulated GPU, `--device cuda-sim:K`),
//! compares every CUDA op with its CPU twin (`checks`), then times GEMMs, decode and the
//! in-place resync (`timings`). bench/device_check.sh runs it.
//!
//! Built to survive its first run on a new GPU: every group runs in a child process of its own
//! (this binary with the hidden `--worker GROUP`), so a failing, crashing or hanging group is
//! reported and the next one starts on a fresh context; the check groups run with
//! `COLOTRAIN_CUDA_SYNC=1` (a fault is reported at the kernel that caused it), the timing
//! groups without it. Rows are printed as they are measured, and the JSON report is rewritten
//! (write, fsync, rename) after every group, so a run stopped from outside keeps what it had.
//!
//! Owns: the group sequence, the child processes and the report. May call: `checks`,
//! `timings`, the device. Must not: compare or time anything itself.

mod checks;
mod engine_checks;
mod gemm_checks;
mod learner_checks;
mod node_timing;
mod prep_checks;
mod timings;
mod train_checks;

use crate::device::cuda::CudaDevice;
use crate::device::DeviceSpec;
use anyhow::{anyhow, bail, Context, Result};
use checks::Check;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The GPU: a CUDA ordinal (0), cuda:K, or cuda-sim:K (the simulated GPU: the checks only).
    #[arg(long, default_value = "0")]
    pub device: String,
    /// Where to write the JSON report.
    #[arg(long, default_value = "device_check.json")]
    pub out: PathBuf,
    /// Only compare the ops with their CPU twins (no timings).
    #[arg(long)]
    pub checks_only: bool,
    /// Run only these groups (comma-separated; `--list` names them).
    #[arg(long, value_delimiter = ',')]
    pub groups: Vec<String>,
    /// List the groups and exit.
    #[arg(long)]
    pub list: bool,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Iterations per GEMM timing.
    #[arg(long, default_value_t = 20)]
    pub iters: usize,
    /// Decode steps per batch size.
    #[arg(long, default_value_t = 16)]
    pub decode_steps: usize,
    /// Seconds one group may run before it is stopped and reported as hung.
    #[arg(long, default_value_t = 240)]
    pub group_timeout: u64,
    /// Internal: run one group in this process and write its part of the report to --out.
    #[arg(long, hide = true)]
    pub worker: Option<String>,
    /// Internal (tests): the worker of this group aborts, as a crashing kernel would.
    #[arg(long, hide = true)]
    pub inject_crash: Option<String>,
}

/// What one group's child process reports.
#[derive(Serialize, Deserialize, Default)]
struct Part {
    gpu: String,
    simulated: bool,
    checks: Vec<Check>,
    timings: Option<serde_json::Value>,
    /// The allocator's peak bytes during the group.
    peak_bytes: usize,
    error: Option<String>,
}

/// One group's line in the report.
#[derive(Serialize)]
struct GroupResult {
    name: String,
    kind: &'static str,
    /// ok, failed (a check failed), error, crashed, hung, skipped.
    status: String,
    seconds: f64,
    checks: usize,
    failed_checks: usize,
    peak_bytes: usize,
    note: String,
}

/// The device spelling the children get: `0` and `cuda:0` mean the GPU, `cuda-sim:0` the
/// simulator.
fn device_spec(s: &str) -> Result<(String, bool)> {
    let spec = if s.chars().all(|c| c.is_ascii_digit()) && !s.is_empty() { format!("cuda:{s}") } else { s.into() };
    match DeviceSpec::parse(&spec) {
        Ok(DeviceSpec::Cuda { ordinal }) => Ok((format!("cuda:{}", ordinal.unwrap_or(0)), false)),
        Ok(DeviceSpec::CudaSim { ordinal }) => Ok((format!("cuda-sim:{}", ordinal.unwrap_or(0)), true)),
        _ => bail!("--device '{s}': expected a CUDA ordinal (0), cuda:K or cuda-sim:K"),
    }
}

fn open(spec: &str) -> Result<CudaDevice> {
    match DeviceSpec::parse(spec)? {
        DeviceSpec::Cuda { ordinal } => CudaDevice::new(ordinal.unwrap_or(0)),
        DeviceSpec::CudaSim { ordinal } => CudaDevice::sim(ordinal.unwrap_or(0)),
        DeviceSpec::Cpu { .. } => bail!("device-check compares a CUDA device with the CPU, not the CPU with itself"),
    }
}

pub fn run(a: Args) -> Result<()> {
    if a.iters == 0 || a.decode_steps == 0 {
        bail!("--iters and --decode-steps must be at least 1");
    }
    let (spec, simulated) = device_spec(&a.device)?;
    if let Some(group) = &a.worker {
        return worker(&a, &spec, group);
    }
    let all: Vec<(&str, &str, &'static str)> = checks::GROUPS
        .iter()
        .map(|g| (g.0, g.1, "check"))
        .chain(timings::GROUPS.iter().map(|g| (g.0, g.1, "timing")))
        .collect();
    if a.list {
        for (name, what, kind) in &all {
            println!("{name:<14} {kind:<7} {what}");
        }
        return Ok(());
    }
    for g in &a.groups {
        if !all.iter().any(|x| x.0 == g) {
            let names: Vec<&str> = all.iter().map(|x| x.0).collect();
            bail!("--groups: no group '{g}' (the groups: {})", names.join(", "));
        }
    }
    let chosen: Vec<_> = all
        .into_iter()
        .filter(|g| a.groups.is_empty() || a.groups.iter().any(|x| x == g.0))
        .filter(|g| !(a.checks_only && g.2 == "timing"))
        .collect();
    let exe = std::env::current_exe().context("finding this colotrain binary to run the groups")?;
    let parts = a.out.with_extension("parts");
    std::fs::create_dir_all(&parts).with_context(|| format!("creating {}", parts.display()))?;
    let built = crate::device::cuda::BUILT_ARCHS;
    println!(
        "device-check on {spec}{} (this binary: cubins for {}); each group in its own process",
        if simulated { ", a simulated GPU: the glue and kernels run on the host, not a GPU run" } else { "" },
        if built.is_empty() { "no GPU (built without --features cuda)".to_string() } else { built.join(", ") }
    );
    let mut report = Report { device: spec.clone(), simulated, ..Default::default() };
    let mut printed_header = false;
    for (name, what, kind) in chosen {
        println!("\n== {name}: {what}");
        if kind == "check" && !printed_header {
            println!("{}", Check::header());
            printed_header = true;
        }
        let part_file = parts.join(format!("{name}.json"));
        let _ = std::fs::remove_file(&part_file);
        let t = Instant::now();
        let status = run_child(&exe, &a, &spec, name, kind, &part_file);
        let part: Option<Part> = std::fs::read(&part_file).ok().and_then(|b| serde_json::from_slice::<Part>(&b).ok());
        let mut g = GroupResult {
            name: name.into(),
            kind,
            status: String::new(),
            seconds: t.elapsed().as_secs_f64(),
            checks: 0,
            failed_checks: 0,
            peak_bytes: 0,
            note: String::new(),
        };
        match (&status, part) {
            (Ok(()), Some(p)) if p.error.is_none() => {
                g.checks = p.checks.len();
                g.failed_checks = p.checks.iter().filter(|c| c.pass == Some(false)).count();
                g.status = if g.failed_checks > 0 { "failed".into() } else { "ok".into() };
                if kind == "timing" && p.timings.is_none() {
                    g.status = "skipped".into();
                    g.note = "a simulated GPU has no timings".into();
                }
                report.absorb(name, p, &mut g);
            }
            (_, Some(p)) if p.error.is_some() => {
                g.status = "error".into();
                g.note = p.error.clone().unwrap_or_default();
                g.checks = p.checks.len();
                g.failed_checks = p.checks.iter().filter(|c| c.pass == Some(false)).count();
                report.absorb(name, p, &mut g);
            }
            (Err(e), _) => {
                let e = format!("{e:#}");
                g.status = if e.contains("stopped after") { "hung".into() } else { "crashed".into() };
                g.note = e;
            }
            (Ok(()), _) => {
                g.status = "crashed".into();
                g.note = format!("the group's process left no readable report at {}", part_file.display());
            }
        }
        println!(
            "== {name}: {} in {:.1} s{}",
            g.status,
            g.seconds,
            if g.note.is_empty() { String::new() } else { format!(" ({})", g.note) }
        );
        report.groups.push(g);
        report.write(&a.out)?;
    }
    let _ = std::fs::remove_dir_all(&parts);
    let failed_checks = report.checks.iter().filter(|c| c.pass == Some(false)).count();
    let bad_groups: Vec<&str> = report
        .groups
        .iter()
        .filter(|g| !matches!(g.status.as_str(), "ok" | "skipped"))
        .map(|g| g.name.as_str())
        .collect();
    println!(
        "\n{} checks, {failed_checks} failed; groups not ok: {}",
        report.checks.len(),
        if bad_groups.is_empty() { "none".to_string() } else { bad_groups.join(", ") }
    );
    println!("report written to {}", a.out.display());
    if failed_checks > 0 || !bad_groups.is_empty() {
        bail!(
            "device-check failed: {failed_checks} of {} op checks failed; groups not ok: {}",
            report.checks.len(),
            bad_groups.join(", ")
        );
    }
    Ok(())
}

/// Runs one group in a child process, its output streamed through ours; an error when the
/// child was killed by a signal or ran past the group timeout.
fn run_child(exe: &Path, a: &Args, spec: &str, name: &str, kind: &str, part: &Path) -> Result<()> {
    let mut cmd = Command::new(exe);
    cmd.arg("device-check")
        .args(["--device", spec, "--worker", name, "--seed", &a.seed.to_string()])
        .args(["--iters", &a.iters.to_string(), "--decode-steps", &a.decode_steps.to_string()])
        .arg("--out")
        .arg(part)
        .stdin(Stdio::null());
    if let Some(c) = &a.inject_crash {
        cmd.args(["--inject-crash", c]);
    }
    if kind == "check" {
        cmd.env("COLOTRAIN_CUDA_SYNC", "1");
    } else {
        cmd.env_remove("COLOTRAIN_CUDA_SYNC");
    }
    let mut child = cmd.spawn().with_context(|| format!("starting {} for group {name}", exe.display()))?;
    let limit = Duration::from_secs(a.group_timeout.max(1));
    let t = Instant::now();
    loop {
        if let Some(st) = child.try_wait()? {
            return match st.code() {
                Some(_) => Ok(()),
                None => {
                    #[cfg(unix)]
                    let sig = std::os::unix::process::ExitStatusExt::signal(&st).unwrap_or(0);
                    #[cfg(not(unix))]
                    let sig = 0;
                    Err(anyhow!("the group's process was killed by signal {sig}"))
                }
            };
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            bail!("stopped after {} s (--group-timeout)", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One group in this process: its rows printed as they come, its part written to `a.out`.
/// Exits with an error only when the part cannot be written.
fn worker(a: &Args, spec: &str, group: &str) -> Result<()> {
    let mut part = Part { simulated: spec.starts_with("cuda-sim"), ..Default::default() };
    let r = (|| -> Result<()> {
        let d = open(spec)?;
        part.gpu =
            format!("{} (compute capability {}.{})", d.name(), d.compute_capability().0, d.compute_capability().1);
        if a.inject_crash.as_deref() == Some(group) {
            eprintln!("device-check: --inject-crash {group}: aborting");
            std::process::abort();
        }
        if checks::GROUPS.iter().any(|g| g.0 == group) {
            let rows = checks::run_group(group, &d, a.seed);
            match rows {
                Ok(rows) => part.checks = rows,
                Err(e) => return Err(e),
            }
        } else if !part.simulated || group == "node" {
            // `node` runs on the simulator too, at a tiny shape: there its seconds are the host's,
            // and what it checks is the job's glue on a CUDA device and the model's column.
            part.timings = Some(timings::run_group(group, &d, a.iters, a.decode_steps)?);
        } else {
            println!("skip: a simulated GPU has no timings");
        }
        d.synchronize()?;
        part.peak_bytes = d.memory().2;
        Ok(())
    })();
    if let Err(e) = r {
        eprintln!("device-check {group}: {e:#}");
        part.error = Some(format!("{e:#}"));
    }
    crate::util::write_atomic(&a.out, &serde_json::to_vec(&part)?)
}

#[derive(Serialize, Default)]
struct Report {
    device: String,
    gpu: String,
    simulated: bool,
    built_archs: Vec<String>,
    groups: Vec<GroupResult>,
    checks: Vec<Check>,
    /// Each timing group's rows, under the group's name.
    timings: std::collections::BTreeMap<String, serde_json::Value>,
}

impl Report {
    fn absorb(&mut self, name: &str, p: Part, g: &mut GroupResult) {
        if self.gpu.is_empty() {
            self.gpu = p.gpu;
        }
        g.peak_bytes = p.peak_bytes;
        self.checks.extend(p.checks);
        if let Some(t) = p.timings {
            self.timings.insert(name.into(), t);
        }
    }

    fn write(&mut self, path: &Path) -> Result<()> {
        self.built_archs = crate::device::cuda::BUILT_ARCHS.iter().map(|s| s.to_string()).collect();
        crate::util::write_atomic(path, &serde_json::to_vec_pretty(self)?)
    }
}
