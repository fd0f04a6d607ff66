//! The CUDA twin of the linears: BF16 / F16 weights take their input rows rounded to the same
//! dtype in a scratch buffer and run a cuBLASLt GEMM with FP32 accumulation (F32 weights: an
//! FP32 GEMM, never TF32); `linear_q` is the emulated low-precision linear (the weight decoded
//! to its unit values, exact in BF16, the tensor scale as the GEMM's alpha). Not yet run on a
//! GPU.

use crate::device::cuda::args::{code, f32p, i32_of, ptr, vp, FLOATS};
use crate::device::cuda::{ffi, CudaDevice, DevBuf, Elem, Form};
use crate::device::{DType, Tensor};
use crate::quant::qtensor::QTensor;
use anyhow::{bail, Result};

/// y (rows, cols) += bias.
pub fn add_bias(d: &CudaDevice, y: u64, bias: &Tensor, rows: usize, cols: usize) -> Result<()> {
    if bias.numel() != cols {
        bail!("linear bias: {} values for {cols} columns", bias.numel());
    }
    add_biases(d, &[(y, bias)], rows)
}

/// y_j (rows, N_j) += bias_j (N_j) for the projections (y_j, bias_j) of one input: one
/// ct_add_bias launch for up to three of one dtype (q, k, v), else one each.
pub fn add_biases(d: &CudaDevice, ys: &[(u64, &Tensor)], rows: usize) -> Result<()> {
    if ys.len() > 3 || ys.iter().any(|(_, b)| b.dtype() != ys[0].1.dtype()) {
        return ys.iter().try_for_each(|&(y, b)| add_biases(d, &[(y, b)], rows));
    }
    let Some(&(_, first)) = ys.first() else { return Ok(()) };
    let seg = |j: usize| -> Result<(*mut f32, *const std::ffi::c_void, i32)> {
        match ys.get(j) {
            Some(&(y, b)) => Ok((f32p(y), vp(ptr(d, b, FLOATS, "linear bias")?), i32_of(b.numel(), "bias columns")?)),
            None => Ok((std::ptr::null_mut(), std::ptr::null(), 0)),
        }
    };
    let ((y0, bias0, cols0), (y1, bias1, cols1), (y2, bias2, cols2)) = (seg(0)?, seg(1)?, seg(2)?);
    d.k_add_bias(ffi::ct_add_bias_params {
        y0,
        y1,
        y2,
        bias0,
        bias1,
        bias2,
        cols0,
        cols1,
        cols2,
        dtype: code(first.dtype()),
        rows: i32_of(rows, "bias rows")?,
    })
}

/// x (n f32) rounded to `dt` (BF16 / F16) into a new scratch buffer.
pub fn cast_rows(d: &CudaDevice, x: u64, n: usize, dt: DType) -> Result<DevBuf> {
    cast_rows_scaled(d, x, n, 1, std::ptr::null(), dt)
}

/// x (rows, cols f32) rounded to `dt` into a new scratch buffer, each row first multiplied by
/// its NVFP4 global scale from `row_amax` (amax / 2688; NULL: none).
pub fn cast_rows_scaled(
    d: &CudaDevice,
    x: u64,
    rows: usize,
    cols: usize,
    row_amax: *const u32,
    dt: DType,
) -> Result<DevBuf> {
    let n = rows * cols;
    let buf = d.scratch(n * 2, "GEMM input rows")?;
    d.k_cast(ffi::ct_cast_params {
        x: f32p(x),
        y: vp(buf.ptr),
        dtype: code(dt),
        n: n as i64,
        row_amax,
        cols: cols.max(1) as i64,
    })?;
    Ok(buf)
}

/// A GEMM's 16-bit operand rows (an input, or an output gradient): x itself when it already
/// holds them in the GEMM's dtype (a producer wrote them rounded: `rmsnorm_train`, `swiglu`,
/// `swiglu_bwd` with a BF16 output), else x (f32) rounded into a scratch buffer (kept alive
/// with this value).
struct Rounded {
    ptr: u64,
    _scratch: Option<DevBuf>,
}

/// x's first `n` values in `dt` (BF16 / F16) at `xp` (x's device address): see [`Rounded`].
fn rounded(d: &CudaDevice, x: &Tensor, xp: u64, n: usize, dt: DType) -> Result<Rounded> {
    if x.dtype() == dt {
        return Ok(Rounded { ptr: xp, _scratch: None });
    }
    if x.dtype() != DType::F32 {
        bail!(
            "linear: a {} operand for {} GEMM operands (f32 values are rounded, or the operands' own dtype)",
            x.dtype().name(),
            dt.name()
        );
    }
    let buf = cast_rows(d, xp, n, dt)?;
    Ok(Rounded { ptr: buf.ptr, _scratch: Some(buf) })
}

/// An F32 GEMM's operand must be F32 (16-bit values would be read as f32 values).
fn f32_input(x: &Tensor) -> Result<()> {
    if x.dtype() != DType::F32 {
        bail!("linear: a {} operand for an F32 GEMM", x.dtype().name());
    }
    Ok(())
}

/// The dtypes a linear's input (and a backward's output gradient) may have: f32, or the
/// 16-bit values a producer rounded.
const INPUTS: &[DType] = &[DType::F32, DType::BF16, DType::F16];

pub fn linear(
    d: &CudaDevice,
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    y: &mut Tensor,
    m: usize,
    acc: bool,
) -> Result<()> {
    linear_onto(d, x, w, b, None, y, m, acc)
}

/// y (m, N) = r (m, N) + x · wᵀ (+ b): [`linear`] accumulating onto the residual r, which
/// cuBLASLt reads as its C while it writes y (C ≠ D): no copy of r into y first.
pub fn linear_residual(
    d: &CudaDevice,
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    r: &Tensor,
    y: &mut Tensor,
    m: usize,
) -> Result<()> {
    linear_onto(d, x, w, b, Some(r), y, m, true)
}

/// y = x · wᵀ (+ b), accumulated (`acc`) onto y itself or, given `r`, onto r.
#[allow(clippy::too_many_arguments)]
fn linear_onto(
    d: &CudaDevice,
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    r: Option<&Tensor>,
    y: &mut Tensor,
    m: usize,
    acc: bool,
) -> Result<()> {
    let (n, k) = (w.dim(0), w.dim(1));
    let xp = ptr(d, x, INPUTS, "linear input")?;
    let wp = ptr(d, w, FLOATS, "linear weight")?;
    let rp = r.map(|r| ptr(d, r, &[DType::F32], "linear residual")).transpose()?;
    let yp = ptr(d, y, &[DType::F32], "linear output")?;
    if m == 0 {
        return Ok(());
    }
    let (e, xg) = match w.dtype() {
        DType::F32 => {
            f32_input(x)?;
            (Elem::F32, Rounded { ptr: xp, _scratch: None })
        }
        dt => (if dt == DType::BF16 { Elem::BF16 } else { Elem::F16 }, rounded(d, x, xp, m * k, dt)?),
    };
    match rp {
        Some(rp) => d.gemm_residual(e, wp, xg.ptr, rp, yp, m, n, k)?,
        None => d.gemm(e, wp, xg.ptr, yp, m, n, k, 1.0, acc, None)?,
    }
    match b {
        Some(b) => add_bias(d, yp, b, m, n),
        None => Ok(()),
    }
}

/// [`linear`] of several projections of one input: x rounded once where every weight has the
/// same 16-bit dtype (each GEMM is then the one `linear` launches), else one `linear` each.
pub fn linears<const J: usize>(
    d: &CudaDevice,
    x: &Tensor,
    projs: [super::Proj<'_>; J],
    m: usize,
    acc: bool,
) -> Result<()> {
    let dt = projs[0].w.dtype();
    if dt == DType::F32 || projs.iter().any(|p| p.w.dtype() != dt) || m == 0 {
        for p in projs {
            linear(d, x, p.w, p.bias, p.y, m, acc)?;
        }
        return Ok(());
    }
    let k = projs[0].w.dim(1);
    let xh = rounded(d, x, ptr(d, x, INPUTS, "linear input")?, m * k, dt)?;
    let e = if dt == DType::BF16 { Elem::BF16 } else { Elem::F16 };
    // The projections' biases after their GEMMs, in one launch (each y its own: the same adds).
    let mut biases = Vec::with_capacity(J);
    for p in projs {
        let n = p.w.dim(0);
        let wp = ptr(d, p.w, FLOATS, "linear weight")?;
        let yp = ptr(d, p.y, &[DType::F32], "linear output")?;
        d.gemm(e, wp, xh.ptr, yp, m, n, k, 1.0, acc, None)?;
        if let Some(b) = p.bias {
            biases.push((yp, b));
        }
    }
    add_biases(d, &biases, m)
}

pub fn linear_q(d: &CudaDevice, x: &Tensor, wq: &QTensor, b: Option<&Tensor>, y: &mut Tensor, m: usize) -> Result<()> {
    let (n, k) = (wq.rows, wq.k);
    let xp = ptr(d, x, &[DType::F32], "linear input")?;
    let yp = ptr(d, y, &[DType::F32], "linear output")?;
    if m == 0 {
        return Ok(());
    }
    let w = super::cuda_lowp::decoded_weight(d, wq)?;
    let xh = cast_rows(d, xp, m * k, DType::BF16)?;
    d.gemm(Elem::BF16, w.ptr(), xh.ptr, yp, m, n, k, wq.scale, false, None)?;
    match b {
        Some(b) => add_bias(d, yp, b, m, n),
        None => Ok(()),
    }
}

/// dx (m, K) (+)= dy (m, N) · W (N, K): cuBLASLt's x·w form, dy rounded to a 16-bit weight's
/// dtype first (unless its producer wrote it so).
pub fn linear_dx(d: &CudaDevice, dy: &Tensor, w: &Tensor, dx: &mut Tensor, m: usize, acc: bool) -> Result<()> {
    let (n, k) = (w.dim(0), w.dim(1));
    let dyp = ptr(d, dy, INPUTS, "linear output gradient")?;
    let wp = ptr(d, w, FLOATS, "linear weight")?;
    let dxp = ptr(d, dx, &[DType::F32], "linear input gradient")?;
    if m == 0 {
        return Ok(());
    }
    match w.dtype() {
        DType::F32 => {
            f32_input(dy)?;
            d.gemm_form(Form::Nn, Elem::F32, wp, dyp, dxp, m, k, n, 1.0, acc)
        }
        dt => {
            let dyh = rounded(d, dy, dyp, m * n, dt)?;
            let e = if dt == DType::BF16 { Elem::BF16 } else { Elem::F16 };
            d.gemm_form(Form::Nn, e, wp, dyh.ptr, dxp, m, k, n, 1.0, acc)
        }
    }
}

/// dW (N, K) f32 (+)= dyᵀ · x over m rows: cuBLASLt's xᵀ·w form (x = dy stored (m, N), w = the
/// layer input stored (m, K)), the operands rounded to BF16 first when asked.
pub fn linear_dw(
    d: &CudaDevice,
    dy: &Tensor,
    x: &Tensor,
    dw: &mut Tensor,
    m: usize,
    acc: bool,
    operands: DType,
) -> Result<()> {
    let (n, k) = (dw.dim(0), dw.dim(1));
    let dyp = ptr(d, dy, INPUTS, "linear output gradient")?;
    let xp = ptr(d, x, INPUTS, "linear input")?;
    let dwp = ptr(d, dw, &[DType::F32], "linear weight gradient")?;
    if m == 0 {
        return if acc { Ok(()) } else { d.memset0(dwp, n * k * 4) };
    }
    if operands == DType::BF16 {
        let (dyh, xh) = (rounded(d, dy, dyp, m * n, DType::BF16)?, rounded(d, x, xp, m * k, DType::BF16)?);
        d.gemm_form(Form::Tn, Elem::BF16, xh.ptr, dyh.ptr, dwp, n, k, m, 1.0, acc)
    } else {
        f32_input(x)?;
        f32_input(dy)?;
        d.gemm_form(Form::Tn, Elem::F32, xp, dyp, dwp, n, k, m, 1.0, acc)
    }
}

/// `super::linear_grads`: each projection's `linear_dx` and `linear_dw` launches, with x
/// rounded to BF16 once for all weight gradients and dy once for both of its GEMMs when its
/// weight is BF16 and the operands BF16 (the roundings are the same, so the bits are too); a
/// dy its producer already wrote in BF16 is not rounded at all.
pub fn linear_grads<const J: usize>(
    d: &CudaDevice,
    x: &Tensor,
    projs: [super::GradProj<'_>; J],
    dx: &mut Tensor,
    acc_dx: bool,
    m: usize,
    operands: DType,
) -> Result<()> {
    let k = projs[0].w.dim(1);
    let xp = ptr(d, x, INPUTS, "linear input")?;
    let dxp = ptr(d, dx, &[DType::F32], "linear input gradient")?;
    if m == 0 {
        return Ok(());
    }
    // Every dy's dtype before the first launch: 16-bit only where each of its GEMMs rounds
    // to that dtype (a 16-bit weight's data gradient, BF16 weight-gradient operands).
    for p in &projs {
        if p.w.dtype() == DType::F32 || operands != DType::BF16 {
            f32_input(p.dy)?;
        }
    }
    let xh = if operands == DType::BF16 {
        Some(rounded(d, x, xp, m * k, DType::BF16)?)
    } else {
        f32_input(x)?;
        None
    };
    for (j, p) in projs.into_iter().enumerate() {
        let n = p.w.dim(0);
        let dyp = ptr(d, p.dy, INPUTS, "linear output gradient")?;
        let wp = ptr(d, p.w, FLOATS, "linear weight")?;
        let dwp = ptr(d, p.dw, &[DType::F32], "linear weight gradient")?;
        // dx: dy in the weight's dtype (`linear_dx`).
        let wdt = p.w.dtype();
        let dyw = match wdt {
            DType::F32 => {
                f32_input(p.dy)?;
                None
            }
            _ => Some(rounded(d, p.dy, dyp, m * n, wdt)?),
        };
        let acc = acc_dx || j > 0;
        match &dyw {
            None => d.gemm_form(Form::Nn, Elem::F32, wp, dyp, dxp, m, k, n, 1.0, acc)?,
            Some(h) => {
                let e = if wdt == DType::BF16 { Elem::BF16 } else { Elem::F16 };
                d.gemm_form(Form::Nn, e, wp, h.ptr, dxp, m, k, n, 1.0, acc)?
            }
        }
        // dw (`linear_dw`): BF16 operands reuse dx's rounding of dy when it is BF16.
        match &xh {
            None => {
                f32_input(p.dy)?;
                d.gemm_form(Form::Tn, Elem::F32, xp, dyp, dwp, n, k, m, 1.0, true)?
            }
            Some(xh) => {
                let own;
                let dyb = match &dyw {
                    Some(h) if wdt == DType::BF16 => h.ptr,
                    _ => {
                        own = rounded(d, p.dy, dyp, m * n, DType::BF16)?;
                        own.ptr
                    }
                };
                d.gemm_form(Form::Tn, Elem::BF16, xh.ptr, dyb, dwp, n, k, m, 1.0, true)?
            }
        }
    }
    Ok(())
}

/// db (N) += column sums of dy (m, N) (ct_col_sum in the order of `ops::reduction_chunk_rows`:
/// bit-exact with the CPU).
pub fn bias_grad(d: &CudaDevice, dy: &Tensor, db: &mut Tensor, m: usize) -> Result<()> {
    let (chunk_rows, partial) = column_chunks(d, m, db.numel())?;
    d.k_col_sum(ffi::ct_col_sum_params {
        x: ptr(d, dy, &[DType::F32], "linear output gradient")? as *const f32,
        out: f32p(ptr(d, db, &[DType::F32], "bias gradient")?),
        partial: partial.as_ref().map_or(std::ptr::null_mut(), |b| b.ptr as *mut f32),
        rows: i32_of(m, "rows")?,
        cols: i32_of(db.numel(), "bias width")?,
        chunk_rows,
    })
}

/// out (N) += the rows of x[..m] (m, N) in row order: ct_col_sum as one chunk.
pub fn sum_rows_in_order(d: &CudaDevice, x: &Tensor, out: &mut Tensor, m: usize) -> Result<()> {
    d.k_col_sum(ffi::ct_col_sum_params {
        x: ptr(d, x, &[DType::F32], "rows to sum")? as *const f32,
        out: f32p(ptr(d, out, &[DType::F32], "their sum")?),
        partial: std::ptr::null_mut(),
        rows: i32_of(m, "rows")?,
        cols: i32_of(out.numel(), "columns")?,
        chunk_rows: i32_of(m.max(1), "rows")?,
    })
}

/// A column sum of `rows` rows of `cols` values in the order of `ops::reduction_chunk_rows`:
/// its rows a chunk, and for more than one chunk a scratch (chunks, cols) f32 for the chunks'
/// sums (freed blocks are reused only by later work on the stream).
pub(crate) fn column_chunks(d: &CudaDevice, rows: usize, cols: usize) -> Result<(i32, Option<DevBuf>)> {
    let k = crate::ops::reduction_chunk_rows(rows);
    if rows <= k {
        return Ok((i32_of(rows.max(1), "rows")?, None));
    }
    Ok((i32_of(k, "rows a chunk")?, Some(d.scratch(rows.div_ceil(k) * cols * 4, "column sums of the chunks")?)))
}
