//! Real low-precision linears: FP8 W8A8 and NVFP4 W4A4, with the activations quantized on the
//! device exactly as the CPU engine fake-quantizes them (`crate::ops::quantize`), so the GEMM
//! sees the same codes as the CPU's emulation and only the FP32 summation order differs.
//!
//! Paths, chosen per call (`Path::Auto`) or forced (the device check times each):
//! - `Cutlass`: csrc/cutlass: FP8 on sm_90a (TMA warp-specialized WGMMA) and sm_100a / sm_103a
//!   (tcgen05); NVFP4 block-scaled on sm_100a / sm_103a. Needs the kernel's alignment (FP8:
//!   K % 16, NVFP4: K % 32, and N % 4 for the f32 output) and a build with CUTLASS; on the
//!   simulator, the references of `device/cuda/sim_gemm.rs` for the profile's architecture.
//! - `CublasLt`: the library's FP8 / block-scaled NVFP4 GEMMs (the baseline).
//! - `Mma`: NVFP4 with at most 64 activation rows (decode steps) where there is no CUTLASS
//!   kernel (Hopper): `ct_gemm_w4a4` (csrc/kernels/gemm_w4a4.cu) decodes both operands' codes
//!   in registers into BF16 mma.sync, so a decode step reads 0.5625 bytes a weight value
//!   instead of the 2 of the weight's decoded copy: the emulated path's products.
//! - `Emulated`: decode both operands to their unit values in BF16 (e4m3, or q·bs for NVFP4:
//!   exact), a BF16 GEMM with FP32 accumulation and alpha = product of the tensor scales: the
//!   same products as the real kernel. This is the NVFP4 path on Hopper for prefill, and the
//!   fallback.
//!
//! The engine reaches `linear_act_q` through `ops::linear::linear_act_q` (whose CPU twin is
//! fake_quant_rows + linear_q); `ops::linear_q` alone (no activation format) stays emulated.
//! Not yet run on a GPU.

use super::cuda::add_bias;
use super::QProj;
use crate::device::cuda::args::ptr;
use crate::device::cuda::{ffi, kernels, CudaDevice, Cutlass, CutlassArgs, DevBuf, Elem};
use crate::device::{DType, Tensor};
use crate::ops::quantize::{dequant, quant_rows_fixed, swizzle_sf_into, ActQuant};
use crate::quant::nvfp4::Nvfp4Opts;
use crate::quant::qtensor::{QFormat, QTensor};
use anyhow::{bail, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    Auto,
    Cutlass,
    CublasLt,
    Mma,
    Emulated,
}

/// Activation rows quantized on the device: codes (and NVFP4 block scales) with their scale.
pub struct QAct {
    codes: DevBuf,
    scales: Option<DevBuf>,
    scale: f32,
    rows: usize,
    k: usize,
}

/// Quantizes x[..m] (m, K) f32 with a fixed scale: FP8 (scale) or NVFP4 (global, opts).
pub fn quantize_act(d: &CudaDevice, x: &Tensor, m: usize, act: &ActQuant) -> Result<QAct> {
    let k = x.dim(x.shape().len() - 1);
    let xp = ptr(d, x, &[DType::F32], "activation rows")?;
    quantize_rows(d, xp, 0, m, k, act)
}

/// [`quantize_act`] of SwiGLU(gate, up) (both (m, K) f32), computed by the quantizer as it reads
/// them (`ct_swiglu`'s arithmetic) and never written.
pub fn quantize_swiglu_act(d: &CudaDevice, gate: &Tensor, up: &Tensor, m: usize, act: &ActQuant) -> Result<QAct> {
    let k = gate.dim(gate.shape().len() - 1);
    if up.dim(up.shape().len() - 1) != k {
        bail!("SwiGLU quantization: gate rows of {k} values, up rows of {}", up.dim(up.shape().len() - 1));
    }
    crate::ops::check_rows(gate, m, k, "SwiGLU gate")?;
    crate::ops::check_rows(up, m, k, "SwiGLU up")?;
    let gp = ptr(d, gate, &[DType::F32], "SwiGLU gate")?;
    let upp = ptr(d, up, &[DType::F32], "SwiGLU up")?;
    quantize_rows(d, gp, upp, m, k, act)
}

/// The codes of rows (m, K) at `xp` (with `up`: of SwiGLU(x, up)).
fn quantize_rows(d: &CudaDevice, xp: u64, up: u64, m: usize, k: usize, act: &ActQuant) -> Result<QAct> {
    let n = m * k;
    match *act {
        ActQuant::Fp8 { scale } => {
            let codes = d.scratch(n, "FP8 activation codes")?;
            quant_rows_fixed(d, xp, up, m, k, act, codes.ptr, 0, 0)?;
            Ok(QAct { codes, scales: None, scale, rows: m, k })
        }
        ActQuant::Nvfp4 { global, .. } => {
            if k % 16 != 0 {
                bail!("NVFP4 activations need K % 16 == 0, got K = {k}");
            }
            let (codes, scales) =
                (d.scratch(n / 2, "NVFP4 activation codes")?, d.scratch(n / 16, "NVFP4 activation scales")?);
            quant_rows_fixed(d, xp, up, m, k, act, codes.ptr, scales.ptr, 0)?;
            Ok(QAct { codes, scales: Some(scales), scale: global, rows: m, k })
        }
        ActQuant::None => bail!("quantize_act: no activation format given"),
    }
}

/// y[..m] (m, N) = quant(x) · wqᵀ (+ bias) through a real low-precision GEMM (the activation
/// format must match the weight's: FP8 with FP8, NVFP4 with NVFP4). Returns the path taken.
#[allow(clippy::too_many_arguments)]
pub fn linear_act_q(
    d: &CudaDevice,
    x: &Tensor,
    act: &ActQuant,
    wq: &QTensor,
    bias: Option<&Tensor>,
    y: &mut Tensor,
    m: usize,
    path: Path,
) -> Result<Path> {
    linears_act_q(d, x, act, &mut [QProj { w: wq, bias, y }], m, path)
}

/// [`linear_act_q`] for several projections of one input: x quantized once, then each
/// projection's GEMM on those codes. Returns the last projection's path.
pub fn linears_act_q(
    d: &CudaDevice,
    x: &Tensor,
    act: &ActQuant,
    projs: &mut [QProj],
    m: usize,
    path: Path,
) -> Result<Path> {
    check_projs(d, x.dim(x.shape().len() - 1), act, projs, m)?;
    if m == 0 {
        return Ok(path);
    }
    let qa = quantize_act(d, x, m, act)?;
    gemms_q(d, &qa, projs, m, path)
}

/// The projections of rows of `kx` values quantized with `act`: formats, K and outputs.
fn check_projs(d: &CudaDevice, kx: usize, act: &ActQuant, projs: &[QProj], m: usize) -> Result<()> {
    for p in projs.iter() {
        match (act, p.w.format) {
            (ActQuant::Fp8 { .. }, QFormat::Fp8) | (ActQuant::Nvfp4 { .. }, QFormat::Nvfp4) => {}
            _ => bail!("linear_act_q: activation format {act:?} does not match a {:?} weight", p.w.format),
        }
        if kx != p.w.k {
            bail!("linear_act_q: input rows of {kx} values for a weight with K = {}", p.w.k);
        }
        ptr(d, p.y, &[DType::F32], "linear output")?;
        crate::ops::check_rows(p.y, m, p.w.rows, "linear output")?;
    }
    Ok(())
}

/// y[..m] = quant(SwiGLU(gate, up)) · wqᵀ (+ bias): a down projection of a W8A8 / W4A4 MLP,
/// the quantizer computing SwiGLU as it reads gate and up (no pass writes SwiGLU's output).
#[allow(clippy::too_many_arguments)]
pub fn swiglu_linear_act_q(
    d: &CudaDevice,
    gate: &Tensor,
    up: &Tensor,
    act: &ActQuant,
    wq: &QTensor,
    bias: Option<&Tensor>,
    y: &mut Tensor,
    m: usize,
    path: Path,
) -> Result<Path> {
    let mut projs = [QProj { w: wq, bias, y }];
    check_projs(d, gate.dim(gate.shape().len() - 1), act, &projs, m)?;
    if m == 0 {
        return Ok(path);
    }
    let qa = quantize_swiglu_act(d, gate, up, m, act)?;
    gemms_q(d, &qa, &mut projs, m, path)
}

/// Each projection's GEMM on the quantized rows `qa` (+ its bias); the last one's path.
fn gemms_q(d: &CudaDevice, qa: &QAct, projs: &mut [QProj], m: usize, path: Path) -> Result<Path> {
    let mut taken = path;
    for p in projs.iter_mut() {
        let yp = ptr(d, p.y, &[DType::F32], "linear output")?;
        taken = gemm_q(d, qa, p.w, yp, path)?;
        if let Some(b) = p.bias {
            add_bias(d, yp, b, m, p.w.rows)?;
        }
    }
    Ok(taken)
}

/// The W8A8 linear of an FP8 engine: activations quantized with the calibrated scale.
pub fn linear_w8a8(
    d: &CudaDevice,
    x: &Tensor,
    act_scale: f32,
    wq: &QTensor,
    bias: Option<&Tensor>,
    y: &mut Tensor,
    m: usize,
) -> Result<Path> {
    linear_act_q(d, x, &ActQuant::Fp8 { scale: act_scale }, wq, bias, y, m, Path::Auto)
}

/// The W4A4 linear of an NVFP4 engine: activations with the calibrated global scale, dynamic
/// block scales, and the recipe's RHT / stochastic rounding options.
#[allow(clippy::too_many_arguments)]
pub fn linear_w4a4(
    d: &CudaDevice,
    x: &Tensor,
    act_global: f32,
    opts: Nvfp4Opts,
    wq: &QTensor,
    bias: Option<&Tensor>,
    y: &mut Tensor,
    m: usize,
) -> Result<Path> {
    linear_act_q(d, x, &ActQuant::Nvfp4 { global: act_global, opts }, wq, bias, y, m, Path::Auto)
}

pub use crate::ops::quantize::swizzled_sf_bytes;

/// NVFP4 scales (rows, K/16) in the tiled layout, in a new scratch.
pub(super) fn swizzle(d: &CudaDevice, src: u64, rows: usize, k: usize) -> Result<DevBuf> {
    let buf = d.scratch(swizzled_sf_bytes(rows, k), "tiled NVFP4 scales")?;
    swizzle_sf_into(d, src, buf.ptr, rows, k)?;
    Ok(buf)
}

/// The CUTLASS GEMM for `format` on this device (the simulator's reference on cuda-sim), if
/// there is one.
pub(super) fn cutlass_kernel(d: &CudaDevice, format: QFormat) -> Option<Cutlass> {
    d.cutlass_kernel(if format == QFormat::Fp8 { Elem::E4M3 } else { Elem::E2M1 })
}

/// Whether a CUTLASS kernel exists here for `format` and suits the shape.
pub fn cutlass_supports(d: &CudaDevice, format: QFormat, n: usize, k: usize) -> bool {
    let k_align = if format == QFormat::Fp8 { 16 } else { 32 };
    cutlass_kernel(d, format).is_some() && k % k_align == 0 && n % 4 == 0
}

/// y (m, n) = a · wᵀ for quantized activations and weights, on `path`.
pub fn gemm_q(d: &CudaDevice, a: &QAct, w: &QTensor, y: u64, path: Path) -> Result<Path> {
    let (m, n, k) = (a.rows, w.rows, w.k);
    if a.k != k {
        bail!("low-precision GEMM: activations of K = {} for a weight of K = {k}", a.k);
    }
    let alpha = a.scale * w.scale;
    let wc = ptr(d, &w.codes, &[DType::U8], "weight codes")?;
    let ws = if w.format == QFormat::Nvfp4 { ptr(d, &w.block_scales, &[DType::U8], "weight block scales")? } else { 0 };
    let want_cutlass = matches!(path, Path::Auto | Path::Cutlass);
    if want_cutlass && cutlass_supports(d, w.format, n, k) {
        if let Some(g) = cutlass_kernel(d, w.format) {
            // The weight's tiled scales: kept by the engine (rewritten once per requantize,
            // `QTensor::swizzled`), else tiled now.
            let kept = match &w.swizzled {
                Some(t) => Some(ptr(d, t, &[DType::U8], "tiled weight scales")?),
                None => None,
            };
            let (sa, sw) = match (&a.scales, w.format) {
                (Some(s), QFormat::Nvfp4) => {
                    (Some(swizzle(d, s.ptr, m, k)?), if kept.is_some() { None } else { Some(swizzle(d, ws, n, k)?) })
                }
                _ => (None, None),
            };
            let args = CutlassArgs {
                a: a.codes.ptr,
                b: wc,
                sfa: sa.as_ref().map(|b| b.ptr).unwrap_or(0),
                sfb: kept.or(sw.as_ref().map(|b| b.ptr)).unwrap_or(0),
                d: y,
                m,
                n,
                k,
                alpha,
            };
            if d.cutlass_gemm(g, &args)? {
                return Ok(Path::Cutlass);
            }
        }
    }
    if path == Path::Cutlass {
        bail!("no CUTLASS {:?} GEMM for {} with n={n} k={k} in this build", w.format, d.name());
    }
    let mma = w.format == QFormat::Nvfp4 && kernels::w4a4_fits(m, n, k, &[a.codes.ptr, wc]);
    if mma && matches!(path, Path::Auto | Path::Mma) {
        let Some(sa) = a.scales.as_ref() else { bail!("NVFP4 activations without block scales") };
        // Split over K where the weight's column blocks alone leave SMs idle (a down
        // projection of few columns): each split's sums in a scratch, then merged in order.
        let splits = d.w4a4_splits(n, k);
        let part = if splits > 1 { Some(d.scratch(splits * m * n * 4, "split W4A4 sums")?) } else { None };
        d.k_gemm_w4a4(ffi::ct_gemm_w4a4_params {
            a_codes: a.codes.ptr as *const u8,
            a_scales: sa.ptr as *const u8,
            w_codes: wc as *const u8,
            w_scales: ws as *const u8,
            y: y as *mut f32,
            m: m as i32,
            n: n as i32,
            k: k as i32,
            alpha,
            part: part.as_ref().map_or(std::ptr::null_mut(), |b| b.ptr as *mut f32),
            splits: splits as i32,
        })?;
        return Ok(Path::Mma);
    }
    if path == Path::Mma {
        bail!(
            "no W4A4 mma kernel for a {:?} GEMM with m={m} n={n} k={k}: it takes NVFP4, m <= {}, n % {} == 0, k % {} == 0",
            w.format,
            kernels::W4A4_MAX_M,
            kernels::W4A4_COLS,
            kernels::W4A4_K_STEP
        );
    }
    if path == Path::CublasLt {
        return match w.format {
            QFormat::Fp8 => d.gemm(Elem::E4M3, wc, a.codes.ptr, y, m, n, k, alpha, false, None).map(|_| Path::CublasLt),
            QFormat::Nvfp4 => {
                let sa = a.scales.as_ref().map(|s| s.ptr).unwrap_or(0);
                let (tsa, tsw) = (swizzle(d, sa, m, k)?, swizzle(d, ws, n, k)?);
                d.gemm(Elem::E2M1, wc, a.codes.ptr, y, m, n, k, alpha, false, Some((tsw.ptr, tsa.ptr)))
                    .map(|_| Path::CublasLt)
            }
        };
    }
    // Emulated: unit values in BF16 (exact), FP32 accumulation, alpha = product of the scales;
    // the weight's decoded once per requantize where the engine keeps it (`QTensor::decoded`).
    let wb = decoded_weight(d, w)?;
    let ab = d.scratch(m * k * 2, "decoded activations")?;
    d.k_dequant(ffi::ct_dequant_params {
        codes: a.codes.ptr as *const u8,
        scales: a.scales.as_ref().map(|s| s.ptr as *const u8).unwrap_or(std::ptr::null()),
        format: if w.format == QFormat::Fp8 { ffi::CT_FORMAT_FP8 } else { ffi::CT_FORMAT_NVFP4 },
        n: (m * k) as i64,
        scale: a.scale,
        out: ab.ptr as *mut std::ffi::c_void,
        out_dtype: ffi::CT_DTYPE_BF16,
    })?;
    d.gemm(Elem::BF16, wb.ptr(), ab.ptr, y, m, n, k, alpha, false, None)?;
    Ok(Path::Emulated)
}

/// A weight's BF16 unit values for an emulated GEMM: its kept decoded copy, or decoded now
/// into a scratch.
pub enum Decoded {
    Kept(u64),
    Now(DevBuf),
}

impl Decoded {
    pub fn ptr(&self) -> u64 {
        match self {
            Decoded::Kept(p) => *p,
            Decoded::Now(b) => b.ptr,
        }
    }
}

pub fn decoded_weight(d: &CudaDevice, w: &QTensor) -> Result<Decoded> {
    if let Some(t) = &w.decoded {
        return Ok(Decoded::Kept(ptr(d, t, &[DType::BF16], "decoded weight")?));
    }
    let wb = d.scratch(w.rows * w.k * 2, "decoded weight")?;
    dequant(d, w, wb.ptr, DType::BF16)?;
    Ok(Decoded::Now(wb))
}

/// What an engine's quantized weight keeps for its W8A8 / W4A4 GEMM, rewritten by each
/// requantize instead of prepared at every GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kept {
    /// The BF16 unit values (`QTensor::decoded`), where the GEMM is emulated (NVFP4 on Hopper)
    /// and no decode step reads the codes instead (`ct_gemm_w4a4` does not take the shape).
    Decoded,
    /// The NVFP4 block scales in CUTLASS's tiled layout (`QTensor::swizzled`, sm_100).
    Swizzled,
}

impl Kept {
    /// What a quantized (n, K) weight of `format` keeps on `dev` (None on the CPU, and for FP8
    /// on its CUTLASS kernel, which reads the codes as they are). An NVFP4 weight on Hopper
    /// whose shape the mma kernel takes keeps nothing either: its decode steps read the codes,
    /// and a prefill step (m > 64, the emulated GEMM) decodes it into a scratch, a few calls
    /// a rollout against 2 bytes a weight value held for good.
    pub fn on(dev: &crate::device::Device, format: QFormat, n: usize, k: usize) -> Option<Kept> {
        let codes_at_decode = format == QFormat::Nvfp4 && kernels::w4a4_takes(n, k);
        match dev {
            crate::device::Device::Cpu(_) => None,
            _ if emulated_here(dev, format, n, k) => (!codes_at_decode).then_some(Kept::Decoded),
            _ if format == QFormat::Nvfp4 => Some(Kept::Swizzled),
            _ => None,
        }
    }

    pub fn bytes(self, n: usize, k: usize) -> usize {
        match self {
            Kept::Decoded => 2 * n * k,
            Kept::Swizzled => swizzled_sf_bytes(n, k),
        }
    }
}

/// Whether a quantized (n, K) weight's GEMM is emulated on `dev` (no CUTLASS kernel for its
/// format or shape: NVFP4 on Hopper), so an engine keeps its decoded unit values; where it is
/// not, an NVFP4 weight keeps its tiled block scales instead (`QTensor::swizzled`).
pub fn emulated_here(dev: &crate::device::Device, format: QFormat, n: usize, k: usize) -> bool {
    match dev {
        crate::device::Device::Cuda(d) => !cutlass_supports(d, format, n, k),
        crate::device::Device::Cpu(_) => false,
    }
}

/// The sizes of CUTLASS's scale tensors for an (m, n, k) NVFP4 problem, when this build has
/// the sm100 kernels (the device check compares them with [`swizzled_sf_bytes`]).
pub fn cutlass_nvfp4_sf_bytes(m: usize, n: usize, k: usize) -> Option<(usize, usize)> {
    #[cfg(colotrain_cutlass_sm100)]
    {
        let (mut a, mut b) = (0usize, 0usize);
        // SAFETY: host-only arithmetic on the layout; writes the two sizes.
        unsafe { ffi::ct_nvfp4_sf_bytes_sm100a(m as i32, n as i32, k as i32, &mut a, &mut b) };
        Some((a, b))
    }
    #[cfg(not(colotrain_cutlass_sm100))]
    {
        let _ = (m, n, k);
        None
    }
}
