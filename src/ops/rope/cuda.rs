//! Rotary embeddings' CUDA twin: the ct_rope_table and ct_rope launches (csrc/kernels/rope.cu).
//! rope is bit-exact with the CPU twin; rope_table to the last bit of the f64 cos/sin. Not yet
//! run on a GPU.

use crate::device::cuda::args::{f32p, i32_of, ptr, u32p};
use crate::device::cuda::{ffi, CudaDevice};
use crate::device::{DType, Tensor};
use anyhow::Result;

pub fn rope_table(d: &CudaDevice, p: &Tensor, f: &Tensor, c: &mut Tensor, s: &mut Tensor, m: usize) -> Result<()> {
    let half = f.numel();
    d.k_rope_table(ffi::ct_rope_table_params {
        pos: u32p(ptr(d, p, &[DType::U32], "rope positions")?),
        inv_freq: ptr(d, f, &[DType::F32], "rope inv_freq")? as *const f32,
        cos: f32p(ptr(d, c, &[DType::F32], "rope cos")?),
        sin: f32p(ptr(d, s, &[DType::F32], "rope sin")?),
        rows: i32_of(m, "rope rows")?,
        half: i32_of(half, "rope half dimension")?,
    })
}

pub fn rope(d: &CudaDevice, x: &mut Tensor, c: &Tensor, s: &Tensor, m: usize, heads: usize) -> Result<()> {
    let half = c.dim(c.shape().len() - 1);
    d.k_rope(ffi::ct_rope_params {
        x: f32p(ptr(d, x, &[DType::F32], "rope input")?),
        cos: ptr(d, c, &[DType::F32], "rope cos")? as *const f32,
        sin: ptr(d, s, &[DType::F32], "rope sin")? as *const f32,
        rows: i32_of(m, "rope rows")?,
        heads: i32_of(heads, "rope heads")?,
        half: i32_of(half, "rope half dimension")?,
    })
}

pub fn rope_bwd(d: &CudaDevice, x: &mut Tensor, c: &Tensor, s: &Tensor, m: usize, heads: usize) -> Result<()> {
    let half = c.dim(c.shape().len() - 1);
    d.k_rope_bwd(ffi::ct_rope_params {
        x: f32p(ptr(d, x, &[DType::F32], "rope gradient")?),
        cos: ptr(d, c, &[DType::F32], "rope cos")? as *const f32,
        sin: ptr(d, s, &[DType::F32], "rope sin")? as *const f32,
        rows: i32_of(m, "rope rows")?,
        heads: i32_of(heads, "rope heads")?,
        half: i32_of(half, "rope half dimension")?,
    })
}
