//! The calibration pass (seed 000 App. C.1): the untrained student generates responses with the
//! standard engine while the forward records the max magnitude of every linear input and of the
//! keys and values per layer.

use crate::data::dataset::PromptItem;
use crate::engine::rollout;
use crate::engine::{Engine, SamplingConfig};
use crate::model::calib::Calibration;
use crate::model::{ModelConfig, ModelWeights};
use anyhow::Result;
use std::sync::Arc;

pub fn calibrate(
    engine: &mut Engine,
    w: &ModelWeights,
    cfg: &ModelConfig,
    prompts: &[PromptItem],
    sampling: &SamplingConfig,
    seed: u64,
) -> Result<Calibration> {
    engine.set_observer(Some(Calibration::new(Calibration::fingerprint(cfg), cfg.num_layers)));
    let s = Arc::new(SamplingConfig { seed: seed ^ 20261008, ..sampling.clone() });
    let r = rollout::generate(engine, w, prompts, 1, &s, u64::MAX >> 33, 0);
    let mut c = engine.set_observer(None).unwrap_or_else(|| Calibration::new(String::new(), 0));
    let r = r?;
    c.samples = r.len();
    c.tokens = r.iter().map(|x| x.prompt.len() + x.response.len()).sum();
    Ok(c)
}
