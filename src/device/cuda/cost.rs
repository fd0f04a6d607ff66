//! What each launch costs, from its shapes: the FLOPs and bytes every typed kernel launcher
//! (`kernels.rs`), GEMM and copy declares to the ledger (`ledger.rs`). Bytes are the tensors
//! the launch must read and write, each once (4 bytes an f32, 2 a BF16 / F16, 1 an FP8 code,
//! half an FP4 code and a sixteenth for its block scale); FLOPs are the arithmetic the
//! operation needs (2·m·n·k for a GEMM; for element-wise and row kernels a few per element,
//! as each function says), not the instructions a kernel issues. Where the parameter struct
//! does not hold a shape (the keys attention reads, the optimizer's element count) the launcher
//! is given it by its caller, who has it on the host.
//!
//! Owns: the arithmetic. May call: `ffi` (the parameter structs), `driver` (GEMM shapes). Must
//! not: read device memory.

use super::driver::{Cutlass, CutlassArgs, Elem, GemmKey};
use super::ffi;
use super::ledger::{Cost, Path, Rate};

/// Bytes of one element of a ct dtype code (F32, BF16, F16, U8).
fn dsize(code: i32) -> f64 {
    match code {
        ffi::CT_DTYPE_BF16 | ffi::CT_DTYPE_F16 => 2.0,
        ffi::CT_DTYPE_U8 => 1.0,
        _ => 4.0,
    }
}

/// Bytes of one element of a GEMM operand (E2M1: half a byte plus its share of a 16-value
/// block's E4M3 scale).
pub fn elem_bytes(e: Elem) -> f64 {
    match e {
        Elem::F32 => 4.0,
        Elem::BF16 | Elem::F16 => 2.0,
        Elem::E4M3 => 1.0,
        Elem::E2M1 => 0.5 + 1.0 / 16.0,
    }
}

fn elem_rate(e: Elem) -> Rate {
    match e {
        Elem::F32 => Rate::F32,
        Elem::BF16 | Elem::F16 => Rate::Bf16,
        Elem::E4M3 => Rate::Fp8,
        Elem::E2M1 => Rate::Fp4,
    }
}

fn n(x: impl Into<i64>) -> f64 {
    x.into().max(0) as f64
}

/// A cuBLASLt GEMM y (m, n) f32 (+)= op(x) · op(w): 2·m·n·k FLOPs at the operands' rate; x and
/// w read once, y written (and read when accumulating).
pub fn gemm(k: &GemmKey) -> Cost {
    let (m, nn, kk) = (k.m as f64, k.n as f64, k.k as f64);
    let y = m * nn * 4.0 * if k.accumulate { 2.0 } else { 1.0 };
    Cost {
        flops: 2.0 * m * nn * kk,
        bytes: (m * kk + nn * kk) * elem_bytes(k.ab) + y,
        rate: elem_rate(k.ab),
        path: Path::Hbm,
        blocks: None,
    }
}

/// A CUTLASS GEMM D (m, n) f32 = A (m, k) · B (n, k)ᵀ in FP8 or NVFP4.
pub fn cutlass(g: Cutlass, a: &CutlassArgs) -> Cost {
    let ab = match g {
        Cutlass::Fp8Sm90 | Cutlass::Fp8Sm100 => Elem::E4M3,
        Cutlass::Nvfp4Sm100 => Elem::E2M1,
    };
    gemm(&GemmKey {
        m: a.m,
        n: a.n,
        k: a.k,
        ab,
        accumulate: false,
        form: super::driver::Form::Nt,
        device_scalars: false,
    })
}

/// (Copies.) `bytes` over `path`; a copy on one device reads and writes them.
pub fn copy(bytes: usize, path: Path) -> Cost {
    let b = bytes as f64 * if path == Path::Hbm { 2.0 } else { 1.0 };
    Cost { flops: 0.0, bytes: b, rate: Rate::F32, path, blocks: None }
}

/// Zeroing `bytes` of device memory: written once.
pub fn memset(bytes: usize) -> Cost {
    Cost::hbm(0.0, bytes as f64)
}

/// x (+= r) then y = x·rstd·w: x read (and r read, x written), y written, w read; 4 FLOPs an
/// element (+1 with the residual).
pub fn rmsnorm(p: &ffi::ct_rmsnorm_params) -> Cost {
    let e = n(p.rows) * n(p.cols);
    let res = !p.r.is_null();
    // x read (and with r: r read, x written), y written in its dtype.
    let rw = if res { 3.0 } else { 1.0 };
    Cost::hbm(e * if res { 5.0 } else { 4.0 }, e * (4.0 * rw + dsize(p.y_dtype)) + n(p.cols) * dsize(p.w_dtype))
}

/// cos, sin (rows, half) written, pos and inv_freq read; 3 FLOPs (a product, two functions
/// counted once each) a value.
pub fn rope_table(p: &ffi::ct_rope_table_params) -> Cost {
    let e = n(p.rows) * n(p.half);
    Cost::hbm(3.0 * e, 8.0 * e + 4.0 * n(p.rows) + 4.0 * n(p.half))
}

/// x (rows, heads·2·half) rotated in place with the (rows, half) tables: 6 FLOPs a pair.
pub fn rope(p: &ffi::ct_rope_params) -> Cost {
    let pairs = n(p.rows) * n(p.heads) * n(p.half);
    Cost::hbm(6.0 * pairs, pairs * 2.0 * 4.0 * 2.0 + n(p.rows) * n(p.half) * 8.0)
}

/// Rows of the table gathered into f32 rows.
pub fn embedding(p: &ffi::ct_embedding_params) -> Cost {
    let e = n(p.rows) * n(p.cols);
    Cost::hbm(0.0, e * (dsize(p.dtype) + 4.0) + 4.0 * n(p.rows))
}

/// silu(gate)·up: gate and up read, out written in its dtype; 5 FLOPs an element.
pub fn swiglu(p: &ffi::ct_swiglu_params) -> Cost {
    Cost::hbm(5.0 * n(p.n), (8.0 + dsize(p.out_dtype)) * n(p.n))
}

pub fn gather_rows(p: &ffi::ct_gather_rows_params) -> Cost {
    Cost::hbm(0.0, n(p.rows) * n(p.cols) * 8.0 + 4.0 * n(p.rows))
}

/// dst rows read and written, src read: one add an element.
pub fn scatter_add_rows(p: &ffi::ct_scatter_add_rows_params) -> Cost {
    let e = n(p.rows) * n(p.cols);
    Cost::hbm(e, e * 12.0 + 4.0 * n(p.rows))
}

pub fn add_bias(p: &ffi::ct_add_bias_params) -> Cost {
    let cols = n(p.cols0) + n(p.cols1) + n(p.cols2);
    let e = n(p.rows) * cols;
    Cost::hbm(e, e * 8.0 + cols * dsize(p.dtype))
}

/// dst (+)= src·g_row·g_col (then, with the RHT, 4 butterfly stages and the signs: 6 more
/// FLOPs a value); with `scalars`, two amax read and two values written.
pub fn nvfp4_scale_out(p: &ffi::ct_nvfp4_scale_out_params) -> Cost {
    if !p.scalars.is_null() {
        return Cost::hbm(1.0, 16.0);
    }
    let e = n(p.rows) * n(p.cols);
    let flops = if p.rht != 0 { 8.0 } else { 2.0 };
    Cost::hbm(flops * e, e * if p.accumulate != 0 { 12.0 } else { 8.0 })
}

/// One rounding a value (and the row scale's multiply).
pub fn cast(p: &ffi::ct_cast_params) -> Cost {
    let flops = if p.row_amax.is_null() { 1.0 } else { 2.0 };
    Cost::hbm(flops * n(p.n), n(p.n) * (4.0 + dsize(p.dtype)))
}

pub fn fill_normal(p: &ffi::ct_fill_normal_params) -> Cost {
    Cost::hbm(10.0 * n(p.n), n(p.n) * dsize(p.dtype))
}

/// k and v rows (f32) read, written into the caches in their element type.
pub fn kv_write(p: &ffi::ct_kv_write_params) -> Cost {
    let e = n(p.tokens) * n(p.kv_heads) * n(p.head_dim) * 2.0;
    Cost::hbm(if p.dtype == ffi::CT_DTYPE_U8 { e } else { 0.0 }, e * (4.0 + dsize(p.dtype)) + 4.0 * n(p.tokens))
}

/// ct_qk_rope_kv: q and k read and written once (normalized and rotated in place), k and v
/// (read) written into the caches (as [`kv_write`]), the RoPE tables read once per token; per value
/// 3 FLOPs of RoPE, 4 more of the norm where there is one.
pub fn qk_rope_kv(p: &ffi::ct_qk_rope_kv_params) -> Cost {
    let (t, d) = (n(p.kv.tokens), n(p.kv.head_dim));
    let (q, kv) = (t * n(p.heads) * d, t * n(p.kv.kv_heads) * d);
    let norm = if p.q_norm.is_null() { 0.0 } else { 4.0 };
    let cache = 4.0 * kv + 2.0 * kv * dsize(p.kv.dtype) + 4.0 * t;
    Cost::hbm((3.0 + norm) * (q + kv), 8.0 * (q + kv) + cache + t * d * 4.0)
}

/// Paged attention of `p.num_tokens` query rows that attend `keys` cached positions in all
/// (Σ over rows; a decode row attends its whole context): each row reads its keys and values
/// once per KV head (a block of the kernel serves a KV head's group of query heads), q read
/// and out written; 4·D FLOPs per (query head, key) for q·k and p·v. The keys' part is a cost
/// per key, so that a replayed graph counts the replaying step's keys.
pub fn paged_attention(p: &ffi::ct_attention_params, keys: u64) -> Charge {
    let c = prefill_attention(p, keys, 1);
    if p.splits <= 1 {
        return c;
    }
    // Split-K: each split reads q and writes its partial output, max and sum (f32) instead of
    // the output (the merge writes that); the keys' bytes are split, not repeated.
    let (rows, s, d) = (n(p.num_tokens) * n(p.heads), n(p.splits), n(p.head_dim));
    Charge { base: Cost::hbm(0.0, rows * s * (d * 4.0 + (d + 2.0) * 4.0)), ..c }
}

/// The split-K merge: the parts read, out written; 4 FLOPs per (split, value).
pub fn attention_merge(p: &ffi::ct_attention_merge_params) -> Cost {
    let (rows, s, d) = (n(p.num_tokens) * n(p.heads), n(p.splits), n(p.head_dim));
    Cost::hbm(4.0 * rows * s * d, rows * (s * (d + 2.0) * 4.0 + d * dsize(p.out_dtype)))
}

/// ct_prefill_attention: as [`paged_attention`], but a tile of `rows_per_tile` query rows
/// shares each key tile it loads, so the keys' bytes are read once per tile of rows.
pub fn prefill_attention(p: &ffi::ct_attention_params, keys: u64, rows_per_tile: usize) -> Charge {
    let (h, hkv, d) = (n(p.heads), n(p.kv_heads), n(p.head_dim));
    let rows = n(p.num_tokens) * h * d * (4.0 + dsize(p.out_dtype)); // q read, out written
    let per_key = Cost::hbm(4.0 * d * h, hkv * d * 2.0 * dsize(p.dtype) / rows_per_tile.max(1) as f64);
    Charge { base: Cost::hbm(0.0, rows), per_key: Some((per_key, keys)) }
}

/// ct_prefill_attention_tc: [`prefill_attention`]'s bytes for a BF16 cache (a tile of
/// `rows_per_tile` rows reads each key and value once), its FLOPs on the tensor cores (the
/// ledger times a launch at its base's rate).
pub fn prefill_attention_tc(p: &ffi::ct_attention_params, keys: u64, rows_per_tile: usize) -> Charge {
    let c = prefill_attention(p, keys, rows_per_tile);
    let tc = |k: Cost| Cost { rate: Rate::Bf16, ..k };
    Charge { base: tc(c.base), per_key: c.per_key.map(|(k, n)| (tc(k), n)) }
}

/// One row's log-softmax and the gathered target: the row read, 3 FLOPs an element.
pub fn log_softmax_gather(p: &ffi::ct_logprob_params) -> Cost {
    let e = n(p.rows) * n(p.vocab);
    Cost::hbm(3.0 * e, 4.0 * e + 8.0 * n(p.rows))
}

/// The `drawn` rows a sampling kernel draws (ct_sample skips the truncated rows, ct_sample_topk
/// the others): their logits read, 3 FLOPs an element (scale, exp, sum), the row's parameters
/// read and its token and log-prob written.
pub fn sample(p: &ffi::ct_sample_params, drawn: usize) -> Cost {
    let e = drawn as f64 * n(p.vocab);
    Cost::hbm(3.0 * e, 4.0 * e + 48.0 * drawn as f64)
}

pub fn amax(p: &ffi::ct_amax_params) -> Cost {
    let f = if p.rht != 0 { 5.0 } else { 1.0 };
    Cost::hbm(f * n(p.n), n(p.n) * dsize(p.dtype))
}

/// x read; the codes and (when asked) the dequantized f32 values written.
pub fn quant_fp8(p: &ffi::ct_quant_fp8_params) -> Cost {
    let out = if p.codes.is_null() { 0.0 } else { 1.0 } + if p.dequant.is_null() { 0.0 } else { 4.0 };
    let (flops, input) = quant_input(p.up.is_null(), p.dtype);
    Cost::hbm((2.0 + flops) * n(p.n), n(p.n) * (input + out))
}

/// x read; packed codes, block scales and (when asked) the dequantized values written.
pub fn quant_nvfp4(p: &ffi::ct_quant_nvfp4_params) -> Cost {
    let out = if p.packed.is_null() { 0.0 } else { 0.5 + 1.0 / 16.0 } + if p.dequant.is_null() { 0.0 } else { 4.0 };
    let f = if p.rht != 0 { 8.0 } else { 4.0 };
    let (flops, input) = quant_input(p.up.is_null(), p.dtype);
    Cost::hbm((f + flops) * n(p.n), n(p.n) * (input + out))
}

/// A quantizer's input per value: (FLOPs, bytes): x in its dtype, or (with `up`) the gate and
/// up in f32 and their SwiGLU ([`swiglu`]'s 5 FLOPs).
fn quant_input(plain: bool, dtype: i32) -> (f64, f64) {
    if plain {
        (0.0, dsize(dtype))
    } else {
        (5.0, 8.0)
    }
}

/// Codes (and block scales) read, values written in `out_dtype`.
pub fn dequant(p: &ffi::ct_dequant_params) -> Cost {
    let code = if p.format == ffi::CT_FORMAT_NVFP4 { 0.5 + 1.0 / 16.0 } else { 1.0 };
    Cost::hbm(n(p.n), n(p.n) * (code + dsize(p.out_dtype)))
}

/// The W4A4 decode GEMM: 2·m·n·k FLOPs on the BF16 tensor cores (mma.sync); both operands'
/// codes and block scales read once (the activations are re-read by every block, from L2),
/// y written in f32 — or, split over K, each split's (m, n) sums.
pub fn gemm_w4a4(p: &ffi::ct_gemm_w4a4_params) -> Cost {
    let (m, nn, kk) = (n(p.m), n(p.n), n(p.k));
    Cost {
        flops: 2.0 * m * nn * kk,
        bytes: (m + nn) * kk * elem_bytes(Elem::E2M1) + m * nn * 4.0 * n(p.splits.max(1)),
        rate: Rate::Bf16,
        path: Path::Hbm,
        blocks: None,
    }
}

/// Split-K's merge: the splits' sums read, y written.
pub fn gemm_w4a4_merge(p: &ffi::ct_gemm_w4a4_params) -> Cost {
    let mn = n(p.m) * n(p.n);
    Cost::hbm(mn * n(p.splits), mn * 4.0 * (n(p.splits) + 1.0))
}

pub fn swizzle_sf(p: &ffi::ct_swizzle_sf_params) -> Cost {
    Cost::hbm(0.0, n(p.rows) * n(p.sf_cols) + n(p.padded_rows) * n(p.padded_cols))
}

/// The optimizer over `elems` values: master, gradient (and AdamW's moments) read and written,
/// the compute weights written; SGD 4 FLOPs a value, AdamW 14.
pub fn optim(p: &ffi::ct_optim_params, elems: usize) -> Cost {
    let e = elems as f64;
    let (flops, state) = if p.adamw != 0 { (14.0, 4.0 * 4.0 * 2.0) } else { (4.0, 2.0 * 4.0 * 2.0) };
    let compute = if p.compute_dtype == ffi::CT_DTYPE_F32 { 4.0 } else { dsize(p.compute_dtype) };
    Cost::hbm(flops * e, e * (state + compute))
}

/// Σ g² in f64: g read, 2 FLOPs a value (counted at the FP32 rate; the f64 accumulation is the
/// kernels' choice for determinism).
pub fn sum_sq(p: &ffi::ct_sum_sq_params) -> Cost {
    Cost::hbm(2.0 * n(p.n), 4.0 * n(p.n) + 8.0 * n(p.blocks))
}

pub fn sum_sq_finish(p: &ffi::ct_sum_sq_params) -> Cost {
    Cost::hbm(n(p.blocks), 8.0 * n(p.blocks) + 8.0)
}

/// ct_lm_stats over a chunk of logits: z scaled in place (read, written), 4 FLOPs an element.
pub fn lm_stats(p: &ffi::ct_lm_params) -> Cost {
    let e = n(p.rows) * n(p.vocab);
    // The one pass's coefficient: its denominator (and teacher log-prob, or sampler log-prob
    // and advantage) read, the value written.
    let teacher = if p.coef_teacher.is_null() { 0.0 } else { 4.0 };
    let tis = if p.coef_adv.is_null() { 0.0 } else { 12.0 };
    let coef = if p.coef_den.is_null() { 0.0 } else { (8.0 + teacher + tis) * n(p.rows) };
    Cost::hbm(4.0 * e, 8.0 * e + 16.0 * n(p.rows) + coef)
}

/// ct_lm_dz: z read and overwritten with dz, 4 FLOPs an element.
pub fn lm_dz(p: &ffi::ct_lm_params) -> Cost {
    let e = n(p.rows) * n(p.vocab);
    let center = n(p.rows) * n(p.center_k) * 8.0;
    // z read; dz written over it in f32, or in BF16 apart.
    let dz = if p.dz_bf16.is_null() { 4.0 } else { 2.0 };
    Cost::hbm(4.0 * e, (4.0 + dz) * e + 16.0 * n(p.rows) + center)
}

/// x read, y written in its dtype, the row's 1/rms written, the gain read.
pub fn rmsnorm_train(p: &ffi::ct_rmsnorm_train_params) -> Cost {
    let e = n(p.rows) * n(p.cols);
    Cost::hbm(4.0 * e, (4.0 + dsize(p.y_dtype)) * e + 4.0 * n(p.rows) + n(p.cols) * dsize(p.w_dtype))
}

/// dx from dy, x, w, rstd: dy and x read, dx written (and read when accumulating); 8 FLOPs an
/// element.
pub fn rmsnorm_bwd(p: &ffi::ct_rmsnorm_bwd_params) -> Cost {
    let e = n(p.rows) * n(p.cols);
    let dx = if p.accumulate != 0 { 8.0 } else { 4.0 };
    Cost::hbm(8.0 * e, e * (8.0 + dx) + 4.0 * n(p.rows) + n(p.cols) * dsize(p.w_dtype))
}

/// The first pass of dw += Σ_rows dy·x·r: dy and x read again, a chunk's rows per thread; the
/// chunks' sums written (one chunk: dw read and written); 3 FLOPs an element.
pub fn rmsnorm_dw(p: &ffi::ct_rmsnorm_bwd_params) -> Cost {
    let e = n(p.rows) * n(p.cols);
    Cost::hbm(3.0 * e, e * 8.0 + 4.0 * n(p.rows) + chunk_sums(p.partial.is_null(), p.rows, p.chunk_rows, p.cols))
}

/// The bytes a column sum's pass writes: the chunks' sums (chunks, cols), or with one chunk the
/// total read and written.
fn chunk_sums(direct: bool, rows: i32, chunk_rows: i32, cols: i32) -> f64 {
    match direct {
        true => 8.0 * n(cols),
        false => 4.0 * n((rows.max(0) as u32).div_ceil(chunk_rows.max(1) as u32) as i64) * n(cols),
    }
}

/// da, g, u read; dg, du written in their dtype; 10 FLOPs an element.
pub fn swiglu_bwd(p: &ffi::ct_swiglu_bwd_params) -> Cost {
    Cost::hbm(10.0 * n(p.n), (12.0 + 2.0 * dsize(p.out_dtype)) * n(p.n))
}

/// One pass of a column sum: x read once; the chunks' sums written, or the total updated.
pub fn col_sum(p: &ffi::ct_col_sum_params) -> Cost {
    let e = n(p.rows) * n(p.cols);
    Cost::hbm(e, 4.0 * e + chunk_sums(p.partial.is_null(), p.rows, p.chunk_rows, p.cols))
}

pub fn embed_bwd(p: &ffi::ct_embed_bwd_params) -> Cost {
    let e = n(p.tokens) * n(p.cols);
    Cost::hbm(e, 12.0 * e + 4.0 * n(p.tokens))
}

/// The three launches of training attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnPart {
    Fwd,
    BwdDq,
    BwdDkv,
}

/// Training attention over packed causal sequences whose (query, key) pairs number `pairs`
/// (Σ L(L+1)/2), per (query head, pair) as the kernels compute: the forward 4·D FLOPs (q·k,
/// p·v); the dq launch 6·D (the scores and dP = dout·vᵀ again, then dS·k); the dk/dv launch
/// 8·D (scores and dP again, dSᵀ·q, Pᵀ·dout): the backward recomputes the scores twice,
/// 14·D against the 8·D a fused backward needs. `tc`: the tensor-core kernels (BF16 operands).
/// Each tensor the launch reads or writes counts once.
pub fn attn_train(p: &ffi::ct_attn_train_params, pairs: u64, part: AttnPart, tc: bool) -> Cost {
    let (t, h, hkv, d) = (n(p.tokens), n(p.heads), n(p.kv_heads), n(p.head_dim));
    let q = t * h * d * 4.0; // one (tokens, heads·D) f32 tensor
    let kv = t * hkv * d * 4.0; // one (tokens, kv_heads·D) f32 tensor
    let stat = t * h * 4.0; // lse or delta
    let (per_pair, bytes) = match part {
        // q, k, v read; o (in its dtype), lse written.
        AttnPart::Fwd => (4.0, q * (1.0 + dsize(p.o_dtype) / 4.0) + 2.0 * kv + stat),
        // q, out, dout read, k, v read; dq, delta written, lse read.
        AttnPart::BwdDq => (6.0, 4.0 * q + 2.0 * kv + 2.0 * stat),
        // q, dout read, k, v read; dk, dv written; lse, delta read.
        AttnPart::BwdDkv => (8.0, 2.0 * q + 4.0 * kv + 2.0 * stat),
    };
    Cost {
        flops: per_pair * d * h * pairs as f64,
        bytes,
        rate: if tc { Rate::Bf16 } else { Rate::F32 },
        path: Path::Hbm,
        blocks: None,
    }
}

/// A launch's cost as the ledger takes it: a flat cost, or (attention) a base plus a cost per
/// key read, so that a CUDA-graph replay counts its own step's keys.
#[derive(Clone, Copy, Debug)]
pub struct Charge {
    pub base: Cost,
    pub per_key: Option<(Cost, u64)>,
}

impl From<Cost> for Charge {
    fn from(base: Cost) -> Charge {
        Charge { base, per_key: None }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::cuda::driver::Form;

    /// A GEMM declares 2·m·n·k FLOPs at its operands' rate and the bytes of its three
    /// operands by their element types (hand arithmetic).
    #[test]
    fn gemms_declare_their_flops_and_operand_bytes() {
        let k = GemmKey { m: 3, n: 5, k: 7, ab: Elem::BF16, accumulate: false, form: Form::Nt, device_scalars: false };
        let c = gemm(&k);
        assert_eq!(c.flops, 210.0);
        // x 3×7 and w 5×7 BF16 (2 B), y 3×5 f32 written.
        assert_eq!(c.bytes, (21.0 + 35.0) * 2.0 + 60.0);
        assert_eq!(c.rate, Rate::Bf16);
        // Accumulating reads y as well; F32 operands at the CUDA cores' rate.
        let f = gemm(&GemmKey { ab: Elem::F32, accumulate: true, ..k });
        assert_eq!((f.bytes, f.rate), ((21.0 + 35.0) * 4.0 + 120.0, Rate::F32));
        // NVFP4: 9/16 of a byte per value, at the FP4 rate.
        let a = CutlassArgs { a: 0, b: 0, sfa: 0, sfb: 0, d: 0, m: 16, n: 32, k: 64, alpha: 1.0 };
        let q = cutlass(Cutlass::Nvfp4Sm100, &a);
        assert_eq!((q.flops, q.rate), (2.0 * 16.0 * 32.0 * 64.0, Rate::Fp4));
        assert_eq!(q.bytes, (16.0 * 64.0 + 32.0 * 64.0) * 0.5625 + 16.0 * 32.0 * 4.0);
        // A copy on the device reads and writes its bytes; a peer copy moves them once.
        assert_eq!(copy(100, Path::Hbm).bytes, 200.0);
        assert_eq!(copy(100, Path::Nvlink).bytes, 100.0);
    }

    /// Attention's cost follows the keys it reads: a decode row over a 1000-token context of
    /// an FP8 cache reads 1000 keys and values per KV head, one byte each.
    #[test]
    fn attention_costs_follow_the_keys_read() {
        // SAFETY: the parameter struct is integers, floats and raw pointers: all-zero bytes are
        // a valid value of each (null pointers, which the cost functions never read).
        let mut p: ffi::ct_attention_params = unsafe { std::mem::zeroed() };
        (p.heads, p.kv_heads, p.head_dim, p.num_tokens, p.dtype) = (8, 2, 64, 1, ffi::CT_DTYPE_U8);
        let c = paged_attention(&p, 1000);
        let (k, keys) = c.per_key.unwrap();
        assert_eq!(keys, 1000);
        assert_eq!(c.base.bytes + 1000.0 * k.bytes, 1000.0 * 2.0 * 64.0 * 2.0 + 8.0 * 64.0 * 8.0);
        assert_eq!(c.base.flops + 1000.0 * k.flops, 4.0 * 64.0 * 8.0 * 1000.0);
        // Prefill: a tile of 16 rows shares each key tile, so the keys' bytes are a sixteenth;
        // the FLOPs stay.
        let pf = prefill_attention(&p, 1000, 16).per_key.unwrap().0;
        assert_eq!((pf.bytes, pf.flops), (k.bytes / 16.0, k.flops));
        // The tensor-core prefill: the same work, timed at the BF16 tensor-core rate.
        let tc = prefill_attention_tc(&p, 1000, 16);
        let (tk, _) = tc.per_key.unwrap();
        assert_eq!((tk.bytes, tk.flops, tk.rate, tc.base.rate), (pf.bytes, pf.flops, Rate::Bf16, Rate::Bf16));
        assert_eq!(tc.base.bytes, prefill_attention(&p, 1000, 16).base.bytes);
        // A BF16 output (o_proj's GEMM input) writes 2 bytes a value instead of 4; q stays f32.
        p.out_dtype = ffi::CT_DTYPE_BF16;
        assert_eq!(paged_attention(&p, 1000).base.bytes, 8.0 * 64.0 * (4.0 + 2.0));
        // SAFETY: as above.
        let mut t: ffi::ct_attn_train_params = unsafe { std::mem::zeroed() };
        (t.heads, t.kv_heads, t.head_dim, t.tokens) = (4, 2, 16, 10);
        // One sequence of 10 tokens: 55 causal pairs; the backward's two launches recompute the
        // scores, 14·D per pair against the forward's 4·D.
        let f = attn_train(&t, 55, AttnPart::Fwd, true);
        assert_eq!((f.flops, f.rate), (4.0 * 16.0 * 4.0 * 55.0, Rate::Bf16));
        // q and o (T, H·D) f32, k and v (T, Hkv·D) f32, lse (T, H): then o in BF16.
        let (qb, kvb, stat) = (10.0 * 4.0 * 16.0 * 4.0, 10.0 * 2.0 * 16.0 * 4.0, 10.0 * 4.0 * 4.0);
        assert_eq!(f.bytes, 2.0 * qb + 2.0 * kvb + stat);
        t.o_dtype = ffi::CT_DTYPE_BF16;
        assert_eq!(attn_train(&t, 55, AttnPart::Fwd, true).bytes, 1.5 * qb + 2.0 * kvb + stat);
        let b = attn_train(&t, 55, AttnPart::BwdDq, false).flops + attn_train(&t, 55, AttnPart::BwdDkv, false).flops;
        assert_eq!(b, 3.5 * f.flops);
    }
}
