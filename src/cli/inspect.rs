//! `colotrain inspect --model DIR`.

use crate::engine::kv_cache::KvCache;
use crate::model::{weights::SafetensorsFiles, ModelConfig, TextTools};
use anyhow::Result;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Hugging Face model directory.
    #[arg(long)]
    pub model: PathBuf,
}

pub fn run(a: Args) -> Result<()> {
    let cfg = ModelConfig::from_dir(&a.model)?;
    let files = SafetensorsFiles::open(&a.model)?;
    let mut dtypes = std::collections::BTreeMap::<String, usize>::new();
    let mut stored = 0usize;
    for name in files.names() {
        let (_, v) = files.get(name)?;
        *dtypes.entry(format!("{:?}", v.dtype())).or_default() += 1;
        stored += v.data().len();
    }
    let n = cfg.num_params();
    let gib = |b: f64| b / (1u64 << 30) as f64;
    println!("model        {}", a.model.display());
    println!("architecture {} ({})", cfg.arch.hf_name(), cfg.arch.model_type());
    println!("layers       {}", cfg.num_layers);
    println!("hidden       {} (intermediate {})", cfg.hidden_size, cfg.intermediate_size);
    println!(
        "attention    {} query heads, {} KV heads (GQA {}:1), head_dim {}{}{}",
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.num_heads / cfg.num_kv_heads,
        cfg.head_dim,
        if cfg.qkv_bias { ", qkv bias" } else { "" },
        if cfg.qk_norm { ", q/k norm" } else { "" }
    );
    println!(
        "vocab        {} (embeddings {})",
        cfg.vocab_size,
        if cfg.tie_word_embeddings { "tied" } else { "untied" }
    );
    println!("rope         theta {} {:?}", cfg.rope.theta, cfg.rope.scaling);
    println!("max length   {}", cfg.max_position_embeddings);
    println!("parameters   {} ({:.3} B)", n, n as f64 / 1e9);
    let dt: Vec<String> = dtypes.iter().map(|(k, v)| format!("{k} x{v}")).collect();
    println!("stored       {} tensors: {} ({:.3} GiB)", files.names().count(), dt.join(", "), gib(stored as f64));
    println!(
        "memory       weights bf16 {:.3} GiB, f32 {:.3} GiB; training (bf16 weights + f32 master + Adam m, v + f32 grads) {:.3} GiB",
        gib(n as f64 * 2.0),
        gib(n as f64 * 4.0),
        gib(n as f64 * (2.0 + 4.0 * 4.0))
    );
    // generate / score on CPU: the linears (projections and the LM head) packed once, in the
    // weights' dtype, beside the weights (--no-pack skips it).
    let linears = cfg.num_layers
        * (cfg.hidden_size * (2 * cfg.q_dim() + 2 * cfg.kv_dim()) + 3 * cfg.hidden_size * cfg.intermediate_size)
        + cfg.vocab_size * cfg.hidden_size;
    println!(
        "decode copy  CPU generate/score pack the linears once: +{:.3} GiB in bf16, +{:.3} GiB in f32 (--no-pack: none)",
        gib(linears as f64 * 2.0),
        gib(linears as f64 * 4.0)
    );
    let per_tok = KvCache::block_bytes(&cfg, 1, crate::device::DType::BF16);
    println!(
        "KV cache     {} KiB per token in bf16 ({:.3} GiB for one {}-token sequence)",
        per_tok / 1024,
        gib((per_tok * cfg.max_position_embeddings) as f64),
        cfg.max_position_embeddings
    );
    match TextTools::load(&a.model, &cfg) {
        Ok(t) => println!(
            "tokenizer    {} tokens, chat template {}, bos {:?}, eos {:?}",
            t.vocab_size(),
            if t.has_chat_template() { "yes" } else { "no" },
            t.bos_id,
            t.eos_ids
        ),
        Err(e) => println!("tokenizer    none ({e:#})"),
    }
    Ok(())
}
