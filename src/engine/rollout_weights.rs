//! What a rollout engine reads, and its in-place resync from the trainer's weights: the standard
//! engine reads the trainer's tensors themselves (no copy); a stale engine reads a ring of up to
//! k older versions (seed 000 App. C.5); a weight-noise engine adds σ·s_w·ε_w to every projection
//! matrix (App. C.4: s_w the matrix's std at the first sync, ε_w ~ N(0, I) from a Philox stream
//! keyed by (seed, tensor name), fixed across syncs and devices, unseen by the trainer); a
//! quantized engine re-quantizes its preallocated buffers (recipe, `model::quant_state`). They compose:
//! staleness, then noise, then quantization. Every buffer is allocated at construction; a sync
//! rewrites them in place.

mod check;

pub use check::ViewCheck;

use super::View;
use crate::device::Device;
use crate::model::calib::Calibration;
use crate::model::QuantState;
use crate::model::{ModelConfig, ModelWeights};
use crate::quant::recipe::Recipe;
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
    /// The engine's own copy of the weights: base + σ·s_w·ε on every projection matrix.
    weights: ModelWeights,
    /// Per parameter: σ·s_w·ε_w for projection matrices (BF16; drawn once, so a sync is one
    /// pass over the weights), None for everything else.
    offset: Vec<Option<Vec<half::bf16>>>,
}

/// ε_w ~ N(0, I) for the tensor named `name`: chunk c of 4096 values comes from Philox stream
/// (seed, hash(name) + c), so values are fixed whatever the thread count or device.
fn gaussian(seed: u64, name: &str, n: usize, scale: f64) -> Vec<half::bf16> {
    use rayon::prelude::*;
    let key = crate::rand::fnv1a64(name.as_bytes());
    let mut out = vec![half::bf16::ZERO; n];
    out.par_chunks_mut(4096).enumerate().for_each(|(c, ch)| {
        let mut s = crate::rand::Stream::new(seed, key.wrapping_add(c as u64));
        for v in ch.iter_mut() {
            *v = half::bf16::from_f64(scale * s.normal());
        }
    });
    out
}

/// dst = src + offset, elementwise, in dst's dtype (rounded to nearest even).
fn add_offset(dst: &mut crate::device::Tensor, src: &crate::device::Tensor, off: &[half::bf16]) -> Result<()> {
    use crate::device::CpuStorage;
    use rayon::prelude::*;
    if !dst.storage().is_cpu() {
        // On a GPU: the same arithmetic on the host, the result uploaded (one round trip per
        // resync; a noise engine is a measurement tool, not the fast path).
        let mut v = src.to_f32_vec()?;
        for (x, o) in v.iter_mut().zip(off) {
            *x += f32::from_bits((o.to_bits() as u32) << 16);
        }
        return dst.write_f32(&v);
    }
    let s = crate::device::CpuFloats::of(src)?;
    match dst.cpu_mut()? {
        CpuStorage::BF16(d) => d.par_chunks_mut(4096).zip(off.par_chunks(4096)).enumerate().for_each(|(c, (d, o))| {
            let mut buf = [0.0f32; 4096];
            s.read_into(c * 4096, &mut buf[..d.len()]);
            for ((d, o), x) in d.iter_mut().zip(o).zip(&buf) {
                *d = crate::device::bf16_rne(x + f32::from_bits((o.to_bits() as u32) << 16));
            }
        }),
        CpuStorage::F32(d) => d.par_chunks_mut(4096).zip(off.par_chunks(4096)).enumerate().for_each(|(c, (d, o))| {
            s.read_into(c * 4096, d);
            for (d, o) in d.iter_mut().zip(o) {
                *d += o.to_f32();
            }
        }),
        _ => anyhow::bail!("weight noise needs F32 or BF16 weights"),
    }
    Ok(())
}

pub struct RolloutWeights {
    dev: Device,
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
    pub fn new(
        dev: &Device,
        spec: &EngineSpec,
        cfg: &ModelConfig,
        w: &ModelWeights,
        calib: Option<&Calibration>,
        version: u64,
    ) -> Result<RolloutWeights> {
        Self::with_ring(dev, spec, cfg, w, calib, version, VecDeque::new())
    }

    /// [`Self::new`], keeping `ring` (another engine's older versions, [`Self::into_ring`]) as
    /// this stale engine's ring when it has the slots this one keeps: an engine switched in
    /// place serves the versions the old one would have.
    pub fn with_ring(
        dev: &Device,
        spec: &EngineSpec,
        cfg: &ModelConfig,
        w: &ModelWeights,
        calib: Option<&Calibration>,
        version: u64,
        ring: VecDeque<(u64, ModelWeights)>,
    ) -> Result<RolloutWeights> {
        let noise = if spec.noise_sigma > 0.0 {
            // s_w: each projection matrix's std at this first sync.
            let names: Vec<String> = crate::model::weights::param_specs(cfg).into_iter().map(|(n, _)| n).collect();
            let mut offset = Vec::with_capacity(names.len());
            for (name, t) in names.iter().zip(w.tensors()) {
                offset.push(if is_projection(name) {
                    let v = t.to_f32_vec()?;
                    let len = v.len() as f64;
                    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / len;
                    let s_w = (v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / len).sqrt();
                    Some(gaussian(spec.noise_seed, name, v.len(), spec.noise_sigma * s_w))
                } else {
                    None
                });
            }
            Some(Noise { weights: w.try_clone(cfg)?, offset })
        } else {
            None
        };
        let quant =
            if spec.recipe.is_standard() { None } else { Some(QuantState::new(dev, &spec.recipe, cfg, w, calib)?) };
        let mut rw = RolloutWeights {
            dev: dev.clone(),
            spec: spec.clone(),
            cfg: cfg.clone(),
            ring: VecDeque::new(),
            noise,
            quant,
            version,
            syncs: 0,
        };
        if spec.staleness > 0 {
            if ring.len() == spec.staleness + 1 {
                rw.ring = ring;
            } else {
                drop(ring);
                for _ in 0..=spec.staleness {
                    rw.ring.push_back((version, w.try_clone(cfg)?));
                }
            }
        }
        rw.sync(w, version)?;
        Ok(rw)
    }

    /// The stale engine's ring of versions (empty without staleness), for [`Self::with_ring`].
    pub fn into_ring(self) -> VecDeque<(u64, ModelWeights)> {
        self.ring
    }

    /// Rewrites the engine's buffers from the trainer's weights `w` at `version`, in place.
    pub fn sync(&mut self, w: &ModelWeights, version: u64) -> Result<()> {
        self.sync_with_amax(w, version, None)
    }

    /// [`Self::sync`], given each parameter's amax of `w` as the device optimizer reduced it
    /// (`Trainer::weight_amax`): a quantized view made from `w` itself (no staleness ring, no
    /// noise copy) then skips its own amax pass.
    pub fn sync_with_amax(
        &mut self,
        w: &ModelWeights,
        version: u64,
        amax: Option<&crate::device::Tensor>,
    ) -> Result<()> {
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
        // (`Self::base` inline: the noise copy and the quantized buffers are borrowed mutably below.)
        let base: &ModelWeights = match self.ring.front() {
            Some((_, s)) if self.spec.staleness > 0 => s,
            _ => w,
        };
        if let Some(n) = &mut self.noise {
            let Noise { weights, offset } = n;
            // Walk the base's tensors alongside the engine copy's (both in parameter order).
            let mut i = 0;
            let mut err = None;
            weights.for_each_mut(|_, d| {
                let s = base.nth(i).expect("same layout");
                i += 1;
                let r = match &offset[i - 1] {
                    Some(o) => add_offset(d, s, o),
                    None => d.copy_from(s),
                };
                if let Err(e) = r {
                    err = Some(e);
                }
                Ok(())
            })?;
            if let Some(e) = err {
                return Err(e);
            }
        }
        let dense: &ModelWeights = match &self.noise {
            Some(n) => &n.weights,
            None => base,
        };
        if let Some(q) = &mut self.quant {
            match amax {
                Some(a) if std::ptr::eq(dense, w) => q.sync_known(&self.dev, dense, a)?,
                _ => q.sync(&self.dev, dense)?,
            }
        }
        self.version = base_version;
        self.syncs += 1;
        Ok(())
    }

    /// The weights the view derives from: a stale engine's oldest ring slot, else the trainer's.
    fn base<'a>(&'a self, trainer: &'a ModelWeights) -> &'a ModelWeights {
        match self.ring.front() {
            Some((_, s)) if self.spec.staleness > 0 => s,
            _ => trainer,
        }
    }

    /// The weights an engine step reads (the trainer's own tensors when nothing differs).
    pub fn view<'a>(&'a self, trainer: &'a ModelWeights) -> View<'a> {
        let w = match &self.noise {
            Some(n) => &n.weights,
            None => self.base(trainer),
        };
        View { w, q: self.quant.as_ref().map(|q| q.layers.as_slice()) }
    }

    /// A stale engine's older versions (every ring slot but the newest, which is the trainer's
    /// current weights), oldest first, as a safetensors file: what a checkpoint keeps so that a
    /// resumed run reads the same old weights. None without staleness.
    pub fn ring_file(&self) -> Result<Option<Vec<u8>>> {
        if self.spec.staleness == 0 {
            return Ok(None);
        }
        let older = self.ring.len().saturating_sub(1);
        let mut views = Vec::with_capacity(older);
        let mut versions = Vec::with_capacity(older);
        for (i, (v, w)) in self.ring.iter().take(older).enumerate() {
            let mut flat = Vec::new();
            w.for_each(|_, t| {
                flat.extend(t.to_f32_vec()?);
                Ok(())
            })?;
            let bytes = flat.iter().flat_map(|x| x.to_le_bytes()).collect();
            views.push((
                format!("slot{i}"),
                crate::model::weights::OwnedView { dtype: safetensors::Dtype::F32, shape: vec![flat.len()], bytes },
            ));
            versions.push(v.to_string());
        }
        let meta = std::collections::HashMap::from([("versions".to_string(), versions.join(","))]);
        Ok(Some(
            safetensors::serialize(views, Some(meta))
                .map_err(|e| anyhow::anyhow!("serializing the stale ring: {e}"))?,
        ))
    }

    /// Puts a checkpoint's older versions (see [`Self::ring_file`]) back into the ring, in
    /// place (values are the compute weights' own, so BF16/F16 round-trip exactly through F32).
    pub fn restore_ring(&mut self, bytes: &[u8], what: &str, trainer: &ModelWeights) -> Result<()> {
        let st = safetensors::SafeTensors::deserialize(bytes)
            .map_err(|e| anyhow::anyhow!("{what}: invalid safetensors file: {e}"))?;
        let (_, meta) = safetensors::SafeTensors::read_metadata(bytes).map_err(|e| anyhow::anyhow!("{what}: {e}"))?;
        let versions: Vec<u64> = meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get("versions"))
            .map(|s| s.split(',').filter(|x| !x.is_empty()).map(|x| x.parse::<u64>()).collect::<Result<Vec<_>, _>>())
            .transpose()
            .map_err(|e| anyhow::anyhow!("{what}: bad 'versions' metadata: {e}"))?
            .unwrap_or_default();
        let older = self.ring.len().saturating_sub(1);
        if versions.len() != older {
            anyhow::bail!("{what}: holds {} older versions, this engine's staleness keeps {older}", versions.len());
        }
        for (i, v) in versions.into_iter().enumerate() {
            let t = st.tensor(&format!("slot{i}")).map_err(|e| anyhow::anyhow!("{what}: slot{i}: {e}"))?;
            let flat: Vec<f32> =
                t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            let (_, w) = &mut self.ring[i];
            let mut at = 0;
            let mut short = false;
            w.for_each_mut(|_, t| {
                let n = t.numel();
                if at + n > flat.len() {
                    short = true;
                    return Ok(());
                }
                t.write_f32(&flat[at..at + n])?;
                at += n;
                Ok(())
            })?;
            if short || at != flat.len() {
                anyhow::bail!("{what}: slot{i} holds {} values, the model has a different size", flat.len());
            }
            self.ring[i].0 = v;
        }
        // Re-derive the view (noise, quantization) from the restored oldest slot: a sync at the
        // newest slot's version rotates nothing.
        let current = self.ring.back().map(|(v, _)| *v).unwrap_or(self.version);
        let syncs = self.syncs;
        self.sync(trainer, current)?;
        self.syncs = syncs;
        Ok(())
    }

    /// [`Self::extra_bytes`] before anything is allocated (the memory plan sizes the KV cache
    /// from what is left): the ring's k + 1 copies, the noise copy, the quantized weights.
    pub fn estimate_extra_bytes(spec: &EngineSpec, w: &ModelWeights) -> usize {
        use crate::quant::qtensor::{QFormat, QTensor};
        use crate::quant::recipe::Precision;
        let copy = w.size_bytes();
        let ring = if spec.staleness > 0 { (spec.staleness + 1) * copy } else { 0 };
        let noise = if spec.noise_sigma > 0.0 { copy } else { 0 };
        let mut quant = 0;
        if !spec.recipe.is_standard() {
            for (lr, lw) in spec.recipe.layers.iter().zip(&w.layers) {
                let dense = [&lw.q_proj, &lw.k_proj, &lw.v_proj, &lw.o_proj, &lw.gate_proj, &lw.up_proj, &lw.down_proj];
                for ((p, t), input) in lr.weight.iter().zip(dense).zip(&lr.input) {
                    let f = match p {
                        Precision::Native => continue,
                        Precision::Fp8 => QFormat::Fp8,
                        Precision::Nvfp4 => QFormat::Nvfp4,
                    };
                    quant += QTensor::bytes_for(f, t.dim(0), t.dim(1));
                    // On a GPU, what the W8A8 / W4A4 GEMM keeps (as `QuantState::new` decides).
                    if let (crate::device::Storage::Cuda(c), true) = (t.storage(), input == p) {
                        let dev = crate::device::Device::Cuda(c.device().clone());
                        let (n, k) = (t.dim(0), t.dim(1));
                        quant += crate::ops::linear::cuda_lowp::Kept::on(&dev, f, n, k).map_or(0, |x| x.bytes(n, k));
                    }
                }
            }
        }
        ring + noise + quant
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
