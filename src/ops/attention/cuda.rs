//! Paged attention's CUDA twin: ct_kv_write (and ct_qk_rope_kv: a layer's q/k norms, RoPE and
//! the KV write in one launch), and ct_paged_attention (mostly decode rows, one
//! block per row) or, for mostly prefill rows (key tiles shared across a tile of rows),
//! ct_prefill_attention on the CUDA cores or, with a BF16 cache, ct_prefill_attention_tc on
//! the tensor cores. The CUDA-core kernels equal the CPU twin to f32 rounding, the tensor
//! cores to BF16 rounding (they round q and the probabilities too). Not yet run on a GPU.

use super::{cache_dims, AttnMeta};
use crate::device::cuda::args::{code, err_word, i32_of, ptr, u32p, vp};
use crate::device::cuda::kernels::prefill_tc_fits;
use crate::device::cuda::{ffi, CudaDevice};
use crate::device::{DType, Tensor};
use anyhow::{bail, Result};
use std::ffi::c_void;

const CACHES: &[DType] = &[DType::F32, DType::BF16, DType::F16, DType::U8];
/// The output's dtypes: f32, or BF16 / F16 rounded as `ct_cast` rounds (o_proj's GEMM input).
const OUTPUTS: &[DType] = &[DType::F32, DType::BF16, DType::F16];

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
    let kp = ptr(d, k, &[DType::F32], "kv_write keys")?;
    d.k_kv_write(kv_params(d, kp, v, (kc, vc), (ks, vs), m)?)
}

/// ct_kv_write's parameters: keys at `k` (0: none, ct_qk_rope_kv reads its own), values `v`.
fn kv_params(
    d: &CudaDevice,
    k: u64,
    v: &Tensor,
    (kc, vc): (&mut Tensor, &mut Tensor),
    (ks, vs): (f32, f32),
    m: &AttnMeta,
) -> Result<ffi::ct_kv_write_params> {
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
    Ok(ffi::ct_kv_write_params {
        k: k as *const f32,
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

/// One ct_qk_rope_kv launch (`super::qk_rope_kv`).
#[allow(clippy::too_many_arguments)]
pub fn qk_rope_kv(
    d: &CudaDevice,
    q: &mut Tensor,
    k: &mut Tensor,
    v: &Tensor,
    norms: Option<(&Tensor, &Tensor, f32)>,
    (cos, sin): (&Tensor, &Tensor),
    caches: (&mut Tensor, &mut Tensor),
    scales: (f32, f32),
    m: &AttnMeta,
    heads: usize,
) -> Result<()> {
    const NORMS: &[DType] = &[DType::F32, DType::BF16, DType::F16];
    let (qn, kn, eps) = match norms {
        Some((qn, kn, eps)) => {
            if qn.dtype() != kn.dtype() {
                bail!("q_norm in {} and k_norm in {}: one dtype expected", qn.dtype().name(), kn.dtype().name());
            }
            (ptr(d, qn, NORMS, "q_norm")?, ptr(d, kn, NORMS, "k_norm")?, eps)
        }
        None => (0, 0, 0.0),
    };
    let norm_dtype = code(norms.map_or(DType::F32, |n| n.0.dtype()));
    d.k_qk_rope_kv(ffi::ct_qk_rope_kv_params {
        kv: kv_params(d, 0, v, caches, scales, m)?,
        q: ptr(d, q, &[DType::F32], "attention queries")? as *mut f32,
        k: ptr(d, k, &[DType::F32], "attention keys")? as *mut f32,
        q_norm: qn as *const c_void,
        k_norm: kn as *const c_void,
        norm_dtype,
        eps,
        cos: ptr(d, cos, &[DType::F32], "RoPE cos")? as *const f32,
        sin: ptr(d, sin, &[DType::F32], "RoPE sin")? as *const f32,
        heads: i32_of(heads, "query heads")?,
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
        out: vp(ptr(d, o, OUTPUTS, "attention output")?),
        out_dtype: code(o.dtype()),
        err: err_word(d),
        part_acc: std::ptr::null_mut(),
        part_ml: std::ptr::null_mut(),
        splits: 1,
    };
    // Mostly prefill rows: the flash-style kernel (shares each key tile across a tile of rows),
    // on the tensor cores where the cache is BF16 and the shape fits; mostly decode rows: one
    // block per row (a decode step never switches kernels: CUDA graphs replay it).
    if m.num_tokens >= 2 * m.num_seqs {
        if kc.dtype() == DType::BF16 && prefill_tc_fits(h / hkv.max(1), hd) {
            d.k_prefill_attention_tc(p, m.attended)
        } else {
            d.k_prefill_attention(p, m.attended)
        }
    } else {
        // Few rows (a small decode batch, or its tail): each row's keys split over blocks
        // (split-K), the parts merged by ct_attention_merge.
        let splits = d.decode_splits(m.num_tokens, hkv, m.max_blocks * bs);
        if splits == 1 {
            return d.k_paged_attention(p, m.attended);
        }
        let part = m.num_tokens * h * splits;
        let acc = d.scratch(part * hd * 4, "split attention outputs")?; // (tokens, H, splits, D)
        let ml = d.scratch(part * 2 * 4, "split attention maxima and sums")?; // (tokens, H, splits, 2)
        let (part_acc, part_ml) = (acc.ptr as *mut f32, ml.ptr as *mut f32);
        d.k_paged_attention(ffi::ct_attention_params { part_acc, part_ml, splits: splits as i32, ..p }, m.attended)
    }
}
