//! Models: Hugging Face directories in (config, safetensors, tokenizer, chat template) and out,
//! and the transformer forward shared by the decoding engine and the scorer.
//!
//! Owns: config parsing, weight loading/saving, tokenization, the forward pass and its training
//! twin (`trainable`, the NVFP4 learner in `learner_quant`), an engine's quantized weight set
//! (`quant_state`) and calibration scales (`calib`), ModelOpt import / export, the tiny models'
//! shapes (`tiny`). May call: `crate::device`, `crate::quant`, `crate::ops`. Must not: schedule
//! requests or sample (engine/).

pub mod calib;
pub mod config;
pub mod learner_quant;
pub mod modelopt;
pub mod quant_state;
pub mod rope;
pub mod tiny;
pub mod tokenizer;
pub mod trainable;
pub mod trainable_device;
pub mod transformer;
pub mod weights;

pub use config::{Arch, ModelConfig};
pub use quant_state::{QLayer, QuantState};
pub use tokenizer::TextTools;
pub use transformer::{ForwardBuffers, Transformer};
pub use weights::ModelWeights;

use crate::device::{DType, Device};
use anyhow::Result;
use std::path::Path;
use std::sync::Arc;

/// A model directory loaded onto a device: config, weights, and (when present) its tokenizer.
pub struct LoadedModel {
    pub dir: std::path::PathBuf,
    pub cfg: ModelConfig,
    pub weights: ModelWeights,
    pub text: Option<Arc<TextTools>>,
    /// A ModelOpt-quantized directory's engine view (its stored codes and scales).
    pub quant: Option<crate::model::QuantState>,
}

impl LoadedModel {
    /// Loads `dir`. The tokenizer is optional here (token-id inputs need none); commands that
    /// need text report its absence themselves.
    pub fn load(dir: &Path, dev: &Device, dtype: DType) -> Result<LoadedModel> {
        if !dir.is_dir() {
            anyhow::bail!("model directory '{}' does not exist", dir.display());
        }
        let cfg = ModelConfig::from_dir(dir)?;
        let (weights, quant) = match modelopt::detect(dir)? {
            Some(q) => {
                let (w, s) = modelopt::load(dir, &cfg, dev, dtype, &q)?;
                (w, Some(s))
            }
            None => (ModelWeights::load(dir, &cfg, dev, dtype)?, None),
        };
        let text = if dir.join("tokenizer.json").exists() { Some(Arc::new(TextTools::load(dir, &cfg)?)) } else { None };
        if let Some(t) = &text {
            if t.vocab_size() > cfg.vocab_size {
                anyhow::bail!(
                    "{}: tokenizer has {} tokens but config.json's vocab_size is {}",
                    dir.display(),
                    t.vocab_size(),
                    cfg.vocab_size
                );
            }
        }
        Ok(LoadedModel { dir: dir.to_path_buf(), cfg, weights, text, quant })
    }

    /// For engines whose weights stay fixed (`generate`, `score`): packs the CPU linears once
    /// ([`ModelWeights::pack_panels`]; the same outputs, bit for bit, without per-step packing)
    /// and says what it cost.
    pub fn pack_for_decode(&mut self) -> Result<()> {
        if self.weights.pack_panels()? {
            let bytes: usize = self
                .weights
                .panels()
                .map(|p| p.layers.iter().flatten().chain([&p.head]).map(|x| x.size_bytes()).sum())
                .unwrap_or(0);
            tracing::info!("packed the linears for decoding: {:.1} MiB", bytes as f64 / (1 << 20) as f64);
        }
        Ok(())
    }
}
