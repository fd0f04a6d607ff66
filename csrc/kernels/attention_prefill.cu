// attention_prefill.cu: flash-style causal attention for prefill rows over the paged caches,
// with the parameters and results of ct_paged_attention (attention.cu). One block per (tile of
// up to R query rows of one sequence, KV head). Each key / value tile of the sequence is
// loaded into shared memory once and used by all R rows x G query heads of the block, where
// ct_paged_attention reloads it for every row. So a prefill of T rows reads each cached key
// about T / R times, not T times.
//   R = max(1, QV / G) with QV = 64 query vectors per block (32 when head_dim > 128);
//   grid.x = num_tokens / R + num_seqs, an upper bound on the tiles; block b finds its
//   (sequence, first row) by walking q_start, and blocks past the last tile exit.
// CPU twin: src/ops/attention/cpu.rs paged_attention, to rounding. This kernel differs from it in:
//   - online softmax in f32 over tiles of CT_PF_KEYS keys (CPU: KCHUNK);
//   - dot products summed in d order by one thread;
//   - a tile whose first row has no valid position (ctx_len < q_len) is all NaN (the decode
//     kernel NaNs only the bad rows); both raise CT_ERR_ATTN_META.
// CUDA cores: the kernel for F32, F16 and FP8 caches. A BF16 cache's prefill runs
// ct_prefill_attention_tc (below, the tensor cores). Not yet run on a GPU;
// src/ops/hostemu/blocks.rs runs it under host emulation against the CPU twin.
#include "attention_tc.cuh"

#define CT_PF_THREADS 128  // blockDim.x (PF_THREADS in kernels.rs)
#define CT_PF_KEYS 32      // keys per shared-memory tile (PF_KEYS in kernels.rs)
#define CT_PF_PS (CT_PF_KEYS + 1)  // row stride of the score tile (padded: no bank conflicts)

// Query vectors per block and rows per tile; kernels.rs prefill_shape computes the same.
__device__ __forceinline__ int ct_pf_qv(int head_dim) { return head_dim > 128 ? 32 : 64; }
__device__ __forceinline__ int ct_pf_rows(int head_dim, int groups) { return max(1, ct_pf_qv(head_dim) / groups); }

// This block's tile: the blockIdx.x-th of the sequences' tiles of R rows, in order (its
// sequence, or -1 past the last tile, and its first row). One thread walks q_start.
__device__ __forceinline__ void ct_pf_find_tile(const ct_attention_params& p, int R, int* seq, int* row0) {
  int b = blockIdx.x;
  *seq = -1;
  *row0 = 0;
  for (int s = 0; s < p.num_seqs; s++) {
    const int q_len = static_cast<int>(p.q_start[s + 1]) - static_cast<int>(p.q_start[s]);
    const int tiles = q_len > 0 ? (q_len + R - 1) / R : 0;
    if (b < tiles) {
      *seq = s;
      *row0 = static_cast<int>(p.q_start[s]) + b * R;
      return;
    }
    b -= tiles;
  }
}

// Dynamic shared memory (floats), QVm = max(QV, groups), KD = head_dim + 1 (padded key rows):
//   q (QVm * D) | acc (QVm * D) | k (KEYS * KD) | v (KEYS * D) | p (QVm * (KEYS + 1)) | m, l, corr (3 * QVm)
extern "C" __global__ void __launch_bounds__(CT_PF_THREADS) ct_prefill_attention(ct_attention_params p) {
  CT_DYNAMIC_SMEM(float, smem);
  CT_SHARED_VAR(int, tile_seq);
  CT_SHARED_VAR(int, tile_row0);
  const int D = p.head_dim, G = p.heads / p.kv_heads, kvh = blockIdx.y;
  const int R = ct_pf_rows(D, G), QVm = max(ct_pf_qv(D), G), KD = D + 1;
  const int tid = threadIdx.x;
  if (tid == 0) ct_pf_find_tile(p, R, &tile_seq, &tile_row0);
  __syncthreads();
  const int s = tile_seq, row0 = tile_row0;
  if (s < 0) return;
  float* sq = smem;
  float* acc = sq + QVm * D;
  float* sk = acc + QVm * D;
  float* sv = sk + CT_PF_KEYS * KD;
  float* sp = sv + CT_PF_KEYS * D;
  float* mrun = sp + QVm * CT_PF_PS;
  float* lrun = mrun + QVm;
  float* corr = lrun + QVm;

  const int64_t q0 = p.q_start[s], q_len = static_cast<int64_t>(p.q_start[s + 1]) - q0;
  const int nq = static_cast<int>(min(static_cast<int64_t>(R), q0 + q_len - row0));  // rows of this tile
  const int nv = nq * G;                                                               // query vectors
  const int64_t ctx = p.ctx_len[s];
  const int64_t pos0 = ctx - q_len + (row0 - q0);  // position of the tile's first row
  const int64_t n_keys = pos0 + nq;                // keys 0 .. position of its last row
  const int64_t row_stride = static_cast<int64_t>(p.heads) * D;
  if (pos0 < 0 || n_keys > static_cast<int64_t>(p.max_blocks) * p.block_size) {
    if (tid == 0) ct_set_error(p.err, CT_ERR_ATTN_META);
    for (int i = tid; i < nv * D; i += blockDim.x) {
      const int v = i / D, r = v / G, g = v % G;
      ct_store(p.out, p.out_dtype, (row0 + r) * row_stride + static_cast<int64_t>(kvh * G + g) * D + i % D,
               __uint_as_float(0x7FC00000u));
    }
    return;
  }
  const uint32_t* table = p.block_tables + static_cast<int64_t>(s) * p.max_blocks;
  for (int i = tid; i < nv * D; i += blockDim.x) {
    const int v = i / D, r = v / G, g = v % G;
    sq[i] = p.q[(row0 + r) * row_stride + static_cast<int64_t>(kvh * G + g) * D + i % D];
    acc[i] = 0.0f;
  }
  for (int v = tid; v < nv; v += blockDim.x) {
    mrun[v] = -INFINITY;
    lrun[v] = 0.0f;
  }

  for (int64_t j0 = 0; j0 < n_keys; j0 += CT_PF_KEYS) {
    const int jn = static_cast<int>(n_keys - j0 < CT_PF_KEYS ? n_keys - j0 : CT_PF_KEYS);
    __syncthreads();  // the previous tile's readers are done (and q, m, l are written)
    for (int i = tid; i < jn * D; i += blockDim.x) {
      const int j = i / D, d = i % D;
      const int64_t key = j0 + j;
      const uint32_t blk = table[key / p.block_size];
      float kv = __uint_as_float(0x7FC00000u), vv = kv;
      if (blk < static_cast<uint32_t>(p.num_blocks)) {
        const int64_t at = ((static_cast<int64_t>(blk) * p.kv_heads + kvh) * p.block_size + key % p.block_size) * D + d;
        kv = p.dtype == CT_DTYPE_U8 ? __fmul_rn(ct_e4m3_decode(static_cast<const uint8_t*>(p.k_cache)[at]), p.k_scale) : ct_load(p.k_cache, p.dtype, at);
        vv = p.dtype == CT_DTYPE_U8 ? __fmul_rn(ct_e4m3_decode(static_cast<const uint8_t*>(p.v_cache)[at]), p.v_scale) : ct_load(p.v_cache, p.dtype, at);
      } else if (d == 0) {
        ct_set_error(p.err, CT_ERR_ATTN_META);
      }
      sk[j * KD + d] = kv;
      sv[j * D + d] = vv;
    }
    __syncthreads();
    // Scores, causal: query vector v (row r) sees keys up to its position pos0 + r.
    for (int i = tid; i < nv * jn; i += blockDim.x) {
      const int v = i / jn, j = i % jn;
      float sc = -INFINITY;
      if (j0 + j <= pos0 + v / G) {
        float dot = 0.0f;
        for (int d = 0; d < D; d++) dot += sq[v * D + d] * sk[j * KD + d];
        sc = dot * p.softmax_scale;
      }
      sp[v * CT_PF_PS + j] = sc;
    }
    __syncthreads();
    // Online softmax update, one thread per query vector; masked keys get weight 0.
    // The first tile holds key 0, in every row's window: the running max is finite from then on.
    for (int v = tid; v < nv; v += blockDim.x) corr[v] = ct_online_softmax(sp + v * CT_PF_PS, jn, &mrun[v], &lrun[v]);
    __syncthreads();
    // acc = acc * corr + P . V, threads over (v, d).
    for (int i = tid; i < nv * D; i += blockDim.x) {
      const int v = i / D, d = i % D;
      float a = acc[i] * corr[v];
      for (int j = 0; j < jn; j++) a += sp[v * CT_PF_PS + j] * sv[j * D + d];
      acc[i] = a;
    }
  }
  __syncthreads();
  for (int i = tid; i < nv * D; i += blockDim.x) {
    const int v = i / D, r = v / G, g = v % G;
    ct_store(p.out, p.out_dtype, (row0 + r) * row_stride + static_cast<int64_t>(kvh * G + g) * D + i % D, acc[i] / lrun[v]);
  }
}

// ---- The tensor-core prefill -------------------------------------------------------------
// ct_prefill_attention_tc: ct_prefill_attention's parameters and results for a BF16 cache, on
// the tensor cores (attention_tc.cuh), flash-attention 2 style as ct_attn_fwd_tc but over the
// paged cache. One block per (tile of R query rows of one sequence, KV head), R = max(1,
// CT_TC_Q / G): the tile's query vectors v = r G + g (row r, head g of the KV head's group),
// at most 64, are the mma rows of the 4 warps (16 each), so each key / value tile is staged
// once for the group's G heads, as ct_prefill_attention shares it. Keys 0 .. the tile's last
// position in tiles of CT_TC_K, staged as the cache's BF16 bits (exact); q and the
// probabilities rounded to BF16; scores, softmax and sums in FP32. Metadata errors as
// ct_prefill_attention: CT_ERR_ATTN_META, and the tile's rows NaN (a missing block: NaN keys).
// Needs G <= CT_TC_Q and head_dim a multiple of 16 up to CT_TC_MAX_D (kernels.rs checks).
// Grid (num_tokens / R + num_seqs, kv_heads), 128 threads. Not yet run on a GPU.

template <int DT>
__device__ __forceinline__ void ct_prefill_tc_body(const ct_attention_params& p, uint16_t* ks, uint16_t* vs, int s,
                                                   int row0) {
  const int D = DT > 0 ? DT : p.head_dim, G = p.heads / p.kv_heads, kvh = blockIdx.y;
  const int R = max(1, CT_TC_Q / G);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int64_t q0 = p.q_start[s], q_len = static_cast<int64_t>(p.q_start[s + 1]) - q0;
  const int nq = static_cast<int>(min(static_cast<int64_t>(R), q0 + q_len - row0));  // rows of this tile
  const int nv = nq * G;                                                               // query vectors
  const int64_t pos0 = static_cast<int64_t>(p.ctx_len[s]) - q_len + (row0 - q0);       // the first row's position
  const int64_t n_keys = pos0 + nq;
  const int64_t row_stride = static_cast<int64_t>(p.heads) * D;
  if (pos0 < 0 || n_keys > static_cast<int64_t>(p.max_blocks) * p.block_size) {
    if (threadIdx.x == 0) ct_set_error(p.err, CT_ERR_ATTN_META);
    for (int i = threadIdx.x; i < nv * D; i += blockDim.x) {
      const int v = i / D;
      ct_store(p.out, p.out_dtype, (row0 + v / G) * row_stride + static_cast<int64_t>(kvh * G + v % G) * D + i % D,
               __uint_as_float(0x7FC00000u));
    }
    return;
  }
  const uint32_t* table = p.block_tables + static_cast<int64_t>(s) * p.max_blocks;
  const uint16_t* kc = static_cast<const uint16_t*>(p.k_cache);
  const uint16_t* vc = static_cast<const uint16_t*>(p.v_cache);
  // This thread's two query vectors (its warp's mma rows g and g + 8): q and out rows, position.
  const float* qp[2];
  int64_t op[2];  // the out rows' first element
  int64_t pos[2];
  bool valid[2];
#pragma unroll
  for (int x = 0; x < 2; x++) {
    const int v = warp * 16 + g + 8 * x;
    valid[x] = v < nv;
    const int r = valid[x] ? v / G : 0, hh = kvh * G + (valid[x] ? v % G : 0);
    const int64_t at = (row0 + r) * row_stride + static_cast<int64_t>(hh) * D;
    qp[x] = p.q + at;
    op[x] = at;
    pos[x] = pos0 + r;
  }
  uint32_t qa[CT_TC_MAX_D / 16][4];
  ct_tc_load_a_rows(qa, qp, valid, D, t);
  float o[CT_TC_MAX_D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  for (int64_t kt = 0; kt < n_keys; kt += CT_TC_K) {
    __syncthreads();  // the previous tile's readers are done
    for (int idx = threadIdx.x; idx < CT_TC_K * D; idx += blockDim.x) {
      const int jj = idx / D, d = idx % D;
      const int64_t key = kt + jj;
      uint16_t kb = 0, vb = 0;  // zeros past the keys (masked below)
      if (key < n_keys) {
        const uint32_t blk = table[key / p.block_size];
        if (blk < static_cast<uint32_t>(p.num_blocks)) {
          const int64_t at = ((static_cast<int64_t>(blk) * p.kv_heads + kvh) * p.block_size + key % p.block_size) * D + d;
          kb = kc[at];
          vb = vc[at];
        } else {
          kb = vb = 0x7FC0;  // a BF16 NaN
          if (d == 0) ct_set_error(p.err, CT_ERR_ATTN_META);
        }
      }
      ks[jj * CT_TC_LD + d] = kb;
      vs[jj * CT_TC_LD + d] = vb;
    }
    __syncthreads();
    // S (16 x 64 per warp) = Q K^T, scaled and masked (key j <= the vector's position), then
    // the online softmax of each of the thread's two vectors (a 4-lane group holds a row's 64).
    float sc[CT_TC_K / 8][4];
    ct_tc_rows_product(sc, qa, ks, D, g, t);
#pragma unroll
    for (int x = 0; x < 2; x++) {
#pragma unroll
      for (int n = 0; n < CT_TC_K / 8; n++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
          const int64_t j = kt + n * 8 + 2 * t + e;
          const float v = valid[x] && j <= pos[x] ? __fmul_rn(p.softmax_scale, sc[n][2 * x + e]) : -INFINITY;
          sc[n][2 * x + e] = v;
        }
      }
      ct_tc_softmax_tile(sc, o, m, l, x, D);
    }
    // O += P V (P's accumulators as the A operand, V's columns down the tile's keys).
    ct_tc_acc_product(o, sc, vs, D, g, t);
  }
  // out = o / l per vector.
#pragma unroll
  for (int x = 0; x < 2; x++) ct_tc_finish_row(p.out, p.out_dtype, op[x], o, l[x], x, valid[x], D, t);
}

extern "C" __global__ void __launch_bounds__(128) ct_prefill_attention_tc(ct_attention_params p) {
  CT_SHARED(uint16_t, ks, CT_TC_K * CT_TC_LD);
  CT_SHARED(uint16_t, vs, CT_TC_K * CT_TC_LD);
  CT_SHARED_VAR(int, tile_seq);
  CT_SHARED_VAR(int, tile_row0);
  const int R = max(1, CT_TC_Q / (p.heads / p.kv_heads));
  if (threadIdx.x == 0) ct_pf_find_tile(p, R, &tile_seq, &tile_row0);
  __syncthreads();
  const int s = tile_seq, row0 = tile_row0;
  if (s < 0) return;
  switch (p.head_dim) {
    case 64: ct_prefill_tc_body<64>(p, ks, vs, s, row0); break;
    case 128: ct_prefill_tc_body<128>(p, ks, vs, s, row0); break;
    default: ct_prefill_tc_body<0>(p, ks, vs, s, row0); break;
  }
}
