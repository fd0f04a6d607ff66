//! `colotrain train`: the main job. No --config runs the built-in tiny OPD job
//! (configs/tiny-opd.toml, embedded).

use crate::config::JobConfig;
use crate::orchestrator::{self as job, JobOptions};
use crate::train::checkpoint;
use anyhow::{bail, Result};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub const TINY_OPD: &str = include_str!("../../configs/tiny-opd.toml");

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Job config (TOML). Default: the built-in tiny OPD job, or with --resume the run's own
    /// config.toml.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Continue from a checkpoint directory, or from a run directory's newest checkpoint.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Override run.steps.
    #[arg(long)]
    pub steps: Option<u64>,
    /// Override run.out_dir.
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
    /// Override run.name.
    #[arg(long)]
    pub name: Option<String>,
    /// Override run.device.
    #[arg(long)]
    pub device: Option<String>,
    /// Override run.devices (how many devices to use; 0: all visible GPUs, 1 CPU device).
    #[arg(long)]
    pub devices: Option<usize>,
    /// Also print each step's metrics line on stdout.
    #[arg(long)]
    pub print_metrics: bool,
}

/// The run directory of `--resume PATH` (a run directory, or one of its checkpoint-N).
fn run_dir_of(path: &Path) -> Result<PathBuf> {
    if path.join("config.toml").exists() {
        return Ok(path.to_path_buf());
    }
    if path.join(checkpoint::STATE_FILE).exists() {
        if let Some(parent) = path.parent().filter(|p| p.join("config.toml").exists()) {
            return Ok(parent.to_path_buf());
        }
    }
    bail!(
        "--resume {}: no config.toml there or in its parent (not a run directory or one of its checkpoints); pass the run's --config",
        path.display()
    )
}

pub fn run(a: Args) -> Result<()> {
    let mut job = match (&a.config, &a.resume) {
        (Some(p), _) => JobConfig::from_file(p)?,
        // Resuming without --config: the run's own config, kept in its directory (and the run
        // continues there, wherever the directory now is).
        (None, Some(r)) => {
            let dir = run_dir_of(r)?;
            let cp = dir.join("config.toml");
            let mut j = JobConfig::from_file(&cp)?;
            j.run.out_dir = Some(dir);
            eprintln!("resuming with the run's own {}", cp.display());
            j
        }
        (None, None) => JobConfig::from_toml(TINY_OPD, "built-in configs/tiny-opd.toml")?,
    };
    if let Some(s) = a.steps {
        job.run.steps = s;
    }
    if let Some(d) = a.out_dir {
        job.run.out_dir = Some(d);
    }
    if let Some(n) = a.name {
        job.run.name = n;
    }
    if let Some(d) = a.device {
        job.run.device = d;
    }
    if let Some(n) = a.devices {
        job.run.devices = n;
    }
    job.validate("command line")?;
    // Ctrl-C once: finish the step, write a checkpoint, exit. Twice: leave at once (the last
    // checkpoint is whole: checkpoints are written aside and renamed into place).
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    let handler = ctrlc::set_handler(move || {
        if s2.swap(true, Ordering::SeqCst) {
            eprintln!("\ninterrupted again: leaving now; the last checkpoint is intact");
            std::process::exit(130);
        }
        eprintln!("\ninterrupt: finishing this step and writing a checkpoint (Ctrl-C again to leave at once)");
    });
    if let Err(e) = handler {
        tracing::warn!(
            "cannot install the Ctrl-C handler ({e}); an interrupt stops the run without a final checkpoint"
        );
    }
    let opts = JobOptions {
        resume: a.resume,
        progress: std::io::stderr().is_terminal(),
        stop: Some(stop),
        fault: None,
        view_fault: None,
    };
    let s = job::run(&job, &opts)?;
    if a.print_metrics {
        print!("{}", std::fs::read_to_string(s.out_dir.join("metrics.jsonl"))?);
    }
    println!("{}", job::summary_table(&s));
    println!("metrics: {}", s.out_dir.join("metrics.jsonl").display());
    Ok(())
}
