//! `colotrain train`: the main job. No --config runs the built-in tiny OPD job
//! (configs/tiny-opd.toml, embedded).

use crate::config::JobConfig;
use crate::train::job::{self, JobOptions};
use anyhow::Result;
use std::io::IsTerminal;
use std::path::PathBuf;

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
    job.validate("command line")?;
    let opts = JobOptions { resume: a.resume, progress: std::io::stderr().is_terminal() };
    let s = job::run(&job, &opts)?;
    if a.print_metrics {
        print!("{}", std::fs::read_to_string(s.out_dir.join("metrics.jsonl"))?);
    }
    println!("{}", job::summary_table(&s));
    println!("metrics: {}", s.out_dir.join("metrics.jsonl").display());
    Ok(())
}
