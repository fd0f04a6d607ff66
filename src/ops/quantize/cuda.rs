//! Quantization's CUDA twin: launches of csrc/kernels/quantize.cu (amax, FP8 / NVFP4 encode,
//! decode), bit-exact with the CPU twin. Not yet run on a GPU.

use super::ActQuant;
use crate::device::cuda::args::{code, f32p, i32_of, ptr, vp, FLOATS};
use crate::device::cuda::{ffi, CudaDevice, DevBuf};
use crate::device::{DType, Tensor};
use crate::quant::nvfp4;
use crate::quant::qtensor::{QFormat, QTensor};
use anyhow::{bail, Result};
use std::ffi::c_void;

/// ct_amax over n values of x (dtype code `dt`) into `amax` (u32 bits; the caller zeroes it),
/// over the rotated blocks under the RHT (`signs`), one slot per row of `row_k` values if > 0.
fn k_amax(d: &CudaDevice, x: u64, dt: i32, n: i64, signs: Option<[f32; 16]>, amax: u64, row_k: i32) -> Result<()> {
    d.k_amax(ffi::ct_amax_params {
        x: x as *const c_void,
        dtype: dt,
        n,
        rht: signs.is_some() as i32,
        signs: signs.unwrap_or([1.0; 16]),
        amax_bits: amax as *mut u32,
        row_k,
    })
}

/// The max |x| bit pattern of n values (with the RHT: of the rotated 16-blocks), as f32.
pub fn amax(d: &CudaDevice, x: u64, dt: DType, n: usize, rht: Option<&[f32; 16]>) -> Result<f32> {
    let buf = d.scratch(4, "amax")?;
    d.memset0(buf.ptr, 4)?;
    k_amax(d, x, code(dt), n as i64, rht.copied(), buf.ptr, 0)?;
    let mut bits = [0u32; 1];
    d.dtoh(&mut bits, buf.ptr)?;
    Ok(f32::from_bits(bits[0]))
}

/// Re-quantizes every (source, buffer, name) in place: per tensor an amax kernel and a quantize
/// kernel that reads that amax on the device, all queued on the stream, then one read-back of
/// every amax (one wait per resync instead of one per tensor) for the host-side scales.
/// `known`: amaxes already on the device (f32 bits, U32) and each item's slot in them: such an
/// item gets no amax kernel, its quantize kernel reads the slot (the weights are read once). An
/// item under the RHT always gets its own (its amax is of the rotated blocks).
pub fn requantize_all(
    d: &CudaDevice,
    items: &mut [(&Tensor, &mut QTensor, &str)],
    known: Option<(&Tensor, &[Option<usize>])>,
) -> Result<()> {
    if items.is_empty() {
        return Ok(());
    }
    let buf = d.scratch(4 * items.len(), "amax")?;
    d.memset0(buf.ptr, 4 * items.len())?;
    let known = match known {
        Some((t, slots)) => {
            if slots.len() != items.len() {
                bail!("requantize: {} amax slots for {} tensors", slots.len(), items.len());
            }
            if let Some(s) = slots.iter().flatten().find(|&&s| s >= t.numel()) {
                bail!("requantize: amax slot {s} of {}", t.numel());
            }
            Some((ptr(d, t, &[DType::U32], "known amax")?, t.numel(), slots))
        }
        None => None,
    };
    let slot_of = |t: usize, q: &QTensor| match known {
        Some((_, _, slots)) if q.opts.rht.is_none() => slots[t],
        _ => None,
    };
    for (t, (src, q, name)) in items.iter().enumerate() {
        let n = q.rows * q.k;
        if src.numel() != n {
            bail!("{name}: quantizing {} values into a buffer of {n}", src.numel());
        }
        let sp = ptr(d, src, FLOATS, name)?;
        let signs = q.opts.rht.map(nvfp4::rht_signs);
        let amax = match (slot_of(t, q), known) {
            (Some(s), Some((kp, _, _))) => kp + 4 * s as u64,
            _ => {
                let amax = buf.ptr + 4 * t as u64;
                k_amax(d, sp, code(src.dtype()), n as i64, signs, amax, 0)?;
                amax
            }
        };
        let codes = ptr(d, &q.codes, &[DType::U8], "quantized codes")?;
        match q.format {
            QFormat::Fp8 => d.k_quant_fp8(ffi::ct_quant_fp8_params {
                x: sp as *const c_void,
                dtype: code(src.dtype()),
                n: n as i64,
                amax_bits: amax as *const u32,
                fixed_scale: 0.0,
                codes: codes as *mut u8,
                dequant: std::ptr::null_mut(),
                scale_out: std::ptr::null_mut(),
                up: std::ptr::null(),
            })?,
            QFormat::Nvfp4 => {
                let scales = ptr(d, &q.block_scales, &[DType::U8], "block scales")?;
                d.k_quant_nvfp4(ffi::ct_quant_nvfp4_params {
                    x: sp as *const c_void,
                    dtype: code(src.dtype()),
                    n: n as i64,
                    amax_bits: amax as *const u32,
                    fixed_global: 0.0,
                    rht: signs.is_some() as i32,
                    signs: signs.unwrap_or([1.0; 16]),
                    stochastic: q.opts.stochastic.is_some() as i32,
                    sr_seed: q.opts.stochastic.unwrap_or(0),
                    packed: codes as *mut u8,
                    scales: scales as *mut u8,
                    dequant: std::ptr::null_mut(),
                    global_out: std::ptr::null_mut(),
                    row_k: 0,
                    unrotate: 0,
                    up: std::ptr::null(),
                })?
            }
        }
        // The emulated GEMM's operand, decoded once per version (BF16 unit values: the tensor
        // scale, set below from the amax, is the GEMM's alpha and not part of them).
        if let Some(t) = &q.decoded {
            dequant(d, q, ptr(d, t, &[DType::BF16], "decoded weight")?, DType::BF16)?;
        }
        // The CUTLASS GEMM's tiled block scales, likewise once per version.
        if let Some(t) = &q.swizzled {
            let scales = ptr(d, &q.block_scales, &[DType::U8], "block scales")?;
            swizzle_sf_into(d, scales, ptr(d, t, &[DType::U8], "tiled block scales")?, q.rows, q.k)?;
        }
    }
    let mut bits = vec![0u32; items.len()];
    d.dtoh(&mut bits, buf.ptr)?;
    if let Some((kp, kn, _)) = known {
        let mut kb = vec![0u32; kn];
        d.dtoh(&mut kb, kp)?;
        for (t, (_, q, _)) in items.iter().enumerate() {
            if let Some(s) = slot_of(t, q) {
                bits[t] = kb[s];
            }
        }
    }
    for ((_, q, name), b) in items.iter_mut().zip(bits) {
        let amax = f32::from_bits(b);
        if !amax.is_finite() {
            bail!("{name}: cannot quantize a tensor holding NaN or Inf values");
        }
        // The same f32 arithmetic as the kernels and as QTensor::requantize_cpu.
        q.scale = match q.format {
            QFormat::Fp8 => {
                if amax > 0.0 {
                    amax / crate::quant::fp8::E4M3.max()
                } else {
                    1.0
                }
            }
            QFormat::Nvfp4 => nvfp4::global_scale(amax),
        };
    }
    Ok(())
}

/// Bytes of one operand's tiled NVFP4 scales: rows padded to 128, K/16 columns padded to 4.
pub fn swizzled_sf_bytes(rows: usize, k: usize) -> usize {
    rows.div_ceil(128) * 128 * (k / 16).div_ceil(4) * 4
}

/// Rewrites NVFP4 block scales (rows, K/16) at `src` into the tiled layout of block-scaled
/// tensor-core GEMMs at `dst` ([`swizzled_sf_bytes`] bytes).
pub fn swizzle_sf_into(d: &CudaDevice, src: u64, dst: u64, rows: usize, k: usize) -> Result<()> {
    let (pr, pc) = (rows.div_ceil(128) * 128, (k / 16).div_ceil(4) * 4);
    d.k_swizzle_sf(ffi::ct_swizzle_sf_params {
        src: src as *const u8,
        dst: dst as *mut u8,
        rows: i32_of(rows, "scale rows")?,
        sf_cols: i32_of(k / 16, "scale columns")?,
        padded_rows: i32_of(pr, "scale rows")?,
        padded_cols: i32_of(pc, "scale columns")?,
    })
}

/// Decodes a quantized weight into `out_dtype` (BF16: unit values; F32: exact values).
pub fn dequant(d: &CudaDevice, q: &QTensor, out: u64, out_dtype: DType) -> Result<()> {
    let codes = ptr(d, &q.codes, &[DType::U8], "quantized codes")?;
    let scales = match q.format {
        QFormat::Fp8 => 0,
        QFormat::Nvfp4 => ptr(d, &q.block_scales, &[DType::U8], "block scales")?,
    };
    d.k_dequant(ffi::ct_dequant_params {
        codes: codes as *const u8,
        scales: scales as *const u8,
        format: if q.format == QFormat::Fp8 { ffi::CT_FORMAT_FP8 } else { ffi::CT_FORMAT_NVFP4 },
        n: (q.rows * q.k) as i64,
        scale: q.scale,
        out: vp(out),
        out_dtype: code(out_dtype),
    })
}

pub fn fake_quant_rows(d: &CudaDevice, x: &Tensor, y: &mut Tensor, m: usize, q: &ActQuant) -> Result<()> {
    let k = x.dim(x.shape().len() - 1);
    let xp = ptr(d, x, &[DType::F32], "fake_quant input")?;
    let yp = ptr(d, y, &[DType::F32], "fake_quant output")?;
    match *q {
        ActQuant::None => d.dtod(yp, xp, m * k * 4),
        _ => quant_rows_fixed(d, xp, 0, m, k, q, 0, 0, yp),
    }
}

/// Quantizes f32 rows x (m, K) at `xp` with the fixed scale of `q` (FP8: scale; NVFP4: global,
/// with dynamic block scales, RHT and stochastic rounding as its options), writing whichever of
/// codes (`codes`), NVFP4 block scales (`scales`) and dequantized values (`dequant`) is non-zero.
/// With `up` (non-zero: f32 rows like x's, x then the gate) the rows quantized are SwiGLU(x, up),
/// computed as `ct_swiglu` computes it and not written. The one launch of the quantize kernels
/// for activations (fake_quant_rows, linear::cuda_lowp::quantize_act).
#[allow(clippy::too_many_arguments)]
pub fn quant_rows_fixed(
    d: &CudaDevice,
    xp: u64,
    up: u64,
    m: usize,
    k: usize,
    q: &ActQuant,
    codes: u64,
    scales: u64,
    dequant: u64,
) -> Result<()> {
    let n = m * k;
    let out = |p: u64| p as *mut u8;
    match *q {
        ActQuant::None => bail!("quantizing activations without a format"),
        ActQuant::Fp8 { scale } => {
            if !(scale > 0.0 && scale.is_finite()) {
                bail!("FP8 activation scale must be positive and finite, got {scale}");
            }
            d.k_quant_fp8(ffi::ct_quant_fp8_params {
                x: xp as *const c_void,
                dtype: ffi::CT_DTYPE_F32,
                n: n as i64,
                amax_bits: std::ptr::null(),
                fixed_scale: scale,
                codes: out(codes),
                dequant: f32p(dequant),
                scale_out: std::ptr::null_mut(),
                up: up as *const f32,
            })
        }
        ActQuant::Nvfp4 { global, opts } => {
            if !(global > 0.0 && global.is_finite()) {
                bail!("NVFP4 activation global scale must be positive and finite, got {global}");
            }
            if k % 16 != 0 {
                bail!("NVFP4 needs the reduction dimension to be a multiple of 16, got K = {k}");
            }
            let signs = opts.rht.map(nvfp4::rht_signs);
            d.k_quant_nvfp4(ffi::ct_quant_nvfp4_params {
                x: xp as *const c_void,
                dtype: ffi::CT_DTYPE_F32,
                n: n as i64,
                amax_bits: std::ptr::null(),
                fixed_global: global,
                rht: signs.is_some() as i32,
                signs: signs.unwrap_or([1.0; 16]),
                stochastic: opts.stochastic.is_some() as i32,
                sr_seed: opts.stochastic.unwrap_or(0),
                packed: out(codes),
                scales: out(scales),
                dequant: f32p(dequant),
                global_out: std::ptr::null_mut(),
                row_k: 0,
                unrotate: 0,
                up: up as *const f32,
            })
        }
    }
}

/// The NVFP4 codes of a learner operand (rotated domain under the RHT), for the real W4A4
/// GEMM and the backward's: packed E2M1 codes, E4M3 block scales and the amax its global
/// scale(s) come from (per row or per tensor, or the fixed global) — the global stays on the
/// device — and the RHT signs that rotated it (None: not rotated).
pub struct LearnerCodes {
    pub packed: DevBuf,
    pub scales: DevBuf,
    pub amax: DevBuf,
    pub per_row: bool,
    pub fixed: f32,
    pub rows: usize,
    pub k: usize,
    pub signs: Option<[f32; 16]>,
}

/// The learner's NVFP4 rounding of x's first m rows into out (F32; None: not written): the
/// amax kernel (per tensor or per row, over the rotated blocks) and the encode kernel writing
/// the decoded values rotated back — and, with `codes`, in the same launch the codes and block
/// scales the real GEMMs read (the same rounding, so the STE backward sees what the forward
/// multiplied).
#[allow(clippy::too_many_arguments)]
pub fn learner_round(
    d: &CudaDevice,
    x: &Tensor,
    out: Option<&mut Tensor>,
    m: usize,
    k: usize,
    global: nvfp4::Global,
    opts: &nvfp4::Nvfp4Opts,
    codes: bool,
) -> Result<Option<LearnerCodes>> {
    let n = m * k;
    if n == 0 {
        return Ok(None);
    }
    let xp = ptr(d, x, FLOATS, "learner NVFP4 input")?;
    let op = match out {
        Some(out) => ptr(d, out, &[DType::F32], "learner NVFP4 output")?,
        None if codes => 0,
        None => bail!("learner NVFP4: neither the rounded values nor the codes asked for"),
    };
    let signs = opts.rht.map(nvfp4::rht_signs);
    let (slots, row_k, fixed) = match global {
        nvfp4::Global::Tensor => (1, 0, 0.0),
        nvfp4::Global::Row => (m, k, 0.0),
        nvfp4::Global::Fixed(g) => (0, 0, g),
    };
    let buf = d.scratch(4 * slots.max(1), "learner NVFP4 amax")?;
    if slots > 0 {
        d.memset0(buf.ptr, 4 * slots)?;
        k_amax(d, xp, code(x.dtype()), n as i64, signs, buf.ptr, row_k as i32)?;
    }
    let (packed, scales) = match codes {
        true => (Some(d.scratch(n / 2, "learner NVFP4 codes")?), Some(d.scratch(n / 16, "learner NVFP4 scales")?)),
        false => (None, None),
    };
    let raw = |b: &Option<DevBuf>| b.as_ref().map(|b| b.ptr as *mut u8).unwrap_or(std::ptr::null_mut());
    d.k_quant_nvfp4(ffi::ct_quant_nvfp4_params {
        x: xp as *const c_void,
        dtype: code(x.dtype()),
        n: n as i64,
        amax_bits: if slots > 0 { buf.ptr as *const u32 } else { std::ptr::null() },
        fixed_global: fixed,
        rht: signs.is_some() as i32,
        signs: signs.unwrap_or([1.0; 16]),
        stochastic: opts.stochastic.is_some() as i32,
        sr_seed: opts.stochastic.unwrap_or(0),
        packed: raw(&packed),
        scales: raw(&scales),
        dequant: op as *mut f32,
        global_out: std::ptr::null_mut(),
        row_k: row_k as i32,
        unrotate: 1,
        up: std::ptr::null(),
    })?;
    Ok(match (packed, scales) {
        (Some(packed), Some(scales)) => {
            Some(LearnerCodes { packed, scales, amax: buf, per_row: row_k > 0, fixed, rows: m, k, signs })
        }
        _ => None,
    })
}
