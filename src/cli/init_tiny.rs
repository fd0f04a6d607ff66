//! `colotrain init-tiny`: a complete, tiny, random Hugging Face model directory.

use crate::device::{DType, Device};
use crate::model::tiny::{prepare_empty_dir, tiny_config, write_model_dir, TinySpec};
use crate::model::ModelWeights;
use anyhow::{Context, Result};
use std::path::PathBuf;

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
    /// Instead of a random model: build the built-in tiny arithmetic teacher and student (SFT)
    /// and copy them to --out/teacher and --out/student.
    #[arg(long)]
    pub teacher: bool,
}

impl Args {
    pub fn spec(&self) -> TinySpec {
        TinySpec {
            arch: self.arch.clone(),
            layers: self.layers,
            hidden: self.hidden,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            intermediate: self.intermediate,
            vocab: self.vocab,
            max_position: self.max_position,
            tie: self.tie,
        }
    }
}

pub fn run(a: Args) -> Result<()> {
    if a.teacher {
        prepare_empty_dir(&a.out)?;
        for which in ["teacher", "student"] {
            let src = crate::orchestrator::tiny::resolve(&format!("builtin:tiny-arith-{which}"))?;
            let dst = a.out.join(which);
            std::fs::create_dir_all(&dst)?;
            for e in std::fs::read_dir(&src).with_context(|| format!("cannot list {}", src.display()))? {
                let e = e?;
                std::fs::copy(e.path(), dst.join(e.file_name()))?;
            }
        }
        println!(
            "wrote {}/teacher and {}/student (the built-in tiny arithmetic models)",
            a.out.display(),
            a.out.display()
        );
        return Ok(());
    }
    let cfg = tiny_config(&a.spec())?;
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
