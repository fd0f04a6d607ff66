//! `colotrain score`: per-token log-probabilities of given sequences.

use super::{DeviceArgs, EngineArgs};
use crate::data::prompts::parse_tokens;
use crate::engine::{Engine, Request, SamplingConfig};
use crate::model::LoadedModel;
use anyhow::{bail, Context, Result};
use serde_json::json;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[arg(long)]
    pub model: PathBuf,
    /// JSONL: {"tokens": [ids...], "prompt_len": n (optional)} per line.
    #[arg(long)]
    pub input: PathBuf,
    /// JSONL: {"logprobs": [...]} per input line.
    #[arg(long)]
    pub out: PathBuf,
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
}

pub fn run(a: Args) -> Result<()> {
    let (dev, dtype) = a.device.open()?;
    let mut lm = LoadedModel::load(&a.model, &dev, dtype)?;
    let lines = crate::util::read_jsonl(&a.input)?;
    if lm.quant.is_none() && !a.engine.no_pack {
        lm.pack_for_decode()?;
    }
    if lines.is_empty() {
        bail!("{}: no sequences (the file is empty)", a.input.display());
    }
    let sampling = Arc::new(SamplingConfig { max_new_tokens: 0, ..Default::default() });
    let mut engine = Engine::new(&dev, &lm.cfg, dtype, &a.engine.config().scoring(), None)?;
    let mut prompt_lens = Vec::new();
    for (i, (line, v)) in lines.iter().enumerate() {
        let ctx = || format!("{}:{line}", a.input.display());
        let toks = parse_tokens(
            v.get("tokens").with_context(|| format!("{}: missing field 'tokens'", ctx()))?,
            lm.cfg.vocab_size,
            &ctx,
        )?;
        if toks.len() < 2 {
            bail!("{}: need at least 2 tokens to score, got {}", ctx(), toks.len());
        }
        let pl = match v.get("prompt_len") {
            None | Some(serde_json::Value::Null) => None,
            Some(p) => {
                let p = p.as_u64().with_context(|| format!("{}: 'prompt_len' must be a non-negative integer", ctx()))?
                    as usize;
                if p == 0 || p > toks.len() {
                    bail!("{}: prompt_len {p} must be in 1..={}", ctx(), toks.len());
                }
                Some(p)
            }
        };
        prompt_lens.push(pl);
        engine
            .add(Request { id: i as u64, sample: 0, prompt: toks, sampling: sampling.clone(), prompt_logprobs: true })
            .with_context(ctx)?;
    }
    let done = engine.run_to_completion(&lm.weights, |_| {})?;
    let mut out = String::new();
    for (c, pl) in done.iter().zip(&prompt_lens) {
        let lp = match pl {
            Some(p) => &c.prompt_logprobs[p - 1..],
            None => &c.prompt_logprobs[..],
        };
        out.push_str(&json!({ "logprobs": lp }).to_string());
        out.push('\n');
    }
    crate::util::write_atomic(&a.out, out.as_bytes())?;
    eprintln!("scored {} sequences -> {}", done.len(), a.out.display());
    Ok(())
}
