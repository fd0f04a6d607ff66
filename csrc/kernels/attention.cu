// attention.cu: the paged KV cache write and paged attention (vLLM layout: caches of shape
// (num_blocks, kv_heads, block_size, head_dim)), for prefill and decode rows alike.
// CPU twins: src/ops/attention/cpu.rs kv_write (bit-exact: the same f32 division and E4M3 / BF16 /
// F16 rounding) and paged_attention (the same online softmax in f32, but keys are processed in
// tiles of CT_ATT_TILE and dot products are reduced across a warp, so results agree to
// rounding). One block per (query row, KV head): the decode kernel. Batches that are mostly
// prefill rows run attention_prefill.cu instead, which shares K/V tiles across rows (attention/cuda.rs
// picks). A decode batch of fewer (row, KV head) blocks than SMs splits each row's keys over
// several blocks (split-K) and ct_attention_merge combines them (the CPU twin does not split:
// equal to rounding). Not yet run on a GPU; src/ops/hostemu/blocks.rs runs it under host
// emulation against the CPU twin.
#include "common.cuh"

#define CT_ATT_TILE 32
#define CT_ATT_THREADS 128  // blockDim.x of ct_paged_attention (ATT_THREADS in kernels.rs)

__device__ __forceinline__ float ct_cache_load(const void* c, int dtype, int64_t i, float scale) {
  if (dtype == CT_DTYPE_U8) {
    return __fmul_rn(ct_e4m3_decode(static_cast<const uint8_t*>(c)[i]), scale);
  }
  return ct_load(c, dtype, i);
}

// Key and value d of KV head h of token t into the caches at slots[t] (ct_kv_write and
// ct_qk_rope_kv): U8 caches store e4m3_satfinite(x / scale).
__device__ __forceinline__ void ct_kv_store(const ct_kv_write_params& p, int64_t t, int h, int d, float k, float v) {
  const uint32_t slot = p.slots[t];
  const uint32_t blk = slot / static_cast<uint32_t>(p.block_size);
  const uint32_t off = slot % static_cast<uint32_t>(p.block_size);
  if (blk >= static_cast<uint32_t>(p.num_blocks)) {
    ct_set_error(p.err, CT_ERR_KV_SLOT);
    return;
  }
  const int64_t dst = ((static_cast<int64_t>(blk) * p.kv_heads + h) * p.block_size + off) * p.head_dim + d;
  const float kv[2] = {k, v};
  void* caches[2] = {p.k_cache, p.v_cache};
  const float scales[2] = {p.k_scale, p.v_scale};
#pragma unroll
  for (int w = 0; w < 2; w++) {
    if (p.dtype == CT_DTYPE_U8) {
      static_cast<uint8_t*>(caches[w])[dst] = static_cast<uint8_t>(ct_e4m3_encode_nan(__fdiv_rn(kv[w], scales[w])));
    } else {
      ct_store(caches[w], p.dtype, dst, kv[w]);
    }
  }
}

// One thread per (token, kv head, d) for keys and values.
extern "C" __global__ void ct_kv_write(ct_kv_write_params p) {
  const int64_t row = static_cast<int64_t>(p.kv_heads) * p.head_dim;
  const int64_t n = static_cast<int64_t>(p.tokens) * row;
  CT_GRID_LOOP(idx, n) {
    const int h = static_cast<int>((idx % row) / p.head_dim);
    ct_kv_store(p, idx / row, h, static_cast<int>(idx % p.head_dim), p.k[idx], p.v[idx]);
  }
}

// A layer's attention inputs in one launch: block (t, s) of 256 threads (NORM_THREADS in kernels.rs, as
// ct_rmsnorm: the same per-thread sums, so the same bits) takes query head s (s < heads) or
// KV head s - heads of token t: the head's RMSNorm in place (with a norm weight), its RoPE
// (ct_rope's pairs), and for a KV head its key and value into the caches (ct_kv_write's
// stores). Global writes of a thread are visible to the block after __syncthreads.
extern "C" __global__ void __launch_bounds__(256) ct_qk_rope_kv(ct_qk_rope_kv_params p) {
  CT_SHARED(float, scratch, 32);
  const int64_t t = blockIdx.x;
  const int s = blockIdx.y, D = p.kv.head_dim, half = D / 2;
  const bool query = s < p.heads;
  const int h = query ? s : s - p.heads;
  float* x = query ? p.q + (t * p.heads + h) * D : p.k + (t * p.kv.kv_heads + h) * D;
  const void* w = query ? p.q_norm : p.k_norm;
  if (w != nullptr) {
    float ss = 0.0f;
    for (int j = threadIdx.x; j < D; j += blockDim.x) ss = __fadd_rn(ss, __fmul_rn(x[j], x[j]));
    const float rstd = ct_rms_rstd(ss, D, p.eps, scratch);
    for (int j = threadIdx.x; j < D; j += blockDim.x) x[j] = __fmul_rn(__fmul_rn(x[j], rstd), ct_load(w, p.norm_dtype, j));
    __syncthreads();
  }
  for (int i = threadIdx.x; i < half; i += blockDim.x) ct_rope_pair(x, i, half, p.cos[t * half + i], p.sin[t * half + i]);
  if (query) return;
  __syncthreads();
  const float* v = p.kv.v + (t * p.kv.kv_heads + h) * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) ct_kv_store(p.kv, t, h, d, x[d], v[d]);
}

// The split's partial results (splits > 1): acc unnormalized, the running max and sum per head.
__device__ void ct_attention_part(const ct_attention_params& p, int t, int h0, int groups, int z, const float* acc,
                                  const float* mrun, const float* lrun) {
  const int D = p.head_dim;
  for (int i = threadIdx.x; i < groups * D; i += blockDim.x) {
    const int64_t h = h0 + i / D;
    p.part_acc[((t * static_cast<int64_t>(p.heads) + h) * p.splits + z) * D + i % D] = acc[i];
  }
  for (int g = threadIdx.x; g < groups; g += blockDim.x) {
    const int64_t at = ((t * static_cast<int64_t>(p.heads) + h0 + g) * p.splits + z) * 2;
    p.part_ml[at] = mrun[g];
    p.part_ml[at + 1] = lrun[g];
  }
}

// grid (num_tokens, kv_heads * splits), block 128 threads (4 warps). Dynamic shared memory:
//   q (groups * D) | acc (groups * D) | scores (groups * TILE) | m, l, corr (3 * groups) floats.
extern "C" __global__ void __launch_bounds__(CT_ATT_THREADS) ct_paged_attention(ct_attention_params p) {
  CT_DYNAMIC_SMEM(float, smem);
  const int t = blockIdx.x, kvh = blockIdx.y / p.splits, z = blockIdx.y % p.splits;
  const int D = p.head_dim, groups = p.heads / p.kv_heads;
  float* sq = smem;
  float* acc = sq + groups * D;
  float* scores = acc + groups * D;
  float* mrun = scores + groups * CT_ATT_TILE;
  float* lrun = mrun + groups;
  float* corr = lrun + groups;
  const int tid = threadIdx.x, lane = tid % CT_WARP, warp = tid / CT_WARP;
  const int nwarps = blockDim.x / CT_WARP;
  const int64_t row_stride = static_cast<int64_t>(p.heads) * D;
  const int64_t out0 = t * row_stride + static_cast<int64_t>(kvh) * groups * D;  // the group's first output

  // The sequence of row t: the last s with q_start[s] <= t.
  int lo = 0, hi = p.num_seqs;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (p.q_start[mid] <= static_cast<uint32_t>(t)) lo = mid; else hi = mid;
  }
  const int s = lo;
  const int64_t q0 = p.q_start[s], q_len = static_cast<int64_t>(p.q_start[s + 1]) - q0;
  const int64_t ctx = p.ctx_len[s];
  const int64_t pos = ctx - q_len + (t - q0);
  const int64_t n = pos + 1;
  if (q_len <= 0 || t - q0 >= q_len || pos < 0 || n > static_cast<int64_t>(p.max_blocks) * p.block_size) {
    if (tid == 0) ct_set_error(p.err, CT_ERR_ATTN_META);
    if (p.splits > 1) {
      // NaN partials: the merge writes NaN rows, as the unsplit kernel does.
      for (int i = tid; i < groups * D; i += blockDim.x) acc[i] = __uint_as_float(0x7FC00000u);
      for (int g = tid; g < groups; g += blockDim.x) mrun[g] = lrun[g] = __uint_as_float(0x7FC00000u);
      __syncthreads();
      ct_attention_part(p, t, kvh * groups, groups, z, acc, mrun, lrun);
      return;
    }
    for (int i = tid; i < groups * D; i += blockDim.x) ct_store(p.out, p.out_dtype, out0 + i, __uint_as_float(0x7FC00000u));
    return;
  }
  // This block's keys [k0, k1): split z of runs of ceil(n / splits) keys in whole tiles.
  const int64_t run = ((n + p.splits - 1) / p.splits + CT_ATT_TILE - 1) / CT_ATT_TILE * CT_ATT_TILE;
  const int64_t k0 = min(n, z * run), k1 = min(n, k0 + run);
  const uint32_t* table = p.block_tables + static_cast<int64_t>(s) * p.max_blocks;

  const float* q = p.q + t * row_stride + static_cast<int64_t>(kvh) * groups * D;
  for (int i = tid; i < groups * D; i += blockDim.x) {
    sq[i] = q[i];
    acc[i] = 0.0f;
  }
  for (int g = tid; g < groups; g += blockDim.x) {
    mrun[g] = -INFINITY;
    lrun[g] = 0.0f;
  }
  __syncthreads();

  for (int64_t j0 = k0; j0 < k1; j0 += CT_ATT_TILE) {
    const int jn = static_cast<int>(k1 - j0 < CT_ATT_TILE ? k1 - j0 : CT_ATT_TILE);
    // Scores: one warp per key, lanes over D.
    for (int j = warp; j < jn; j += nwarps) {
      const int64_t key = j0 + j;
      const uint32_t blk = table[key / p.block_size];
      if (blk >= static_cast<uint32_t>(p.num_blocks)) {
        if (lane == 0) ct_set_error(p.err, CT_ERR_ATTN_META);
        for (int g = lane; g < groups; g += CT_WARP) scores[g * CT_ATT_TILE + j] = __uint_as_float(0x7FC00000u);
        continue;
      }
      const int64_t base = ((static_cast<int64_t>(blk) * p.kv_heads + kvh) * p.block_size + key % p.block_size) * D;
      for (int g = 0; g < groups; g++) {
        float dot = 0.0f;
        for (int d = lane; d < D; d += CT_WARP) dot += sq[g * D + d] * ct_cache_load(p.k_cache, p.dtype, base + d, p.k_scale);
        dot = ct_warp_sum(dot);
        if (lane == 0) scores[g * CT_ATT_TILE + j] = dot * p.softmax_scale;
      }
    }
    __syncthreads();
    // Online softmax update, one thread per query head of the group.
    for (int g = tid; g < groups; g += blockDim.x) corr[g] = ct_online_softmax(scores + g * CT_ATT_TILE, jn, &mrun[g], &lrun[g]);
    __syncthreads();
    // acc = acc * corr + P . V, threads over (g, d).
    for (int i = tid; i < groups * D; i += blockDim.x) {
      const int g = i / D, d = i % D;
      float a = acc[i] * corr[g];
      for (int j = 0; j < jn; j++) {
        const int64_t key = j0 + j;
        const uint32_t blk = table[key / p.block_size];
        if (blk >= static_cast<uint32_t>(p.num_blocks)) continue;
        const int64_t base = ((static_cast<int64_t>(blk) * p.kv_heads + kvh) * p.block_size + key % p.block_size) * D;
        a += scores[g * CT_ATT_TILE + j] * ct_cache_load(p.v_cache, p.dtype, base + d, p.v_scale);
      }
      acc[i] = a;
    }
    __syncthreads();
  }
  if (p.splits > 1) {
    ct_attention_part(p, t, kvh * groups, groups, z, acc, mrun, lrun);
    return;
  }
  for (int i = tid; i < groups * D; i += blockDim.x) ct_store(p.out, p.out_dtype, out0 + i, acc[i] / lrun[i / D]);
}

// grid (num_tokens, heads), threads over head_dim; each thread weighs the splits itself.
extern "C" __global__ void ct_attention_merge(ct_attention_merge_params p) {
  const int64_t th = static_cast<int64_t>(blockIdx.x) * p.heads + blockIdx.y;
  const float* ml = p.part_ml + th * p.splits * 2;
  const float* acc = p.part_acc + th * p.splits * p.head_dim;
  float m = -INFINITY;
  for (int z = 0; z < p.splits; z++) m = fmaxf(m, ml[2 * z]);
  float l = 0.0f;
  for (int z = 0; z < p.splits; z++) l = __fadd_rn(l, __fmul_rn(ml[2 * z + 1], ct_exp_f32(__fsub_rn(ml[2 * z], m))));
  for (int d = threadIdx.x; d < p.head_dim; d += blockDim.x) {
    float a = 0.0f;
    for (int z = 0; z < p.splits; z++)
      a = __fadd_rn(a, __fmul_rn(acc[z * p.head_dim + d], ct_exp_f32(__fsub_rn(ml[2 * z], m))));
    ct_store(p.out, p.out_dtype, th * p.head_dim + d, a / l);
  }
}
