//! Whether a rollout engine serves the weights the trainer has: the consistency check the
//! mismatch guard runs before it blames a recipe (`crate::mismatch::guard`). The view is
//! compared with what a resync from the trainer's weights would give: a stale engine's newest
//! ring slot with the trainer's tensors and a noise engine's copy with base + offset (whole
//! tensors, bit for bit), a quantized
//! engine's buffers with a fresh quantization of sampled rows (bit for bit, tensor by tensor),
//! and the version the view was last synced to with the trainer's. Also the fault hook of the
//! guard's tests: a view corrupted in place while its counters say it is current.
//!
//! Owns: [`ViewCheck`]. May call: the parent's buffers, `model::quant_state`. Must not: change
//! a view (a repair is a resync, the parent's), except [`RolloutWeights::corrupt_for_test`].

use super::{is_projection, RolloutWeights};
use crate::device::Tensor;
use crate::model::ModelWeights;
use anyhow::{bail, Result};
use serde::Serialize;

/// What a consistency check found.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ViewCheck {
    /// The version the view was last synced to, and the trainer's.
    pub engine_version: u64,
    pub trainer_version: u64,
    /// Tensors (HF names) whose view differs from what the trainer's weights give.
    pub tensors: Vec<String>,
    /// Tensors compared (0: the engine reads the trainer's own tensors, nothing to compare).
    pub checked: usize,
}

impl ViewCheck {
    pub fn consistent(&self) -> bool {
        self.engine_version == self.trainer_version && self.tensors.is_empty()
    }
}

/// Whether two tensors hold the same values, bit for bit (as f32: BF16 and F16 widen exactly).
fn same_values(a: &Tensor, b: &Tensor) -> Result<bool> {
    let (x, y) = (a.to_f32_vec()?, b.to_f32_vec()?);
    Ok(x.len() == y.len() && x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()))
}

impl ViewCheck {
    /// Records `name` as differing (once).
    fn differs(&mut self, name: &str) {
        if !self.tensors.iter().any(|t| t == name) {
            self.tensors.push(name.to_string());
        }
    }
}

impl RolloutWeights {
    /// The version of the trainer's weights the view was last synced from (a stale engine's
    /// newest ring slot): the trainer's own after every resync.
    pub fn synced_version(&self) -> u64 {
        match self.ring.back() {
            Some((v, _)) if self.spec.staleness > 0 => *v,
            _ => self.version,
        }
    }

    /// Compares the view with the trainer's weights `w` at `version` (quantized weights at
    /// `rows` sampled rows each). Reads every dense tensor of the view once; costs about one
    /// resync.
    pub fn check(&self, w: &ModelWeights, version: u64, rows: usize) -> Result<ViewCheck> {
        let names: Vec<String> = crate::model::weights::param_specs(&self.cfg).into_iter().map(|(n, _)| n).collect();
        let mut out =
            ViewCheck { engine_version: self.synced_version(), trainer_version: version, ..Default::default() };
        // A stale engine: its newest slot is a copy of the trainer's weights.
        if let (true, Some((_, newest))) = (self.spec.staleness > 0, self.ring.back()) {
            for ((name, t), s) in names.iter().zip(w.tensors()).zip(newest.tensors()) {
                out.checked += 1;
                if !same_values(t, s)? {
                    out.differs(name);
                }
            }
        }
        // A noise engine: its copy is what `add_offset` makes of the base (the projections), or
        // the base itself.
        if let Some(n) = &self.noise {
            let base = self.base(w).tensors();
            for (i, (name, copy)) in names.iter().zip(n.weights.tensors()).enumerate() {
                out.checked += 1;
                let same = match &n.offset[i] {
                    Some(off) => {
                        let mut want = copy.try_clone()?;
                        super::add_offset(&mut want, base[i], off)?;
                        same_values(&want, copy)?
                    }
                    None => same_values(base[i], copy)?,
                };
                if !same {
                    out.differs(name);
                }
            }
        }
        // A quantized engine: its buffers against a fresh quantization of the dense view.
        if let Some(q) = &self.quant {
            out.checked += q.layers.iter().flat_map(|l| l.w.iter().flatten()).count();
            for name in q.stale_tensors(self.view(w).w, rows)? {
                out.differs(&name);
            }
        }
        Ok(out)
    }

    /// Repairs the view from the trainer's weights `w` at `version`: a stale engine's newest
    /// slot is rewritten even when its version says it is current, then everything derived
    /// from the ring (noise copy, quantized buffers) is resynced.
    pub fn repair(&mut self, w: &ModelWeights, version: u64) -> Result<()> {
        if self.spec.staleness > 0 {
            if let Some((v, newest)) = self.ring.back_mut() {
                if *v == version {
                    newest.copy_from(w)?;
                }
            }
        }
        self.sync(w, version)
    }

    /// Fault hook of the guard's tests: the counters of a sync at `version` without its writes
    /// (a resync that wrote buffers the engine does not read).
    pub fn mark_synced_for_test(&mut self, version: u64) {
        if let Some((v, _)) = self.ring.back_mut() {
            *v = version;
        }
        self.version = version;
        self.syncs += 1;
    }

    /// Fault hook of the guard's tests: zeroes one buffer of the view in place, leaving every
    /// counter as it was (a wake that lost the weights, a resync that wrote garbage): the first
    /// quantized weight's codes, else the first projection of the noise copy. Returns the
    /// tensor's name.
    pub fn corrupt_for_test(&mut self) -> Result<String> {
        if let Some(q) = &mut self.quant {
            let names = crate::model::quant_state::linear_names(&self.cfg);
            for (l, ql) in q.layers.iter_mut().enumerate() {
                if let Some((i, t)) = ql.w.iter_mut().enumerate().find_map(|(i, t)| t.as_mut().map(|t| (i, t))) {
                    // The codes and what the GPU's GEMM reads in their place (kept operands).
                    t.codes.fill_zero()?;
                    for kept in [&mut t.decoded, &mut t.swizzled].into_iter().flatten() {
                        kept.fill_zero()?;
                    }
                    return Ok(names[l][i].clone());
                }
            }
        }
        if let Some(n) = &mut self.noise {
            let names: Vec<String> =
                crate::model::weights::param_specs(&self.cfg).into_iter().map(|(n, _)| n).collect();
            if let Some(i) = names.iter().position(|s| is_projection(s)) {
                if let Some(t) = n.weights.tensors_mut().into_iter().nth(i) {
                    t.fill_zero()?;
                    return Ok(names[i].clone());
                }
            }
        }
        bail!(
            "this engine keeps no buffers of its own to corrupt (it reads the trainer's weights, or only a stale ring)"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{DType, Device};
    use crate::engine::rollout_weights::EngineSpec;
    use crate::model::tiny::{tiny_config, TinySpec};

    fn spec(recipe: &str, noise: f64, staleness: usize) -> EngineSpec {
        let r = crate::quant::recipe::Recipe::preset(
            recipe,
            2,
            &[],
            crate::quant::recipe::KvScale::Fixed(1.0),
            Default::default(),
        )
        .unwrap();
        EngineSpec { recipe: r, noise_sigma: noise, noise_seed: 3, staleness }
    }

    /// A 2-layer qwen2-shaped model with random weights of `dtype` on one CPU thread.
    fn tiny(dtype: DType) -> (Device, crate::model::ModelConfig, ModelWeights) {
        let dev = Device::cpu(1).unwrap();
        let ts = TinySpec {
            arch: "qwen2".into(),
            layers: 2,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            head_dim: None,
            intermediate: Some(128),
            vocab: 260,
            max_position: 32,
            tie: false,
        };
        let cfg = tiny_config(&ts).unwrap();
        let w = ModelWeights::random(&cfg, &dev, dtype, 5, 0.05).unwrap();
        (dev, cfg, w)
    }

    /// Every kind of view is consistent after a sync, names the tensor a fault zeroed, is a
    /// version behind after a missed sync, and is consistent again after a resync.
    #[test]
    fn checks_find_what_a_fault_or_a_missed_sync_leaves() {
        let (dev, cfg, mut w) = tiny(DType::BF16);
        for (name, s) in [
            ("fp8", spec("fp8", 0.0, 0)),
            ("nvfp4", spec("nvfp4", 0.0, 0)),
            ("noise", spec("bf16", 0.3, 0)),
            ("stale-fp8", spec("fp8", 0.0, 1)),
        ] {
            let mut cal = crate::model::calib::Calibration::new(crate::model::calib::Calibration::fingerprint(&cfg), 2);
            cal.input_amax = vec![[4.0; 4]; 2];
            cal.k_amax = vec![8.0; 2];
            cal.v_amax = vec![8.0; 2];
            let mut rw = RolloutWeights::new(&dev, &s, &cfg, &w, Some(&cal), 0).unwrap();
            let c = rw.check(&w, 0, 3).unwrap();
            assert!(c.consistent() && c.checked > 0, "{name}: {c:?}");
            // The trainer moves on; the engine misses the sync.
            let t = w.tensors_mut().into_iter().nth(3).unwrap();
            let mut v = t.to_f32_vec().unwrap();
            v.iter_mut().for_each(|x| *x *= 1.5);
            t.write_f32(&v).unwrap();
            let c = rw.check(&w, 1, 3).unwrap();
            assert!(!c.consistent() && c.engine_version == 0 && c.trainer_version == 1, "{name}: {c:?}");
            rw.sync(&w, 1).unwrap();
            assert!(rw.check(&w, 1, 3).unwrap().consistent(), "{name}");
            // Silent corruption: the counters say current, the tensor does not.
            let hit = rw.corrupt_for_test().unwrap();
            let c = rw.check(&w, 1, 3).unwrap();
            assert_eq!((c.engine_version, c.tensors.clone()), (1, vec![hit.clone()]), "{name}");
            rw.sync(&w, 1).unwrap();
            assert!(rw.check(&w, 1, 3).unwrap().consistent(), "{name}");
        }
        // The standard engine reads the trainer's tensors: nothing of its own to compare.
        let rw = RolloutWeights::new(&dev, &spec("bf16", 0.0, 0), &cfg, &w, None, 0).unwrap();
        let c = rw.check(&w, 0, 3).unwrap();
        assert!(c.consistent() && c.checked == 0);
    }

    /// A switched engine keeps the old one's ring: it serves the versions the old one would.
    #[test]
    fn a_switched_stale_engine_keeps_its_ring() {
        let (dev, cfg, mut w) = tiny(DType::F32);
        let mut rw = RolloutWeights::new(&dev, &spec("bf16", 0.0, 2), &cfg, &w, None, 0).unwrap();
        let first = w.tensors()[1].to_f32_vec().unwrap();
        for v in 1..=3u64 {
            let t = w.tensors_mut().into_iter().nth(1).unwrap();
            let x: Vec<f32> = t.to_f32_vec().unwrap().iter().map(|x| x + 1.0).collect();
            t.write_f32(&x).unwrap();
            rw.sync(&w, v).unwrap();
        }
        // Versions 1, 2, 3 in the ring; the view reads version 1.
        let ring = rw.into_ring();
        assert_eq!(ring.iter().map(|r| r.0).collect::<Vec<_>>(), vec![1, 2, 3]);
        let moved = RolloutWeights::with_ring(&dev, &spec("fp8-kv", 0.0, 2), &cfg, &w, None, 3, ring).unwrap();
        assert_eq!((moved.version, moved.synced_version()), (1, 3));
        let served = moved.view(&w).w.tensors()[1].to_f32_vec().unwrap();
        assert!(served.iter().zip(&first).all(|(a, b)| *a == b + 1.0), "the view must be version 1");
        assert!(moved.check(&w, 3, 4).unwrap().consistent());
    }
}
