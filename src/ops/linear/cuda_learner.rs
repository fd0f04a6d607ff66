//! The NVFP4 learner's linears on their operands' codes (seed 004 §5.1: W4A4 on the learner),
//! on a CUDA device: the forward [`learner_w4a4`] and the straight-through backward
//! [`learner_dx`] / [`learner_dw`]. Every GEMM multiplies unit values q·bs (exact in BF16) or
//! the codes themselves (CUTLASS) with FP32 accumulation, in the operands' rotated domain under
//! the RHT (H is orthogonal, so the products are the unrotated ones); the global scales, read
//! on the device, are applied by the forward's BF16 GEMM in its epilogue where the activation
//! scale is one value, else by one more kernel, which also rotates the backward's results back.
//!
//! Owns: nothing (functions over `LearnerCodes`). May call: the device's GEMMs and kernels,
//! `cuda_lowp`'s CUTLASS lookup and scale tiling. Must not: keep state between calls.

use super::cuda::{add_bias, cast_rows, cast_rows_scaled};
use super::cuda_lowp::{cutlass_kernel, cutlass_supports, swizzle};
use crate::device::cuda::args::{i32_of, ptr};
use crate::device::cuda::{ffi, CudaDevice, CutlassArgs, DevBuf, Elem, Form};
use crate::device::{DType, Tensor};
use crate::ops::quantize::LearnerCodes;
use crate::quant::qtensor::QFormat;
use anyhow::{bail, Result};

/// y[..m] (m, N) (+)= x · wᵀ (+ bias) for the NVFP4 learner's operands (codes of the same
/// rounding as their decoded copies): the unit values' products with FP32 accumulation — the
/// CUTLASS block-scaled GEMM where there is one for the shape, else (Hopper) a BF16 GEMM of
/// both operands decoded to their unit values (q·bs, exact in BF16: the same products) —
/// times the operands' global scales read on the device. The BF16 GEMM applies them in its
/// epilogue (alpha = g_x·g_w and beta written by a one-thread launch, cuBLASLt's device
/// pointer mode) where x's scale is one value (also where CUTLASS refuses the problem);
/// CUTLASS (alpha from the host) and per-token scales write a scratch that one more kernel
/// scales into y. Ok(false) when K is not a
/// multiple of 16 (the caller multiplies the decoded copies instead). Before the BF16 path,
/// Hopper multiplied the rounded f32 copies on the CUDA cores: 22.4 s of the 4B TRIAGE
/// config's modelled 49 s train phase (`bench node --model-gpu h200 --ledger`); the pass over
/// the scratch was 0.37 s more of it.
pub fn learner_w4a4(
    d: &CudaDevice,
    x: &LearnerCodes,
    w: &LearnerCodes,
    bias: Option<&Tensor>,
    y: &mut Tensor,
    accumulate: bool,
) -> Result<bool> {
    let (m, n, k) = (x.rows, w.rows, w.k);
    if x.k != k || w.per_row || w.fixed > 0.0 {
        bail!("learner W4A4: activations of K = {} for a weight of K = {k} (per-tensor scale)", x.k);
    }
    let yp = ptr(d, y, &[DType::F32], "learner linear output")?;
    crate::ops::check_rows(y, m, n, "learner linear output")?;
    if k % 16 != 0 {
        return Ok(false);
    }
    let row = match x.per_row {
        true => Scale::Rows(x.amax.ptr),
        false => Scale::of(x),
    };
    let cutlass = cutlass_kernel(d, QFormat::Nvfp4).filter(|_| cutlass_supports(d, QFormat::Nvfp4, n, k));
    // CUTLASS's product (alpha from the host) in a scratch, where it runs the shape.
    let mut raw = match cutlass {
        Some(g) => {
            let raw = d.scratch(m * n * 4, "learner W4A4 product")?;
            let (sa, sw) = (swizzle(d, x.scales.ptr, m, k)?, swizzle(d, w.scales.ptr, n, k)?);
            let args = CutlassArgs {
                a: x.packed.ptr,
                b: w.packed.ptr,
                sfa: sa.ptr,
                sfb: sw.ptr,
                d: raw.ptr,
                m,
                n,
                k,
                alpha: 1.0,
            };
            d.cutlass_gemm(g, &args)?.then_some(raw)
        }
        None => None,
    };
    if raw.is_none() {
        let (xb, wb) = (unit_values(d, x)?, unit_values(d, w)?);
        if x.per_row {
            let r = d.scratch(m * n * 4, "learner W4A4 product")?;
            d.gemm(Elem::BF16, wb.ptr, xb.ptr, r.ptr, m, n, k, 1.0, false, None)?;
            raw = Some(r);
        } else {
            let scalars = gemm_scalars(d, row, Scale::of(w), accumulate)?;
            d.gemm_device_scalars(Elem::BF16, wb.ptr, xb.ptr, yp, (m, n, k), scalars.ptr, accumulate)?;
        }
    }
    if let Some(raw) = raw {
        scale_out(d, raw.ptr, yp, (m, n), row, Scale::of(w), None, accumulate)?;
    }
    if let Some(b) = bias {
        add_bias(d, yp, b, m, n)?;
    }
    Ok(true)
}

/// The learner operand's codes decoded to their BF16 unit values q·bs (exact), in a scratch.
fn unit_values(d: &CudaDevice, c: &LearnerCodes) -> Result<DevBuf> {
    let out = d.scratch(c.rows * c.k * 2, "learner unit values")?;
    d.k_dequant(ffi::ct_dequant_params {
        codes: c.packed.ptr as *const u8,
        scales: c.scales.ptr as *const u8,
        format: ffi::CT_FORMAT_NVFP4,
        n: (c.rows * c.k) as i64,
        scale: 1.0,
        out: out.ptr as *mut std::ffi::c_void,
        out_dtype: ffi::CT_DTYPE_BF16,
    })?;
    Ok(out)
}

/// One side's global scale in [`scale_out`]: a known value, an amax on the device (one
/// slot), or one amax per row (row side only).
#[derive(Clone, Copy)]
enum Scale {
    Value(f32),
    Amax(u64),
    Rows(u64),
}

impl Scale {
    /// A per-tensor or fixed operand's global scale.
    fn of(c: &LearnerCodes) -> Scale {
        match c.fixed > 0.0 {
            true => Scale::Value(c.fixed),
            false => Scale::Amax(c.amax.ptr),
        }
    }
}

/// dst (rows, cols) (+)= src · g_row · g_col, each 16-column block then rotated back by the
/// inverse RHT of `signs` (ct_nvfp4_scale_out).
#[allow(clippy::too_many_arguments)]
fn scale_out(
    d: &CudaDevice,
    src: u64,
    dst: u64,
    (rows, cols): (usize, usize),
    row: Scale,
    col: Scale,
    signs: Option<[f32; 16]>,
    accumulate: bool,
) -> Result<()> {
    let (row_amax, per_row, row_fixed) = match row {
        Scale::Value(v) => (0, false, v),
        Scale::Amax(p) => (p, false, 0.0),
        Scale::Rows(p) => (p, true, 0.0),
    };
    let (col_amax, col_fixed) = match col {
        Scale::Value(v) => (0, v),
        Scale::Amax(p) => (p, 0.0),
        Scale::Rows(_) => bail!("learner scale-out: per-row scales on the column side"),
    };
    d.k_nvfp4_scale_out(ffi::ct_nvfp4_scale_out_params {
        src: src as *const f32,
        dst: dst as *mut f32,
        rows: i32_of(rows, "learner linear rows")?,
        cols: i32_of(cols, "learner linear columns")?,
        row_amax: row_amax as *const u32,
        per_row: per_row as i32,
        row_fixed,
        col_amax: col_amax as *const u32,
        col_fixed,
        accumulate: accumulate as i32,
        rht: signs.is_some() as i32,
        signs: signs.unwrap_or([1.0; 16]),
        scalars: std::ptr::null_mut(),
    })
}

/// The (alpha, beta) of a GEMM in device pointer mode that applies `row` · `col` itself: g_x ·
/// g_w by ct_nvfp4_scale_out's rule, and 1 with `accumulate` (else 0), in a scratch of two f32.
fn gemm_scalars(d: &CudaDevice, row: Scale, col: Scale, accumulate: bool) -> Result<DevBuf> {
    let out = d.scratch(8, "learner GEMM alpha and beta")?;
    let side = |s: Scale| match s {
        Scale::Value(v) => Ok((0, v)),
        Scale::Amax(p) => Ok((p, 0.0)),
        Scale::Rows(_) => bail!("learner GEMM scalars: one alpha for per-row scales"),
    };
    let ((row_amax, row_fixed), (col_amax, col_fixed)) = (side(row)?, side(col)?);
    d.k_nvfp4_scale_out(ffi::ct_nvfp4_scale_out_params {
        src: std::ptr::null(),
        dst: std::ptr::null_mut(),
        rows: 0,
        cols: 0,
        row_amax: row_amax as *const u32,
        per_row: 0,
        row_fixed,
        col_amax: col_amax as *const u32,
        col_fixed,
        accumulate: accumulate as i32,
        rht: 0,
        signs: [1.0; 16],
        scalars: out.ptr as *mut f32,
    })?;
    Ok(out)
}

/// The straight-through data gradient of the learner's linear y = Q(x)·Q(w)ᵀ: dx[..m] (m, K)
/// (+)= dy[..m] (m, N) · Q(w), w's codes (N, K) under a per-tensor scale. Q(w) = g_w·R⁻¹(q·bs)
/// blockwise along K, so dx = g_w · R⁻¹(dy · (q·bs)): dy rounded to BF16 (as every BF16
/// linear's data gradient), a BF16 GEMM of w's unit values (exact) with FP32 accumulation, then
/// the scale and the inverse RHT on the result. Before, the GEMM multiplied the rotated-back
/// f32 copy on the CUDA cores (not BF16 values).
pub fn learner_dx(d: &CudaDevice, dy: &Tensor, w: &LearnerCodes, dx: &mut Tensor, m: usize, acc: bool) -> Result<()> {
    let dyp = check_dy(d, dy, m, w.rows)?;
    let dxp = check_dx(d, w, dx, m)?;
    if m == 0 {
        return Ok(());
    }
    let dyh = cast_rows(d, dyp, m * w.rows, DType::BF16)?; // (m, N)
    dx_from(d, dyh.ptr, w, dxp, m, acc)
}

/// The straight-through weight gradient of the learner's linear: dw (N, K) (+)= dy[..m]ᵀ ·
/// Q(x), x's codes (m, K). Q(x)[t] = g_t·R⁻¹(q·bs)[t] blockwise along K, so dw =
/// R⁻¹((dy ⊙ g)ᵀ · (q·bs)): each row of dy times its token's scale g_t (per-token scales; a
/// fixed or per-tensor scale multiplies the result instead), rounded to BF16 (as every BF16
/// linear's weight gradient rounds dy), a BF16 GEMM of x's unit values (exact) with FP32
/// accumulation, then the inverse RHT on the result.
pub fn learner_dw(d: &CudaDevice, dy: &Tensor, x: &LearnerCodes, dw: &mut Tensor, m: usize, acc: bool) -> Result<()> {
    let dyp = check_dy(d, dy, m, dw.dim(0))?;
    let dwp = check_dw(d, x, dw, m)?;
    if m == 0 {
        return if acc { Ok(()) } else { d.memset0(dwp, dw.numel() * 4) };
    }
    let dyh = dy_for_dw(d, dyp, x, m, dw.dim(0))?;
    dw_from(d, dyh.ptr, x, dwp, dw.dim(0), m, acc)
}

/// Both straight-through gradients of one learner linear, [`learner_dx`] (accumulating when
/// `acc_dx`) and [`learner_dw`] (accumulating), from one BF16 rounding of dy where x's scale is
/// per tensor or fixed (per-token scales round g_t·dy for dw: a second rounding). dy may come
/// in BF16 already, rounded by its producer as this rounds it (SwiGLU's backward), where x's
/// scale is per tensor or fixed.
#[allow(clippy::too_many_arguments)]
pub fn learner_grads(
    d: &CudaDevice,
    dy: &Tensor,
    w: &LearnerCodes,
    x: &LearnerCodes,
    dx: &mut Tensor,
    acc_dx: bool,
    dw: &mut Tensor,
    m: usize,
) -> Result<()> {
    let n = w.rows;
    crate::ops::check_rows(dy, m, n, "learner linear output gradient")?;
    let dyp = ptr(d, dy, &[DType::F32, DType::BF16], "learner linear output gradient")?;
    let (dxp, dwp) = (check_dx(d, w, dx, m)?, check_dw(d, x, dw, m)?);
    if (dw.dim(0), dw.dim(1)) != (n, w.k) {
        bail!("learner gradients: a weight gradient of {:?} for a weight of ({n}, {})", dw.shape(), w.k);
    }
    if dy.dtype() == DType::BF16 && x.per_row {
        bail!("learner gradients: a BF16 output gradient for per-token input scales (dw scales the f32 values)");
    }
    if m == 0 {
        return Ok(());
    }
    let own;
    let dyh = match dy.dtype() {
        DType::BF16 => dyp,
        _ => {
            own = cast_rows(d, dyp, m * n, DType::BF16)?; // (m, N)
            own.ptr
        }
    };
    dx_from(d, dyh, w, dxp, m, acc_dx)?;
    match x.per_row {
        true => dw_from(d, dy_for_dw(d, dyp, x, m, n)?.ptr, x, dwp, n, m, true),
        false => dw_from(d, dyh, x, dwp, n, m, true),
    }
}

/// dy (m, N) f32, checked; its address.
fn check_dy(d: &CudaDevice, dy: &Tensor, m: usize, n: usize) -> Result<u64> {
    crate::ops::check_rows(dy, m, n, "learner linear output gradient")?;
    ptr(d, dy, &[DType::F32], "learner linear output gradient")
}

/// dx (m, K) f32 for w's codes under a per-tensor scale, checked; its address.
fn check_dx(d: &CudaDevice, w: &LearnerCodes, dx: &Tensor, m: usize) -> Result<u64> {
    if w.per_row {
        bail!("learner data gradient: the weight's codes need a per-tensor scale");
    }
    crate::ops::check_rows(dx, m, w.k, "learner linear input gradient")?;
    ptr(d, dx, &[DType::F32], "learner linear input gradient")
}

/// dw (N, K) f32 for x's codes of m rows, checked; its address.
fn check_dw(d: &CudaDevice, x: &LearnerCodes, dw: &Tensor, m: usize) -> Result<u64> {
    if x.rows != m || x.k != dw.dim(1) {
        bail!("learner weight gradient: codes of ({}, {}) for {m} rows of K = {}", x.rows, x.k, dw.dim(1));
    }
    ptr(d, dw, &[DType::F32], "learner weight gradient")
}

/// dy (m, N) rounded to BF16 for the weight gradient: each row times its token's scale first
/// where x's scales are per token.
fn dy_for_dw(d: &CudaDevice, dyp: u64, x: &LearnerCodes, m: usize, n: usize) -> Result<DevBuf> {
    match x.per_row {
        true => cast_rows_scaled(d, dyp, m, n, x.amax.ptr as *const u32, DType::BF16),
        false => cast_rows(d, dyp, m * n, DType::BF16),
    }
}

/// dx (m, K) (+)= g_w·R⁻¹(dyh · (q·bs)), dyh (m, N) BF16.
fn dx_from(d: &CudaDevice, dyh: u64, w: &LearnerCodes, dxp: u64, m: usize, acc: bool) -> Result<()> {
    let (n, k) = (w.rows, w.k);
    let wb = unit_values(d, w)?; // (N, K)
    let raw = d.scratch(m * k * 4, "learner data gradient")?; // (m, K), rotated domain
    d.gemm_form(Form::Nn, Elem::BF16, wb.ptr, dyh, raw.ptr, m, k, n, 1.0, false)?;
    scale_out(d, raw.ptr, dxp, (m, k), Scale::Value(1.0), Scale::of(w), w.signs, acc)
}

/// dw (N, K) (+)= R⁻¹(dyhᵀ · (q·bs)) · g_x, dyh (m, N) BF16 (g_t already folded in for
/// per-token scales).
fn dw_from(d: &CudaDevice, dyh: u64, x: &LearnerCodes, dwp: u64, n: usize, m: usize, acc: bool) -> Result<()> {
    let k = x.k;
    let col = if x.per_row { Scale::Value(1.0) } else { Scale::of(x) };
    let xb = unit_values(d, x)?; // (m, K)
    let raw = d.scratch(n * k * 4, "learner weight gradient")?; // (N, K), rotated domain
    d.gemm_form(Form::Tn, Elem::BF16, xb.ptr, dyh, raw.ptr, n, k, m, 1.0, false)?;
    scale_out(d, raw.ptr, dwp, (n, k), Scale::Value(1.0), col, x.signs, acc)
}
