//! `config.json` of a Hugging Face causal LM: parsing (both rope spellings), validation, and
//! writing back with the real HF field names.
//!
//! Owns: [`ModelConfig`], [`Arch`], [`Rope`]. May call: serde_json. Must not: touch weights.

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};
use std::path::Path;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
}

impl Arch {
    pub fn hf_name(self) -> &'static str {
        match self {
            Arch::Llama => "LlamaForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
        }
    }
    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
        }
    }
    pub fn parse(s: &str) -> Result<Arch> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "llama" | "llamaforcausallm" => Arch::Llama,
            "qwen2" | "qwen2forcausallm" => Arch::Qwen2,
            "qwen3" | "qwen3forcausallm" => Arch::Qwen3,
            _ => bail!("unknown architecture '{s}': expected llama, qwen2 or qwen3"),
        })
    }
}

/// RoPE frequency scaling.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor` (equivalently, every frequency divided by it).
    Linear {
        factor: f64,
    },
    /// Llama 3.x frequency-dependent scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    pub theta: f64,
    pub scaling: RopeScaling,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope: Rope,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Biases on q/k/v projections (always for Qwen2; `attention_bias` for Llama/Qwen3).
    pub qkv_bias: bool,
    /// Bias on the output projection (`attention_bias` for Llama/Qwen3).
    pub o_bias: bool,
    /// Biases on the MLP projections (`mlp_bias`, Llama).
    pub mlp_bias: bool,
    /// Per-head RMSNorm on q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// transformers builds the embedding as nn.Embedding(padding_idx = pad_token_id): that row
    /// gets no gradient from lookups (the trainer reproduces this).
    pub pad_token_id: Option<u32>,
    /// The dtype the checkpoint declares (`torch_dtype` / `dtype`), informational.
    pub torch_dtype: Option<String>,
}

struct Fields<'a> {
    obj: &'a Map<String, Value>,
    file: String,
}

impl<'a> Fields<'a> {
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }
    fn usize_req(&self, key: &str) -> Result<usize> {
        let v = self.get(key).with_context(|| format!("{}: missing field '{key}'", self.file))?;
        as_usize(v).with_context(|| format!("{}: field '{key}' must be a non-negative integer, got {v}", self.file))
    }
    fn usize_opt(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => {
                Ok(Some(as_usize(v).with_context(|| {
                    format!("{}: field '{key}' must be a non-negative integer, got {v}", self.file)
                })?))
            }
        }
    }
    fn f64_opt(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => {
                Ok(Some(v.as_f64().with_context(|| format!("{}: field '{key}' must be a number, got {v}", self.file))?))
            }
        }
    }
    fn bool_opt(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => Ok(Some(
                v.as_bool().with_context(|| format!("{}: field '{key}' must be true or false, got {v}", self.file))?,
            )),
        }
    }
}

fn as_usize(v: &Value) -> Option<usize> {
    v.as_u64().map(|x| x as usize)
}

/// Token ids may be an integer or a list of integers in HF files.
pub fn token_ids(v: &Value) -> Option<Vec<u32>> {
    match v {
        Value::Number(n) => n.as_u64().map(|x| vec![x as u32]),
        Value::Array(a) => a.iter().map(|x| x.as_u64().map(|x| x as u32)).collect(),
        _ => None,
    }
}

fn parse_rope_block(block: &Map<String, Value>, where_: &str, theta_default: Option<f64>) -> Result<Rope> {
    let num = |k: &str| -> Result<Option<f64>> {
        match block.get(k).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => Ok(Some(v.as_f64().with_context(|| format!("{where_}.{k} must be a number, got {v}"))?)),
        }
    };
    let theta = match num("rope_theta")? {
        Some(t) => t,
        None => theta_default.with_context(|| format!("{where_}: missing 'rope_theta'"))?,
    };
    let kind = block.get("rope_type").or_else(|| block.get("type")).and_then(|v| v.as_str()).unwrap_or("default");
    let req = |k: &str| -> Result<f64> { num(k)?.with_context(|| format!("{where_}: rope type '{kind}' needs '{k}'")) };
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: req("factor")? },
        "llama3" => RopeScaling::Llama3 {
            factor: req("factor")?,
            low_freq_factor: req("low_freq_factor")?,
            high_freq_factor: req("high_freq_factor")?,
            original_max_position_embeddings: req("original_max_position_embeddings")?,
        },
        other => bail!("{where_}: rope type '{other}' is not supported (supported: default, linear, llama3)"),
    };
    if let RopeScaling::Llama3 { low_freq_factor, high_freq_factor, .. } = &scaling {
        if high_freq_factor <= low_freq_factor {
            bail!("{where_}: llama3 rope needs high_freq_factor > low_freq_factor");
        }
    }
    if !(theta > 0.0) {
        bail!("{where_}: rope_theta must be positive, got {theta}");
    }
    Ok(Rope { theta, scaling })
}

impl ModelConfig {
    /// Reads and validates `DIR/config.json`.
    pub fn from_dir(dir: &Path) -> Result<ModelConfig> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).with_context(|| {
            format!("cannot read {} (is '{}' a Hugging Face model directory?)", path.display(), dir.display())
        })?;
        Self::from_json_str(&text, &path.display().to_string())
    }

    pub fn from_json_str(text: &str, file: &str) -> Result<ModelConfig> {
        let v: Value = serde_json::from_str(text).with_context(|| format!("{file}: not valid JSON"))?;
        let obj = v.as_object().with_context(|| format!("{file}: expected a JSON object"))?;
        let f = Fields { obj, file: file.to_string() };
        let arch_name = match f.get("architectures").and_then(|a| a.as_array()).and_then(|a| a.first()) {
            Some(a) => a.as_str().with_context(|| format!("{file}: 'architectures' must hold strings"))?.to_string(),
            None => f
                .get("model_type")
                .and_then(|m| m.as_str())
                .with_context(|| format!("{file}: missing 'architectures' (and no 'model_type')"))?
                .to_string(),
        };
        let arch = match arch_name.as_str() {
            "LlamaForCausalLM" | "llama" => Arch::Llama,
            "Qwen2ForCausalLM" | "qwen2" => Arch::Qwen2,
            "Qwen3ForCausalLM" | "qwen3" => Arch::Qwen3,
            other => bail!(
                "{file}: architecture '{other}' is not supported (supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)"
            ),
        };
        if let Some(act) = f.get("hidden_act") {
            if act.as_str() != Some("silu") {
                bail!("{file}: hidden_act {act} is not supported (expected \"silu\")");
            }
        }
        if f.bool_opt("use_sliding_window")?.unwrap_or(false) {
            bail!("{file}: use_sliding_window = true is not supported (full attention only)");
        }
        let hidden_size = f.usize_req("hidden_size")?;
        let num_heads = f.usize_req("num_attention_heads")?;
        let num_kv_heads = f.usize_opt("num_key_value_heads")?.unwrap_or(num_heads);
        let head_dim = match f.usize_opt("head_dim")? {
            Some(d) => d,
            None => {
                if num_heads == 0 || hidden_size % num_heads != 0 {
                    bail!("{file}: hidden_size {hidden_size} is not divisible by num_attention_heads {num_heads} and no head_dim is given");
                }
                hidden_size / num_heads
            }
        };
        // Rope: transformers 5 writes a `rope_parameters` block; older checkpoints have
        // `rope_theta` (+ optional `rope_scaling`) at the top level.
        let top_theta = f.f64_opt("rope_theta")?;
        let rope = if let Some(rp) = f.get("rope_parameters") {
            let block = rp.as_object().with_context(|| format!("{file}: 'rope_parameters' must be an object"))?;
            parse_rope_block(block, &format!("{file}: rope_parameters"), top_theta)?
        } else if let Some(rs) = f.get("rope_scaling") {
            let block = rs.as_object().with_context(|| format!("{file}: 'rope_scaling' must be an object or null"))?;
            parse_rope_block(block, &format!("{file}: rope_scaling"), Some(top_theta.unwrap_or(10000.0)))?
        } else {
            let theta = top_theta.unwrap_or(10000.0);
            if !(theta > 0.0) {
                bail!("{file}: rope_theta must be positive, got {theta}");
            }
            Rope { theta, scaling: RopeScaling::None }
        };
        let attention_bias = f.bool_opt("attention_bias")?.unwrap_or(false);
        let (qkv_bias, o_bias) = match arch {
            Arch::Qwen2 => (true, false),
            Arch::Llama | Arch::Qwen3 => (attention_bias, attention_bias),
        };
        let cfg = ModelConfig {
            arch,
            vocab_size: f.usize_req("vocab_size")?,
            hidden_size,
            intermediate_size: f.usize_req("intermediate_size")?,
            num_layers: f.usize_req("num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: f.f64_opt("rms_norm_eps")?.unwrap_or(1e-6),
            rope,
            max_position_embeddings: f.usize_opt("max_position_embeddings")?.unwrap_or(4096),
            tie_word_embeddings: f.bool_opt("tie_word_embeddings")?.unwrap_or(false),
            qkv_bias,
            o_bias,
            mlp_bias: arch == Arch::Llama && f.bool_opt("mlp_bias")?.unwrap_or(false),
            qk_norm: arch == Arch::Qwen3,
            bos_token_id: f.get("bos_token_id").and_then(token_ids).and_then(|v| v.first().copied()),
            eos_token_ids: f.get("eos_token_id").and_then(token_ids).unwrap_or_default(),
            pad_token_id: f.get("pad_token_id").and_then(token_ids).and_then(|v| v.first().copied()),
            torch_dtype: f.get("torch_dtype").or_else(|| f.get("dtype")).and_then(|d| d.as_str()).map(str::to_string),
        };
        cfg.validate(file)?;
        Ok(cfg)
    }

    fn validate(&self, file: &str) -> Result<()> {
        let pos = |name: &str, v: usize| -> Result<()> {
            if v == 0 {
                bail!("{file}: '{name}' must be positive");
            }
            Ok(())
        };
        pos("vocab_size", self.vocab_size)?;
        pos("hidden_size", self.hidden_size)?;
        pos("intermediate_size", self.intermediate_size)?;
        pos("num_hidden_layers", self.num_layers)?;
        pos("num_attention_heads", self.num_heads)?;
        pos("num_key_value_heads", self.num_kv_heads)?;
        pos("head_dim", self.head_dim)?;
        if self.num_heads % self.num_kv_heads != 0 {
            bail!(
                "{file}: num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.num_heads,
                self.num_kv_heads
            );
        }
        if self.head_dim % 2 != 0 {
            bail!("{file}: head_dim ({}) must be even for rotary embeddings", self.head_dim);
        }
        if !(self.rms_norm_eps > 0.0) {
            bail!("{file}: rms_norm_eps must be positive");
        }
        if self.vocab_size > u32::MAX as usize / 2 {
            bail!("{file}: vocab_size {} is too large", self.vocab_size);
        }
        Ok(())
    }

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Number of parameters (tied embeddings counted once).
    pub fn num_params(&self) -> usize {
        let (c, i, q, kv) = (self.hidden_size, self.intermediate_size, self.q_dim(), self.kv_dim());
        let mut per_layer = 2 * c + q * c + 2 * kv * c + c * q + 3 * c * i;
        if self.qkv_bias {
            per_layer += q + 2 * kv;
        }
        if self.o_bias {
            per_layer += c;
        }
        if self.mlp_bias {
            per_layer += 2 * i + c;
        }
        if self.qk_norm {
            per_layer += 2 * self.head_dim;
        }
        let embed = self.vocab_size * c;
        let head = if self.tie_word_embeddings { 0 } else { embed };
        embed + head + c + self.num_layers * per_layer
    }

    /// The `config.json` that transformers reads, in the classic spelling (top-level
    /// `rope_theta` + `rope_scaling`), which transformers 4.x reads and 5.x converts.
    pub fn to_hf_json(&self, dtype: &str) -> Value {
        let rope_scaling = match &self.rope.scaling {
            RopeScaling::None => Value::Null,
            RopeScaling::Linear { factor } => json!({"rope_type": "linear", "factor": factor}),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                json!({
                    "rope_type": "llama3",
                    "factor": factor,
                    "low_freq_factor": low_freq_factor,
                    "high_freq_factor": high_freq_factor,
                    "original_max_position_embeddings": *original_max_position_embeddings as u64,
                })
            }
        };
        let mut m = json!({
            "architectures": [self.arch.hf_name()],
            "model_type": self.arch.model_type(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope.theta,
            "rope_scaling": rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": 0.02,
            "use_cache": true,
            "torch_dtype": dtype,
            "attention_dropout": 0.0,
        });
        let o = m.as_object_mut().expect("json! object");
        match self.arch {
            Arch::Llama => {
                o.insert("attention_bias".into(), json!(self.qkv_bias));
                o.insert("mlp_bias".into(), json!(self.mlp_bias));
                o.insert("pretraining_tp".into(), json!(1));
            }
            Arch::Qwen2 => {
                o.insert("use_sliding_window".into(), json!(false));
                o.insert("sliding_window".into(), json!(self.max_position_embeddings));
                o.insert("max_window_layers".into(), json!(self.num_layers));
            }
            Arch::Qwen3 => {
                o.insert("attention_bias".into(), json!(self.qkv_bias));
                o.insert("use_sliding_window".into(), json!(false));
                o.insert("sliding_window".into(), Value::Null);
                o.insert("max_window_layers".into(), json!(self.num_layers));
            }
        }
        if let Some(b) = self.bos_token_id {
            o.insert("bos_token_id".into(), json!(b));
        }
        if let Some(p) = self.pad_token_id {
            o.insert("pad_token_id".into(), json!(p));
        }
        match self.eos_token_ids.as_slice() {
            [] => {}
            [e] => {
                o.insert("eos_token_id".into(), json!(e));
            }
            many => {
                o.insert("eos_token_id".into(), json!(many));
            }
        }
        m
    }
}
