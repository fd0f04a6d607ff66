//! Reading finished runs: their config, metrics lines and held-out evaluations, and comparing
//! them (Δ against a reference at the same step, the mismatch level D over a step window).

use super::eval::EvalResult;
use crate::config::JobConfig;
use crate::mismatch::budget::{self, Delta};
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// Steps with a held-out evaluation in run directory `dir` (eval/step-NNNNNN.json), in order.
pub fn eval_steps_in(dir: &Path) -> Vec<u64> {
    let mut v: Vec<u64> = std::fs::read_dir(dir.join("eval"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| {
                    e.file_name()
                        .to_string_lossy()
                        .strip_prefix("step-")
                        .and_then(|s| s.strip_suffix(".json"))
                        .and_then(|s| s.parse().ok())
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// The held-out evaluations of run directory `dir` at steps ≤ `step` (a resumed run's summary
/// starts from its first evaluation, not from the resume).
pub fn evals_up_to(dir: &Path, step: u64) -> Result<Vec<EvalResult>> {
    eval_steps_in(dir)
        .into_iter()
        .filter(|&s| s <= step)
        .map(|s| {
            let p = dir.join("eval").join(format!("step-{s:06}.json"));
            let text = std::fs::read_to_string(&p).with_context(|| format!("cannot read {}", p.display()))?;
            serde_json::from_str(&text).with_context(|| format!("{}: not a held-out evaluation", p.display()))
        })
        .collect()
}

pub struct RunDir {
    pub path: PathBuf,
    pub config: JobConfig,
    pub metrics: Vec<Value>,
}

impl RunDir {
    pub fn open(path: &Path) -> Result<RunDir> {
        let cp = path.join("config.toml");
        let config = JobConfig::from_file(&cp)
            .with_context(|| format!("{} is not a colotrain run directory", path.display()))?;
        let mp = path.join("metrics.jsonl");
        let metrics = crate::util::read_jsonl(&mp)?.into_iter().map(|(_, v)| v).collect();
        Ok(RunDir { path: path.to_path_buf(), config, metrics })
    }

    pub fn name(&self) -> String {
        self.path
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_else(|| self.path.display().to_string())
    }

    /// Steps with a held-out evaluation on disk.
    pub fn eval_steps(&self) -> Vec<u64> {
        eval_steps_in(&self.path)
    }

    pub fn eval_at(&self, step: u64) -> Result<EvalResult> {
        let p = self.path.join("eval").join(format!("step-{step:06}.json"));
        if !p.exists() {
            bail!(
                "run {} has no held-out evaluation at step {step} (evaluated at steps {:?})",
                self.path.display(),
                self.eval_steps()
            );
        }
        let text = std::fs::read_to_string(&p).with_context(|| format!("cannot read {}", p.display()))?;
        serde_json::from_str(&text).with_context(|| format!("{}: not an evaluation file", p.display()))
    }

    /// D(c): the mean of d_n over steps 1..=upto (seed 000 §3.1).
    pub fn mismatch_level(&self, upto: u64) -> Option<f64> {
        let v: Vec<f64> = self
            .metrics
            .iter()
            .filter(|m| m.get("step").and_then(|s| s.as_u64()).map(|s| s >= 1 && s <= upto).unwrap_or(false))
            .filter_map(|m| m.get("mismatch").and_then(|x| x.get("d_n")).and_then(|d| d.as_f64()))
            .collect();
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    }
}

/// Δ of `run` against `reference` (same step), refusing comparisons across different students,
/// teachers or held-out sets.
pub fn compare(run: &EvalResult, reference: &EvalResult, tau: f64, reps: usize) -> Result<Delta> {
    if run.heldout != reference.heldout || run.kl_per_problem.len() != reference.kl_per_problem.len() {
        bail!(
            "the runs were evaluated on different held-out sets (fingerprints {} and {}); Δ compares the same problems",
            run.heldout,
            reference.heldout
        );
    }
    if run.student != reference.student || run.teacher != reference.teacher {
        bail!(
            "the runs train different students or teachers ({} / {} vs {} / {}); Δ compares runs of one student",
            run.student,
            run.teacher,
            reference.student,
            reference.teacher
        );
    }
    if run.step != reference.step {
        bail!("evaluations at different steps ({} vs {})", run.step, reference.step);
    }
    if run.kl_per_problem.is_empty() {
        bail!("empty held-out evaluation");
    }
    Ok(budget::delta(&run.kl_per_problem, &reference.kl_per_problem, tau, reps, 0xB007))
}
