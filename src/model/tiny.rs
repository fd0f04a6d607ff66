//! Tiny model directories: a config from a few sizes, and writing a complete Hugging Face
//! directory (config.json, model.safetensors, byte-level tokenizer, chat template,
//! generation_config.json) that transformers loads unchanged.

use super::config::{Arch, ModelConfig, Rope, RopeScaling};
use super::{tokenizer, ModelWeights};
use crate::device::DType;
use anyhow::{bail, Context, Result};
use std::path::Path;

/// The sizes of a tiny model.
#[derive(Clone, Debug)]
pub struct TinySpec {
    pub arch: String,
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: Option<usize>,
    pub intermediate: Option<usize>,
    pub vocab: usize,
    pub max_position: usize,
    pub tie: bool,
}

/// The config of a tiny model of `arch` (llama gets llama3 rope scaling).
pub fn tiny_config(a: &TinySpec) -> Result<ModelConfig> {
    let arch = Arch::parse(&a.arch)?;
    if a.vocab < 259 {
        bail!("--vocab {} is too small: the byte-level tokenizer needs 259 ids", a.vocab);
    }
    if a.heads == 0 || a.kv_heads == 0 || a.heads % a.kv_heads != 0 {
        bail!("--heads ({}) must be a positive multiple of --kv-heads ({})", a.heads, a.kv_heads);
    }
    let head_dim = match a.head_dim {
        Some(d) => d,
        None => {
            if a.hidden % a.heads != 0 {
                bail!("--hidden ({}) is not divisible by --heads ({}); give --head-dim", a.hidden, a.heads);
            }
            a.hidden / a.heads
        }
    };
    let rope = match arch {
        Arch::Llama => Rope {
            theta: 500000.0,
            scaling: RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 256.0,
            },
        },
        _ => Rope { theta: 1_000_000.0, scaling: RopeScaling::None },
    };
    let cfg = ModelConfig {
        arch,
        vocab_size: a.vocab,
        hidden_size: a.hidden,
        intermediate_size: a.intermediate.unwrap_or(3 * a.hidden),
        num_layers: a.layers,
        num_heads: a.heads,
        num_kv_heads: a.kv_heads,
        head_dim,
        rms_norm_eps: 1e-6,
        rope,
        max_position_embeddings: a.max_position,
        tie_word_embeddings: a.tie,
        qkv_bias: arch == Arch::Qwen2,
        o_bias: false,
        mlp_bias: false,
        qk_norm: arch == Arch::Qwen3,
        bos_token_id: Some(256),
        eos_token_ids: vec![258, 256],
        pad_token_id: Some(256),
        torch_dtype: None,
    };
    // Round-trip through the HF JSON so that what we write is what we validate.
    ModelConfig::from_json_str(&cfg.to_hf_json("float32").to_string(), "generated config")
}

/// Fails unless `dir` is absent or an empty directory; then creates it.
pub fn prepare_empty_dir(dir: &Path) -> Result<()> {
    if dir.exists() {
        let mut it = std::fs::read_dir(dir)
            .with_context(|| format!("{} exists and is not a readable directory", dir.display()))?;
        if it.next().is_some() {
            bail!("{} already exists and is not empty; refusing to overwrite it", dir.display());
        }
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))
}

/// Writes a complete model directory with the given config and weights.
pub fn write_model_dir(dir: &Path, cfg: &ModelConfig, w: &ModelWeights, dtype: DType) -> Result<()> {
    let torch = match dtype {
        DType::F32 => "float32",
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        other => bail!("cannot store weights as {}", other.name()),
    };
    w.save(cfg, dir, dtype)?;
    crate::util::write_atomic(
        &dir.join("config.json"),
        serde_json::to_string_pretty(&cfg.to_hf_json(torch))?.as_bytes(),
    )?;
    tokenizer::write_tiny_text_files(dir)
}
