//! `colotrain generate`: sample responses with the continuous-batching engine.

use super::{DeviceArgs, EngineArgs};
use crate::data::prompts::{encode_prompt, read_prompts};
use crate::engine::{truncate_at_stop, Engine, Request, SamplingConfig};
use crate::model::LoadedModel;
use anyhow::{bail, Result};
use serde_json::json;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Hugging Face model directory.
    #[arg(long)]
    pub model: PathBuf,
    /// JSONL prompts: {"prompt": "..."}, {"messages": [...]} or {"tokens": [...]} per line.
    #[arg(long)]
    pub prompts: PathBuf,
    /// Render plain-text prompts with the chat template too (messages always are).
    #[arg(long)]
    pub chat: bool,
    /// Samples per prompt.
    #[arg(long, default_value_t = 1)]
    pub n: u32,
    /// Sampling temperature; 0 means greedy.
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// 0 disables top-k.
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,
    #[arg(long, default_value_t = 128)]
    pub max_new_tokens: usize,
    /// Stop strings (repeatable); the text is cut before the stop string.
    #[arg(long)]
    pub stop: Vec<String>,
    /// Do not stop at the end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output JSONL file.
    #[arg(long)]
    pub out: PathBuf,
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
}

pub fn run(a: Args) -> Result<()> {
    if a.n == 0 {
        bail!("--n must be at least 1");
    }
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        bail!("--top-p must be in (0, 1], got {}", a.top_p);
    }
    if !(a.temperature >= 0.0 && a.temperature.is_finite()) {
        bail!("--temperature must be a finite number >= 0, got {}", a.temperature);
    }
    let (dev, dtype) = a.device.open()?;
    let mut lm = LoadedModel::load(&a.model, &dev, dtype)?;
    let prompts = read_prompts(&a.prompts, lm.cfg.vocab_size)?;
    if lm.quant.is_none() && !a.engine.no_pack {
        lm.pack_for_decode()?;
    }
    let sampling = Arc::new(SamplingConfig {
        temperature: a.temperature,
        top_p: a.top_p,
        top_k: a.top_k,
        max_new_tokens: a.max_new_tokens,
        stop: a.stop.clone(),
        ignore_eos: a.ignore_eos,
        seed: a.seed,
        topk_logprobs: 0,
    });
    // A ModelOpt directory runs as its quantized engine (FP8 KV where it says so).
    let mut ec = a.engine.config();
    if let Some(q) = &lm.quant {
        ec.kv_fp8 = q.recipe.kv_layers();
    }
    let mut engine = Engine::new(&dev, &lm.cfg, dtype, &ec, lm.text.clone())?;
    for (i, p) in prompts.iter().enumerate() {
        let ids = encode_prompt(p, lm.text.as_deref(), a.chat, &a.prompts)?;
        for s in 0..a.n {
            let req = Request {
                id: i as u64,
                sample: s,
                prompt: ids.clone(),
                sampling: sampling.clone(),
                prompt_logprobs: false,
            };
            engine.add(req).map_err(|e| anyhow::anyhow!("{}:{}: {e:#}", a.prompts.display(), p.line))?;
        }
    }
    let total = prompts.len() as u64 * a.n as u64;
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{spinner} generate [{bar:30}] {pos}/{len} samples {elapsed} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let t0 = Instant::now();
    let mut ntok = 0usize;
    let view = crate::engine::View { w: &lm.weights, q: lm.quant.as_ref().map(|q| q.layers.as_slice()) };
    let done = engine.run_to_completion(view, |c| {
        ntok += c.tokens.len();
        bar.inc(1);
        bar.set_message(format!("{:.0} tok/s", ntok as f64 / t0.elapsed().as_secs_f64().max(1e-9)));
    })?;
    bar.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    let mut out = String::new();
    for c in &done {
        let text = match &lm.text {
            Some(t) => Some(truncate_at_stop(&t.decode(&c.tokens)?, &a.stop)),
            None => None,
        };
        let line = json!({
            "prompt_id": c.id,
            "sample": c.sample,
            "tokens": c.tokens,
            "text": text,
            "logprobs": c.logprobs,
            "finish_reason": c.finish.as_str(),
        });
        out.push_str(&line.to_string());
        out.push('\n');
    }
    crate::util::write_atomic(&a.out, out.as_bytes())?;
    eprintln!(
        "generated {} samples, {} tokens in {:.2}s ({:.1} tokens/s) on {} -> {}",
        done.len(),
        ntok,
        secs,
        ntok as f64 / secs.max(1e-9),
        dev.name(),
        a.out.display()
    );
    Ok(())
}
