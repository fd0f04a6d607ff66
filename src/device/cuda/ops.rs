//! The CUDA twins of `crate::ops`: same signatures as cuda_stub.rs, same results as the CPU
//! twins (bit for bit where the kernel header says so, to rounding otherwise). The generic ops
//! in `crate::ops` validate shapes before dispatching here; these functions check that every
//! tensor lives on this device with the dtype the kernel expects. `m` is the number of live
//! rows, as on the CPU. Not yet run on a GPU.
//!
//! Decisions: activations stay f32 (the engine allocates them so); a linear with BF16 / F16
//! weights rounds its input rows to BF16 / F16 in a scratch buffer and runs a cuBLASLt GEMM with
//! FP32 accumulation (F32 weights: an FP32 GEMM, never TF32). `linear_q` is the emulated
//! low-precision linear: the weight is decoded to its unit values (e4m3, or q·bs for NVFP4,
//! exact in BF16) and the tensor scale becomes the GEMM's alpha; the real W8A8 / W4A4 GEMMs
//! need the activation scale, which this signature does not carry (see `lowp::linear_w8a8`).
//! `sample` draws greedy and untruncated rows with ct_sample and rows with top-k / top-p with
//! ct_sample_topk; the few rows that kernel leaves (see CT_TOPK_CAP) are copied to the host and
//! drawn by the CPU twin itself (`crate::ops::sample::sample_row`), so they match
//! the CPU exactly but cost a device-to-host copy of their logits.

use super::blas::{Elem, GemmKey};
use super::{ffi, CudaDevice, CudaStorage};
use crate::device::{DType, Storage, Tensor};
use crate::ops::attention::{cache_dims, AttnMeta};
use crate::ops::quantize::ActQuant;
use crate::ops::sample::SampleParams;
use crate::quant::nvfp4;
use crate::quant::qtensor::{QFormat, QTensor};
use anyhow::{bail, Result};
use std::ffi::c_void;

// ---- helpers ----------------------------------------------------------------------------------

pub(super) fn storage<'a>(d: &CudaDevice, t: &'a Tensor, what: &str) -> Result<&'a CudaStorage> {
    match t.storage() {
        Storage::Cuda(s) if s.dev().inner.ordinal == d.inner.ordinal => Ok(s),
        Storage::Cuda(s) => bail!("{what}: tensor on cuda:{}, op on {}", s.dev().inner.ordinal, d.name()),
        Storage::Cpu(_) => bail!("{what}: expected a tensor on {}, found a CPU tensor", d.name()),
    }
}

/// The device address of a tensor of one of `dtypes`.
pub(super) fn ptr(d: &CudaDevice, t: &Tensor, dtypes: &[DType], what: &str) -> Result<u64> {
    let s = storage(d, t, what)?;
    if !dtypes.contains(&s.dtype()) {
        let want: Vec<&str> = dtypes.iter().map(|d| d.name()).collect();
        bail!("{what}: expected a {} tensor, found {}", want.join(" or "), s.dtype().name());
    }
    Ok(s.ptr)
}

pub(super) fn code(dt: DType) -> i32 {
    match dt {
        DType::F32 => ffi::CT_DTYPE_F32,
        DType::BF16 => ffi::CT_DTYPE_BF16,
        DType::F16 => ffi::CT_DTYPE_F16,
        DType::U8 | DType::U32 => ffi::CT_DTYPE_U8,
    }
}

pub(super) fn i32_of(n: usize, what: &str) -> Result<i32> {
    i32::try_from(n).map_err(|_| anyhow::anyhow!("{what}: {n} does not fit the kernels' 32-bit sizes"))
}

fn f32p(p: u64) -> *mut f32 {
    p as *mut f32
}

fn u32p(p: u64) -> *const u32 {
    p as *const u32
}

fn vp(p: u64) -> *mut c_void {
    p as *mut c_void
}

const FLOATS: &[DType] = &[DType::F32, DType::BF16, DType::F16];

fn err_word(d: &CudaDevice) -> *mut u32 {
    d.inner.err_word as *mut u32
}

/// y (rows, cols) += bias.
pub(super) fn add_bias(d: &CudaDevice, y: u64, bias: &Tensor, rows: usize, cols: usize) -> Result<()> {
    let b = ptr(d, bias, FLOATS, "linear bias")?;
    d.k_add_bias(ffi::ct_add_bias_params {
        y: f32p(y),
        bias: vp(b),
        dtype: code(bias.dtype()),
        rows: i32_of(rows, "bias rows")?,
        cols: i32_of(cols, "bias columns")?,
    })
}

/// x (n f32) rounded to `dt` (BF16 / F16) into a new scratch buffer.
pub(super) fn cast_rows(d: &CudaDevice, x: u64, n: usize, dt: DType) -> Result<super::DevBuf> {
    let buf = d.scratch(n * 2, "GEMM input rows")?;
    d.k_cast(ffi::ct_cast_params { x: f32p(x), y: vp(buf.ptr), dtype: code(dt), n: n as i64 })?;
    Ok(buf)
}

/// y (m, n) (+)= alpha · x (m, k) · w (n, k)ᵀ through cuBLASLt, w and x of element type `ab`.
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm(
    d: &CudaDevice,
    ab: Elem,
    w: u64,
    x: u64,
    y: u64,
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    accumulate: bool,
    scales: Option<(u64, u64)>,
) -> Result<()> {
    d.bind()?;
    d.blas().gemm(d.stream(), GemmKey { m, n, k, ab, accumulate }, w, x, y, alpha, scales)
}

// ---- the ops ----------------------------------------------------------------------------------

pub fn linear(
    d: &CudaDevice,
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    y: &mut Tensor,
    m: usize,
    acc: bool,
) -> Result<()> {
    let (n, k) = (w.dim(0), w.dim(1));
    let xp = ptr(d, x, &[DType::F32], "linear input")?;
    let wp = ptr(d, w, FLOATS, "linear weight")?;
    let yp = ptr(d, y, &[DType::F32], "linear output")?;
    if m == 0 {
        return Ok(());
    }
    match w.dtype() {
        DType::F32 => gemm(d, Elem::F32, wp, xp, yp, m, n, k, 1.0, acc, None)?,
        dt => {
            let xh = cast_rows(d, xp, m * k, dt)?;
            let e = if dt == DType::BF16 { Elem::BF16 } else { Elem::F16 };
            gemm(d, e, wp, xh.ptr, yp, m, n, k, 1.0, acc, None)?;
        }
    }
    match b {
        Some(b) => add_bias(d, yp, b, m, n),
        None => Ok(()),
    }
}

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

pub fn embedding(d: &CudaDevice, t: &Tensor, ids: &Tensor, o: &mut Tensor, m: usize) -> Result<()> {
    let (v, c) = (t.dim(0), t.dim(1));
    d.k_embedding(ffi::ct_embedding_params {
        table: vp(ptr(d, t, FLOATS, "embedding table")?),
        dtype: code(t.dtype()),
        vocab: i32_of(v, "vocabulary")?,
        ids: u32p(ptr(d, ids, &[DType::U32], "token ids")?),
        out: f32p(ptr(d, o, &[DType::F32], "embedding output")?),
        rows: i32_of(m, "embedding rows")?,
        cols: i32_of(c, "embedding width")?,
        err: err_word(d),
    })
}

pub fn swiglu(d: &CudaDevice, g: &Tensor, u: &Tensor, o: &mut Tensor, m: usize) -> Result<()> {
    let i = g.dim(g.shape().len() - 1);
    d.k_swiglu(ffi::ct_swiglu_params {
        gate: ptr(d, g, &[DType::F32], "swiglu gate")? as *const f32,
        up: ptr(d, u, &[DType::F32], "swiglu up")? as *const f32,
        out: f32p(ptr(d, o, &[DType::F32], "swiglu output")?),
        n: (m * i) as i64,
    })
}

pub fn gather_rows(d: &CudaDevice, s: &Tensor, i: &Tensor, o: &mut Tensor, r: usize) -> Result<()> {
    let c = s.dim(s.shape().len() - 1);
    d.k_gather_rows(ffi::ct_gather_rows_params {
        src: ptr(d, s, &[DType::F32], "gather_rows source")? as *const f32,
        idx: u32p(ptr(d, i, &[DType::U32], "gather_rows indices")?),
        dst: f32p(ptr(d, o, &[DType::F32], "gather_rows output")?),
        rows: i32_of(r, "gathered rows")?,
        cols: i32_of(c, "gather width")?,
        src_rows: i32_of(s.numel() / c.max(1), "source rows")?,
        err: err_word(d),
    })
}

const CACHES: &[DType] = &[DType::F32, DType::BF16, DType::F16, DType::U8];

#[allow(clippy::too_many_arguments)]
pub fn kv_write(
    d: &CudaDevice,
    k: &Tensor,
    v: &Tensor,
    kc: &mut Tensor,
    vc: &mut Tensor,
    ks: f32,
    vs: f32,
    m: &AttnMeta,
) -> Result<()> {
    let (nb, hkv, bs, hd) = cache_dims(kc)?;
    if vc.dtype() != kc.dtype() || vc.shape() != kc.shape() {
        bail!(
            "kv_write: key cache {} {:?} and value cache {} {:?} differ",
            kc.dtype().name(),
            kc.shape(),
            vc.dtype().name(),
            vc.shape()
        );
    }
    d.k_kv_write(ffi::ct_kv_write_params {
        k: ptr(d, k, &[DType::F32], "kv_write keys")? as *const f32,
        v: ptr(d, v, &[DType::F32], "kv_write values")? as *const f32,
        k_cache: vp(ptr(d, kc, CACHES, "key cache")?),
        v_cache: vp(ptr(d, vc, CACHES, "value cache")?),
        dtype: code(kc.dtype()),
        k_scale: ks,
        v_scale: vs,
        slots: u32p(ptr(d, &m.slot_mapping, &[DType::U32], "slot mapping")?),
        tokens: i32_of(m.num_tokens, "tokens")?,
        kv_heads: i32_of(hkv, "KV heads")?,
        block_size: i32_of(bs, "block size")?,
        head_dim: i32_of(hd, "head dimension")?,
        num_blocks: i32_of(nb, "cache blocks")?,
        err: err_word(d),
    })
}

#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    d: &CudaDevice,
    q: &Tensor,
    kc: &Tensor,
    vc: &Tensor,
    ks: f32,
    vs: f32,
    m: &AttnMeta,
    o: &mut Tensor,
    h: usize,
) -> Result<()> {
    let (nb, hkv, bs, hd) = cache_dims(kc)?;
    if vc.dtype() != kc.dtype() || vc.shape() != kc.shape() {
        bail!("paged_attention: key and value caches differ");
    }
    if m.num_tokens == 0 {
        return Ok(());
    }
    let p = ffi::ct_attention_params {
        q: ptr(d, q, &[DType::F32], "attention queries")? as *const f32,
        k_cache: ptr(d, kc, CACHES, "key cache")? as *const c_void,
        v_cache: ptr(d, vc, CACHES, "value cache")? as *const c_void,
        dtype: code(kc.dtype()),
        k_scale: ks,
        v_scale: vs,
        q_start: u32p(ptr(d, &m.q_start, &[DType::U32], "q_start")?),
        ctx_len: u32p(ptr(d, &m.ctx_len, &[DType::U32], "ctx_len")?),
        block_tables: u32p(ptr(d, &m.block_tables, &[DType::U32], "block tables")?),
        num_seqs: i32_of(m.num_seqs, "sequences")?,
        num_tokens: i32_of(m.num_tokens, "tokens")?,
        max_blocks: i32_of(m.max_blocks, "blocks per sequence")?,
        block_size: i32_of(bs, "block size")?,
        num_blocks: i32_of(nb, "cache blocks")?,
        heads: i32_of(h, "heads")?,
        kv_heads: i32_of(hkv, "KV heads")?,
        head_dim: i32_of(hd, "head dimension")?,
        softmax_scale: 1.0 / (hd as f32).sqrt(),
        out: f32p(ptr(d, o, &[DType::F32], "attention output")?),
        err: err_word(d),
    };
    // Mostly prefill rows: the flash-style kernel (shares each key tile across a tile of rows);
    // mostly decode rows: one block per row. Both give every row the same result to rounding.
    if m.num_tokens >= 2 * m.num_seqs {
        d.k_prefill_attention(p)
    } else {
        d.k_paged_attention(p)
    }
}

pub fn log_softmax_gather(d: &CudaDevice, z: &Tensor, y: &Tensor, t: f32, o: &mut Tensor, m: usize) -> Result<()> {
    let v = z.dim(z.shape().len() - 1);
    d.k_log_softmax_gather(ffi::ct_logprob_params {
        logits: ptr(d, z, &[DType::F32], "logits")? as *const f32,
        targets: u32p(ptr(d, y, &[DType::U32], "targets")?),
        out: f32p(ptr(d, o, &[DType::F32], "log-prob output")?),
        rows: i32_of(m, "rows")?,
        vocab: i32_of(v, "vocabulary")?,
        temperature: t,
        err: err_word(d),
    })
}

/// The max |x| bit pattern of n values (with the RHT: of the rotated 16-blocks), as f32.
pub(super) fn amax(d: &CudaDevice, x: u64, dt: DType, n: usize, rht: Option<&[f32; 16]>) -> Result<f32> {
    let buf = d.scratch(4, "amax")?;
    d.memset0(buf.ptr, 4)?;
    d.k_amax(ffi::ct_amax_params {
        x: x as *const c_void,
        dtype: code(dt),
        n: n as i64,
        rht: rht.is_some() as i32,
        signs: rht.copied().unwrap_or([1.0; 16]),
        amax_bits: buf.ptr as *mut u32,
    })?;
    let mut bits = [0u32; 1];
    d.dtoh(&mut bits, buf.ptr)?;
    Ok(f32::from_bits(bits[0]))
}

pub fn amax_rows(d: &CudaDevice, x: &Tensor, m: usize) -> Result<f32> {
    let c = x.dim(x.shape().len() - 1);
    amax(d, ptr(d, x, &[DType::F32], "amax input")?, DType::F32, m * c, None)
}

/// Rewrites `q` from `src` in place: one amax pass, one quantize pass (which derives the scale
/// from the amax on the device), then the amax comes back to the host for the NaN check and
/// `q.scale`. One synchronization per tensor.
pub fn requantize(d: &CudaDevice, src: &Tensor, q: &mut QTensor, name: &str) -> Result<()> {
    requantize_all(d, &mut [(src, q, name)])
}

/// Re-quantizes every (source, buffer, name) in place: per tensor an amax kernel and a quantize
/// kernel that reads that amax on the device, all queued on the stream, then one read-back of
/// every amax (one wait per resync instead of one per tensor) for the host-side scales.
pub fn requantize_all(d: &CudaDevice, items: &mut [(&Tensor, &mut QTensor, &str)]) -> Result<()> {
    if items.is_empty() {
        return Ok(());
    }
    let buf = d.scratch(4 * items.len(), "amax")?;
    d.memset0(buf.ptr, 4 * items.len())?;
    for (t, (src, q, name)) in items.iter().enumerate() {
        let n = q.rows * q.k;
        if src.numel() != n {
            bail!("{name}: quantizing {} values into a buffer of {n}", src.numel());
        }
        let sp = ptr(d, src, FLOATS, name)?;
        let signs = q.opts.rht.map(nvfp4::rht_signs);
        let amax = buf.ptr + 4 * t as u64;
        d.k_amax(ffi::ct_amax_params {
            x: sp as *const c_void,
            dtype: code(src.dtype()),
            n: n as i64,
            rht: signs.is_some() as i32,
            signs: signs.unwrap_or([1.0; 16]),
            amax_bits: amax as *mut u32,
        })?;
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
                })?
            }
        }
    }
    let mut bits = vec![0u32; items.len()];
    d.dtoh(&mut bits, buf.ptr)?;
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

/// Decodes a quantized weight into `out_dtype` (BF16: unit values; F32: exact values).
pub(super) fn dequant(d: &CudaDevice, q: &QTensor, out: u64, out_dtype: DType) -> Result<()> {
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

/// `ops::matmul::linear_act_q`'s CUDA twin: the real W8A8 / W4A4 GEMM (`lowp`, CUTLASS or
/// cuBLASLt where the shape and architecture allow, else the emulated path).
#[allow(clippy::too_many_arguments)]
pub fn linear_act_q(
    d: &CudaDevice,
    x: &Tensor,
    act: &crate::ops::quantize::ActQuant,
    wq: &QTensor,
    b: Option<&Tensor>,
    y: &mut Tensor,
    m: usize,
) -> Result<()> {
    super::lowp::linear_act_q(d, x, act, wq, b, y, m, super::lowp::Path::Auto).map(|_| ())
}

pub fn linear_q(d: &CudaDevice, x: &Tensor, wq: &QTensor, b: Option<&Tensor>, y: &mut Tensor, m: usize) -> Result<()> {
    let (n, k) = (wq.rows, wq.k);
    let xp = ptr(d, x, &[DType::F32], "linear input")?;
    let yp = ptr(d, y, &[DType::F32], "linear output")?;
    if m == 0 {
        return Ok(());
    }
    let w = d.scratch(n * k * 2, "decoded weight")?;
    dequant(d, wq, w.ptr, DType::BF16)?;
    let xh = cast_rows(d, xp, m * k, DType::BF16)?;
    gemm(d, Elem::BF16, w.ptr, xh.ptr, yp, m, n, k, wq.scale, false, None)?;
    match b {
        Some(b) => add_bias(d, yp, b, m, n),
        None => Ok(()),
    }
}

pub fn fake_quant_rows(d: &CudaDevice, x: &Tensor, y: &mut Tensor, m: usize, q: &ActQuant) -> Result<()> {
    let k = x.dim(x.shape().len() - 1);
    let xp = ptr(d, x, &[DType::F32], "fake_quant input")?;
    let yp = ptr(d, y, &[DType::F32], "fake_quant output")?;
    match *q {
        ActQuant::None => d.dtod(yp, xp, m * k * 4),
        _ => quant_rows_fixed(d, xp, m, k, q, 0, 0, yp),
    }
}

/// Quantizes f32 rows x (m, K) at `xp` with the fixed scale of `q` (FP8: scale; NVFP4: global,
/// with dynamic block scales, RHT and stochastic rounding as its options), writing whichever of
/// codes (`codes`), NVFP4 block scales (`scales`) and dequantized values (`dequant`) is non-zero.
/// The one launch of the quantize kernels for activations (fake_quant_rows, lowp::quantize_act).
#[allow(clippy::too_many_arguments)]
pub(super) fn quant_rows_fixed(
    d: &CudaDevice,
    xp: u64,
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
            })
        }
    }
}

/// Whether a row is truncated (top-k or top-p at a positive temperature): ct_sample_topk draws
/// it; ct_sample draws the others (greedy or the whole distribution).
pub(super) fn truncated(p: &SampleParams, vocab: usize) -> bool {
    let cut = (p.top_k > 0 && (p.top_k as usize) < vocab) || p.top_p < 1.0;
    p.temperature > 0.0 && cut
}

/// The kernel's view of one row's sampling parameters.
pub(super) fn sample_row_params(p: &SampleParams, vocab: usize) -> ffi::ct_sample_row {
    ffi::ct_sample_row {
        seed: p.seed,
        request: p.request,
        temperature: p.temperature,
        sample: p.sample,
        position: p.position,
        truncated: truncated(p, vocab) as u32,
        top_k: p.top_k,
        top_p: p.top_p,
    }
}

pub fn sample(
    d: &CudaDevice,
    z: &Tensor,
    params: &[SampleParams],
    tokens: &mut [u32],
    logprobs: &mut [f32],
) -> Result<()> {
    let s = params.len();
    let v = z.dim(z.shape().len() - 1);
    let zp = ptr(d, z, &[DType::F32], "sample logits")?;
    if s == 0 {
        return Ok(());
    }
    let rows: Vec<ffi::ct_sample_row> = params.iter().map(|p| sample_row_params(p, v)).collect();
    let pbuf = d.scratch(std::mem::size_of_val(rows.as_slice()), "sampling parameters")?;
    let tbuf = d.scratch(s * 4, "sampled tokens")?;
    let lbuf = d.scratch(s * 4, "sampled log-probs")?;
    let hbuf = d.scratch(s * 4, "rows left to the host")?;
    d.htod(pbuf.ptr, &rows)?;
    let kp = ffi::ct_sample_params {
        logits: zp as *const f32,
        params: pbuf.ptr as *const ffi::ct_sample_row,
        rows: i32_of(s, "rows")?,
        vocab: i32_of(v, "vocabulary")?,
        tokens: tbuf.ptr as *mut u32,
        logprobs: f32p(lbuf.ptr),
        host_rows: hbuf.ptr as *mut u32,
    };
    d.k_sample(kp)?;
    let any_truncated = rows.iter().any(|r| r.truncated != 0);
    if any_truncated {
        d.k_sample_topk(kp)?;
    }
    d.dtoh(&mut tokens[..s], tbuf.ptr)?;
    d.dtoh(&mut logprobs[..s], lbuf.ptr)?;
    if !any_truncated {
        return Ok(());
    }
    // Rows the top-k kernel left (top_k above CT_TOPK_CAP, or a top-p prefix longer than its
    // sorted candidates) are drawn on the host by the CPU twin: their logits come over in one
    // copy and the rows are sampled in parallel.
    let mut host_rows = vec![0u32; s];
    d.dtoh(&mut host_rows, hbuf.ptr)?;
    let off: Vec<usize> = (0..s).filter(|&i| rows[i].truncated != 0 && host_rows[i] != 0).collect();
    if let (Some(&first), Some(&last)) = (off.first(), off.last()) {
        use rayon::prelude::*;
        let mut host = vec![0.0f32; (last - first + 1) * v];
        d.dtoh(&mut host, zp + (first * v * 4) as u64)?;
        let drawn: Vec<(u32, f32)> = off
            .par_iter()
            .map(|&i| crate::ops::sample::sample_row(&host[(i - first) * v..(i - first + 1) * v], &params[i]))
            .collect();
        for (&i, (t, l)) in off.iter().zip(drawn) {
            tokens[i] = t;
            logprobs[i] = l;
        }
    }
    Ok(())
}

/// Fills a float tensor with mean + std · N(0, 1) on the device (no CPU twin: the device
/// check's and benchmarks' random inputs).
pub fn fill_normal(d: &CudaDevice, t: &mut Tensor, seed: u64, stream: u64, mean: f32, std: f32) -> Result<()> {
    let p = ptr(d, t, FLOATS, "fill_normal")?;
    d.k_fill_normal(ffi::ct_fill_normal_params {
        out: vp(p),
        dtype: code(t.dtype()),
        n: t.numel() as i64,
        seed,
        stream,
        mean,
        std,
    })
}
