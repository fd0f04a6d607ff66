//! The CUDA twin of the optimizer step: launches of csrc/kernels/optimizer.cu, no arithmetic
//! of its own. The step and the compute weights are bit-exact with `cpu.rs`; the squared norm
//! is a fixed-order f64 reduction (deterministic, equal to the CPU's within f64 rounding). The
//! chunk table is uploaded at the first step on a device and kept (`Layout`). Not yet run on a
//! GPU.

use super::{Compute, Rule, State, CHUNK};
use crate::device::cuda::args::{code, i32_of, ptr, vp};
use crate::device::cuda::{ffi, CudaDevice};
use crate::device::{CpuStorage, DType, Tensor};
use anyhow::{bail, Result};

/// The device copy of the layout's chunk table (ct_opt_chunk: 16 bytes each), uploaded once.
fn chunk_table(d: &CudaDevice, st: &State<'_>) -> Result<(u64, usize)> {
    let mut slot = st.layout.device_table.lock().unwrap_or_else(|e| e.into_inner());
    let chunks = st.layout.chunks();
    if !matches!(&*slot, Some((name, _)) if *name == d.name()) {
        let mut bytes = Vec::with_capacity(chunks.len() * 16);
        for &(start, len, tensor) in &chunks {
            bytes.extend_from_slice(&(start as i64).to_le_bytes());
            bytes.extend_from_slice(&(len as i32).to_le_bytes());
            bytes.extend_from_slice(&i32_of(tensor, "optimizer tensors")?.to_le_bytes());
        }
        let mut h = Tensor::cpu_zeros(DType::U8, &[bytes.len()]);
        if let CpuStorage::U8(v) = h.cpu_mut()? {
            v.copy_from_slice(&bytes);
        }
        *slot = Some((d.name(), d.upload(&h)?));
    }
    match &*slot {
        Some((_, t)) => Ok((ptr(d, t, &[DType::U8], "optimizer chunk table")?, chunks.len())),
        None => bail!("optimizer chunk table missing"),
    }
}

pub fn step(
    d: &CudaDevice,
    st: &mut State<'_>,
    grad: &mut Tensor,
    clip: f32,
    rule: &Rule,
    out: Option<Compute<'_>>,
) -> Result<()> {
    let (table, num_chunks) = chunk_table(d, st)?;
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
    let tensors = st.layout.tensors().len();
    let (compute, dtype, amax_buf) = match &out {
        Some(c) => {
            let w = ptr(d, c.weights, &[DType::F32, DType::BF16, DType::F16], "compute weights")?;
            let amax = match &c.amax {
                Some(_) => {
                    let b = d.scratch(tensors * 4, "optimizer amax")?;
                    d.memset0(b.ptr, tensors * 4)?;
                    Some(b)
                }
                None => None,
            };
            (w, code(c.weights.dtype()), amax)
        }
        None => (0, 0, None),
    };
    let mut p = ffi::ct_optim_params {
        master: master as *mut f32,
        m: m as *mut f32,
        v: v as *mut f32,
        grad: g as *mut f32,
        compute: vp(compute),
        compute_dtype: dtype,
        chunks: table as *const ffi::ct_opt_chunk,
        num_chunks: i32_of(num_chunks, "optimizer chunks")?,
        amax_bits: amax_buf.as_ref().map(|b| b.ptr as *mut u32).unwrap_or(std::ptr::null_mut()),
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
    d.k_optim(p)?;
    if let (Some(c), Some(b)) = (out, amax_buf) {
        if let Some(a) = c.amax {
            let mut bits = vec![0u32; tensors];
            d.dtoh(&mut bits, b.ptr)?;
            a.iter_mut().zip(&bits).for_each(|(o, &x)| *o = f32::from_bits(x));
        }
    }
    Ok(())
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
