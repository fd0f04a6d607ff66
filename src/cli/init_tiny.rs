//! `colotrain init-tiny`: a complete, tiny, random Hugging Face model directory.

use crate::device::{DType, Device};
use crate::model::config::{Arch, Rope, RopeScaling};
use crate::model::{tokenizer, ModelConfig, ModelWeights};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// llama, qwen2 or qwen3.
    #[arg(long, default_value = "qwen2")]
    pub arch: String,
    /// Output directory (must not exist or be empty).
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    #[arg(long, default_value_t = 128)]
    pub hidden: usize,
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    #[arg(long, default_value_t = 2)]
    pub kv_heads: usize,
    /// Head dimension (default hidden / heads).
    #[arg(long)]
    pub head_dim: Option<usize>,
    /// MLP width (default 3 × hidden).
    #[arg(long)]
    pub intermediate: Option<usize>,
    /// Vocabulary size (at least 259: 256 bytes + 3 special tokens).
    #[arg(long, default_value_t = 320)]
    pub vocab: usize,
    #[arg(long, default_value_t = 2048)]
    pub max_position: usize,
    /// Tie the LM head to the embeddings.
    #[arg(long)]
    pub tie: bool,
    /// Std of the random projections and embeddings.
    #[arg(long, default_value_t = 0.02)]
    pub std: f64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stored dtype: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Replace the model files in an existing --out directory (other files are left alone).
    #[arg(long)]
    pub force: bool,
}

/// The config of a tiny model of `arch` (llama gets llama3 rope scaling).
pub fn tiny_config(a: &Args) -> Result<ModelConfig> {
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

pub fn run(a: Args) -> Result<()> {
    let cfg = tiny_config(&a)?;
    let dtype = DType::parse(&a.dtype).map_err(|e| anyhow::anyhow!("--dtype: {e}"))?;
    if a.force {
        std::fs::create_dir_all(&a.out).with_context(|| format!("cannot create {}", a.out.display()))?;
    } else {
        prepare_empty_dir(&a.out)?;
    }
    let dev = Device::cpu(0)?;
    let w = ModelWeights::random(&cfg, &dev, DType::F32, a.seed, a.std)?;
    write_model_dir(&a.out, &cfg, &w, dtype)?;
    println!(
        "wrote {} ({}, {} layers, hidden {}, {} parameters)",
        a.out.display(),
        cfg.arch.hf_name(),
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_params()
    );
    Ok(())
}
