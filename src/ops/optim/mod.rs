//! The optimizer step as an op: AdamW (torch.optim.AdamW, single-tensor semantics) or SGD on
//! flat FP32 master weights, gradient clipping by a given coefficient, the compute weights
//! written from the new master with each tensor's amax of them, and the gradient's squared
//! norm. The trainer (`train::optimizer`) decides the learning rate, the clipping coefficient
//! and whether a non-finite step is skipped; this room applies them on the device that holds
//! the state.
//!
//! Owns: [`Rule`], [`Layout`], the signatures and their checks; the CPU twin (`cpu.rs`: the
//! reference, which the CPU trainer runs), the CUDA twin (`cuda.rs`, csrc/kernels/optimizer.cu,
//! bit-exact with it). May call: `crate::device`. Must not: know about configs or schedules.

pub mod cpu;
mod cuda;
#[cfg(test)]
mod tests;

use crate::device::{DType, Device, Tensor};
use anyhow::{bail, Result};
use std::sync::Mutex;

/// Elements per chunk of the multi-tensor step (one CUDA block each) and per block of the
/// squared-norm reduction.
pub const CHUNK: usize = 65536;

/// The update rule of one step, its scalars already in f32 as the element loop uses them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Rule {
    /// torch.optim.SGD: g += wd·p; p −= lr·g.
    Sgd { lr: f32, wd: f32 },
    /// torch.optim.AdamW: p *= decay; m = β1 m + (1−β1) g; v = β2 v + (1−β2) g²;
    /// p −= step_size · m / (√v / bc2_sqrt + eps).
    AdamW { decay: f32, b1: f32, b2: f32, omb1: f32, omb2: f32, eps: f32, step_size: f32, bc2_sqrt: f32 },
}

impl Rule {
    pub fn sgd(lr: f64, wd: f64) -> Rule {
        Rule::Sgd { lr: lr as f32, wd: wd as f32 }
    }

    /// AdamW at optimizer step `t` (1-based): the bias corrections in f64, then every scalar
    /// rounded once to f32 (as torch computes them in Python floats).
    pub fn adamw(lr: f64, wd: f64, betas: [f64; 2], eps: f64, t: u64) -> Rule {
        let [b1, b2] = betas;
        let bc1 = 1.0 - b1.powi(t as i32);
        let bc2_sqrt = (1.0 - b2.powi(t as i32)).sqrt();
        let (b1, b2) = (b1 as f32, b2 as f32);
        Rule::AdamW {
            decay: (1.0 - lr * wd) as f32,
            b1,
            b2,
            omb1: 1.0 - b1,
            omb2: 1.0 - b2,
            eps: eps as f32,
            step_size: (lr / bc1) as f32,
            bc2_sqrt: bc2_sqrt as f32,
        }
    }
}

/// Where each tensor lies in the flat vectors: (offset, length), in order, back to back. The
/// CUDA twin keeps its chunk table on the device (uploaded again only when the compute
/// weights' addresses change, which in-place training never does).
#[derive(Debug)]
pub struct Layout {
    tensors: Vec<(usize, usize)>,
    n: usize,
    device_table: Mutex<Option<(String, Vec<u64>, Tensor)>>,
}

impl Layout {
    pub fn new(tensors: Vec<(usize, usize)>) -> Result<Layout> {
        let mut next = 0;
        for (i, &(off, len)) in tensors.iter().enumerate() {
            if off != next {
                bail!("optimizer layout: tensor {i} starts at {off}, expected {next} (tensors back to back)");
            }
            if len > i32::MAX as usize {
                bail!("optimizer layout: tensor {i} of {len} values is too large");
            }
            next = off + len;
        }
        Ok(Layout { tensors, n: next, device_table: Mutex::new(None) })
    }

    /// Values in all tensors together.
    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    pub fn tensors(&self) -> &[(usize, usize)] {
        &self.tensors
    }

    /// (start, length, tensor) of each chunk: every tensor cut into pieces of at most CHUNK.
    pub fn chunks(&self) -> Vec<(usize, usize, usize)> {
        let mut out = Vec::new();
        for (t, &(off, len)) in self.tensors.iter().enumerate() {
            let mut s = 0;
            while s < len {
                let l = CHUNK.min(len - s);
                out.push((off + s, l, t));
                s += l;
            }
        }
        out
    }
}

/// The optimizer's state on a device: flat FP32 tensors of `layout.len()` values (moments for
/// AdamW only).
pub struct State<'a> {
    pub master: &'a mut Tensor,
    pub m: Option<&'a mut Tensor>,
    pub v: Option<&'a mut Tensor>,
    pub layout: &'a Layout,
}

/// Where the step writes the compute weights: one tensor per layout tensor (any shape, as many
/// values as that tensor, all of one dtype: F32, BF16 or F16; the parameters' own tensors,
/// which the engine reads), and optionally each tensor's amax of the written values as f32 bit
/// patterns into a U32 tensor of one value per layout tensor, on the step's device (the input
/// of a quantized engine's requantize, `ops::quantize::requantize_all_known`).
pub struct Compute<'a, 'b> {
    pub weights: &'b mut [&'a mut Tensor],
    pub amax: Option<&'b mut Tensor>,
}

fn check_flat(t: &Tensor, n: usize, dtypes: &[DType], what: &str) -> Result<()> {
    if t.numel() != n {
        bail!("optimizer {what}: {} values for a layout of {n}", t.numel());
    }
    if !dtypes.contains(&t.dtype()) {
        bail!("optimizer {what}: a {} tensor, expected {:?}", t.dtype().name(), dtypes);
    }
    Ok(())
}

/// One step: grad *= clip (in place), then the rule on master (and moments), then the compute
/// weights and their per-tensor amax from the new master.
pub fn step(
    dev: &Device,
    st: &mut State<'_>,
    grad: &mut Tensor,
    clip: f32,
    rule: &Rule,
    out: Option<Compute<'_, '_>>,
) -> Result<()> {
    let n = st.layout.len();
    check_flat(st.master, n, &[DType::F32], "master weights")?;
    check_flat(grad, n, &[DType::F32], "gradient")?;
    if let Rule::AdamW { .. } = rule {
        match (&st.m, &st.v) {
            (Some(m), Some(v)) => {
                check_flat(m, n, &[DType::F32], "first moment")?;
                check_flat(v, n, &[DType::F32], "second moment")?;
            }
            _ => bail!("optimizer: AdamW needs both moments"),
        }
    }
    if let Some(c) = &out {
        let tensors = st.layout.tensors();
        if c.weights.len() != tensors.len() {
            bail!("optimizer: {} compute tensors for a layout of {} tensors", c.weights.len(), tensors.len());
        }
        let dt = c.weights.first().map(|w| w.dtype()).unwrap_or(DType::F32);
        for (i, (w, &(_, len))) in c.weights.iter().zip(tensors).enumerate() {
            check_flat(w, len, &[dt], &format!("compute weights of tensor {i}"))?;
        }
        if ![DType::F32, DType::BF16, DType::F16].contains(&dt) {
            bail!("optimizer compute weights: a {} tensor, expected F32, BF16 or F16", dt.name());
        }
        if let Some(a) = &c.amax {
            check_flat(a, tensors.len(), &[DType::U32], "amax")?;
        }
    }
    match dev {
        Device::Cpu(_) => cpu::step(st, grad, clip, rule, out),
        Device::Cuda(d) => cuda::step(d, st, grad, clip, rule, out),
    }
}

/// Σ g² of a flat F32 tensor, in f64 (the square of its L2 norm). The CUDA twin sums in
/// another (fixed) order: equal to the CPU's within f64 rounding.
pub fn sum_sq(dev: &Device, g: &Tensor) -> Result<f64> {
    sum_sq_all(dev, &[g])
}

/// Σ g² over every tensor of `gs` (F32, any shape), in f64: each tensor's sum (as
/// [`sum_sq`]) added in order. The CUDA twin reads all the sums back in one copy.
pub fn sum_sq_all(dev: &Device, gs: &[&Tensor]) -> Result<f64> {
    for g in gs {
        check_flat(g, g.numel(), &[DType::F32], "gradient")?;
    }
    match dev {
        Device::Cpu(_) => gs.iter().map(|g| Ok(cpu::sum_sq(g.f32s()?))).sum(),
        Device::Cuda(d) => cuda::sum_sq_all(d, gs),
    }
}
