//! The `train` job: the colocated synchronous schedule on one device. Per step: rollout (the
//! engine reads the trainer's weights), teacher scoring, rewards, the training step, the in-place
//! resync, metrics (one JSON line), periodic held-out evaluation and checkpoints.

use super::checkpoint;
use super::eval::{self, EvalResult};
use super::rollout::{self, Rollout};
use super::monitor::{Monitor, RlMetrics};
use super::trainer::{StepOut, Trainer};
use crate::config::JobConfig;
use crate::data::answer;
use crate::data::dataset::Dataset;
use crate::device::{DType, Device};
use crate::engine::{Engine, EngineConfig, SamplingConfig};
use crate::mismatch::{self, StepMismatch};
use crate::model::LoadedModel;
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

#[derive(Clone, Debug, Default)]
pub struct JobOptions {
    pub resume: Option<PathBuf>,
    /// Draw a progress bar (stderr).
    pub progress: bool,
}

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
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct StepMetrics {
    pub step: u64,
    pub version: u64,
    pub time: PhaseSeconds,
    pub gen_tokens: usize,
    pub tokens_per_s: f64,
    pub updates_per_hour: f64,
    pub loss: f64,
    pub grad_norm: f64,
    pub lr: f64,
    pub entropy: f64,
    pub response_len: f64,
    pub length_cap_rate: f64,
    pub reward: Option<f64>,
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
    #[serde(skip_serializing_if = "Option::is_none")]
    pub heldout_kl: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub heldout_acc: Option<f64>,
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
}

/// Loads a model source (a directory or a `builtin:` name).
fn load(src: &crate::config::ModelSource, dev: &Device) -> Result<LoadedModel> {
    let dir = super::tiny::resolve(&src.path)?;
    let dtype = match src.dtype.as_deref() {
        Some(d) => DType::parse(d)?,
        None if dev.is_cpu() => DType::F32,
        None => DType::BF16,
    };
    LoadedModel::load(&dir, dev, dtype)
}

fn engine_config(job: &JobConfig) -> EngineConfig {
    let r = &job.rollout;
    EngineConfig { max_seqs: r.max_seqs, max_tokens_per_step: r.max_tokens_per_step, kv_cache_bytes: r.kv_cache_mb << 20, ..Default::default() }
}

/// Keeps the lines of metrics.jsonl with step <= `upto` (resume), rewriting it atomically.
fn truncate_metrics(path: &Path, upto: u64) -> Result<()> {
    if !path.exists() {
        return Ok(());
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| serde_json::from_str::<serde_json::Value>(l).ok().and_then(|v| v.get("step").and_then(|s| s.as_u64())).map(|s| s <= upto).unwrap_or(false))
        .collect();
    let mut out = kept.join("\n");
    if !out.is_empty() {
        out.push('\n');
    }
    crate::util::write_atomic(path, out.as_bytes())
}

pub fn run(job: &JobConfig, opts: &JobOptions) -> Result<JobSummary> {
    let t_job = Instant::now();
    let out_dir = job.out_dir();
    let metrics_path = out_dir.join("metrics.jsonl");
    let resume = match &opts.resume {
        Some(p) => Some(checkpoint::resolve(p)?),
        None => {
            if metrics_path.exists() || !checkpoint::list(&out_dir)?.is_empty() {
                bail!(
                    "{} already holds a run; resume it with --resume {} or choose another run.name / run.out_dir",
                    out_dir.display(),
                    out_dir.display()
                );
            }
            None
        }
    };
    std::fs::create_dir_all(out_dir.join("eval")).with_context(|| format!("cannot create {}", out_dir.display()))?;
    let dev = Device::parse(&job.run.device)?;
    let student = load(&job.model, &dev).with_context(|| format!("loading the student '{}'", job.model.path))?;
    // The tokenizer is needed for text data, rewards and accuracy; token-only runs do without.
    let text = student.text.clone();
    let teacher = match &job.teacher {
        Some(t) if job.objective.kind == "opd" => {
            let tm = load(t, &dev).with_context(|| format!("loading the teacher '{}'", t.path))?;
            if tm.cfg.vocab_size != student.cfg.vocab_size {
                bail!(
                    "student {} and teacher {} have different vocabularies ({} vs {} tokens); OPD needs one vocabulary",
                    student.dir.display(),
                    tm.dir.display(),
                    student.cfg.vocab_size,
                    tm.cfg.vocab_size
                );
            }
            Some(tm)
        }
        _ => None,
    };
    let file_rollouts = match job.rollout.source.as_str() {
        "file" => Some(rollout::read_file(job.rollout.file.as_deref().context("rollout.file")?, student.cfg.vocab_size)?),
        _ => None,
    };
    // With file rollouts, data is only needed for held-out evaluation, and only if given.
    let data = match (&file_rollouts, &job.data.heldout) {
        (Some(_), None) => None,
        _ => Some(Dataset::open(&job.data.train, text.clone(), job.data.chat, student.cfg.vocab_size, job.run.seed)?),
    };
    let heldout = match (&job.data.heldout, &data) {
        (Some(h), _) => Dataset::open(h, text.clone(), job.data.chat, student.cfg.vocab_size, job.run.seed)?.heldout(usize::MAX)?,
        (None, Some(d)) => d.heldout(job.data.heldout_size)?,
        (None, None) => Vec::new(),
    };
    let student_dir = student.dir.clone();
    let cfg = student.cfg.clone();
    let weights_dtype = student.weights.dtype();
    let spec = job.engine.spec(cfg.num_layers).context("[engine]")?;
    let standard = spec.recipe.is_standard() && spec.noise_sigma == 0.0 && spec.staleness == 0;
    let ec = engine_config(job);
    // The standard engine: held-out evaluation and calibration always use it.
    let mut std_engine = Engine::new(&dev, &cfg, weights_dtype, &ec, text.clone())?;
    // The rollout engine, when it differs (its KV cache follows the recipe).
    let mut rollout_engine = if standard {
        None
    } else {
        let ec = EngineConfig { kv_fp8: spec.recipe.kv_layers(), ..ec.clone() };
        Some(Engine::new(&dev, &cfg, weights_dtype, &ec, text.clone())?)
    };
    let mut t_engine = match &teacher {
        Some(t) => Some(Engine::new(&dev, &t.cfg, t.weights.dtype(), &ec, None)?),
        None => None,
    };
    let mut trainer = Trainer::new(&cfg, student.weights, job)?;
    let calib = if spec.recipe.needs_calibration() {
        let saved = out_dir.join("calibration.json");
        let path = job.engine.calibration_file.clone().or_else(|| saved.exists().then(|| saved.clone()));
        Some(match path {
            Some(p) => crate::quant::calib::Calibration::load(&p, &cfg)?,
            None => {
                let prompts = match &data {
                    Some(d) => d.train_prompts(u64::MAX >> 1, job.engine.calibration_samples)?,
                    None => bail!("[engine] recipe '{}' needs calibration prompts: give data.train or engine.calibration_file", spec.recipe.name),
                };
                let c = super::calibrate::calibrate(&mut std_engine, &trainer.weights, &cfg, &prompts, &sampling_of(job), job.run.seed)?;
                c.save(&saved)?;
                tracing::info!("calibrated activation and KV scales on {} responses ({} tokens) -> {}", c.samples, c.tokens, saved.display());
                c
            }
        })
    } else {
        None
    };
    let mut rw = crate::engine::rollout_weights::RolloutWeights::new(&dev, &spec, &cfg, &trainer.weights, calib.as_ref(), trainer.version)?;
    if job.learner.precision == "nvfp4" {
        let mut lq = crate::model::learner_quant::LearnerQuant::new(&job.learner.linears, spec.recipe.nvfp4, cfg.num_layers)?;
        // The engine's calibrated input scales where it quantizes the same linears in NVFP4.
        if let Some(q) = &rw.quant {
            for (l, ql) in q.layers.iter().enumerate() {
                for (i, a) in ql.act.iter().enumerate() {
                    if let crate::ops::quantize::ActQuant::Nvfp4 { global, .. } = a {
                        lq.act_global[l][i] = Some(*global);
                    }
                }
            }
        }
        trainer.set_learner_quant(Some(lq));
    }
    let mut monitor = Monitor::new(&job.monitor);
    let mut start = 0u64;
    if let Some(ck) = &resume {
        let (state, master, m, v) = checkpoint::load(ck, job)?;
        trainer.restore(master, m, v, state.optimizer_step, state.version, state.skipped_steps, state.step)?;
        start = state.step;
        truncate_metrics(&metrics_path, start)?;
        tracing::info!("resumed from {} at step {start}", ck.display());
    }
    crate::util::write_atomic(&out_dir.join("config.toml"), job.to_toml().as_bytes())?;
    tracing::info!(
        "run {}: {} ({} parameters, {}) on {}; trainer state {:.1} MiB; KV cache {} tokens",
        job.run.name,
        student_dir.display(),
        trainer.num_params(),
        weights_dtype.name(),
        dev.name(),
        trainer.state_bytes() as f64 / (1 << 20) as f64,
        rollout_engine.as_ref().unwrap_or(&std_engine).cache.capacity_tokens()
    );
    tracing::info!(
        "rollout engine '{}'{}{}: {:.1} MiB of own buffers",
        spec.recipe.name,
        if spec.noise_sigma > 0.0 { format!(", weight noise σ = {}", spec.noise_sigma) } else { String::new() },
        if spec.staleness > 0 { format!(", staleness {}", spec.staleness) } else { String::new() },
        rw.extra_bytes() as f64 / (1 << 20) as f64
    );
    let mut metrics_file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&metrics_path)
        .with_context(|| format!("cannot open {}", metrics_path.display()))?;
    let eval_new = job.eval.max_new_tokens.unwrap_or(job.rollout.max_new_tokens);
    let mut summary = JobSummary { out_dir: out_dir.clone(), ..Default::default() };
    let do_eval = |step: u64, trainer: &Trainer, engine: &mut Engine, t_engine: &mut Option<Engine>| -> Result<EvalResult> {
        let te = match (t_engine.as_mut(), teacher.as_ref()) {
            (Some(e), Some(t)) => Some((e, &t.weights)),
            _ => None,
        };
        let mut r = eval::evaluate(step, (engine, &trainer.weights), te, text.as_deref(), &heldout, job.eval.samples_per_prompt as u32, eval_new, job.eval.seed)?;
        r.student = job.model.path.clone();
        r.teacher = job.teacher.as_ref().map(|t| t.path.clone()).unwrap_or_default();
        crate::util::write_atomic(&out_dir.join("eval").join(format!("step-{step:06}.json")), serde_json::to_string(&r)?.as_bytes())?;
        Ok(r)
    };
    let evaluate = !heldout.is_empty();
    if start == 0 && evaluate {
        let r = do_eval(0, &trainer, &mut std_engine, &mut t_engine)?;
        let line = serde_json::json!({"step": 0, "heldout_kl": teacher.is_some().then_some(r.kl), "heldout_acc": r.accuracy});
        writeln!(metrics_file, "{line}")?;
        summary.evals.push(r);
    }
    let bar = if opts.progress { indicatif::ProgressBar::new(job.run.steps) } else { indicatif::ProgressBar::hidden() };
    bar.set_style(
        indicatif::ProgressStyle::with_template("{spinner} train [{bar:30}] {pos}/{len} steps {elapsed}<{eta} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_position(start);
    let sampling = Arc::new(sampling_of(job));
    let mut sum_time = PhaseSeconds::default();
    let t_loop = Instant::now();
    for step in start + 1..=job.run.steps {
        let t_step = Instant::now();
        let mut time = PhaseSeconds::default();
        // 1. Rollout.
        let t0 = Instant::now();
        let mut rollouts: Vec<Rollout> = match (&file_rollouts, job.rollout.source.as_str()) {
            (Some(f), _) => f.clone(),
            _ => {
                let prompts = data.as_ref().context("no training data")?.train_prompts(step, job.rollout.prompts_per_step)?;
                if job.objective.kind == "sft" && prompts.iter().all(|p| p.response.is_some()) {
                    reference_rollouts(&prompts, job.rollout.samples_per_prompt)
                } else {
                    let engine = rollout_engine.as_mut().unwrap_or(&mut std_engine);
                    rollout::generate(engine, rw.view(&trainer.weights), &prompts, job.rollout.samples_per_prompt as u32, &sampling, step, rw.version)?
                }
            }
        };
        time.rollout = t0.elapsed().as_secs_f64();
        // 2. Teacher scoring.
        let t0 = Instant::now();
        if let (Some(te), Some(t)) = (t_engine.as_mut(), teacher.as_ref()) {
            rollout::score_teacher(te, &t.weights, &mut rollouts, job.rollout.temperature)?;
        }
        time.teacher = t0.elapsed().as_secs_f64();
        // 3. Rewards.
        let t0 = Instant::now();
        let mut rewards = Vec::new();
        for r in rollouts.iter_mut() {
            if let (None, Some(text)) = (r.reward, &text) {
                if let Some(ans) = &r.answer {
                    r.reward = Some(if r.truncated { 0.0 } else { answer::reward(&text.decode(&r.response)?, ans) });
                }
            }
            rewards.extend(r.reward.map(|x| x as f64));
        }
        time.reward = t0.elapsed().as_secs_f64();
        // 4. Train.
        let t0 = Instant::now();
        let out: StepOut = trainer.step(&rollouts)?;
        time.train = t0.elapsed().as_secs_f64();
        // 5. Resync: a standard engine reads the trainer's weights in place (nothing to do);
        // the others rewrite their preallocated buffers.
        let t0 = Instant::now();
        rw.sync(&trainer.weights, trainer.version)?;
        time.resync = t0.elapsed().as_secs_f64();
        time.wait = time.rollout + time.teacher;
        time.total = t_step.elapsed().as_secs_f64();
        let gen_tokens: usize = rollouts.iter().map(|r| r.response.len()).sum();
        let sampler: Vec<f32> = rollouts.iter().filter(|r| !r.response.is_empty()).flat_map(|r| r.sampler_logprobs.iter().copied()).collect();
        let done_steps = (step - start) as f64;
        let mut m = StepMetrics {
            step,
            version: trainer.version,
            gen_tokens,
            tokens_per_s: gen_tokens as f64 / time.rollout.max(1e-9),
            updates_per_hour: done_steps * 3600.0 / t_loop.elapsed().as_secs_f64().max(1e-9),
            loss: out.loss,
            grad_norm: out.info.grad_norm,
            lr: out.info.lr,
            entropy: out.entropy,
            response_len: gen_tokens as f64 / rollouts.len().max(1) as f64,
            length_cap_rate: rollouts.iter().filter(|r| r.truncated).count() as f64 / rollouts.len().max(1) as f64,
            reward: (!rewards.is_empty()).then(|| rewards.iter().sum::<f64>() / rewards.len() as f64),
            mismatch: if file_rollouts.is_none() && job.objective.kind != "sft" { mismatch::step_mismatch(&sampler, &out.logp) } else { Default::default() },
            updates: out.updates,
            rl: out.adv_response.as_ref().map(|a| monitor.observe(a, &out.seq_lens, &out.logp, &sampler, out.clipped)),
            triage: out.triage.clone(),
            skipped: out.skipped,
            skipped_steps: trainer.skipped_steps,
            time,
            ..Default::default()
        };
        m.sampling_logp_difference = LogpDifference { mean: m.mismatch.abs_mean, max: m.mismatch.abs_max };
        let eval_now = evaluate && (step == job.run.steps || (job.eval.every > 0 && step % job.eval.every == 0));
        if eval_now {
            let r = do_eval(step, &trainer, &mut std_engine, &mut t_engine)?;
            m.heldout_kl = teacher.is_some().then_some(r.kl);
            m.heldout_acc = Some(r.accuracy);
            summary.evals.push(r);
        }
        writeln!(metrics_file, "{}", serde_json::to_string(&m)?)?;
        metrics_file.flush()?;
        for (a, b) in [
            (&mut sum_time.rollout, m.time.rollout),
            (&mut sum_time.teacher, m.time.teacher),
            (&mut sum_time.reward, m.time.reward),
            (&mut sum_time.train, m.time.train),
            (&mut sum_time.resync, m.time.resync),
            (&mut sum_time.wait, m.time.wait),
            (&mut sum_time.total, m.time.total),
        ] {
            *a += b;
        }
        bar.set_message(format!(
            "loss {:.4} d_n {:.1e} ent {:.3}{}{}{} | {:.0} tok/s {:.0} upd/h wait {:.2}s",
            m.loss,
            m.mismatch.d_n,
            m.entropy,
            m.reward.map(|r| format!(" reward {r:.3}")).unwrap_or_default(),
            m.heldout_kl.map(|k| format!(" heldout KL {k:.4}")).unwrap_or_default(),
            m.heldout_acc.map(|a| format!(" acc {:.1}%", 100.0 * a)).unwrap_or_default(),
            m.tokens_per_s,
            m.updates_per_hour,
            m.time.wait
        ));
        bar.inc(1);
        if step == job.run.steps || (job.checkpoint.every > 0 && step % job.checkpoint.every == 0) {
            checkpoint::save(&out_dir, step, &trainer, job, Some(&student_dir))?;
            checkpoint::prune(&out_dir, job.checkpoint.keep)?;
        }
        summary.last = Some(m);
    }
    bar.finish_and_clear();
    let n = (job.run.steps.saturating_sub(start)).max(1) as f64;
    summary.mean_time = PhaseSeconds {
        rollout: sum_time.rollout / n,
        teacher: sum_time.teacher / n,
        reward: sum_time.reward / n,
        train: sum_time.train / n,
        resync: sum_time.resync / n,
        wait: sum_time.wait / n,
        total: sum_time.total / n,
    };
    summary.steps = job.run.steps;
    summary.seconds = t_job.elapsed().as_secs_f64();
    summary.skipped_steps = trainer.skipped_steps;
    Ok(summary)
}

/// The rollout sampling settings of a job.
fn sampling_of(job: &JobConfig) -> SamplingConfig {
    SamplingConfig {
        temperature: job.rollout.temperature,
        top_p: job.rollout.top_p,
        top_k: job.rollout.top_k,
        max_new_tokens: job.rollout.max_new_tokens,
        stop: Vec::new(),
        ignore_eos: false,
        seed: job.run.seed,
        topk_logprobs: if job.objective.centering { job.objective.centering_top_k } else { 0 },
    }
}

/// SFT on reference responses (teacher forcing on the dataset's answers).
fn reference_rollouts(prompts: &[crate::data::dataset::PromptItem], samples: usize) -> Vec<Rollout> {
    let mut out = Vec::new();
    for p in prompts {
        let resp = p.response.clone().unwrap_or_default();
        for s in 0..samples.max(1) {
            out.push(Rollout {
                prompt_id: p.id,
                sample: s as u32,
                group: p.id,
                prompt: p.tokens.clone(),
                sampler_logprobs: vec![0.0; resp.len()],
                response: resp.clone(),
                teacher_logprobs: None,
                sampler_topk: None,
                reward: None,
                answer: p.answer.clone(),
                truncated: false,
                version: 0,
            });
        }
    }
    out
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
            t.push_str(&format!("held-out KL    {:.4} (step {}) -> {:.4} (step {})  {:+.1}%\n", a.kl, a.step, b.kl, b.step, rel));
        }
        t.push_str(&format!("accuracy       {:.1}% -> {:.1}%\n", a.accuracy * 100.0, b.accuracy * 100.0));
    }
    if let Some(m) = &s.last {
        t.push_str(&format!("last step      loss {:.4}  entropy {:.3}  d_n {:.2e}  response {:.1} tokens", m.loss, m.entropy, m.mismatch.d_n, m.response_len));
        if let Some(r) = m.reward {
            t.push_str(&format!("  reward {r:.3}"));
        }
        if let Some(tr) = &m.triage {
            t.push_str(&format!("  gated {} tokens, repair {}/{} segments", tr.gated_tokens, tr.repair_active, tr.repair_segments));
        }
        t.push('\n');
    }
    let p = &s.mean_time;
    t.push_str(&format!(
        "seconds/step   total {:.3} = rollout {:.3} + teacher {:.3} + reward {:.3} + train {:.3} + resync {:.3}\n",
        p.total, p.rollout, p.teacher, p.reward, p.train, p.resync
    ));
    t
}
