//! RMSNorm's CUDA twin: buffers and the ct_rmsnorm launch (csrc/kernels/norm.cu), no arithmetic
//! of its own. Agrees with the CPU twin to rounding (the kernel's sum of squares is a parallel
//! reduction). Not yet run on a GPU.

use crate::device::cuda::args::{code, f32p, i32_of, ptr, vp, FLOATS};
use crate::device::cuda::{ffi, CudaDevice};
use crate::device::{DType, Tensor};
use anyhow::Result;

#[allow(clippy::too_many_arguments)]
fn norm(d: &CudaDevice, y: u64, x: u64, r: Option<u64>, w: &Tensor, eps: f32, rows: usize, cols: usize) -> Result<()> {
    let wp = ptr(d, w, FLOATS, "norm weight")?;
    d.k_rmsnorm(ffi::ct_rmsnorm_params {
        y: f32p(y),
        x: f32p(x),
        r: r.map(|r| r as *const f32).unwrap_or(std::ptr::null()),
        w: vp(wp),
        w_dtype: code(w.dtype()),
        rows: i32_of(rows, "norm rows")?,
        cols: i32_of(cols, "norm width")?,
        eps,
    })
}

pub fn rmsnorm(d: &CudaDevice, x: &Tensor, w: &Tensor, eps: f32, y: &mut Tensor, m: usize) -> Result<()> {
    let xp = ptr(d, x, &[DType::F32], "rmsnorm input")?;
    let yp = ptr(d, y, &[DType::F32], "rmsnorm output")?;
    norm(d, yp, xp, None, w, eps, m, w.numel())
}

pub fn add_rmsnorm(
    d: &CudaDevice,
    x: &mut Tensor,
    r: &Tensor,
    w: &Tensor,
    eps: f32,
    y: &mut Tensor,
    m: usize,
) -> Result<()> {
    let xp = ptr(d, x, &[DType::F32], "add_rmsnorm residual")?;
    let rp = ptr(d, r, &[DType::F32], "add_rmsnorm update")?;
    let yp = ptr(d, y, &[DType::F32], "add_rmsnorm output")?;
    norm(d, yp, xp, Some(rp), w, eps, m, w.numel())
}

pub fn head_rmsnorm(d: &CudaDevice, x: &mut Tensor, w: &Tensor, eps: f32, m: usize, heads: usize) -> Result<()> {
    let xp = ptr(d, x, &[DType::F32], "head_rmsnorm input")?;
    norm(d, xp, xp, None, w, eps, m * heads, w.numel())
}
