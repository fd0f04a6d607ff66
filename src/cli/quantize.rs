//! `colotrain quantize`: export a model in the ModelOpt layout (FP8 or NVFP4, FP8 KV scales),
//! with activation and KV scales from a calibration file or a calibration pass over prompts.

use super::DeviceArgs;
use crate::config::{EngineSection, KvScaleConfig};
use crate::data::dataset::PromptItem;
use crate::data::prompts::{encode_prompt, read_prompts};
use crate::device::DType;
use crate::engine::{Engine, EngineConfig, SamplingConfig};
use crate::model::calib::Calibration;
use crate::model::tiny::prepare_empty_dir;
use crate::model::LoadedModel;
use crate::model::QuantState;
use anyhow::{bail, Result};
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[arg(long)]
    pub model: PathBuf,
    /// fp8 (W8A8 + FP8 KV) or nvfp4 (W4A4 + FP8 KV).
    #[arg(long)]
    pub recipe: String,
    /// Keep in the model's dtype: first-layer-kv, first-layer, last-layer (repeatable).
    #[arg(long)]
    pub keep_bf16: Vec<String>,
    /// Calibration file (from a run's calibration.json). Else calibrate on --prompts.
    #[arg(long)]
    pub calibration: Option<PathBuf>,
    /// Prompts (JSONL) to calibrate activation and KV scales on.
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    #[arg(long, default_value_t = 128)]
    pub max_new_tokens: usize,
    /// Stored dtype of the unquantized tensors: bf16 or f32.
    #[arg(long, default_value = "bf16")]
    pub out_dtype: String,
    #[arg(long)]
    pub out: PathBuf,
    #[command(flatten)]
    pub device: DeviceArgs,
}

pub fn run(a: Args) -> Result<()> {
    if !matches!(a.recipe.as_str(), "fp8" | "nvfp4") {
        bail!("--recipe: expected fp8 or nvfp4, got '{}'", a.recipe);
    }
    let (dev, dtype) = a.device.open()?;
    let lm = LoadedModel::load(&a.model, &dev, dtype)?;
    let es = EngineSection {
        recipe: a.recipe.clone(),
        keep_bf16: a.keep_bf16.clone(),
        kv_scale: KvScaleConfig::Name("calibrated".into()),
        ..Default::default()
    };
    let spec = es.spec(lm.cfg.num_layers)?;
    let calib = match (&a.calibration, &a.prompts) {
        (Some(p), _) => Calibration::load(p, &lm.cfg)?,
        (None, Some(p)) => {
            let lines = read_prompts(p, lm.cfg.vocab_size)?;
            let prompts: Vec<PromptItem> = lines
                .iter()
                .enumerate()
                .map(|(i, l)| {
                    Ok(PromptItem {
                        id: i as u64,
                        tokens: encode_prompt(l, lm.text.as_deref(), false, p)?,
                        answer: None,
                        response: None,
                        meta: None,
                    })
                })
                .collect::<Result<_>>()?;
            let mut e = Engine::new(&dev, &lm.cfg, lm.weights.dtype(), &EngineConfig::default(), lm.text.clone())?;
            let s = SamplingConfig { max_new_tokens: a.max_new_tokens, ..Default::default() };
            crate::train::calibrate::calibrate(&mut e, &lm.weights, &lm.cfg, &prompts, &s, 20261008)?
        }
        (None, None) => bail!("give --calibration FILE or --prompts FILE to set activation and KV scales"),
    };
    let mut q = QuantState::new(&dev, &spec.recipe, &lm.cfg, &lm.weights, Some(&calib))?;
    q.sync(&dev, &lm.weights)?;
    prepare_empty_dir(&a.out)?;
    let out_dtype = DType::parse(&a.out_dtype)?;
    crate::model::modelopt::export(&a.out, &lm.cfg, &lm.weights, &q, out_dtype)?;
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"] {
        let src = a.model.join(f);
        if src.exists() {
            std::fs::copy(&src, a.out.join(f))?;
        }
    }
    println!(
        "wrote {} ({} of {} layers quantized, {:.1} MiB of quantized weights)",
        a.out.display(),
        spec.recipe
            .layers
            .iter()
            .filter(|l| l.weight.iter().any(|p| *p != crate::quant::recipe::Precision::Native))
            .count(),
        lm.cfg.num_layers,
        q.size_bytes() as f64 / (1 << 20) as f64
    );
    Ok(())
}
