//! `colotrain admit`: the offline admission check of candidate rollout engines.

use crate::config::JobConfig;
use crate::data::dataset::Dataset;
use crate::device::{DType, Device};
use crate::mismatch::admit::{self, Settings, Student};
use crate::model::calib::Calibration;
use crate::model::LoadedModel;
use anyhow::{bail, Context, Result};
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The run's config (student, data, rollout temperature and length).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Candidate engines: RECIPE[+KEEP...][@KV_SCALE] (e.g. fp8+first-layer+last-layer,
    /// fp8-kv@1, nvfp4+first-layer-kv) or noise=SIGMA. Repeatable.
    #[arg(long, required = true)]
    pub candidate: Vec<String>,
    /// Prompts (held-out when the config has them).
    #[arg(long, default_value_t = 16)]
    pub prompts: usize,
    #[arg(long, default_value_t = 2)]
    pub samples: u32,
    #[arg(long, default_value_t = 777)]
    pub seed: u64,
    /// Safety margin α of Eq. 6 (at least 1).
    #[arg(long, default_value_t = 1.5)]
    pub alpha: f64,
    /// Admission line L (nats/token, positive).
    #[arg(long, default_value_t = 0.184)]
    pub line: f64,
    #[arg(long, default_value_t = 10000)]
    pub reps: usize,
    /// Attribute D̂ to layers and to the first layer's keys vs values.
    #[arg(long)]
    pub per_layer: bool,
    /// Reuse calibrated scales instead of calibrating.
    #[arg(long)]
    pub calibration: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
}

/// The flags' ranges, checked before anything is loaded.
fn validate(a: &Args) -> Result<()> {
    if a.prompts == 0 {
        bail!("--prompts must be at least 1, got 0");
    }
    if a.samples == 0 {
        bail!("--samples must be at least 1, got 0");
    }
    if a.reps == 0 {
        bail!("--reps (bootstrap resamples) must be at least 1, got 0");
    }
    if !(a.alpha >= 1.0 && a.alpha.is_finite()) {
        bail!("--alpha is the safety margin of Eq. 6 and must be a finite number >= 1, got {}", a.alpha);
    }
    if !(a.line > 0.0 && a.line.is_finite()) {
        bail!("--line is the admission line L in nats/token and must be a positive finite number, got {}", a.line);
    }
    Ok(())
}

pub fn run(a: Args) -> Result<()> {
    validate(&a)?;
    let job = match &a.config {
        Some(p) => JobConfig::from_file(p)?,
        None => JobConfig::from_toml(super::train::TINY_OPD, "built-in configs/tiny-opd.toml")?,
    };
    let dev = Device::parse(&job.run.device)?;
    let dir = crate::orchestrator::tiny::resolve(&job.model.path)?;
    let dtype = match job.model.dtype.as_deref() {
        Some(d) => DType::parse(d)?,
        None if dev.is_cpu() => DType::F32,
        None => DType::BF16,
    };
    let lm =
        LoadedModel::load(&dir, &dev, dtype).with_context(|| format!("loading the student '{}'", job.model.path))?;
    let candidates: Vec<admit::Candidate> = a
        .candidate
        .iter()
        .map(|c| admit::parse_candidate(c, lm.cfg.num_layers, job.engine.noise_seed))
        .collect::<Result<_>>()?;
    let data = Dataset::open(&job.data.train, lm.text.clone(), job.data.chat, lm.cfg.vocab_size, job.run.seed)?;
    let mut prompts = match &job.data.heldout {
        Some(h) => {
            Dataset::open(h, lm.text.clone(), job.data.chat, lm.cfg.vocab_size, job.run.seed)?.heldout(usize::MAX)?
        }
        None => data.heldout(a.prompts)?,
    };
    prompts.truncate(a.prompts);
    let s = Settings {
        samples: a.samples,
        seed: a.seed,
        temperature: job.rollout.temperature,
        max_new_tokens: job.rollout.max_new_tokens,
        alpha: a.alpha,
        line: a.line,
        reps: a.reps,
    };
    let needs = candidates.iter().any(|c| c.spec.recipe.needs_calibration());
    let calib = match (&a.calibration, needs) {
        (Some(p), _) => Some(Calibration::load(p, &lm.cfg)?),
        (None, true) => {
            let cp = data.train_prompts(u64::MAX >> 1, job.engine.calibration_samples)?;
            let mut e =
                crate::engine::Engine::new(&dev, &lm.cfg, lm.weights.dtype(), &Default::default(), lm.text.clone())?;
            let sc = crate::engine::SamplingConfig {
                temperature: job.rollout.temperature,
                max_new_tokens: job.rollout.max_new_tokens,
                ..Default::default()
            };
            Some(crate::train::calibrate::calibrate(&mut e, &lm.weights, &lm.cfg, &cp, &sc, job.run.seed)?)
        }
        (None, false) => None,
    };
    let st = Student { dev: &dev, cfg: &lm.cfg, w: &lm.weights, text: lm.text.clone(), calib: calib.as_ref() };
    let (floor, verdicts) = admit::check(&st, &candidates, &prompts, &s, a.per_layer)?;
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(
                &serde_json::json!({"floor": floor, "alpha": a.alpha, "line": a.line, "candidates": verdicts})
            )?
        );
        return Ok(());
    }
    println!(
        "admission check: {} prompts x {} samples (seed {}), alpha = {}, L = {} nats/token (admit iff alpha*D < L)",
        prompts.len(),
        a.samples,
        a.seed,
        a.alpha,
        a.line
    );
    println!("{:<34} {:>11} {:>24} {:>8}", "engine", "D (nats)", "95% interval", "verdict");
    println!(
        "{:<34} {:>11.5} {:>24} {:>8}",
        "standard vs itself (floor)",
        floor.d_hat,
        format!("[{:.5}, {:.5}]", floor.lo, floor.hi),
        "-"
    );
    for v in &verdicts {
        let e = &v.estimate;
        println!(
            "{:<34} {:>11.5} {:>24} {:>8}",
            v.candidate,
            e.d_hat,
            format!("[{:.5}, {:.5}]", e.lo, e.hi),
            if v.admit { "admit" } else { "reject" }
        );
        if let Some(p) = &v.per_layer {
            let layers: Vec<String> = p.layers.iter().map(|x| format!("{x:.4}")).collect();
            println!("    per layer (that layer alone): {}", layers.join(" "));
            if let Some(sh) = p.first_layer_share {
                println!("    first layer's KV cache share (A-B)/(A-F): {sh:.3}");
            }
            if let (Some(k), Some(vv)) = (p.first_keys, p.first_values) {
                println!(
                    "    first layer keys only {k:.5}, values only {vv:.5}{}",
                    p.keys_share.map(|x| format!(", keys share {x:.3}")).unwrap_or_default()
                );
            }
        }
    }
    Ok(())
}
