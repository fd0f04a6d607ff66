/*
 * colotrain_kernels.h: the C ABI between the Rust device layer (src/device/cuda.rs and
 * src/device/cuda/) and the CUDA code in csrc/.
 *
 * - One plain-data parameter struct per kernel (the .cu files of csrc/kernels). Each kernel takes its struct
 *   by value as its only argument, so the Rust side fills named fields instead of a positional
 *   argument list: the argument order is checked in one place (this file).
 * - The host-side CUTLASS launchers (csrc/cutlass), plain C functions.
 *
 * Rust bindings: src/device/cuda/ffi.rs, generated from this file by scripts/gen_bindings.sh
 * (bindgen, with compile-time layout assertions). build.rs refuses to build when this file's
 * hash differs from the one recorded in ffi.rs: rerun the script after editing this file.
 *
 * Conventions: row-major tensors; `rows` are the live rows (the engine's `m`), buffers may be
 * larger. Pointers are device addresses. Nothing in here has been run on a GPU yet.
 */
#ifndef COLOTRAIN_KERNELS_H
#define COLOTRAIN_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element types of float tensors (weights, caches). */
#define CT_DTYPE_F32 0
#define CT_DTYPE_BF16 1
#define CT_DTYPE_F16 2
/* FP8 E4M3 codes (KV caches): value = e4m3(code) * scale. */
#define CT_DTYPE_U8 3

/* Quantized weight formats (QTensor). */
#define CT_FORMAT_FP8 0
#define CT_FORMAT_NVFP4 1

/* Codes written (first error wins) into the device's error word by kernels that meet bad
 * input; the Rust side reads the word at every synchronization and turns it into an error. */
#define CT_ERR_TOKEN_ID 1    /* embedding: token id >= vocabulary size */
#define CT_ERR_GATHER_ROW 2  /* gather_rows: row index out of range */
#define CT_ERR_KV_SLOT 3     /* kv_write: cache slot outside the cache */
#define CT_ERR_TARGET 4      /* log_softmax_gather: target id >= vocabulary size */
#define CT_ERR_ATTN_META 5   /* paged_attention: inconsistent q_start / ctx_len / block table */

/* rmsnorm / add_rmsnorm / head_rmsnorm:
 *   if r: x += r (x is the residual stream, updated in place); y = x / sqrt(mean(x^2) + eps) * w,
 *   stored as y_dtype (F32, or BF16 rounded to nearest even: what a BF16 GEMM that reads it
 *   would round it to). head_rmsnorm runs it in place over rows of one head (y == x, F32,
 *   rows = m * heads, cols = D). */
typedef struct ct_rmsnorm_params {
  void* y;
  int32_t y_dtype;
  float* x;
  const float* r; /* NULL: plain rmsnorm */
  const void* w;  /* (cols), w_dtype */
  int32_t w_dtype;
  int32_t rows;
  int32_t cols;
  float eps;
} ct_rmsnorm_params;

/* cos/sin (rows, half) of angle = f32(pos * inv_freq[i]), evaluated in double. */
typedef struct ct_rope_table_params {
  const uint32_t* pos;
  const float* inv_freq;
  float* cos;
  float* sin;
  int32_t rows;
  int32_t half;
} ct_rope_table_params;

/* HF rotate_half RoPE in place on x (rows, heads * 2 * half). */
typedef struct ct_rope_params {
  float* x;
  const float* cos;
  const float* sin;
  int32_t rows;
  int32_t heads;
  int32_t half;
} ct_rope_params;

/* out (rows, cols) f32 = table[ids[i]], table (vocab, cols) of `dtype`. */
typedef struct ct_embedding_params {
  const void* table;
  int32_t dtype;
  int32_t vocab;
  const uint32_t* ids;
  float* out;
  int32_t rows;
  int32_t cols;
  uint32_t* err;
} ct_embedding_params;

/* out[i] = silu(gate[i]) * up[i] for i < n, stored as out_dtype (F32, or BF16 rounded to
 * nearest even: what a BF16 GEMM that reads it would round it to). */
typedef struct ct_swiglu_params {
  const float* gate;
  const float* up;
  void* out;
  int32_t out_dtype;
  int64_t n;
} ct_swiglu_params;

/* dst (rows, cols) = src[idx[i]], src (src_rows, cols). */
typedef struct ct_gather_rows_params {
  const float* src;
  const uint32_t* idx;
  float* dst;
  int32_t rows;
  int32_t cols;
  int32_t src_rows;
  uint32_t* err;
} ct_gather_rows_params;

/* dst[idx[i]] (cols) += src[i] (cols) for i < rows, dst (dst_rows, cols). The idx are distinct
 * (every destination row gets at most one source row), so no two threads add to one value. */
typedef struct ct_scatter_add_rows_params {
  const float* src;
  const uint32_t* idx;
  float* dst;
  int32_t rows;
  int32_t cols;
  int32_t dst_rows;
  uint32_t* err;
} ct_scatter_add_rows_params;

/* y_j (rows, cols_j) += bias_j (cols_j) of `dtype` for j = 0, 1, 2 (a segment of cols_j = 0 is
 * none, its pointers NULL): the biases of up to three projections of one input (q, k, v) in
 * one launch. */
typedef struct ct_add_bias_params {
  float* y0;
  float* y1;
  float* y2;
  const void* bias0;
  const void* bias1;
  const void* bias2;
  int32_t cols0;
  int32_t cols1;
  int32_t cols2;
  int32_t dtype;
  int32_t rows;
} ct_add_bias_params;

/* dst (rows, cols) (+)= src (rows, cols) * g_row * g_col: the output of an NVFP4 GEMM run with
 * alpha 1 scaled by its operands' global scales, each by ct_quant_nvfp4's rule: fixed if > 0,
 * else amax / 2688 (1 when amax is 0) from the amax bits (row side: row_amax[row] when per_row,
 * else row_amax[0]; column side: col_fixed if > 0, else col_amax[0]). The learner's W4A4 linear
 * on CUTLASS, whose activation scales are per row or on the device (no scalar alpha known to the
 * host). With rht (cols % 16 == 0), each 16-column block of the scaled values is then rotated
 * back by the inverse RHT (ct_quant_nvfp4's unrotate: H/4, then the signs): the learner's
 * backward, whose GEMMs run in the rotated domain of its operands' codes.
 * With scalars (not NULL), one thread writes scalars[0] = g_row * g_col (per_row 0; src, dst,
 * rows and cols unused) and scalars[1] = accumulate (1 or 0): the alpha and beta of a cuBLASLt
 * GEMM in device pointer mode, which then applies the scales in its epilogue (the learner's
 * forward, whose product needs no rotation back). */
typedef struct ct_nvfp4_scale_out_params {
  const float* src;
  float* dst;
  int32_t rows;
  int32_t cols;
  const uint32_t* row_amax;
  int32_t per_row;
  float row_fixed;
  const uint32_t* col_amax;
  float col_fixed;
  int32_t accumulate;
  int32_t rht;
  float signs[16];
  float* scalars;
} ct_nvfp4_scale_out_params;

/* y[i] = dtype(x[i]) (round to nearest even) for i < n; dtype BF16 or F16. With row_amax (not
 * NULL), x[i] is first multiplied by the NVFP4 global scale of row i / cols (amax / 2688, 1 when
 * amax is 0, ct_quant_nvfp4's rule): the NVFP4 learner's weight gradient folds its input's
 * per-token scales into the output gradient before the BF16 rounding. */
typedef struct ct_cast_params {
  const float* x;
  void* y;
  int32_t dtype;
  int64_t n;
  const uint32_t* row_amax;
  int64_t cols;
} ct_cast_params;

/* out[i] = mean + std * N(0, 1) from Philox (key seed, counter (i / 2, stream)), for the device
 * check's random inputs (not the CPU's crate::rand::Stream sequence). */
typedef struct ct_fill_normal_params {
  void* out;
  int32_t dtype;
  int64_t n;
  uint64_t seed;
  uint64_t stream;
  float mean;
  float std;
} ct_fill_normal_params;

/* Writes k, v (tokens, kv_heads * head_dim) f32 into the caches (num_blocks, kv_heads,
 * block_size, head_dim) at slots[t] = block * block_size + offset. U8 caches store
 * e4m3_satfinite(x / scale). */
typedef struct ct_kv_write_params {
  const float* k;
  const float* v;
  void* k_cache;
  void* v_cache;
  int32_t dtype;
  float k_scale;
  float v_scale;
  const uint32_t* slots;
  int32_t tokens;
  int32_t kv_heads;
  int32_t block_size;
  int32_t head_dim;
  int32_t num_blocks;
  uint32_t* err;
} ct_kv_write_params;

/* A layer's attention inputs, ready, in one launch (grid (tokens, heads + kv.kv_heads) of 256
 * threads): q (tokens, heads * D) and k (tokens, kv_heads * D), D = kv.head_dim, normalized per
 * head in place where q_norm / k_norm (D values of norm_dtype) are given (Qwen3's q_norm and
 * k_norm; ct_rmsnorm's arithmetic), rotated by RoPE (cos, sin (tokens, D/2); ct_rope's), then
 * the keys and kv.v written into the caches as ct_kv_write writes them (kv.k unused). */
typedef struct ct_qk_rope_kv_params {
  ct_kv_write_params kv;
  float* q;
  float* k;
  const void* q_norm;
  const void* k_norm;
  int32_t norm_dtype;
  float eps;
  const float* cos;
  const float* sin;
  int32_t heads;
} ct_qk_rope_kv_params;

/* Paged attention (prefill and decode rows alike): row t of sequence s (rows q_start[s] ..
 * q_start[s+1]) sits at position ctx_len[s] - q_len + (t - q_start[s]) and attends causally
 * to the cached positions 0..=that through block_tables (num_seqs, max_blocks). Online softmax
 * in f32; GQA maps query head h to KV head h / (heads / kv_heads). The decode kernel
 * (ct_paged_attention) may split a row's keys over `splits` blocks (split-K, as
 * flash-decoding: a decode batch of few rows fills the GPU): split z takes the z-th run of
 * ceil(n / splits) keys rounded up to whole tiles, and writes its unnormalized output to
 * part_acc (num_tokens, heads, splits, head_dim) and its running max and sum to part_ml
 * (num_tokens, heads, splits, 2); ct_attention_merge then writes out. splits = 1: out directly
 * (part_* unused; the prefill kernels take only 1). */
typedef struct ct_attention_params {
  const float* q;
  const void* k_cache;
  const void* v_cache;
  int32_t dtype;
  float k_scale;
  float v_scale;
  const uint32_t* q_start;
  const uint32_t* ctx_len;
  const uint32_t* block_tables;
  int32_t num_seqs;
  int32_t num_tokens;
  int32_t max_blocks;
  int32_t block_size;
  int32_t num_blocks;
  int32_t heads;
  int32_t kv_heads;
  int32_t head_dim;
  float softmax_scale;
  void* out;         /* (num_tokens, heads * head_dim) in out_dtype */
  int32_t out_dtype; /* F32, or BF16 / F16 rounded as ct_cast rounds (a GEMM's input) */
  uint32_t* err;
  float* part_acc;
  float* part_ml;
  int32_t splits;
} ct_attention_params;

/* The merge of split-K decode attention (grid (num_tokens, heads)): with M = max_z m_z and
 * w_z = exp(m_z - M), out = sum_z w_z acc_z / sum_z w_z l_z, the splits in order. */
typedef struct ct_attention_merge_params {
  const float* part_acc;
  const float* part_ml;
  void* out;
  int32_t out_dtype;
  int32_t num_tokens;
  int32_t heads;
  int32_t head_dim;
  int32_t splits;
} ct_attention_merge_params;

/* out[i] = log_softmax(logits[i] / temperature)[targets[i]] (normalizer summed in double). */
typedef struct ct_logprob_params {
  const float* logits;
  const uint32_t* targets;
  float* out;
  int32_t rows;
  int32_t vocab;
  float temperature;
  uint32_t* err;
} ct_logprob_params;

/* One row of a sampling call. truncated = 0: greedy or no top-k / top-p, drawn by ct_sample;
 * truncated = 1: drawn by ct_sample_topk (which skips the others, and ct_sample these). */
typedef struct ct_sample_row {
  uint64_t seed;
  uint64_t request;
  float temperature; /* 0: greedy */
  uint32_t sample;
  uint32_t position;
  uint32_t truncated;
  uint32_t top_k; /* 0: off */
  float top_p;    /* 1: off */
} ct_sample_row;

/* Candidates ct_sample_topk sorts per row: rows that need more (top_k above it, or a top-p
 * prefix longer than it) get host_rows[row] = 1 and are drawn on the host by the CPU twin. */
#define CT_TOPK_CAP 2048

typedef struct ct_sample_params {
  const float* logits;
  const ct_sample_row* params;
  int32_t rows;
  int32_t vocab;
  uint32_t* tokens;
  float* logprobs;
  uint32_t* host_rows; /* ct_sample_topk: 1 = left to the host, 0 = drawn (truncated rows only) */
} ct_sample_params;

/* *amax_bits = max over i < n of the |x| bit pattern (atomicMax; the caller zeroes it first).
 * With rht, every 16-value block is rotated (random Hadamard transform) before. NaN
 * propagates (its bit pattern is above every finite one). row_k > 0 (a multiple of 16): one
 * amax per row of row_k values, into amax_bits[row] (the learner's per-token scales). */
typedef struct ct_amax_params {
  const void* x;
  int32_t dtype;
  int64_t n;
  int32_t rht;
  float signs[16];
  uint32_t* amax_bits;
  int32_t row_k;
} ct_amax_params;

/* FP8 E4M3 per-tensor quantization: scale = fixed_scale if > 0, else amax / 448 (1 when amax
 * is 0), amax read from *amax_bits; code = e4m3_satfinite(x / scale). Writes codes (if not
 * NULL), the dequantized values e4m3(code) * scale (if dequant is not NULL) and the scale (if
 * scale_out is not NULL). With up (not NULL, x f32): the values quantized are
 * SwiGLU(x, up) = silu(x) * up, ct_swiglu's arithmetic, read from the gate and up rows. */
typedef struct ct_quant_fp8_params {
  const void* x;
  int32_t dtype;
  int64_t n;
  const uint32_t* amax_bits;
  float fixed_scale;
  uint8_t* codes;
  float* dequant;
  float* scale_out;
  const float* up;
} ct_quant_fp8_params;

/* NVFP4 quantization of n values (n % 16 == 0, blocks of 16 consecutive values), the exact
 * arithmetic of src/quant/nvfp4.rs: global = fixed_global if > 0, else amax / 2688 (1 when amax
 * is 0); optional RHT (signs) and stochastic rounding (Philox key sr_seed, counter (flat index
 * of the value, 0x5352, 0)). Writes packed codes (n/2 bytes, even element in the low nibble),
 * E4M3 block scales (n/16 bytes), the dequantized values (if not NULL) and the global scale
 * (if global_out is not NULL). With up (not NULL, x f32), as ct_quant_fp8: SwiGLU(x, up). */
typedef struct ct_quant_nvfp4_params {
  const void* x;
  int32_t dtype;
  int64_t n;
  const uint32_t* amax_bits;
  float fixed_global;
  int32_t rht;
  float signs[16];
  int32_t stochastic;
  uint64_t sr_seed;
  uint8_t* packed;
  uint8_t* scales;
  float* dequant;
  float* global_out;
  int32_t row_k;    /* > 0: one global per row of row_k values, from amax_bits[row] */
  int32_t unrotate; /* with rht: dequant rotated back (inverse RHT), the learner's domain */
  const float* up;
} ct_quant_nvfp4_params;

/* Decodes n quantized weight values. out_dtype F32: the exact CPU values (FP8: e4m3 * scale;
 * NVFP4: f32(q * bs) * scale). out_dtype BF16: the unit values e4m3 / q * bs, exact in BF16;
 * the tensor scale is then applied by the GEMM (alpha). */
typedef struct ct_dequant_params {
  const uint8_t* codes;
  const uint8_t* scales;
  int32_t format;
  int64_t n;
  float scale;
  void* out;
  int32_t out_dtype;
} ct_dequant_params;

/* y (m, n) f32 = alpha * dec(a) * dec(w)^T for NVFP4 activations and weights, reading their
 * codes (gemm_w4a4.cu: the W4A4 GEMM of decode steps on Hopper, which has no FP4 tensor cores).
 * dec: each code's E2M1 value times its 16-value block's E4M3 scale (linear layout, one row of
 * k/16 per tensor row); alpha: the product of the two tensor scales. Needs m <= 64,
 * n % 32 == 0, k % 128 == 0 and 16-byte aligned code rows.
 * Split-K (splits > 1, grid (n/32, splits)): K's 128-value chunks are cut into `splits`
 * contiguous ranges of ceil(chunks / splits); block (x, s) writes its range's sum, without
 * alpha, to part (splits, m, n), and ct_gemm_w4a4_merge (same parameters) then writes
 * y = alpha * (part[0] + part[1] + ...) in split order. splits = 1: y directly, part unused. */
typedef struct ct_gemm_w4a4_params {
  const uint8_t* a_codes;  /* (m, k/2), two codes a byte, the first in the low nibble */
  const uint8_t* a_scales; /* (m, k/16) */
  const uint8_t* w_codes;  /* (n, k/2) */
  const uint8_t* w_scales; /* (n, k/16) */
  float* y;                /* (m, n) */
  int32_t m;
  int32_t n;
  int32_t k;
  float alpha;
  float* part;             /* (splits, m, n) when splits > 1 */
  int32_t splits;
} ct_gemm_w4a4_params;

/* Rewrites NVFP4 block scales (rows, sf_cols) from the linear layout into the tiled layout of
 * block-scaled tensor-core GEMMs (CUTLASS Sm1xxBlkScaledConfig, cuBLASLt VEC16_UE4M3): tiles
 * of 128 rows x 4 scale columns (512 bytes), K tiles innermost; inside a tile, row r and
 * column c sit at (r % 32) * 16 + (r / 32) * 4 + c. Padding is written as 0. */
typedef struct ct_swizzle_sf_params {
  const uint8_t* src;
  uint8_t* dst;
  int32_t rows;
  int32_t sf_cols;
  int32_t padded_rows;
  int32_t padded_cols;
} ct_swizzle_sf_params;

/* ---- CUTLASS launchers (host functions; csrc/cutlass/) ---------------------------------- */

/* ---- grad.cu: the backward kernels of the layers around the GEMMs ---------------------------- */

/* Training RMSNorm: y (rows, cols) = x r w with r = (mean_j x_j^2 + eps)^(-1/2) saved in
 * rstd (rows); w (cols) of w_dtype (the compute weights' dtype); y stored as y_dtype (F32, or
 * BF16 rounded to nearest even for a consumer that rounds it so anyway). */
typedef struct ct_rmsnorm_train_params {
  const float* x;
  const void* w;
  int32_t w_dtype;
  void* y;
  int32_t y_dtype;
  float* rstd;
  int32_t rows;
  int32_t cols;
  float eps;
} ct_rmsnorm_train_params;

/* RMSNorm backward (ct_rmsnorm_bwd, one block per row): dx (+)= r w dy - (r^3 / cols) x
 * sum_j w_j dy_j x_j. The weight gradient dw += sum_rows dy x r in the fixed order of
 * ops::reduction_chunk_rows (the CPU's too): more rows than chunk_rows are summed in chunks,
 * ct_rmsnorm_dw (grid (column blocks, chunks)) writing partial (chunks, cols), chunk c summed
 * from 0 over its rows in order, then ct_col_sum adds the chunks onto dw in order; one chunk
 * (partial NULL, chunk_rows = rows) adds the rows onto dw in order. (One thread per column
 * over every row would leave all but cols / 128 of the SMs idle.) */
typedef struct ct_rmsnorm_bwd_params {
  const float* dy;
  const float* x;
  const void* w;
  int32_t w_dtype;
  const float* rstd;
  float* dx;
  float* dw;
  float* partial;
  int32_t rows;
  int32_t cols;
  int32_t accumulate;
  int32_t chunk_rows;
} ct_rmsnorm_bwd_params;

/* SwiGLU backward over n values: s = sigmoid(g); du = da g s; dg = da u s (1 + g (1 - s)),
 * dg and du stored as out_dtype (F32, or BF16 rounded to nearest even: what the BF16 GEMMs of
 * the gate and up projections' gradients that read them would round them to). */
typedef struct ct_swiglu_bwd_params {
  const float* da;
  const float* g;
  const float* u;
  void* dg;
  void* du;
  int32_t out_dtype;
  int64_t n;
} ct_swiglu_bwd_params;

/* Column sums of x (rows, cols), grid (column blocks, chunks of chunk_rows rows): partial
 * (chunks, cols) = each chunk summed from 0 in row order (out unused); partial NULL (one chunk,
 * chunk_rows = rows): out (cols) += the rows in order. A bias gradient runs the first, then the
 * second over the partials (ops::reduction_chunk_rows: the CPU's order too). */
typedef struct ct_col_sum_params {
  const float* x;
  float* out;
  float* partial;
  int32_t rows;
  int32_t cols;
  int32_t chunk_rows;
} ct_col_sum_params;

/* Embedding backward: dtable[ids[t]] (cols) += dx[t] for t in order (one thread per column:
 * deterministic with repeated ids), skipping ids equal to `skip` when has_skip (a padding
 * index); an id >= vocab sets CT_ERR_TOKEN_ID. */
typedef struct ct_embed_bwd_params {
  const float* dx;
  const uint32_t* ids;
  float* dtable;
  int32_t tokens;
  int32_t cols;
  int32_t vocab;
  uint32_t skip;
  int32_t has_skip;
  uint32_t* err;
} ct_embed_bwd_params;

/* ---- attention_train.cu: causal GQA attention for training, over packed sequences ---------- */

/* Rows cu[b] .. cu[b + 1] are sequence b (num_seqs + 1 offsets, cu[num_seqs] = tokens); query
 * head h reads KV head h / (heads / kv_heads); q, o, dout, dq (tokens, heads * head_dim);
 * k, v, dk, dv (tokens, kv_heads * head_dim); lse, delta (tokens, heads). head_dim <= 256.
 * ct_attn_fwd (grid tokens x heads): o = softmax(scale q k^T, causal) v, lse saved.
 * ct_attn_bwd_dq (grid tokens x heads): delta = rowsum(dout o); dq = scale dS k with
 *   dS = P (dout v^T - delta).
 * ct_attn_bwd_dkv (grid tokens x kv_heads, after ct_attn_bwd_dq): dk = scale dS^T q,
 *   dv = P^T dout, summed over the query heads of the group and the later rows in order. */
typedef struct ct_attn_train_params {
  const float* q;
  const float* k;
  const float* v;
  const float* out;
  const float* dout;
  void* o;         /* the forward's output, in o_dtype */
  int32_t o_dtype; /* F32 (the backward's out), or BF16 / F16 rounded as ct_cast rounds */
  float* lse;
  float* dq;
  float* dk;
  float* dv;
  float* delta;
  const uint32_t* cu;
  int32_t num_seqs;
  int32_t tokens;
  int32_t heads;
  int32_t kv_heads;
  int32_t head_dim;
  float scale;
} ct_attn_train_params;

/* ---- lm_head.cu: the fused LM-head loss, one chunk of rows at a time ----------------------- */

/* One chunk of the fused loss: z (rows, vocab) holds the chunk's logits h.Wh^T.
 * ct_lm_stats: z *= inv_t in place; lse[r] = log sum_j exp(z_rj); logp[r] = z[r, y_r] - lse[r];
 *   entropy[r] = lse[r] - sum_j softmax_rj * z_rj (logp / entropy may be NULL).
 * ct_lm_dz (after ct_lm_stats): loss[r] = -c_r (z[r, y_r] - lse_r) (+ c_r sum_i q_ri (z[r, id_ri]
 *   - lse_r) with centering), then z[r] = dz_r = (c_r / T) (softmax_r - e_{y_r}) (centering:
 *   (c_r / T) (q~_r - e_{y_r})), the gradient of the loss term in the logits.
 * One pass (coef_den != NULL): ct_lm_stats also writes the coefficient the objective gives
 *   the row at ratio 1 from its own log-prob, in double then rounded to float as
 *   src/objective/{opd,sft}.rs do: w = 1 / coef_den[r] (0 where coef_den[r] is 0),
 *   coef_out[r] = w ((coef_teacher[r] - logp_r) + coef_offset) (OPD, seed 000 Eq. 1) or w (SFT,
 *   coef_teacher NULL), which the host then gives ct_lm_dz as its coef. With coef_adv (GRPO or
 *   REINFORCE with TIS, seed 004 Eq. 3, as src/objective/grpo.rs's base at rho = 1; coef_teacher
 *   NULL): v = fmin(exp(logp_r - coef_sampler[r]), coef_cap), rho = exp(logp_r - logp_r) (1, or
 *   NaN for a log-prob that is not finite, as the host's), coef_out[r] = ((w v) coef_adv[r]) rho
 *   (never clipped at rho = 1). exp is the device's double exp (within 1 ulp; the host's libm
 *   exp may differ from it in the last bit, so a coefficient may differ from the host's in its
 *   last f32 bit, rarely; the simulator calls the same libm exp as the host's objective: the
 *   same bits). coef_adv must be 8-byte aligned. */
typedef struct ct_lm_params {
  float* z;
  const uint32_t* targets;
  int32_t rows;
  int32_t vocab;
  float inv_t;
  float* lse;
  float* logp;
  float* entropy;
  const float* coef;
  int32_t center_k;            /* 0: no centering */
  const uint32_t* center_ids;  /* (rows, center_k) */
  const float* center_probs;   /* (rows, center_k) */
  float* loss;
  uint32_t* err;
  const uint32_t* coef_den;    /* (rows) or NULL: no coefficient written */
  const float* coef_teacher;   /* (rows) or NULL */
  double coef_offset;
  float* coef_out;             /* (rows) */
  const float* coef_sampler;   /* (rows) the sampler's log-probs, with coef_adv */
  const double* coef_adv;      /* (rows) advantages, or NULL: no TIS */
  double coef_cap;             /* TIS cap C */
  void* dz_bf16;               /* (rows, vocab) or NULL: ct_lm_dz writes dz over z; else dz
                                  rounded to BF16 here (the head's GEMM operand; no centering),
                                  z left as it is */
} ct_lm_params;

/* ---- optimizer.cu: the optimizer step on the device ------------------------------------- */

/* One piece of the multi-tensor optimizer: elements [start, start + len) of the flat vectors,
 * all of tensor `tensor` (its amax slot). One block per chunk. */
/* One chunk of the multi-tensor step: values [start, start + len) of the flat master, moments
 * and gradient, all in parameter `tensor`, whose compute weights for this chunk start at
 * `compute` (the tensor's own buffer, offset to the chunk; NULL: none written). */
typedef struct ct_opt_chunk {
  int64_t start;
  int32_t len;
  int32_t tensor;
  void* compute;
} ct_opt_chunk;

/* Sum of g[i]^2 over [0, n) in f64, deterministic: block b sums elements
 * [b * per_block, (b + 1) * per_block) into partial[b] (ct_sum_sq); then one block sums
 * partial[0 .. blocks) into out[0] (ct_sum_sq_finish). Fixed order for a fixed launch shape. */
typedef struct ct_sum_sq_params {
  const float* g;
  int64_t n;
  int64_t per_block;
  double* partial; /* (blocks) */
  int32_t blocks;
  double* out;     /* (1) */
} ct_sum_sq_params;

/* One step of AdamW (torch.optim.AdamW, single-tensor semantics) or SGD on the FP32 master,
 * the f32 operations of src/ops/optim/cpu.rs in the same order: grad *= clip; SGD:
 * g += wd * p, p -= lr * g; AdamW: p *= decay, m = b1 m + omb1 g, v = b2 v + (omb2 g) g,
 * p -= (step_size m) / (sqrt(v) / bc2_sqrt + eps). Then the compute weights are written from
 * the new master (rounded to compute_dtype, into each chunk's `compute`: the compute weights
 * are the parameters' own tensors, not one flat buffer) and, while they are, each tensor's amax of them
 * (max |w| as f32 bits, atomicMax into amax_bits[tensor], which the caller zeroed). */
typedef struct ct_optim_params {
  float* master;          /* (n) */
  float* m;               /* (n), AdamW only */
  float* v;               /* (n), AdamW only */
  float* grad;            /* (n), scaled by clip in place */
  int32_t compute_dtype;  /* of every chunk's compute weights */
  const ct_opt_chunk* chunks;
  int32_t num_chunks;
  uint32_t* amax_bits;    /* (tensors), or NULL */
  int32_t adamw;          /* 1: AdamW, 0: SGD */
  float clip;
  float lr;
  float wd;
  float decay;
  float b1;
  float b2;
  float omb1;
  float omb2;
  float eps;
  float step_size;
  float bc2_sqrt;
} ct_optim_params;

/* d (m, n) f32 row-major = alpha * a (m, k) . b (n, k)^T, FP32 accumulation.
 * FP8: a, b are E4M3 codes, row-major with k contiguous; sfa = sfb = NULL.
 * NVFP4: a, b are packed E2M1 (k/2 bytes per row); sfa, sfb the swizzled E4M3 block scales. */
typedef struct ct_gemm_lp_args {
  const void* a;
  const void* b;
  const void* sfa;
  const void* sfb;
  float* d;
  int32_t m;
  int32_t n;
  int32_t k;
  float alpha;
} ct_gemm_lp_args;

/* Each launcher returns 0 on success, else a cutlass::Status code (or -1 when the problem
 * shape is not supported). With workspace_bytes != NULL it only writes the workspace size
 * (nothing is launched); otherwise it runs on `stream` (a CUstream / cudaStream_t) with
 * `workspace` (device memory of that size, or NULL when 0). */
int ct_fp8_gemm_sm90a(const ct_gemm_lp_args* args, void* workspace, size_t* workspace_bytes, void* stream);
int ct_fp8_gemm_sm100a(const ct_gemm_lp_args* args, void* workspace, size_t* workspace_bytes, void* stream);
int ct_nvfp4_gemm_sm100a(const ct_gemm_lp_args* args, void* workspace, size_t* workspace_bytes, void* stream);
/* Bytes of the swizzled scale tensors CUTLASS expects for an (m, n, k) NVFP4 problem. */
void ct_nvfp4_sf_bytes_sm100a(int32_t m, int32_t n, int32_t k, size_t* sfa_bytes, size_t* sfb_bytes);

#ifdef __cplusplus
}
#endif

#endif /* COLOTRAIN_KERNELS_H */
