//! Text in and out: `tokenizer.json` (through `tokenizers`), the chat template of
//! `tokenizer_config.json` (rendered with minijinja, with Python string methods), and the
//! special token ids of `generation_config.json` / `config.json`.
//!
//! Owns: [`TextTools`]. May call: tokenizers, minijinja. Must not: touch tensors.

use super::config::{token_ids, ModelConfig};
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::path::Path;

pub struct TextTools {
    tokenizer: tokenizers::Tokenizer,
    chat_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    pub bos_id: Option<u32>,
    pub eos_ids: Vec<u32>,
    pub pad_id: Option<u32>,
    source: String,
}

/// A special token in tokenizer_config.json: a string or `{"content": ...}`.
fn token_str(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(str::to_string),
        _ => None,
    }
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    Ok(Some(serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", path.display()))?))
}

impl TextTools {
    /// Loads the tokenizer of model directory `dir`. `cfg` provides fallback special ids.
    pub fn load(dir: &Path, cfg: &ModelConfig) -> Result<TextTools> {
        let tpath = dir.join("tokenizer.json");
        if !tpath.exists() {
            bail!("{}: missing tokenizer.json (needed to encode text prompts and decode responses)", dir.display());
        }
        let tokenizer = tokenizers::Tokenizer::from_file(&tpath)
            .map_err(|e| anyhow::anyhow!("{}: cannot load tokenizer: {e}", tpath.display()))?;
        let tc = read_json(&dir.join("tokenizer_config.json"))?;
        let gc = read_json(&dir.join("generation_config.json"))?;
        let mut chat_template = None;
        let (mut bos_token, mut eos_token) = (None, None);
        if let Some(tc) = &tc {
            chat_template = match tc.get("chat_template") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s.clone()),
                // A list of named templates: take "default", else the first.
                Some(Value::Array(a)) => a
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .or_else(|| a.first())
                    .and_then(|t| t.get("template"))
                    .and_then(|t| t.as_str())
                    .map(str::to_string),
                Some(other) => bail!(
                    "{}: 'chat_template' must be a string or a list, got {other}",
                    dir.join("tokenizer_config.json").display()
                ),
            };
            bos_token = token_str(tc.get("bos_token"));
            eos_token = token_str(tc.get("eos_token"));
        }
        let jinja = dir.join("chat_template.jinja");
        if chat_template.is_none() && jinja.exists() {
            chat_template =
                Some(std::fs::read_to_string(&jinja).with_context(|| format!("cannot read {}", jinja.display()))?);
        }
        let gen = |k: &str| gc.as_ref().and_then(|g| g.get(k)).and_then(token_ids);
        let lookup = |t: &Option<String>| t.as_ref().and_then(|s| tokenizer.token_to_id(s));
        let bos_id =
            gen("bos_token_id").and_then(|v| v.first().copied()).or(cfg.bos_token_id).or_else(|| lookup(&bos_token));
        let mut eos_ids = gen("eos_token_id").unwrap_or_default();
        if eos_ids.is_empty() {
            eos_ids = cfg.eos_token_ids.clone();
        }
        if eos_ids.is_empty() {
            eos_ids.extend(lookup(&eos_token));
        }
        let pad_id = gen("pad_token_id").and_then(|v| v.first().copied());
        Ok(TextTools {
            tokenizer,
            chat_template,
            bos_token,
            eos_token,
            bos_id,
            eos_ids,
            pad_id,
            source: dir.display().to_string(),
        })
    }

    /// Encodes a plain-text prompt with the tokenizer's own special-token rules (e.g. a BOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .tokenizer
            .encode(text, add_special_tokens)
            .map_err(|e| anyhow::anyhow!("{}: cannot encode text: {e}", self.source))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer.decode(ids, true).map_err(|e| anyhow::anyhow!("{}: cannot decode tokens: {e}", self.source))
    }

    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Renders `messages` ([{role, content}, ...]) with the chat template, adding the
    /// assistant generation prompt. The result already holds the template's special tokens, so
    /// it is encoded without adding more.
    pub fn render_chat(&self, messages: &Value) -> Result<String> {
        let tpl = self
            .chat_template
            .as_ref()
            .with_context(|| format!("{}: no chat_template in tokenizer_config.json", self.source))?;
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_template("chat", tpl)
            .map_err(|e| anyhow::anyhow!("{}: chat template does not parse: {e}", self.source))?;
        let t = env.get_template("chat").map_err(|e| anyhow::anyhow!("{e}"))?;
        t.render(minijinja::context! {
            messages => minijinja::Value::from(minijinja::value::Serde(messages)),
            add_generation_prompt => true,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
        })
        .map_err(|e| anyhow::anyhow!("{}: chat template failed: {e}", self.source))
    }
}

/// Special tokens of the tiny byte-level tokenizer (ids 256, 257, 258).
pub const TINY_SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// The ChatML template written for tiny models (Qwen's convention).
pub const CHATML_TEMPLATE: &str = "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// GPT-2's byte → printable character map used by byte-level BPE.
fn byte_chars() -> Vec<char> {
    let mut keep: Vec<u32> = (b'!' as u32..=b'~' as u32).collect();
    keep.extend(0xA1..=0xAC);
    keep.extend(0xAE..=0xFF);
    let mut map = vec!['\0'; 256];
    let mut extra = 0;
    for b in 0..256u32 {
        let c = if keep.contains(&b) {
            b
        } else {
            extra += 1;
            255 + extra
        };
        map[b as usize] = char::from_u32(c).expect("valid scalar");
    }
    map
}

/// A byte-level BPE tokenizer with no merges: every byte is one token (ids 0..=255, so ASCII
/// text is character-level), plus [`TINY_SPECIALS`]. Built with the `tokenizers` crate and
/// loadable by transformers' PreTrainedTokenizerFast.
pub fn byte_level_tokenizer() -> Result<tokenizers::Tokenizer> {
    use tokenizers::models::bpe::{Vocab, BPE};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    let mut vocab = Vocab::new();
    for (b, c) in byte_chars().into_iter().enumerate() {
        vocab.insert(c.to_string(), b as u32);
    }
    for (i, s) in TINY_SPECIALS.iter().enumerate() {
        vocab.insert(s.to_string(), 256 + i as u32);
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, Vec::new())
        .build()
        .map_err(|e| anyhow::anyhow!("cannot build the byte-level BPE: {e}"))?;
    let mut t = tokenizers::Tokenizer::new(bpe);
    t.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    t.with_decoder(Some(ByteLevel::new(false, true, true)));
    let specials: Vec<tokenizers::AddedToken> =
        TINY_SPECIALS.iter().map(|s| tokenizers::AddedToken::from(s.to_string(), true)).collect();
    t.add_special_tokens(&specials);
    Ok(t)
}

/// Writes tokenizer.json, tokenizer_config.json (ChatML template) and generation_config.json
/// for a model using [`byte_level_tokenizer`].
pub fn write_tiny_text_files(dir: &Path) -> Result<()> {
    let t = byte_level_tokenizer()?;
    let json = t.to_string(true).map_err(|e| anyhow::anyhow!("cannot serialize tokenizer: {e}"))?;
    crate::util::write_atomic(&dir.join("tokenizer.json"), json.as_bytes())?;
    let mut added = serde_json::Map::new();
    for (i, s) in TINY_SPECIALS.iter().enumerate() {
        added.insert(
            (256 + i).to_string(),
            serde_json::json!({"content": s, "lstrip": false, "normalized": false, "rstrip": false, "single_word": false, "special": true}),
        );
    }
    let tc = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": null,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 1_000_000,
        "clean_up_tokenization_spaces": false,
        "chat_template": CHATML_TEMPLATE,
    });
    crate::util::write_atomic(&dir.join("tokenizer_config.json"), serde_json::to_string_pretty(&tc)?.as_bytes())?;
    let gc =
        serde_json::json!({"bos_token_id": 256, "eos_token_id": [258, 256], "pad_token_id": 256, "do_sample": true});
    crate::util::write_atomic(&dir.join("generation_config.json"), serde_json::to_string_pretty(&gc)?.as_bytes())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn special_ids_come_from_generation_config_then_config_then_tokenizer_config() {
        let dir = std::env::temp_dir().join(format!("ct-special-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        write_tiny_text_files(&dir).unwrap();
        // config.json's ids differ from generation_config.json's (256 / [258, 256] / 256).
        let cfg = crate::model::ModelConfig::from_json_str(
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,"num_hidden_layers":1,
                "num_attention_heads":4,"num_key_value_heads":2,"vocab_size":300,"bos_token_id":257,"eos_token_id":259}"#,
            "config.json",
        )
        .unwrap();
        let t = TextTools::load(&dir, &cfg).unwrap();
        assert_eq!((t.bos_id, t.eos_ids.clone(), t.pad_id), (Some(256), vec![258, 256], Some(256)));
        // Without generation_config.json: config.json's ids, and no pad id.
        std::fs::remove_file(dir.join("generation_config.json")).unwrap();
        let t = TextTools::load(&dir, &cfg).unwrap();
        assert_eq!((t.bos_id, t.eos_ids.clone(), t.pad_id), (Some(257), vec![259], None));
        // Without either: tokenizer_config.json's eos_token "<|im_end|>" looked up in the
        // vocabulary (bos_token is null there).
        let bare = crate::model::ModelConfig { bos_token_id: None, eos_token_ids: vec![], ..cfg };
        let t = TextTools::load(&dir, &bare).unwrap();
        let im_end = t.tokenizer.token_to_id("<|im_end|>").unwrap();
        assert_eq!((t.bos_id, t.eos_ids.clone()), (None, vec![im_end]));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
