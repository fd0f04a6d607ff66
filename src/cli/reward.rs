//! `colotrain reward`: rewards given responses with the rule a run would use (the built-in
//! math rule, or the `[reward]` plug-in of `--config`), so a user can check a reward on their
//! own data before a run. Writes one line per input line with what the rule extracted. With
//! `--serve` it is itself a plug-in: the built-in rule behind the plug-in protocol on stdin /
//! stdout (`[reward] command = ["colotrain", "reward", "--serve"]` rewards exactly as the
//! built-in rule does; a reference for plug-in authors).
//!
//! Owns: the subcommand's input checks and output. May call: `crate::reward`, `crate::config`.
//! Must not: load models.

use crate::config::{JobConfig, RewardConfig};
use crate::reward::{Job, RewardStats, Rule};
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// JSONL: {"response": text, "answer": reference (optional with a plug-in), "prompt":
    /// text (optional), "meta": any (optional), "truncated": bool (optional)} per line.
    #[arg(long, required_unless_present = "serve")]
    pub input: Option<PathBuf>,
    /// JSONL: {"line", "reward", ...what the rule found} per input line (written atomically).
    #[arg(long, required_unless_present = "serve")]
    pub out: Option<PathBuf>,
    /// Serve the built-in rule as a reward plug-in: one JSON line in on stdin, one
    /// {"reward", "no_answer", "undecided"} line out on stdout, until stdin closes.
    #[arg(long, conflicts_with_all = ["input", "out", "config"])]
    pub serve: bool,
    /// A run's config: its `[reward]` section chooses the rule (default: the built-in rule).
    #[arg(long)]
    pub config: Option<PathBuf>,
}

fn text_field(v: &Value, key: &str, ctx: &dyn Fn() -> String) -> Result<Option<String>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        // References in datasets are often bare numbers.
        Some(n @ Value::Number(_)) if key == "answer" => Ok(Some(n.to_string())),
        Some(other) => bail!("{}: '{key}' must be a string, got {other}", ctx()),
    }
}

/// One input line's job (`ctx` names the file and line in errors).
fn job_of(v: &Value, plugin: bool, ctx: &dyn Fn() -> String) -> Result<Job> {
    if !v.is_object() {
        bail!("{}: expected a JSON object with \"response\" and \"answer\"", ctx());
    }
    let response = text_field(v, "response", ctx)?.with_context(|| format!("{}: missing field 'response'", ctx()))?;
    let answer = text_field(v, "answer", ctx)?;
    if answer.is_none() && !plugin {
        bail!("{}: missing field 'answer' (the built-in rule compares with a reference answer)", ctx());
    }
    let truncated = match v.get("truncated") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => bail!("{}: 'truncated' must be true or false, got {other}", ctx()),
    };
    Ok(Job { response, answer, prompt: text_field(v, "prompt", ctx)?, meta: v.get("meta").cloned(), truncated })
}

/// `--serve`: the built-in rule as a plug-in, line by line (a malformed line is an error on
/// stderr and a non-zero exit, which the trainer reports with the plug-in's stderr).
fn serve() -> Result<()> {
    use std::io::{BufRead, Write};
    let (stdin, stdout) = (std::io::stdin(), std::io::stdout());
    let mut out = stdout.lock();
    let mut rule = Rule::Builtin;
    for (i, line) in stdin.lock().lines().enumerate() {
        let line = line.context("reading stdin")?;
        let ctx = || format!("stdin:{}", i + 1);
        let v: Value = serde_json::from_str(&line).with_context(|| format!("{}: not JSON", ctx()))?;
        // A prompt without a reference answer earns 0 (no_answer), as from the built-in rule.
        let o = rule.score(&[job_of(&v, true, &ctx)?])?.pop().context("no outcome")?;
        let reply = json!({
            "reward": o.reward.unwrap_or(0.0),
            "no_answer": (o.no_answer || o.reward.is_none()) as u8,
            "undecided": o.undecided as u8,
        });
        writeln!(out, "{reply}")?;
        out.flush()?;
    }
    Ok(())
}

pub fn run(a: Args) -> Result<()> {
    if a.serve {
        return serve();
    }
    let (Some(input), Some(out_path)) = (&a.input, &a.out) else { bail!("--input and --out are required") };
    let cfg = match &a.config {
        Some(p) => JobConfig::from_file(p)?.reward,
        None => RewardConfig::default(),
    };
    let lines = crate::util::read_jsonl(input)?;
    if lines.is_empty() {
        bail!("{}: no lines (the file is empty)", input.display());
    }
    let plugin = !cfg.command.is_empty();
    let mut jobs = Vec::with_capacity(lines.len());
    for (line, v) in &lines {
        jobs.push(job_of(v, plugin, &|| format!("{}:{line}", input.display()))?);
    }
    let mut rule = Rule::start(&cfg)?;
    let mut outcomes = Vec::with_capacity(jobs.len());
    for chunk in jobs.chunks(cfg.batch.max(1)) {
        outcomes.extend(rule.score(chunk)?);
    }
    let mut out = String::new();
    for ((line, _), o) in lines.iter().zip(&outcomes) {
        let mut v = serde_json::to_value(o)?;
        if let Value::Object(m) = &mut v {
            m.insert("line".into(), json!(line));
        }
        out.push_str(&v.to_string());
        out.push('\n');
    }
    crate::util::write_atomic(out_path, out.as_bytes())?;
    let cut = jobs.iter().filter(|j| j.truncated).count();
    let st = RewardStats::of(&outcomes, cut, rule.restarts());
    let mean = outcomes.iter().filter_map(|o| o.reward).map(f64::from).sum::<f64>() / st.scored.max(1) as f64;
    eprintln!(
        "rewarded {} responses with {} -> {}: mean reward {mean:.4}, no boxed answer {}, undecided {}, truncated {}",
        st.scored,
        if plugin { format!("the plug-in `{}`", cfg.command.join(" ")) } else { "the built-in math rule".into() },
        out_path.display(),
        st.no_answer,
        st.undecided,
        st.truncated
    );
    Ok(())
}
