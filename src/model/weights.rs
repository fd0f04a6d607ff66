//! Model weights: the named parameter tensors of one transformer, loaded from (memory-mapped,
//! possibly sharded) safetensors, initialized at random, or saved back in the HF layout.
//!
//! Owns: [`ModelWeights`], [`LayerWeights`], the HF tensor names. May call: safetensors,
//! memmap2, `crate::device`. Must not: run any op (the forward lives in `transformer.rs`).

use super::config::ModelConfig;
use crate::device::{CpuStorage, DType, Device, Tensor};
use crate::ops::linear::Panels;
use anyhow::{bail, Context, Result};
use half::{bf16, f16};
use safetensors::{tensor::TensorView, Dtype as StDtype, SafeTensors};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

#[derive(Debug)]
pub struct LayerWeights {
    pub input_layernorm: Tensor,          // (C)
    pub q_proj: Tensor,                   // (H*D, C)
    pub k_proj: Tensor,                   // (Hkv*D, C)
    pub v_proj: Tensor,                   // (Hkv*D, C)
    pub o_proj: Tensor,                   // (C, H*D)
    pub q_bias: Option<Tensor>,           // (H*D)
    pub k_bias: Option<Tensor>,           // (Hkv*D)
    pub v_bias: Option<Tensor>,           // (Hkv*D)
    pub o_bias: Option<Tensor>,           // (C)
    pub q_norm: Option<Tensor>,           // (D)
    pub k_norm: Option<Tensor>,           // (D)
    pub post_attention_layernorm: Tensor, // (C)
    pub gate_proj: Tensor,                // (I, C)
    pub up_proj: Tensor,                  // (I, C)
    pub down_proj: Tensor,                // (C, I)
    pub gate_bias: Option<Tensor>,        // (I)
    pub up_bias: Option<Tensor>,          // (I)
    pub down_bias: Option<Tensor>,        // (C)
}

#[derive(Debug)]
pub struct ModelWeights {
    pub embed_tokens: Tensor, // (V, C)
    pub layers: Vec<LayerWeights>,
    pub norm: Tensor,            // (C)
    pub lm_head: Option<Tensor>, // (V, C); None when tied to embed_tokens
    /// The linears packed once for decoding ([`ModelWeights::pack_panels`]); dropped by every
    /// mutable access to the tensors, so it never outlives the values it copies.
    panels: Option<Box<DecodePanels>>,
}

/// Every linear weight of a model as [`Panels`]: per layer the seven projections in the
/// forward's order (q, k, v, o, gate, up, down), and the LM head.
pub struct DecodePanels {
    pub layers: Vec<[Panels; 7]>,
    pub head: Panels,
}

impl std::fmt::Debug for DecodePanels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DecodePanels({} layers + head)", self.layers.len())
    }
}

/// Name and shape of every parameter, in model order, with the HF tensor names.
pub fn param_specs(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let (c, i, q, kv, d) = (cfg.hidden_size, cfg.intermediate_size, cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
    let mut v = vec![("model.embed_tokens.weight".to_string(), vec![cfg.vocab_size, c])];
    for l in 0..cfg.num_layers {
        let p = format!("model.layers.{l}");
        v.push((format!("{p}.input_layernorm.weight"), vec![c]));
        v.push((format!("{p}.self_attn.q_proj.weight"), vec![q, c]));
        v.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, c]));
        v.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, c]));
        v.push((format!("{p}.self_attn.o_proj.weight"), vec![c, q]));
        if cfg.qkv_bias {
            v.push((format!("{p}.self_attn.q_proj.bias"), vec![q]));
            v.push((format!("{p}.self_attn.k_proj.bias"), vec![kv]));
            v.push((format!("{p}.self_attn.v_proj.bias"), vec![kv]));
        }
        if cfg.o_bias {
            v.push((format!("{p}.self_attn.o_proj.bias"), vec![c]));
        }
        if cfg.qk_norm {
            v.push((format!("{p}.self_attn.q_norm.weight"), vec![d]));
            v.push((format!("{p}.self_attn.k_norm.weight"), vec![d]));
        }
        v.push((format!("{p}.post_attention_layernorm.weight"), vec![c]));
        v.push((format!("{p}.mlp.gate_proj.weight"), vec![i, c]));
        v.push((format!("{p}.mlp.up_proj.weight"), vec![i, c]));
        v.push((format!("{p}.mlp.down_proj.weight"), vec![c, i]));
        if cfg.mlp_bias {
            v.push((format!("{p}.mlp.gate_proj.bias"), vec![i]));
            v.push((format!("{p}.mlp.up_proj.bias"), vec![i]));
            v.push((format!("{p}.mlp.down_proj.bias"), vec![c]));
        }
    }
    v.push(("model.norm.weight".to_string(), vec![c]));
    if !cfg.tie_word_embeddings {
        v.push(("lm_head.weight".to_string(), vec![cfg.vocab_size, c]));
    }
    v
}

impl ModelWeights {
    /// Builds the struct from tensors given in [`param_specs`] order.
    pub fn from_ordered(cfg: &ModelConfig, tensors: Vec<Tensor>) -> Result<ModelWeights> {
        let specs = param_specs(cfg);
        if tensors.len() != specs.len() {
            bail!("expected {} parameter tensors, got {}", specs.len(), tensors.len());
        }
        for ((name, shape), t) in specs.iter().zip(&tensors) {
            if t.shape() != shape.as_slice() {
                bail!("parameter {name}: shape {:?}, expected {shape:?}", t.shape());
            }
        }
        let mut it = tensors.into_iter();
        let mut next = || it.next().expect("count checked above");
        let embed_tokens = next();
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for _ in 0..cfg.num_layers {
            let input_layernorm = next();
            let (q_proj, k_proj, v_proj, o_proj) = (next(), next(), next(), next());
            let (q_bias, k_bias, v_bias) =
                if cfg.qkv_bias { (Some(next()), Some(next()), Some(next())) } else { (None, None, None) };
            let o_bias = if cfg.o_bias { Some(next()) } else { None };
            let (q_norm, k_norm) = if cfg.qk_norm { (Some(next()), Some(next())) } else { (None, None) };
            let post_attention_layernorm = next();
            let (gate_proj, up_proj, down_proj) = (next(), next(), next());
            let (gate_bias, up_bias, down_bias) =
                if cfg.mlp_bias { (Some(next()), Some(next()), Some(next())) } else { (None, None, None) };
            layers.push(LayerWeights {
                input_layernorm,
                q_proj,
                k_proj,
                v_proj,
                o_proj,
                q_bias,
                k_bias,
                v_bias,
                o_bias,
                q_norm,
                k_norm,
                post_attention_layernorm,
                gate_proj,
                up_proj,
                down_proj,
                gate_bias,
                up_bias,
                down_bias,
            });
        }
        let norm = next();
        let lm_head = if cfg.tie_word_embeddings { None } else { Some(next()) };
        Ok(ModelWeights { embed_tokens, layers, norm, lm_head, panels: None })
    }

    /// Every parameter in [`param_specs`] order.
    pub fn tensors(&self) -> Vec<&Tensor> {
        let mut v = vec![&self.embed_tokens];
        for l in &self.layers {
            v.push(&l.input_layernorm);
            v.extend([&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj]);
            v.extend([&l.q_bias, &l.k_bias, &l.v_bias, &l.o_bias, &l.q_norm, &l.k_norm].into_iter().flatten());
            v.push(&l.post_attention_layernorm);
            v.extend([&l.gate_proj, &l.up_proj, &l.down_proj]);
            v.extend([&l.gate_bias, &l.up_bias, &l.down_bias].into_iter().flatten());
        }
        v.push(&self.norm);
        v.extend(self.lm_head.as_ref());
        v
    }

    /// Every parameter in [`param_specs`] order, mutably (drops the packed panels).
    pub fn tensors_mut(&mut self) -> Vec<&mut Tensor> {
        self.panels = None;
        let mut v = vec![&mut self.embed_tokens];
        for l in &mut self.layers {
            v.push(&mut l.input_layernorm);
            v.extend([&mut l.q_proj, &mut l.k_proj, &mut l.v_proj, &mut l.o_proj]);
            v.extend(
                [&mut l.q_bias, &mut l.k_bias, &mut l.v_bias, &mut l.o_bias, &mut l.q_norm, &mut l.k_norm]
                    .into_iter()
                    .flatten(),
            );
            v.push(&mut l.post_attention_layernorm);
            v.extend([&mut l.gate_proj, &mut l.up_proj, &mut l.down_proj]);
            v.extend([&mut l.gate_bias, &mut l.up_bias, &mut l.down_bias].into_iter().flatten());
        }
        v.push(&mut self.norm);
        v.extend(self.lm_head.as_mut());
        v
    }

    /// Visits every parameter in [`param_specs`] order, mutably, without allocating.
    pub fn for_each_mut(&mut self, mut f: impl FnMut(usize, &mut Tensor) -> Result<()>) -> Result<()> {
        self.panels = None;
        let mut i = 0;
        let mut visit = |t: &mut Tensor| -> Result<()> {
            f(i, t)?;
            i += 1;
            Ok(())
        };
        visit(&mut self.embed_tokens)?;
        for l in &mut self.layers {
            visit(&mut l.input_layernorm)?;
            for t in [&mut l.q_proj, &mut l.k_proj, &mut l.v_proj, &mut l.o_proj] {
                visit(t)?;
            }
            for t in [&mut l.q_bias, &mut l.k_bias, &mut l.v_bias, &mut l.o_bias, &mut l.q_norm, &mut l.k_norm]
                .into_iter()
                .flatten()
            {
                visit(t)?;
            }
            visit(&mut l.post_attention_layernorm)?;
            for t in [&mut l.gate_proj, &mut l.up_proj, &mut l.down_proj] {
                visit(t)?;
            }
            for t in [&mut l.gate_bias, &mut l.up_bias, &mut l.down_bias].into_iter().flatten() {
                visit(t)?;
            }
        }
        visit(&mut self.norm)?;
        if let Some(h) = &mut self.lm_head {
            visit(h)?;
        }
        Ok(())
    }

    /// Visits every parameter in [`param_specs`] order without allocating.
    pub fn for_each(&self, mut f: impl FnMut(usize, &Tensor) -> Result<()>) -> Result<()> {
        let mut i = 0;
        let mut visit = |t: &Tensor| -> Result<()> {
            f(i, t)?;
            i += 1;
            Ok(())
        };
        visit(&self.embed_tokens)?;
        for l in &self.layers {
            visit(&l.input_layernorm)?;
            for t in [&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj] {
                visit(t)?;
            }
            for t in [&l.q_bias, &l.k_bias, &l.v_bias, &l.o_bias, &l.q_norm, &l.k_norm].into_iter().flatten() {
                visit(t)?;
            }
            visit(&l.post_attention_layernorm)?;
            for t in [&l.gate_proj, &l.up_proj, &l.down_proj] {
                visit(t)?;
            }
            for t in [&l.gate_bias, &l.up_bias, &l.down_bias].into_iter().flatten() {
                visit(t)?;
            }
        }
        visit(&self.norm)?;
        if let Some(h) = &self.lm_head {
            visit(h)?;
        }
        Ok(())
    }

    /// Parameter `i` in [`param_specs`] order, without allocating.
    pub fn nth(&self, mut i: usize) -> Option<&Tensor> {
        if i == 0 {
            return Some(&self.embed_tokens);
        }
        i -= 1;
        for l in &self.layers {
            let all: [Option<&Tensor>; 18] = [
                Some(&l.input_layernorm),
                Some(&l.q_proj),
                Some(&l.k_proj),
                Some(&l.v_proj),
                Some(&l.o_proj),
                l.q_bias.as_ref(),
                l.k_bias.as_ref(),
                l.v_bias.as_ref(),
                l.o_bias.as_ref(),
                l.q_norm.as_ref(),
                l.k_norm.as_ref(),
                Some(&l.post_attention_layernorm),
                Some(&l.gate_proj),
                Some(&l.up_proj),
                Some(&l.down_proj),
                l.gate_bias.as_ref(),
                l.up_bias.as_ref(),
                l.down_bias.as_ref(),
            ];
            let n = all.iter().flatten().count();
            if i < n {
                return all.into_iter().flatten().nth(i);
            }
            i -= n;
        }
        match i {
            0 => Some(&self.norm),
            1 => self.lm_head.as_ref(),
            _ => None,
        }
    }

    /// A deep copy.
    pub fn try_clone(&self, cfg: &ModelConfig) -> Result<ModelWeights> {
        ModelWeights::from_ordered(cfg, self.tensors().into_iter().map(|t| t.try_clone()).collect::<Result<_>>()?)
    }

    /// Overwrites every tensor from `src` (same layout), in place: no allocation.
    pub fn copy_from(&mut self, src: &ModelWeights) -> Result<()> {
        if src.layers.len() != self.layers.len() || src.lm_head.is_some() != self.lm_head.is_some() {
            bail!("copy_from: weights of different layouts");
        }
        self.panels = None;
        self.embed_tokens.copy_from(&src.embed_tokens)?;
        for (d, s) in self.layers.iter_mut().zip(&src.layers) {
            for (a, b) in [
                (&mut d.input_layernorm, &s.input_layernorm),
                (&mut d.q_proj, &s.q_proj),
                (&mut d.k_proj, &s.k_proj),
                (&mut d.v_proj, &s.v_proj),
                (&mut d.o_proj, &s.o_proj),
                (&mut d.post_attention_layernorm, &s.post_attention_layernorm),
                (&mut d.gate_proj, &s.gate_proj),
                (&mut d.up_proj, &s.up_proj),
                (&mut d.down_proj, &s.down_proj),
            ] {
                a.copy_from(b)?;
            }
            for (a, b) in [
                (&mut d.q_bias, &s.q_bias),
                (&mut d.k_bias, &s.k_bias),
                (&mut d.v_bias, &s.v_bias),
                (&mut d.o_bias, &s.o_bias),
                (&mut d.q_norm, &s.q_norm),
                (&mut d.k_norm, &s.k_norm),
                (&mut d.gate_bias, &s.gate_bias),
                (&mut d.up_bias, &s.up_bias),
                (&mut d.down_bias, &s.down_bias),
            ] {
                match (a, b) {
                    (Some(a), Some(b)) => a.copy_from(b)?,
                    (None, None) => {}
                    _ => bail!("copy_from: weights of different layouts"),
                }
            }
        }
        self.norm.copy_from(&src.norm)?;
        if let (Some(a), Some(b)) = (&mut self.lm_head, &src.lm_head) {
            a.copy_from(b)?;
        }
        Ok(())
    }

    /// Packs every linear once into [`Panels`] for an engine whose weights will not change
    /// (`generate`, `score`): the CPU linears then skip their per-call packing, with the same
    /// bits. Costs a copy of the linears (their own dtype). Returns false, packing nothing,
    /// unless every linear is an F32/BF16/F16 tensor in host memory. Any later mutable access
    /// to the tensors drops the panels.
    pub fn pack_panels(&mut self) -> Result<bool> {
        let pack = |t: &Tensor| -> Result<Option<Panels>> {
            let float = matches!(t.cpu(), Ok(CpuStorage::F32(_) | CpuStorage::BF16(_) | CpuStorage::F16(_)));
            if !float || t.shape().len() != 2 {
                return Ok(None);
            }
            Ok(Panels::pack(crate::device::CpuFloats::of(t)?, t.dim(0), t.dim(1)))
        };
        let mut layers = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let ps: Vec<Panels> = [&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj, &l.gate_proj, &l.up_proj, &l.down_proj]
                .into_iter()
                .map(pack)
                .collect::<Result<Option<Vec<_>>>>()?
                .unwrap_or_default();
            match <[Panels; 7]>::try_from(ps) {
                Ok(a) => layers.push(a),
                Err(_) => return Ok(false),
            }
        }
        let Some(head) = pack(self.head())? else { return Ok(false) };
        self.panels = Some(Box::new(DecodePanels { layers, head }));
        Ok(true)
    }

    /// The packed linears, if [`ModelWeights::pack_panels`] made them and nothing changed since.
    pub fn panels(&self) -> Option<&DecodePanels> {
        self.panels.as_deref()
    }

    /// The LM head matrix (V, C): `lm_head` or, when tied, the embedding table.
    pub fn head(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    pub fn dtype(&self) -> DType {
        self.embed_tokens.dtype()
    }

    pub fn size_bytes(&self) -> usize {
        self.tensors().iter().map(|t| t.size_bytes()).sum()
    }

    /// Random weights: projections and embeddings ~ N(0, std²), norms = 1, biases = 0.
    /// Tensor i draws from Philox stream i of `seed`, so values do not depend on the device.
    pub fn random(cfg: &ModelConfig, dev: &Device, dtype: DType, seed: u64, std: f64) -> Result<ModelWeights> {
        let mut tensors = Vec::new();
        for (i, (name, shape)) in param_specs(cfg).into_iter().enumerate() {
            let n: usize = shape.iter().product();
            let data: Vec<f32> = if name.ends_with("norm.weight") {
                vec![1.0; n]
            } else if name.ends_with(".bias") {
                vec![0.0; n]
            } else {
                let mut s = crate::rand::Stream::new(seed, i as u64);
                (0..n).map(|_| (s.normal() * std) as f32).collect()
            };
            tensors.push(dev.from_f32(dtype, &shape, &data)?);
        }
        ModelWeights::from_ordered(cfg, tensors)
    }

    /// Loads the weights of the HF directory `dir` (single or sharded safetensors), converting
    /// to `dtype`. Errors name the file and the tensor.
    pub fn load(dir: &Path, cfg: &ModelConfig, dev: &Device, dtype: DType) -> Result<ModelWeights> {
        let files = SafetensorsFiles::open(dir)?;
        let mut tensors = Vec::new();
        for (name, shape) in param_specs(cfg) {
            tensors.push(dev.upload(load_one(&files, &name, &shape, dtype)?)?);
        }
        ModelWeights::from_ordered(cfg, tensors)
    }

    /// Writes `model.safetensors` (HF names; tied heads omitted) durably into `dir`, storing
    /// values as `dtype` (F32, BF16 or F16).
    pub fn save(&self, cfg: &ModelConfig, dir: &Path, dtype: DType) -> Result<()> {
        let specs = param_specs(cfg);
        let mut views = Vec::new();
        for ((name, shape), t) in specs.iter().zip(self.tensors()) {
            let vals = t.to_f32_vec()?;
            let (st, bytes) = match dtype {
                DType::F32 => (StDtype::F32, vals.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()),
                DType::BF16 => (StDtype::BF16, vals.iter().flat_map(|x| bf16::from_f32(*x).to_le_bytes()).collect()),
                DType::F16 => (StDtype::F16, vals.iter().flat_map(|x| f16::from_f32(*x).to_le_bytes()).collect()),
                other => bail!("cannot save weights as {}", other.name()),
            };
            views.push((name.clone(), OwnedView { dtype: st, shape: shape.clone(), bytes }));
        }
        write_safetensors(&dir.join("model.safetensors"), views, None)
    }
}

/// One tensor of `files` as a host tensor of `dtype`, its shape checked against `shape`.
pub fn load_one(files: &SafetensorsFiles, name: &str, shape: &[usize], dtype: DType) -> Result<Tensor> {
    let (path, view) = files.get(name)?;
    if view.shape() != shape {
        bail!("{}: tensor '{name}' has shape {:?}, expected {shape:?} from config.json", path.display(), view.shape());
    }
    convert(&view, dtype, shape).with_context(|| format!("{}: tensor '{name}'", path.display()))
}

/// A tensor to serialize.
pub struct OwnedView {
    pub dtype: StDtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

impl safetensors::View for OwnedView {
    fn dtype(&self) -> StDtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// Serializes to a temporary sibling, fsyncs it and renames it over `path`.
pub fn write_safetensors(
    path: &Path,
    views: Vec<(String, OwnedView)>,
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    let bytes =
        safetensors::serialize(views, metadata.or_else(|| Some(HashMap::from([("format".into(), "pt".into())]))))
            .with_context(|| format!("cannot serialize {}", path.display()))?;
    crate::util::write_atomic(path, &bytes)
}

/// Converts a safetensors view into a host tensor of `dtype`.
fn convert(view: &TensorView<'_>, dtype: DType, shape: &[usize]) -> Result<Tensor> {
    let b = view.data();
    let vals: Vec<f32> = match view.dtype() {
        StDtype::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        StDtype::BF16 => {
            if dtype == DType::BF16 {
                let v: Vec<bf16> = b.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]])).collect();
                return Ok(Tensor::from_storage(shape, crate::device::Storage::Cpu(CpuStorage::BF16(v))));
            }
            b.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect()
        }
        StDtype::F16 => {
            if dtype == DType::F16 {
                let v: Vec<f16> = b.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]])).collect();
                return Ok(Tensor::from_storage(shape, crate::device::Storage::Cpu(CpuStorage::F16(v))));
            }
            b.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect()
        }
        other => bail!("dtype {other:?} is not supported (expected BF16, F16 or F32)"),
    };
    if let Some(i) = vals.iter().position(|x| !x.is_finite()) {
        bail!("non-finite value {} at flat index {i}", vals[i]);
    }
    Tensor::from_f32_host(dtype, shape, &vals)
}

/// The safetensors files of a model directory, memory-mapped, with a name → file index.
pub struct SafetensorsFiles {
    maps: Vec<MappedFile>,
    index: HashMap<String, usize>,
}

impl SafetensorsFiles {
    pub fn open(dir: &Path) -> Result<SafetensorsFiles> {
        let single = dir.join("model.safetensors");
        let index_path = dir.join("model.safetensors.index.json");
        let mut file_names: Vec<String> = Vec::new();
        let mut weight_map: BTreeMap<String, String> = BTreeMap::new();
        if index_path.exists() {
            let text = std::fs::read_to_string(&index_path)
                .with_context(|| format!("cannot read {}", index_path.display()))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", index_path.display()))?;
            let wm = v
                .get("weight_map")
                .and_then(|w| w.as_object())
                .with_context(|| format!("{}: missing object 'weight_map'", index_path.display()))?;
            for (k, f) in wm {
                let f = f
                    .as_str()
                    .with_context(|| format!("{}: weight_map['{k}'] must be a file name", index_path.display()))?;
                if f.contains('/') || f.contains("..") {
                    bail!("{}: weight_map['{k}'] = '{f}' is not a plain file name", index_path.display());
                }
                if !file_names.iter().any(|x| x == f) {
                    file_names.push(f.to_string());
                }
                weight_map.insert(k.clone(), f.to_string());
            }
        } else if single.exists() {
            file_names.push("model.safetensors".into());
        } else {
            bail!("{}: no model.safetensors or model.safetensors.index.json found", dir.display());
        }
        let mut maps = Vec::new();
        let mut index = HashMap::new();
        for (fi, f) in file_names.iter().enumerate() {
            let path = dir.join(f);
            let file = std::fs::File::open(&path).with_context(|| format!("cannot open {}", path.display()))?;
            // SAFETY: the map is read-only; colotrain never writes model files in place (saves
            // go to a temporary file and are renamed), so the mapped bytes do not change.
            let map =
                unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("cannot mmap {}", path.display()))?;
            let (header_len, meta) = SafeTensors::read_metadata(&map)
                .map_err(|e| anyhow::anyhow!("{}: invalid safetensors file: {e}", path.display()))?;
            for name in meta.tensors().keys() {
                if weight_map.is_empty() || weight_map.get(name).map(|x| x == f).unwrap_or(false) {
                    index.insert(name.to_string(), fi);
                }
            }
            maps.push(MappedFile { path, map, header_len, meta });
        }
        for (k, f) in &weight_map {
            if !index.contains_key(k) {
                bail!("{}: weight_map lists '{k}' in {f}, but that file has no such tensor", index_path.display());
            }
        }
        Ok(SafetensorsFiles { maps, index })
    }

    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.index.keys()
    }

    pub fn get(&self, name: &str) -> Result<(&Path, TensorView<'_>)> {
        let fi = *self.index.get(name).with_context(|| {
            let files: Vec<String> = self.maps.iter().map(|m| m.path.display().to_string()).collect();
            format!("missing tensor '{name}' (searched {})", files.join(", "))
        })?;
        let m = &self.maps[fi];
        let info = m.meta.info(name).with_context(|| format!("{}: no tensor '{name}'", m.path.display()))?;
        let (a, b) = info.data_offsets;
        // read_metadata validated that the offsets are contiguous and inside the buffer.
        let base = 8 + m.header_len;
        let data = m
            .map
            .get(base + a..base + b)
            .with_context(|| format!("{}: tensor '{name}' lies outside the file", m.path.display()))?;
        let view = TensorView::new(info.dtype, info.shape.clone(), data)
            .map_err(|e| anyhow::anyhow!("{}: tensor '{name}': {e}", m.path.display()))?;
        Ok((m.path.as_path(), view))
    }
}

struct MappedFile {
    path: PathBuf,
    map: memmap2::Mmap,
    header_len: usize,
    meta: safetensors::tensor::Metadata,
}
