//! The prompts a training job draws from: the built-in arithmetic task or a JSONL file, each
//! item tokenized once, with its reference answer and (for SFT) reference response.

use super::arith;
use super::prompts::{encode_prompt, read_prompts};
use crate::model::TextTools;
use crate::rand::Stream;
use anyhow::{bail, Context, Result};
use std::path::Path;

#[derive(Clone, Debug, PartialEq)]
pub struct PromptItem {
    /// Stable id of the prompt within its source (part of the sampling key).
    pub id: u64,
    pub tokens: Vec<u32>,
    /// Reference answer (for accuracy / rewards), if known.
    pub answer: Option<String>,
    /// Reference response tokens, EOS included (for SFT), if known.
    pub response: Option<Vec<u32>>,
    /// The line's `meta` field, passed to a reward plug-in (e.g. a code task's tests).
    pub meta: Option<serde_json::Value>,
}

pub enum Dataset {
    Arith { seed: u64, text: std::sync::Arc<TextTools> },
    Items { items: Vec<PromptItem>, seed: u64 },
}

fn arith_item(text: &TextTools, p: &arith::Problem, id: u64) -> Result<PromptItem> {
    let eos = *text.eos_ids.first().context("the tokenizer defines no EOS token")?;
    let mut response = text.encode(&p.response(), false)?;
    response.push(eos);
    Ok(PromptItem {
        id,
        tokens: text.encode(&p.prompt(), false)?,
        answer: Some(p.answer()),
        response: Some(response),
        meta: None,
    })
}

impl Dataset {
    /// `spec` is `builtin:arith` or a JSONL path (fields as in `generate`, plus optional
    /// "answer", "response" and "meta", the last passed to a reward plug-in as it is).
    pub fn open(
        spec: &str,
        text: Option<std::sync::Arc<TextTools>>,
        chat: bool,
        vocab: usize,
        seed: u64,
    ) -> Result<Dataset> {
        if spec == "builtin:arith" {
            let text = text.context("builtin:arith needs the model's tokenizer")?;
            return Ok(Dataset::Arith { seed, text });
        }
        if let Some(rest) = spec.strip_prefix("builtin:") {
            bail!("unknown built-in dataset 'builtin:{rest}' (known: builtin:arith)");
        }
        let path = Path::new(spec);
        let lines = read_prompts(path, vocab)?;
        let mut items = Vec::with_capacity(lines.len());
        for (i, l) in lines.iter().enumerate() {
            let tokens = encode_prompt(l, text.as_deref(), chat, path)?;
            let answer = l.extra.get("answer").map(|a| match a {
                serde_json::Value::String(s) => s.clone(),
                other => other.to_string(),
            });
            let response = match l.extra.get("response").and_then(|r| r.as_str()) {
                Some(r) => {
                    let t = text
                        .as_deref()
                        .with_context(|| format!("{}:{}: 'response' needs a tokenizer", path.display(), l.line))?;
                    let mut ids = t.encode(r, false)?;
                    ids.extend(t.eos_ids.first());
                    Some(ids)
                }
                None => None,
            };
            let meta = l.extra.get("meta").cloned();
            items.push(PromptItem { id: i as u64, tokens, answer, response, meta });
        }
        Ok(Dataset::Items { items, seed })
    }

    /// The position (0-based, in file order) of the first prompt without a reference answer.
    pub fn first_without_answer(&self) -> Option<usize> {
        match self {
            Dataset::Arith { .. } => None,
            Dataset::Items { items, .. } => items.iter().position(|i| i.answer.is_none()),
        }
    }

    /// The `n` prompts of training step `step` (deterministic: epochs of a Philox-seeded shuffle).
    pub fn train_prompts(&self, step: u64, n: usize) -> Result<Vec<PromptItem>> {
        match self {
            Dataset::Arith { seed, text } => arith::train_problems(*seed, step, n)
                .iter()
                .enumerate()
                .map(|(j, p)| arith_item(text, p, step * n as u64 + j as u64))
                .collect(),
            Dataset::Items { items, seed } => {
                let len = items.len() as u64;
                let mut out = Vec::with_capacity(n);
                let mut perm: Option<(u64, Vec<usize>)> = None;
                for j in 0..n as u64 {
                    let k = step * n as u64 + j;
                    let (epoch, pos) = (k / len, k % len);
                    if perm.as_ref().map(|(e, _)| *e != epoch).unwrap_or(true) {
                        perm = Some((epoch, permutation(*seed, epoch, len)));
                    }
                    let order = &perm.as_ref().expect("set above").1;
                    out.push(items[order[pos as usize]].clone());
                }
                Ok(out)
            }
        }
    }

    /// Held-out prompts: the fixed arithmetic held-out set, or all items of a file.
    pub fn heldout(&self, n: usize) -> Result<Vec<PromptItem>> {
        match self {
            Dataset::Arith { text, .. } => arith::heldout_problems(n)
                .iter()
                .enumerate()
                .map(|(i, p)| arith_item(text, p, 1_000_000_000 + i as u64))
                .collect(),
            Dataset::Items { items, .. } => Ok(items.clone()),
        }
    }
}

/// The shuffle of epoch `epoch` (Fisher–Yates with a Philox stream).
fn permutation(seed: u64, epoch: u64, len: u64) -> Vec<usize> {
    let mut p: Vec<usize> = (0..len as usize).collect();
    let mut s = Stream::new(seed, 0x5348_5546_0000_0000 ^ epoch);
    for i in (1..p.len()).rev() {
        let j = s.below(i as u64 + 1) as usize;
        p.swap(i, j);
    }
    p
}
