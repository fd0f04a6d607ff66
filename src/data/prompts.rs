//! Prompt files: one JSON object per line, either `{"prompt": "text"}`, `{"messages": [...]}`
//! (rendered with the model's chat template) or `{"tokens": [ids...]}`.

use crate::model::TextTools;
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::path::Path;

#[derive(Clone, Debug, PartialEq)]
pub enum PromptInput {
    Text(String),
    Messages(Value),
    Tokens(Vec<u32>),
}

#[derive(Clone, Debug)]
pub struct PromptLine {
    /// 1-based line number in the file (for error messages).
    pub line: usize,
    pub input: PromptInput,
    /// Any other fields of the line (kept for tasks that need them, e.g. a reference answer).
    pub extra: serde_json::Map<String, Value>,
}

/// Parses token ids, checking each is an integer in [0, vocab).
pub fn parse_tokens(v: &Value, vocab: usize, ctx: &dyn Fn() -> String) -> Result<Vec<u32>> {
    let arr = v.as_array().with_context(|| format!("{}: 'tokens' must be a list of integers", ctx()))?;
    let mut out = Vec::with_capacity(arr.len());
    for (i, t) in arr.iter().enumerate() {
        let id = t.as_u64().with_context(|| format!("{}: tokens[{i}] = {t} is not a non-negative integer", ctx()))?;
        if id as usize >= vocab {
            bail!("{}: tokens[{i}] = {id} is out of vocabulary (size {vocab})", ctx());
        }
        out.push(id as u32);
    }
    Ok(out)
}

/// Reads a prompts file. Errors name the file and the line.
pub fn read_prompts(path: &Path, vocab: usize) -> Result<Vec<PromptLine>> {
    let lines = crate::util::read_jsonl(path)?;
    if lines.is_empty() {
        bail!("{}: no prompts (the file is empty)", path.display());
    }
    let mut out = Vec::with_capacity(lines.len());
    for (line, v) in lines {
        let ctx = || format!("{}:{line}", path.display());
        let Value::Object(mut obj) = v else { bail!("{}: expected a JSON object", ctx()) };
        let input = if let Some(p) = obj.remove("prompt") {
            PromptInput::Text(p.as_str().with_context(|| format!("{}: 'prompt' must be a string", ctx()))?.to_string())
        } else if let Some(m) = obj.remove("messages") {
            let arr = m.as_array().with_context(|| format!("{}: 'messages' must be a list", ctx()))?;
            for (i, msg) in arr.iter().enumerate() {
                let ok = msg.get("role").map(|r| r.is_string()).unwrap_or(false)
                    && msg.get("content").map(|c| c.is_string()).unwrap_or(false);
                if !ok {
                    bail!("{}: messages[{i}] must be an object with string 'role' and 'content'", ctx());
                }
            }
            if arr.is_empty() {
                bail!("{}: 'messages' is empty", ctx());
            }
            PromptInput::Messages(m)
        } else if let Some(t) = obj.remove("tokens") {
            let toks = parse_tokens(&t, vocab, &ctx)?;
            if toks.is_empty() {
                bail!("{}: 'tokens' is empty", ctx());
            }
            PromptInput::Tokens(toks)
        } else {
            bail!("{}: expected one of the fields 'prompt', 'messages' or 'tokens'", ctx());
        };
        out.push(PromptLine { line, input, extra: obj });
    }
    Ok(out)
}

/// Turns a prompt into token ids: text through the tokenizer (its own special tokens added,
/// or the chat template when `chat`), messages through the chat template.
pub fn encode_prompt(p: &PromptLine, text: Option<&TextTools>, chat: bool, file: &Path) -> Result<Vec<u32>> {
    let ctx = || format!("{}:{}", file.display(), p.line);
    let need = || text.with_context(|| format!("{}: a text prompt needs the model's tokenizer.json", ctx()));
    let ids = match &p.input {
        PromptInput::Tokens(t) => t.clone(),
        PromptInput::Text(s) if chat => {
            let t = need()?;
            let msgs = serde_json::json!([{"role": "user", "content": s}]);
            t.encode(&t.render_chat(&msgs).with_context(ctx)?, false)?
        }
        PromptInput::Text(s) => need()?.encode(s, true)?,
        PromptInput::Messages(m) => {
            let t = need()?;
            t.encode(&t.render_chat(m).with_context(ctx)?, false)?
        }
    };
    if ids.is_empty() {
        bail!("{}: the prompt encodes to zero tokens", ctx());
    }
    Ok(ids)
}
