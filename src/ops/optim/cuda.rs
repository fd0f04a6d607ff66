//! The CUDA twin of the optimizer step: launches of csrc/kernels/optimizer.cu, no arithmetic
//! of its own. The step and the compute weights are bit-exact with `cpu.rs`; the squared norm
//! is a fixed-order f64 reduction (deterministic, equal to the CPU's within f64 rounding). The
//! chunk table (with each chunk's compute-weight address) is uploaded at the first step on a
//! device and kept (`Layout`); the per-tensor amax stays on the device for the requantize. Not
//! yet run on a GPU.

use super::{Compute, Rule, State, CHUNK};
use crate::device::cuda::args::{code, i32_of, ptr};
use crate::device::cuda::{ffi, CudaDevice};
use crate::device::{CpuStorage, DType, Tensor};
use anyhow::{bail, Result};

/// The device copy of the layout's chunk table (ct_opt_chunk: 24 bytes each) for compute
/// weights at `bases` (one address per tensor; zeros: none written), uploaded again only when
/// the device or an address changes.
fn chunk_table(d: &CudaDevice, st: &State<'_>, bases: &[u64], elem: usize) -> Result<(u64, usize)> {
    let mut slot = st.layout.device_table.lock().unwrap_or_else(|e| e.into_inner());
    let chunks = st.layout.chunks();
    if !matches!(&*slot, Some((name, b, _)) if *name == d.name() && b == bases) {
        let tensors = st.layout.tensors();
        let mut bytes = Vec::with_capacity(chunks.len() * 24);
        for &(start, len, tensor) in &chunks {
            let base = bases[tensor];
            let at = if base == 0 { 0 } else { base + ((start - tensors[tensor].0) * elem) as u64 };
            bytes.extend_from_slice(&(start as i64).to_le_bytes());
            bytes.extend_from_slice(&(len as i32).to_le_bytes());
            bytes.extend_from_slice(&i32_of(tensor, "optimizer tensors")?.to_le_bytes());
            bytes.extend_from_slice(&at.to_le_bytes());
        }
        debug_assert_eq!(std::mem::size_of::<ffi::ct_opt_chunk>(), 24);
        let mut h = Tensor::cpu_zeros(DType::U8, &[bytes.len()]);
        if let CpuStorage::U8(v) = h.cpu_mut()? {
            v.copy_from_slice(&bytes);
        }
        *slot = Some((d.name(), bases.to_vec(), d.upload(&h)?));
    }
    match &*slot {
        Some((_, _, t)) => Ok((ptr(d, t, &[DType::U8], "optimizer chunk table")?, chunks.len())),
        None => bail!("optimizer chunk table missing"),
    }
}

pub fn step(
    d: &CudaDevice,
    st: &mut State<'_>,
    grad: &mut Tensor,
    clip: f32,
    rule: &Rule,
    out: Option<Compute<'_, '_>>,
) -> Result<()> {
    let tensors = st.layout.tensors().len();
    let floats = &[DType::F32, DType::BF16, DType::F16];
    let (bases, dtype, elem, amax) = match out {
        Some(c) => {
            let mut bases = Vec::with_capacity(tensors);
            for w in c.weights.iter() {
                bases.push(ptr(d, w, floats, "compute weights")?);
            }
            let dt = c.weights.first().map(|w| w.dtype()).unwrap_or(DType::F32);
            let amax = match c.amax {
                Some(a) => {
                    let p = ptr(d, a, &[DType::U32], "optimizer amax")?;
                    d.memset0(p, tensors * 4)?;
                    p
                }
                None => 0,
            };
            (bases, code(dt), dt.size(), amax)
        }
        None => (vec![0; tensors], 0, 4, 0),
    };
    let (table, num_chunks) = chunk_table(d, st, &bases, elem)?;
    if num_chunks == 0 {
        return Ok(());
    }
    let f32p = |t: &Tensor, what: &str| ptr(d, t, &[DType::F32], what);
    let master = f32p(st.master, "master weights")?;
    let g = f32p(grad, "gradient")?;
    let (m, v) = match (&st.m, &st.v) {
        (Some(m), Some(v)) => (f32p(m, "first moment")?, f32p(v, "second moment")?),
        _ => (0, 0),
    };
    let mut p = ffi::ct_optim_params {
        master: master as *mut f32,
        m: m as *mut f32,
        v: v as *mut f32,
        grad: g as *mut f32,
        compute_dtype: dtype,
        chunks: table as *const ffi::ct_opt_chunk,
        num_chunks: i32_of(num_chunks, "optimizer chunks")?,
        amax_bits: amax as *mut u32,
        adamw: 0,
        clip,
        lr: 0.0,
        wd: 0.0,
        decay: 1.0,
        b1: 0.0,
        b2: 0.0,
        omb1: 0.0,
        omb2: 0.0,
        eps: 0.0,
        step_size: 0.0,
        bc2_sqrt: 1.0,
    };
    match *rule {
        Rule::Sgd { lr, wd } => (p.lr, p.wd) = (lr, wd),
        Rule::AdamW { decay, b1, b2, omb1, omb2, eps, step_size, bc2_sqrt } => {
            if m == 0 || v == 0 {
                bail!("optimizer: AdamW needs both moments");
            }
            p.adamw = 1;
            (p.decay, p.b1, p.b2, p.omb1, p.omb2, p.eps, p.step_size, p.bc2_sqrt) =
                (decay, b1, b2, omb1, omb2, eps, step_size, bc2_sqrt);
        }
    }
    d.k_optim(p, st.master.numel())
}

/// Each tensor's Σ g² into its own f64 slot (ct_sum_sq, then ct_sum_sq_finish), one read back.
pub fn sum_sq_all(d: &CudaDevice, gs: &[&Tensor]) -> Result<f64> {
    if gs.is_empty() {
        return Ok(0.0);
    }
    let out = d.scratch(gs.len() * 8, "squared norms")?;
    d.memset0(out.ptr, gs.len() * 8)?;
    let most = gs.iter().map(|g| g.numel().div_ceil(CHUNK)).max().unwrap_or(0);
    let partial = d.scratch(most.max(1) * 8, "squared-norm partial sums")?;
    for (i, g) in gs.iter().enumerate() {
        let n = g.numel();
        if n == 0 {
            continue;
        }
        let blocks = n.div_ceil(CHUNK);
        d.k_sum_sq(ffi::ct_sum_sq_params {
            g: ptr(d, g, &[DType::F32], "gradient")? as *const f32,
            n: n as i64,
            per_block: CHUNK as i64,
            partial: partial.ptr as *mut f64,
            blocks: i32_of(blocks, "squared-norm blocks")?,
            out: (out.ptr + 8 * i as u64) as *mut f64,
        })?;
    }
    let mut r = vec![0.0f64; gs.len()];
    d.dtoh(&mut r, out.ptr)?;
    Ok(r.iter().sum())
}
