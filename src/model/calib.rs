//! Calibration: the max magnitudes of every linear's input and of the keys and values, per layer,
//! observed while the untrained student generates N responses with the standard engine (seed 000
//! App. C.1). Scales derive from them (FP8: amax / 448; NVFP4 global: amax / 2688) and stay fixed
//! for the run. Saved next to the run as JSON with the model's fingerprint.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Linear inputs per layer: 0 = q/k/v (shared input), 1 = o, 2 = gate/up (shared), 3 = down.
pub const INPUTS: usize = 4;

/// The input slot of linear i (in `recipe::LINEARS` order).
pub fn input_slot(linear: usize) -> usize {
    [0, 0, 0, 1, 2, 2, 3][linear]
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Calibration {
    /// Hash of the model's config and parameter count: a file from another model is refused.
    pub model: String,
    pub samples: usize,
    pub tokens: usize,
    pub input_amax: Vec<[f32; INPUTS]>,
    pub k_amax: Vec<f32>,
    pub v_amax: Vec<f32>,
}

impl Calibration {
    pub fn new(model: String, layers: usize) -> Calibration {
        Calibration {
            model,
            samples: 0,
            tokens: 0,
            input_amax: vec![[0.0; INPUTS]; layers],
            k_amax: vec![0.0; layers],
            v_amax: vec![0.0; layers],
        }
    }

    /// The fingerprint of a model config.
    pub fn fingerprint(cfg: &crate::model::ModelConfig) -> String {
        format!("{:016x}-{}", crate::rand::fnv1a64(cfg.to_hf_json("").to_string().as_bytes()), cfg.num_params())
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        crate::util::write_atomic(path, serde_json::to_string_pretty(self)?.as_bytes())
    }

    pub fn load(path: &Path, cfg: &crate::model::ModelConfig) -> Result<Calibration> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("cannot read calibration {}", path.display()))?;
        let c: Calibration =
            serde_json::from_str(&text).with_context(|| format!("{}: not a calibration file", path.display()))?;
        let fp = Self::fingerprint(cfg);
        if c.model != fp || c.input_amax.len() != cfg.num_layers || c.k_amax.len() != cfg.num_layers {
            bail!(
                "{}: these scales belong to another model (fingerprint {}, this model {fp})",
                path.display(),
                c.model
            );
        }
        Ok(c)
    }
}
