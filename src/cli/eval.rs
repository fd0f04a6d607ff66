//! `colotrain eval`: held-out KL and accuracy of a checkpoint (optionally Δ against a reference
//! run at the same step, with the primary rule), or `--budget`: the runs' mismatch levels, their
//! verdicts and the empirical bracket B_emp(τ).

use crate::data::dataset::Dataset;
use crate::device::{DType, Device};
use crate::engine::{Engine, EngineConfig};
use crate::mismatch::budget;
use crate::model::LoadedModel;
use crate::train::eval;
use crate::train::runs::{self, RunDir};
use anyhow::{bail, Context, Result};
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// A checkpoint directory to evaluate.
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// The teacher (default with --reference: the reference run's teacher).
    #[arg(long)]
    pub teacher: Option<PathBuf>,
    /// Held-out prompts (JSONL with "answer") or builtin:arith (default with --reference: the
    /// reference run's held-out set).
    #[arg(long)]
    pub heldout: Option<String>,
    /// Problems drawn for builtin:arith [default: 128, or the reference run's].
    #[arg(long)]
    pub heldout_size: Option<usize>,
    /// A reference run (directory) to compare with at the same step.
    #[arg(long)]
    pub reference: Option<PathBuf>,
    /// Runs whose budget to bracket (with --reference).
    #[arg(long, num_args = 1..)]
    pub budget: Vec<PathBuf>,
    /// Step to compare at (default: the checkpoint's step, or the last step every run evaluated).
    #[arg(long)]
    pub step: Option<u64>,
    #[arg(long, default_value_t = 0.20)]
    pub tau: f64,
    #[arg(long, default_value_t = 10000)]
    pub reps: usize,
    /// Samples per problem [default: 4, or the reference run's eval.samples_per_prompt].
    #[arg(long)]
    pub samples: Option<u32>,
    /// [default: 64, or the reference run's evaluation length]
    #[arg(long)]
    pub max_new_tokens: Option<usize>,
    /// Sampling seed [default: 20261101, or the reference run's eval.seed].
    #[arg(long)]
    pub seed: Option<u64>,
    #[arg(long, default_value = "cpu")]
    pub device: String,
    #[arg(long)]
    pub json: bool,
    /// With --budget: also run the offline admission check on each run's rollout engine
    /// (untrained student, 16 prompts × 2 samples) and print its prediction next to the outcome.
    #[arg(long)]
    pub admit: bool,
    /// Admission margin α and line L (nats/token); without --line, the lower end of this
    /// table's own bracket B_emp (the offline check judged against the budget these runs found).
    #[arg(long, default_value_t = 1.5)]
    pub alpha: f64,
    #[arg(long)]
    pub line: Option<f64>,
}

/// How a checkpoint is evaluated: the flags given, else (with --reference) what the reference
/// run evaluated with, so that the two are comparable by default, else the defaults.
struct Settings {
    teacher: PathBuf,
    heldout: String,
    heldout_size: usize,
    chat: bool,
    samples: u32,
    max_new_tokens: usize,
    seed: u64,
}

fn settings(a: &Args) -> Result<Settings> {
    let job = match &a.reference {
        Some(r) => {
            let p = r.join("config.toml");
            Some(
                crate::config::JobConfig::from_file(&p)
                    .with_context(|| format!("--reference {}: reading its config", r.display()))?,
            )
        }
        None => None,
    };
    let j = job.as_ref();
    let teacher = match (&a.teacher, j.and_then(|j| j.teacher.as_ref())) {
        (Some(t), _) => t.clone(),
        (None, Some(t)) => PathBuf::from(&t.path),
        (None, None) => bail!("--teacher DIR is required to measure held-out KL"),
    };
    let heldout = match (&a.heldout, j) {
        (Some(h), _) => h.clone(),
        (None, Some(j)) => j.data.heldout.clone().unwrap_or_else(|| j.data.train.clone()),
        (None, None) => bail!("--heldout FILE (or builtin:arith) is required"),
    };
    Ok(Settings {
        teacher,
        heldout,
        // A run with data.heldout evaluates all of that set; without, data.heldout_size of its
        // training data's held-out problems (as `orchestrator::coordinator::start` does).
        heldout_size: a
            .heldout_size
            .or(j.map(|j| if j.data.heldout.is_some() { usize::MAX } else { j.data.heldout_size }))
            .unwrap_or(128),
        chat: j.map(|j| j.data.chat).unwrap_or(false),
        samples: a.samples.or(j.map(|j| j.eval.samples_per_prompt as u32)).unwrap_or(4),
        max_new_tokens: a
            .max_new_tokens
            .or(j.map(|j| j.eval.max_new_tokens.unwrap_or(j.rollout.max_new_tokens)))
            .unwrap_or(64),
        seed: a.seed.or(j.map(|j| j.eval.seed)).unwrap_or(20261101),
    })
}

pub fn run(a: Args) -> Result<()> {
    if !a.budget.is_empty() {
        return run_budget(&a);
    }
    let ck = a.checkpoint.as_ref().context("give --checkpoint DIR (or --budget RUN... --reference RUN)")?;
    let set = settings(&a)?;
    let (tdir, hspec) = (&set.teacher, &set.heldout);
    if set.samples == 0 || set.max_new_tokens == 0 {
        bail!("--samples and --max-new-tokens must be at least 1");
    }
    let dev = Device::parse(&a.device)?;
    let dtype = if dev.is_cpu() { DType::F32 } else { DType::BF16 };
    let st = LoadedModel::load(ck, &dev, dtype)?;
    let te = LoadedModel::load(&crate::orchestrator::tiny::resolve(&tdir.display().to_string())?, &dev, dtype)?;
    if st.cfg.vocab_size != te.cfg.vocab_size {
        bail!("student and teacher vocabularies differ ({} vs {})", st.cfg.vocab_size, te.cfg.vocab_size);
    }
    let prompts = Dataset::open(hspec, st.text.clone(), set.chat, st.cfg.vocab_size, 0)?.heldout(set.heldout_size)?;
    if prompts.is_empty() {
        bail!("{hspec}: no held-out problems");
    }
    let mut se = Engine::new(&dev, &st.cfg, dtype, &EngineConfig::default(), st.text.clone())?;
    let mut tt = Engine::new(&dev, &te.cfg, dtype, &EngineConfig::default().scoring(), None)?;
    let step = match a.step {
        Some(s) => s,
        None => std::fs::read_to_string(ck.join(crate::train::checkpoint::STATE_FILE))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| v["step"].as_u64())
            .unwrap_or(0),
    };
    let mut r = eval::evaluate(
        step,
        (&mut se, &st.weights),
        Some((&mut tt, &te.weights)),
        st.text.as_deref(),
        &prompts,
        set.samples,
        set.max_new_tokens,
        set.seed,
    )?;
    let mut out = serde_json::json!({"checkpoint": ck, "step": step, "heldout_kl": r.kl, "accuracy": r.accuracy, "problems": prompts.len()});
    println!(
        "{}: step {step}, held-out KL K = {:.5} nats/token over {} problems, accuracy {:.1}%",
        ck.display(),
        r.kl,
        prompts.len(),
        r.accuracy * 100.0
    );
    if let Some(refdir) = &a.reference {
        let rd = RunDir::open(refdir)?;
        let mut reference = rd.eval_at(step)?;
        // The reference's labels come from its run; a checkpoint evaluated here carries its
        // run's labels when it has a trainer state.
        if let Ok(t) = std::fs::read_to_string(ck.join(crate::train::checkpoint::STATE_FILE)) {
            if let Ok(j) = serde_json::from_str::<serde_json::Value>(&t)
                .map(|v| v["config"].as_str().unwrap_or_default().to_string())
            {
                if let Ok(cfg) = crate::config::JobConfig::from_toml(&j, "checkpoint config") {
                    r.student = cfg.model.path.clone();
                    r.teacher = cfg.teacher.map(|t| t.path).unwrap_or_default();
                }
            }
        }
        if reference.heldout != r.heldout {
            bail!(
                "{}: its evaluations used another held-out set or sampling (fingerprint {} vs {}); evaluate with the same --heldout, --samples, --max-new-tokens and --seed",
                refdir.display(),
                reference.heldout,
                r.heldout
            );
        }
        reference.step = step;
        let d = runs::compare(&r, &reference, a.tau, a.reps)?;
        println!(
            "vs {} at step {step}: Δ = {:+.2}% [{:+.2}, {:+.2}], paired difference [{:+.5}, {:+.5}] nats/token -> {}",
            refdir.display(),
            d.delta * 100.0,
            d.lo * 100.0,
            d.hi * 100.0,
            d.diff_lo,
            d.diff_hi,
            if d.fail { "FAIL" } else { "pass" }
        );
        out["delta"] = serde_json::to_value(&d)?;
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    }
    Ok(())
}

fn run_budget(a: &Args) -> Result<()> {
    let refdir = a.reference.as_ref().context("--budget needs --reference RUN (the standard run)")?;
    let reference = RunDir::open(refdir)?;
    let runs: Vec<RunDir> = a.budget.iter().map(|p| RunDir::open(p)).collect::<Result<_>>()?;
    let step = match a.step {
        Some(s) => s,
        None => {
            let mut common = reference.eval_steps();
            for r in &runs {
                let s = r.eval_steps();
                common.retain(|x| s.contains(x));
            }
            *common.iter().rfind(|&&s| s > 0).context("the runs share no evaluated step > 0")?
        }
    };
    let re = reference.eval_at(step)?;
    let mut rows = Vec::new();
    let admitter = if a.admit { Some(Admitter::new(&reference, a)?) } else { None };
    println!(
        "budget at step {step} (τ = {:.0}%), reference {} (K = {:.5}, D = {:.5})",
        a.tau * 100.0,
        reference.name(),
        re.kl,
        reference.mismatch_level(step).unwrap_or(f64::NAN)
    );
    let mut table = Vec::new();
    for r in &runs {
        let e = r.eval_at(step)?;
        let d = runs::compare(&e, &re, a.tau, a.reps)
            .with_context(|| format!("comparing {} with {}", r.path.display(), refdir.display()))?;
        let level = r
            .mismatch_level(step)
            .with_context(|| format!("{}: no mismatch metrics up to step {step}", r.path.display()))?;
        let d_hat = match &admitter {
            Some(ad) => ad.predict(r)?,
            None => None,
        };
        rows.push((level, d.fail));
        table.push((r.name(), level, d, d_hat));
    }
    let bracket = budget::bracket(&rows);
    let line = a.line.or(bracket.map(|b| b.0));
    if a.admit {
        match line {
            Some(l) => println!(
                "offline admission: pass iff {:.2}·D-hat < L = {l:.5}{}",
                a.alpha,
                if a.line.is_none() { " (the lower end of B_emp below)" } else { "" }
            ),
            None => println!("offline admission: no line L (give --line; this table has no bracket)"),
        }
    }
    println!(
        "{:<28} {:>10} {:>9} {:>22} {:>7}{}",
        "run",
        "D",
        "Δ",
        "95% interval",
        "rule",
        if a.admit { "   D-hat (offline)   predicted" } else { "" }
    );
    let mut agree = (0, 0);
    for (name, level, d, d_hat) in &table {
        let pred = match (a.admit, d_hat, line) {
            (false, _, _) => String::new(),
            (true, None, _) => format!("{:>18}   {:>9}", "n/a", "(stale)"),
            (true, Some(x), None) => format!("{x:>18.5}   {:>9}", "?"),
            (true, Some(x), Some(l)) => {
                let ok = budget::admit(*x, a.alpha, l);
                agree.1 += 1;
                if ok != d.fail {
                    agree.0 += 1;
                }
                format!("{x:>18.5}   {:>9}", if ok { "pass" } else { "fail" })
            }
        };
        println!(
            "{:<28} {:>10.5} {:>+8.2}% {:>22} {:>7}{}",
            name,
            level,
            d.delta * 100.0,
            format!("[{:+.2}, {:+.2}]", d.lo * 100.0, d.hi * 100.0),
            if d.fail { "fail" } else { "pass" },
            pred
        );
    }
    match bracket {
        Some((lo, hi)) => println!("B_emp(τ = {:.2}) = [{lo:.5}, {hi:.5}] nats/token", a.tau),
        None => {
            println!("B_emp(τ = {:.2}): the passing and failing levels are not ordered (or one set is empty)", a.tau)
        }
    }
    if agree.1 > 0 {
        println!("offline prediction agrees with the training outcome for {} of {} engines", agree.0, agree.1);
    }
    Ok(())
}

/// The offline admission check on the untrained student of the reference run.
struct Admitter {
    dev: Device,
    lm: LoadedModel,
    prompts: Vec<crate::data::dataset::PromptItem>,
    calib: Option<crate::model::calib::Calibration>,
    settings: crate::mismatch::admit::Settings,
}

impl Admitter {
    fn new(reference: &RunDir, a: &Args) -> Result<Admitter> {
        let job = &reference.config;
        let dev = Device::parse(&job.run.device)?;
        let dir = crate::orchestrator::tiny::resolve(&job.model.path)?;
        let lm = LoadedModel::load(&dir, &dev, if dev.is_cpu() { DType::F32 } else { DType::BF16 })?;
        let data = Dataset::open(&job.data.train, lm.text.clone(), job.data.chat, lm.cfg.vocab_size, job.run.seed)?;
        let mut prompts = match &job.data.heldout {
            Some(h) => Dataset::open(h, lm.text.clone(), job.data.chat, lm.cfg.vocab_size, job.run.seed)?
                .heldout(usize::MAX)?,
            None => data.heldout(16)?,
        };
        prompts.truncate(16);
        let cp = data.train_prompts(u64::MAX >> 1, job.engine.calibration_samples)?;
        let mut e = Engine::new(&dev, &lm.cfg, lm.weights.dtype(), &EngineConfig::default(), lm.text.clone())?;
        let sc = crate::engine::SamplingConfig {
            temperature: job.rollout.temperature,
            max_new_tokens: job.rollout.max_new_tokens,
            ..Default::default()
        };
        let calib = Some(crate::train::calibrate::calibrate(&mut e, &lm.weights, &lm.cfg, &cp, &sc, job.run.seed)?);
        let settings = crate::mismatch::admit::Settings {
            samples: 2,
            seed: 777,
            temperature: job.rollout.temperature,
            max_new_tokens: job.rollout.max_new_tokens,
            alpha: a.alpha,
            line: a.line.unwrap_or(f64::NAN),
            reps: a.reps,
        };
        Ok(Admitter { dev, lm, prompts, calib, settings })
    }

    /// The offline estimate D̂ of a run's rollout engine (None: stale engines, which need a
    /// trained trajectory).
    fn predict(&self, run: &RunDir) -> Result<Option<f64>> {
        let spec = run.config.engine.spec(self.lm.cfg.num_layers)?;
        if spec.staleness > 0 {
            return Ok(None);
        }
        let st = crate::mismatch::admit::Student {
            dev: &self.dev,
            cfg: &self.lm.cfg,
            w: &self.lm.weights,
            text: self.lm.text.clone(),
            calib: self.calib.as_ref(),
        };
        Ok(Some(crate::mismatch::admit::estimate(&st, &spec, &self.prompts, &self.settings)?.d_hat))
    }
}
