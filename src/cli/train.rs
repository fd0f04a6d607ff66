//! `colotrain train`: the main job. No --config runs the built-in tiny OPD job
//! (configs/tiny-opd.toml, embedded).

use crate::config::JobConfig;
use crate::orchestrator::{self as job, JobOptions};
use anyhow::Result;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub const TINY_OPD: &str = include_str!("../../configs/tiny-opd.toml");

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Job config (TOML). Default: the built-in tiny OPD job.
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

pub fn run(a: Args) -> Result<()> {
    let mut job = match &a.config {
        Some(p) => JobConfig::from_file(p)?,
        None => JobConfig::from_toml(TINY_OPD, "built-in configs/tiny-opd.toml")?,
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
    let opts =
        JobOptions { resume: a.resume, progress: std::io::stderr().is_terminal(), stop: Some(stop), fault: None };
    let s = job::run(&job, &opts)?;
    if a.print_metrics {
        print!("{}", std::fs::read_to_string(s.out_dir.join("metrics.jsonl"))?);
    }
    println!("{}", job::summary_table(&s));
    println!("metrics: {}", s.out_dir.join("metrics.jsonl").display());
    Ok(())
}
