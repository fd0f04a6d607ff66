//! RMSNorm's CUDA twin: buffers and the ct_rmsnorm launch (csrc/kernels/norm.cu), no arithmetic
//! of its own. Agrees with the CPU twin to rounding (the kernel's sum of squares is a parallel
//! reduction). Not yet run on a GPU.

use crate::device::cuda::args::{code, f32p, i32_of, ptr, vp, FLOATS};
use crate::device::cuda::{ffi, CudaDevice};
use crate::device::{DType, Tensor};
use anyhow::Result;

/// A norm's output: f32, or BF16 for a BF16 GEMM that reads nothing else (the engine's
/// `ForwardBuffers::h16`).
const OUTPUTS: &[DType] = &[DType::F32, DType::BF16];

/// ct_rmsnorm writing y (`y_dtype`: F32 or BF16) from x (+ r).
#[allow(clippy::too_many_arguments)]
fn norm(
    d: &CudaDevice,
    (y, y_dtype): (u64, DType),
    x: u64,
    r: Option<u64>,
    w: &Tensor,
    eps: f32,
    rows: usize,
    cols: usize,
) -> Result<()> {
    let wp = ptr(d, w, FLOATS, "norm weight")?;
    d.k_rmsnorm(ffi::ct_rmsnorm_params {
        y: vp(y),
        y_dtype: code(y_dtype),
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
    let yp = ptr(d, y, OUTPUTS, "rmsnorm output")?;
    norm(d, (yp, y.dtype()), xp, None, w, eps, m, w.numel())
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
    let yp = ptr(d, y, OUTPUTS, "add_rmsnorm output")?;
    norm(d, (yp, y.dtype()), xp, Some(rp), w, eps, m, w.numel())
}

pub fn head_rmsnorm(d: &CudaDevice, x: &mut Tensor, w: &Tensor, eps: f32, m: usize, heads: usize) -> Result<()> {
    let xp = ptr(d, x, &[DType::F32], "head_rmsnorm input")?;
    norm(d, (xp, DType::F32), xp, None, w, eps, m * heads, w.numel())
}

pub fn rmsnorm_train(
    d: &CudaDevice,
    x: &Tensor,
    w: &Tensor,
    eps: f32,
    y: &mut Tensor,
    rstd: &mut Tensor,
    m: usize,
) -> Result<()> {
    let c = w.numel();
    if m == 0 {
        return Ok(());
    }
    d.k_rmsnorm_train(ffi::ct_rmsnorm_train_params {
        x: ptr(d, x, &[DType::F32], "rmsnorm input")? as *const f32,
        w: vp(ptr(d, w, FLOATS, "rmsnorm weight")?),
        w_dtype: code(w.dtype()),
        y: vp(ptr(d, y, &[DType::F32, DType::BF16], "rmsnorm output")?),
        y_dtype: code(y.dtype()),
        rstd: f32p(ptr(d, rstd, &[DType::F32], "rmsnorm saved 1/rms")?),
        rows: i32_of(m, "rmsnorm rows")?,
        cols: i32_of(c, "rmsnorm width")?,
        eps,
    })
}

#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_bwd(
    d: &CudaDevice,
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    rstd: &Tensor,
    dx: &mut Tensor,
    accumulate: bool,
    dw: &mut Tensor,
    m: usize,
) -> Result<()> {
    let c = w.numel();
    if m == 0 {
        return Ok(());
    }
    let f = |t: &Tensor, what: &str| ptr(d, t, &[DType::F32], what);
    let (chunk_rows, partial) = crate::ops::linear::column_chunks(d, m, c)?;
    d.k_rmsnorm_bwd(ffi::ct_rmsnorm_bwd_params {
        dy: f(dy, "rmsnorm output gradient")? as *const f32,
        x: f(x, "rmsnorm input")? as *const f32,
        w: vp(ptr(d, w, FLOATS, "rmsnorm weight")?),
        w_dtype: code(w.dtype()),
        rstd: f(rstd, "rmsnorm saved 1/rms")? as *const f32,
        dx: f32p(f(dx, "rmsnorm input gradient")?),
        dw: f32p(f(dw, "rmsnorm weight gradient")?),
        partial: partial.as_ref().map_or(std::ptr::null_mut(), |b| b.ptr as *mut f32),
        rows: i32_of(m, "rmsnorm rows")?,
        cols: i32_of(c, "rmsnorm width")?,
        accumulate: accumulate as i32,
        chunk_rows,
    })
}
