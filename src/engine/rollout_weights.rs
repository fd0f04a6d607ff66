//! What a rollout engine reads, and its in-place resync from the trainer's weights: the standard
//! engine reads the trainer's tensors themselves (no copy); a stale engine reads a ring of up to
//! k older versions (seed 000 App. C.5); a weight-noise engine adds σ·s_w·ε_w to every projection
//! matrix (App. C.4: s_w the matrix's std at the first sync, ε_w ~ N(0, I) from a Philox stream
//! keyed by (seed, tensor name), fixed across syncs and devices, unseen by the trainer); a
//! quantized engine re-quantizes its preallocated buffers (recipe, `quant::state`). They compose:
//! staleness, then noise, then quantization. Every buffer is allocated at construction; a sync
//! rewrites them in place.

use super::View;
use crate::model::{ModelConfig, ModelWeights};
use crate::quant::calib::Calibration;
use crate::quant::recipe::Recipe;
use crate::quant::QuantState;
use anyhow::Result;
use std::collections::VecDeque;

#[derive(Clone, Debug, PartialEq)]
pub struct EngineSpec {
    pub recipe: Recipe,
    pub noise_sigma: f64,
    pub noise_seed: u64,
    /// Engine weights are this many versions behind the trainer's (0: current).
    pub staleness: usize,
}

struct Noise {
    sigma: f64,
    seed: u64,
    weights: ModelWeights,
    /// Per parameter: Some(s_w) for projection matrices (set at the first sync), None otherwise.
    std: Vec<Option<f64>>,
    is_projection: Vec<bool>,
    names: Vec<String>,
    scratch: Vec<f32>,
}

pub struct RolloutWeights {
    pub spec: EngineSpec,
    cfg: ModelConfig,
    ring: VecDeque<(u64, ModelWeights)>,
    noise: Option<Noise>,
    pub quant: Option<QuantState>,
    /// The trainer version the engine's view reflects.
    pub version: u64,
    pub syncs: u64,
}

fn is_projection(name: &str) -> bool {
    name.starts_with("model.layers.") && name.ends_with("_proj.weight")
}

impl RolloutWeights {
    /// Builds the engine's buffers for `spec` and syncs them with the trainer's weights `w`
    /// (version `version`).
    pub fn new(spec: &EngineSpec, cfg: &ModelConfig, w: &ModelWeights, calib: Option<&Calibration>, version: u64) -> Result<RolloutWeights> {
        let noise = if spec.noise_sigma > 0.0 {
            let names: Vec<String> = crate::model::weights::param_specs(cfg).into_iter().map(|(n, _)| n).collect();
            Some(Noise {
                sigma: spec.noise_sigma,
                seed: spec.noise_seed,
                weights: w.try_clone(cfg)?,
                std: vec![None; names.len()],
                is_projection: names.iter().map(|n| is_projection(n)).collect(),
                names,
                scratch: Vec::new(),
            })
        } else {
            None
        };
        let quant = if spec.recipe.is_standard() { None } else { Some(QuantState::new(&spec.recipe, cfg, w, calib)?) };
        let mut rw = RolloutWeights { spec: spec.clone(), cfg: cfg.clone(), ring: VecDeque::new(), noise, quant, version, syncs: 0 };
        if spec.staleness > 0 {
            for _ in 0..=spec.staleness {
                rw.ring.push_back((version, w.try_clone(cfg)?));
            }
        }
        rw.sync(w, version)?;
        Ok(rw)
    }

    /// Rewrites the engine's buffers from the trainer's weights `w` at `version`, in place.
    pub fn sync(&mut self, w: &ModelWeights, version: u64) -> Result<()> {
        // Staleness: the ring holds versions v−k..v; the oldest slot is reused for v.
        let base_version = if self.spec.staleness > 0 {
            if let Some((v, _)) = self.ring.back() {
                if *v != version {
                    let (_, mut slot) = self.ring.pop_front().expect("ring is never empty");
                    slot.copy_from(w)?;
                    self.ring.push_back((version, slot));
                }
            }
            self.ring.front().map(|(v, _)| *v).unwrap_or(version)
        } else {
            version
        };
        let base: &ModelWeights = match self.ring.front() {
            Some((_, s)) if self.spec.staleness > 0 => s,
            _ => w,
        };
        if let Some(n) = &mut self.noise {
            n.weights.copy_from(base)?;
            let Noise { weights, std, is_projection, names, scratch, sigma, seed } = n;
            weights.for_each_mut(|i, t| {
                if !is_projection[i] {
                    return Ok(());
                }
                scratch.resize(t.numel(), 0.0);
                t.read_f32_into_any(scratch)?;
                let s_w = *std[i].get_or_insert_with(|| {
                    let len = scratch.len() as f64;
                    let mean = scratch.iter().map(|&x| x as f64).sum::<f64>() / len;
                    (scratch.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / len).sqrt()
                });
                let mut eps = crate::rand::Stream::new(*seed, crate::rand::fnv1a64(names[i].as_bytes()));
                let k = *sigma * s_w;
                for x in scratch.iter_mut() {
                    *x += (k * eps.normal()) as f32;
                }
                t.write_f32(scratch)
            })?;
        }
        let dense: &ModelWeights = match &self.noise {
            Some(n) => &n.weights,
            None => base,
        };
        if let Some(q) = &mut self.quant {
            q.sync(dense)?;
        }
        self.version = base_version;
        self.syncs += 1;
        Ok(())
    }

    /// The weights an engine step reads (the trainer's own tensors when nothing differs).
    pub fn view<'a>(&'a self, trainer: &'a ModelWeights) -> View<'a> {
        let w = match (&self.noise, self.ring.front()) {
            (Some(n), _) => &n.weights,
            (None, Some((_, s))) if self.spec.staleness > 0 => s,
            _ => trainer,
        };
        View { w, q: self.quant.as_ref().map(|q| q.layers.as_slice()) }
    }

    /// Bytes the engine holds beyond the trainer's weights.
    pub fn extra_bytes(&self) -> usize {
        self.ring.iter().map(|(_, w)| w.size_bytes()).sum::<usize>()
            + self.noise.as_ref().map(|n| n.weights.size_bytes()).unwrap_or(0)
            + self.quant.as_ref().map(|q| q.size_bytes()).unwrap_or(0)
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }
}
