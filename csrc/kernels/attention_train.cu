// attention_train.cu: causal grouped-query attention for training, over packed sequences: the
// forward saving the log-sum-exp, and the flash-attention backward that recomputes the
// probabilities from it (no T x T matrix in memory). CPU twin: src/ops/attention/grad.rs
// (fwd / bwd; the same formulas, sums in another order, CUDA's expf / logf). CUDA cores, one
// block per (row, head) with tiles of CT_AT_TILE keys: the checked reference and fallback of
// the training attention, not its fast path (a tensor-core kernel or cuDNN's fused attention
// is). Not yet run on a GPU.
#include "attention_tc.cuh"

#define CT_AT_TILE 128
#define CT_AT_MAX_D 256

// The sequence that row `i` belongs to: cu[b] <= i < cu[b + 1] (binary search).
__device__ __forceinline__ int ct_seq_of(const uint32_t* cu, int num_seqs, int i) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (static_cast<int>(cu[mid]) <= i) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ float ct_dot(const float* a, const float* b, int d) {
  float s = 0.0f;
  for (int t = 0; t < d; t++) s = __fadd_rn(s, __fmul_rn(a[t], b[t]));
  return s;
}

// acc[a] (the dims d = threadIdx.x + a * blockDim.x < D) += sum_jj w[jj] x[row0 + jj][d], jj < n,
// rows `stride` apart from `base`: one tile's weighted sum of key or value rows, in jj order.
__device__ __forceinline__ void ct_at_tile_sum(float* acc, const float* w, int n, const float* base, int64_t row0,
                                               int64_t stride, int D) {
  for (int a = 0, d = threadIdx.x; d < D; a++, d += blockDim.x) {
    for (int jj = 0; jj < n; jj++) acc[a] = __fadd_rn(acc[a], __fmul_rn(w[jj], base[(row0 + jj) * stride + d]));
  }
}

// Grid (tokens, heads), CT_AT_TILE threads.
extern "C" __global__ void ct_attn_fwd(ct_attn_train_params p) {
  CT_SHARED(float, qs, CT_AT_MAX_D);
  CT_SHARED(float, ps, CT_AT_TILE);
  CT_SHARED(float, scratch, 32);
  const int i = blockIdx.x, h = blockIdx.y, D = p.head_dim;
  const int kh = h / (p.heads / p.kv_heads);
  const int start = static_cast<int>(p.cu[ct_seq_of(p.cu, p.num_seqs, i)]);
  const int64_t qrow = static_cast<int64_t>(i) * p.heads * D + static_cast<int64_t>(h) * D;
  const int64_t kstride = static_cast<int64_t>(p.kv_heads) * D, koff = static_cast<int64_t>(kh) * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) qs[d] = p.q[qrow + d];
  __syncthreads();
  // Online max and sum per thread over its keys, then across the block.
  float m = -INFINITY, s = 0.0f;
  for (int j = start + threadIdx.x; j <= i; j += blockDim.x) {
    const float x = __fmul_rn(p.scale, ct_dot(qs, p.k + j * kstride + koff, D));
    if (x > m) {
      s = __fadd_rn(__fmul_rn(s, expf(__fsub_rn(m, x))), 1.0f);
      m = x;
    } else {
      s = __fadd_rn(s, expf(__fsub_rn(x, m)));
    }
  }
  const float M = ct_block_max(m, scratch);
  const float mine = m == -INFINITY ? 0.0f : __fmul_rn(s, expf(__fsub_rn(m, M)));
  const float S = ct_block_sum(mine, scratch);
  const float lse = __fadd_rn(M, logf(S));
  float acc[CT_AT_MAX_D / CT_AT_TILE] = {0.0f, 0.0f};
  for (int tile = start; tile <= i; tile += CT_AT_TILE) {
    const int j = tile + static_cast<int>(threadIdx.x);
    ps[threadIdx.x] = j <= i ? expf(__fsub_rn(__fmul_rn(p.scale, ct_dot(qs, p.k + j * kstride + koff, D)), lse)) : 0.0f;
    __syncthreads();
    ct_at_tile_sum(acc, ps, min(CT_AT_TILE, i - tile + 1), p.v + koff, tile, kstride, D);
    __syncthreads();
  }
  for (int a = 0, d = threadIdx.x; d < D; a++, d += blockDim.x) ct_store(p.o, p.o_dtype, qrow + d, acc[a]);
  if (threadIdx.x == 0) p.lse[static_cast<int64_t>(i) * p.heads + h] = lse;
}

// Grid (tokens, heads), CT_AT_TILE threads.
extern "C" __global__ void ct_attn_bwd_dq(ct_attn_train_params p) {
  CT_SHARED(float, qs, CT_AT_MAX_D);
  CT_SHARED(float, dos, CT_AT_MAX_D);
  CT_SHARED(float, ps, CT_AT_TILE);
  CT_SHARED(float, scratch, 32);
  const int i = blockIdx.x, h = blockIdx.y, D = p.head_dim;
  const int kh = h / (p.heads / p.kv_heads);
  const int start = static_cast<int>(p.cu[ct_seq_of(p.cu, p.num_seqs, i)]);
  const int64_t qrow = static_cast<int64_t>(i) * p.heads * D + static_cast<int64_t>(h) * D;
  const int64_t kstride = static_cast<int64_t>(p.kv_heads) * D, koff = static_cast<int64_t>(kh) * D;
  float part = 0.0f;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    qs[d] = p.q[qrow + d];
    dos[d] = p.dout[qrow + d];
    part = __fadd_rn(part, __fmul_rn(dos[d], p.out[qrow + d]));
  }
  const float delta = ct_block_sum(part, scratch);  // its barriers also publish qs and dos
  const float lse = p.lse[static_cast<int64_t>(i) * p.heads + h];
  float acc[CT_AT_MAX_D / CT_AT_TILE] = {0.0f, 0.0f};
  for (int tile = start; tile <= i; tile += CT_AT_TILE) {
    const int j = tile + static_cast<int>(threadIdx.x);
    float ds = 0.0f;
    if (j <= i) {
      const float pr = expf(__fsub_rn(__fmul_rn(p.scale, ct_dot(qs, p.k + j * kstride + koff, D)), lse));
      const float dp = ct_dot(dos, p.v + j * kstride + koff, D);
      ds = __fmul_rn(__fmul_rn(pr, __fsub_rn(dp, delta)), p.scale);
    }
    ps[threadIdx.x] = ds;
    __syncthreads();
    ct_at_tile_sum(acc, ps, min(CT_AT_TILE, i - tile + 1), p.k + koff, tile, kstride, D);
    __syncthreads();
  }
  for (int a = 0, d = threadIdx.x; d < D; a++, d += blockDim.x) p.dq[qrow + d] = acc[a];
  if (threadIdx.x == 0) p.delta[static_cast<int64_t>(i) * p.heads + h] = delta;
}

// Grid (tokens, kv_heads), CT_AT_TILE threads; after ct_attn_bwd_dq (reads delta).
extern "C" __global__ void ct_attn_bwd_dkv(ct_attn_train_params p) {
  CT_SHARED(float, ks, CT_AT_MAX_D);
  CT_SHARED(float, vs, CT_AT_MAX_D);
  CT_SHARED(float, ps, CT_AT_TILE);
  CT_SHARED(float, dss, CT_AT_TILE);
  const int j = blockIdx.x, kh = blockIdx.y, D = p.head_dim;
  const int G = p.heads / p.kv_heads;
  const int end = static_cast<int>(p.cu[ct_seq_of(p.cu, p.num_seqs, j) + 1]);
  const int64_t krow = static_cast<int64_t>(j) * p.kv_heads * D + static_cast<int64_t>(kh) * D;
  const int64_t qstride = static_cast<int64_t>(p.heads) * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    ks[d] = p.k[krow + d];
    vs[d] = p.v[krow + d];
  }
  __syncthreads();
  // (query row, head of the group) pairs u = (i - j) * G + g, rows i = j .. end - 1.
  const int total = (end - j) * G;
  float acck[CT_AT_MAX_D / CT_AT_TILE] = {0.0f, 0.0f}, accv[CT_AT_MAX_D / CT_AT_TILE] = {0.0f, 0.0f};
  for (int tile = 0; tile < total; tile += CT_AT_TILE) {
    const int u = tile + static_cast<int>(threadIdx.x);
    float pr = 0.0f, ds = 0.0f;
    if (u < total) {
      const int i = j + u / G, h = kh * G + u % G;
      const int64_t qrow = static_cast<int64_t>(i) * qstride + static_cast<int64_t>(h) * D;
      const int64_t lh = static_cast<int64_t>(i) * p.heads + h;
      pr = expf(__fsub_rn(__fmul_rn(p.scale, ct_dot(p.q + qrow, ks, D)), p.lse[lh]));
      const float dp = ct_dot(p.dout + qrow, vs, D);
      ds = __fmul_rn(__fmul_rn(pr, __fsub_rn(dp, p.delta[lh])), p.scale);
    }
    ps[threadIdx.x] = pr;
    dss[threadIdx.x] = ds;
    __syncthreads();
    const int n = min(CT_AT_TILE, total - tile);
    for (int a = 0, d = threadIdx.x; d < D; a++, d += blockDim.x) {
      for (int uu = 0; uu < n; uu++) {
        const int i = j + (tile + uu) / G, h = kh * G + (tile + uu) % G;
        const int64_t qrow = static_cast<int64_t>(i) * qstride + static_cast<int64_t>(h) * D;
        accv[a] = __fadd_rn(accv[a], __fmul_rn(ps[uu], p.dout[qrow + d]));
        acck[a] = __fadd_rn(acck[a], __fmul_rn(dss[uu], p.q[qrow + d]));
      }
    }
    __syncthreads();
  }
  for (int a = 0, d = threadIdx.x; d < D; a++, d += blockDim.x) {
    p.dk[krow + d] = acck[a];
    p.dv[krow + d] = accv[a];
  }
}

// ---- The tensor-core forward -------------------------------------------------------------
// ct_attn_fwd_tc: the same o and lse as ct_attn_fwd (params and formulas alike), on the tensor
// cores (mma.sync m16n8k16, BF16 operands, FP32 accumulation), flash-attention 2 style: a block
// of 4 warps takes CT_TC_Q query rows of one head (16 per warp), walks the keys in tiles of
// CT_TC_K (K and V staged in shared memory as BF16), S = Q K^T and O += P V on the tensor cores
// with the online softmax in registers (P reuses S's accumulator layout as the A operand).
// A block's rows may span sequences: each row masks keys outside [start of its sequence, row].
// q, k, v and P are rounded to BF16 (the twin's tolerance says so); head_dim a multiple of 16,
// at most CT_TC_MAX_D. Grid (ceil(tokens / CT_TC_Q), heads), 128 threads.
template <int DT>
__device__ __forceinline__ void ct_attn_fwd_tc_body(const ct_attn_train_params& p, uint16_t* ks, uint16_t* vs, float*,
                                                    float*) {
  const int D = DT > 0 ? DT : p.head_dim, h = blockIdx.y, kh = h / (p.heads / p.kv_heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int r0 = blockIdx.x * CT_TC_Q;
  const int64_t qstride = static_cast<int64_t>(p.heads) * D, kstride = static_cast<int64_t>(p.kv_heads) * D;
  const int64_t qoff = static_cast<int64_t>(h) * D, koff = static_cast<int64_t>(kh) * D;
  // This thread's two rows (g and g + 8 of its warp's 16) and the first key each may see.
  int rows[2], starts[2];
  bool valid[2];
#pragma unroll
  for (int x = 0; x < 2; x++) {
    rows[x] = r0 + warp * 16 + g + 8 * x;
    valid[x] = rows[x] < p.tokens;
    starts[x] = valid[x] ? static_cast<int>(p.cu[ct_seq_of(p.cu, p.num_seqs, rows[x])]) : 0;
  }
  const int last = min(r0 + CT_TC_Q, p.tokens) - 1;
  const int kfirst = static_cast<int>(p.cu[ct_seq_of(p.cu, p.num_seqs, r0)]);
  // The warp's Q as A fragments, one per 16 dims (rows past the end are zeros).
  uint32_t qa[CT_TC_MAX_D / 16][4];
  ct_tc_load_a(qa, p.q, rows, valid, qstride, qoff, D, t);
  float o[CT_TC_MAX_D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  for (int kt = kfirst; kt <= last; kt += CT_TC_K) {
    __syncthreads();  // the previous tile's readers are done
    ct_tc_stage(ks, p.k, kt, p.tokens, kstride, koff, D);
    ct_tc_stage(vs, p.v, kt, p.tokens, kstride, koff, D);
    __syncthreads();
    // S (16 x 64 per warp) = Q K^T: B[k = dim][n = key] is K's row n, so b reads K row-major.
    float s[CT_TC_K / 8][4];
    ct_tc_rows_product(s, qa, ks, D, g, t);
    // Scale, mask, and the online softmax of each of the thread's two rows (its 4-lane group
    // holds a row's 64 scores).
#pragma unroll
    for (int x = 0; x < 2; x++) {
#pragma unroll
      for (int n = 0; n < CT_TC_K / 8; n++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
          const int j = kt + n * 8 + 2 * t + e;
          const bool ok = valid[x] && j >= starts[x] && j <= rows[x];
          s[n][2 * x + e] = ok ? __fmul_rn(p.scale, s[n][2 * x + e]) : -INFINITY;
        }
      }
      ct_tc_softmax_tile(s, o, m, l, x, D);
    }
    // O += P V: P's accumulators of key tiles 2kk, 2kk + 1 are the A fragment of keys
    // 16kk .. 16kk + 15; B[k = key][n = dim] reads V's column n down 16 keys.
    ct_tc_acc_product(o, s, vs, D, g, t);
  }
  // o / l per row, and lse = m + log l.
#pragma unroll
  for (int x = 0; x < 2; x++) {
    const float L = ct_tc_finish_row(p.o, p.o_dtype, rows[x] * qstride + qoff, o, l[x], x, valid[x], D, t);
    if (valid[x] && t == 0) p.lse[static_cast<int64_t>(rows[x]) * p.heads + h] = __fadd_rn(m[x], logf(L));
  }
}

// ---- The tensor-core backward ------------------------------------------------------------
// The same dq, dk, dv (and delta) as ct_attn_bwd_dq / ct_attn_bwd_dkv, flash-attention 2 style
// without atomics (every output element written by one thread, sums in a fixed order):
// ct_attn_bwd_dq_tc (grid ceil(T / CT_TC_Q) x heads): delta = rowsum(dout o) for the block's rows,
//   then over the key tiles S = Q K^T, P = exp(scale S - lse), dP = dO V^T, dS = P (dP - delta),
//   dq += dS K; dq = scale dq.
// ct_attn_bwd_dkv_tc (grid ceil(T / CT_TC_K) x kv_heads, after it): each warp 16 keys; for each
//   query head of the group in order and each query tile: S^T = K Q^T, P^T, dv += P^T dO,
//   dP^T = V dO^T, dS^T = P^T (dP^T - delta), dk += dS^T Q; dk = scale dk.
// Operands (q, k, v, dout, P, dS) rounded to BF16, FP32 accumulation.

template <int DT>
__device__ __forceinline__ void ct_attn_bwd_dq_tc_body(const ct_attn_train_params& p, uint16_t* ks, uint16_t* vs,
                                                       float*, float*) {
  const int D = DT > 0 ? DT : p.head_dim, h = blockIdx.y, kh = h / (p.heads / p.kv_heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int r0 = blockIdx.x * CT_TC_Q;
  const int64_t qstride = static_cast<int64_t>(p.heads) * D, kstride = static_cast<int64_t>(p.kv_heads) * D;
  const int64_t qoff = static_cast<int64_t>(h) * D, koff = static_cast<int64_t>(kh) * D;
  int rows[2], starts[2];
  bool valid[2];
  float lse[2], delta[2];
#pragma unroll
  for (int x = 0; x < 2; x++) {
    rows[x] = r0 + warp * 16 + g + 8 * x;
    valid[x] = rows[x] < p.tokens;
    starts[x] = valid[x] ? static_cast<int>(p.cu[ct_seq_of(p.cu, p.num_seqs, rows[x])]) : 0;
    lse[x] = valid[x] ? p.lse[static_cast<int64_t>(rows[x]) * p.heads + h] : 0.0f;
    // delta = sum_d dout o over the row, the 4 lanes of the group a quarter each.
    float acc = 0.0f;
    if (valid[x]) {
      const float* dr = p.dout + rows[x] * qstride + qoff;
      const float* orow = p.out + rows[x] * qstride + qoff;
      for (int d = t; d < D; d += 4) acc = __fadd_rn(acc, __fmul_rn(dr[d], orow[d]));
    }
    acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, 1));
    acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, 2));
    delta[x] = acc;
    if (valid[x] && t == 0) p.delta[static_cast<int64_t>(rows[x]) * p.heads + h] = acc;
  }
  const int last = min(r0 + CT_TC_Q, p.tokens) - 1;
  const int kfirst = static_cast<int>(p.cu[ct_seq_of(p.cu, p.num_seqs, r0)]);
  uint32_t qa[CT_TC_MAX_D / 16][4], da[CT_TC_MAX_D / 16][4];
  ct_tc_load_a(qa, p.q, rows, valid, qstride, qoff, D, t);
  ct_tc_load_a(da, p.dout, rows, valid, qstride, qoff, D, t);
  float dq[CT_TC_MAX_D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; n++) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;
  for (int kt = kfirst; kt <= last; kt += CT_TC_K) {
    __syncthreads();
    ct_tc_stage(ks, p.k, kt, p.tokens, kstride, koff, D);
    ct_tc_stage(vs, p.v, kt, p.tokens, kstride, koff, D);
    __syncthreads();
    float s[CT_TC_K / 8][4], dp[CT_TC_K / 8][4];
    ct_tc_rows_product(s, qa, ks, D, g, t);
    ct_tc_rows_product(dp, da, vs, D, g, t);
#pragma unroll
    for (int n = 0; n < CT_TC_K / 8; n++) {
      // dS = P (dP - delta), P = exp(scale s - lse) on the row's own causal keys.
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int x = e >> 1, j = kt + n * 8 + 2 * t + (e & 1);
        const bool ok = valid[x] && j >= starts[x] && j <= rows[x];
        const float pv = ok ? expf(__fsub_rn(__fmul_rn(p.scale, s[n][e]), lse[x])) : 0.0f;
        s[n][e] = __fmul_rn(pv, __fsub_rn(dp[n][e], delta[x]));
      }
    }
    ct_tc_acc_product(dq, s, ks, D, g, t);
  }
#pragma unroll
  for (int x = 0; x < 2; x++) {
    if (!valid[x]) continue;
    float* out = p.dq + rows[x] * qstride + qoff;
#pragma unroll
    for (int n = 0; n < D / 8; n++) {
      out[n * 8 + 2 * t] = __fmul_rn(p.scale, dq[n][2 * x]);
      out[n * 8 + 2 * t + 1] = __fmul_rn(p.scale, dq[n][2 * x + 1]);
    }
  }
}

template <int DT>
__device__ __forceinline__ void ct_attn_bwd_dkv_tc_body(const ct_attn_train_params& p, uint16_t* qs, uint16_t* ds,
                                                        float* lses, float* deltas) {
  const int D = DT > 0 ? DT : p.head_dim, kh = blockIdx.y, group = p.heads / p.kv_heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int k0 = blockIdx.x * CT_TC_K;
  const int64_t qstride = static_cast<int64_t>(p.heads) * D, kstride = static_cast<int64_t>(p.kv_heads) * D;
  const int64_t koff = static_cast<int64_t>(kh) * D;
  // This thread's two keys and the end of each one's sequence (queries j .. end - 1 see key j).
  int keys[2], ends[2];
  bool valid[2];
#pragma unroll
  for (int x = 0; x < 2; x++) {
    keys[x] = k0 + warp * 16 + g + 8 * x;
    valid[x] = keys[x] < p.tokens;
    ends[x] = valid[x] ? static_cast<int>(p.cu[ct_seq_of(p.cu, p.num_seqs, keys[x]) + 1]) : 0;
  }
  const int klast = min(k0 + CT_TC_K, p.tokens) - 1;
  const int qend = static_cast<int>(p.cu[ct_seq_of(p.cu, p.num_seqs, klast) + 1]);
  uint32_t ka[CT_TC_MAX_D / 16][4], va[CT_TC_MAX_D / 16][4];
  ct_tc_load_a(ka, p.k, keys, valid, kstride, koff, D, t);
  ct_tc_load_a(va, p.v, keys, valid, kstride, koff, D, t);
  float dk[CT_TC_MAX_D / 8][4], dv[CT_TC_MAX_D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; n++) {
#pragma unroll
    for (int e = 0; e < 4; e++) dk[n][e] = dv[n][e] = 0.0f;
  }
  for (int gi = 0; gi < group; gi++) {
    const int h = kh * group + gi;
    const int64_t qoff = static_cast<int64_t>(h) * D;
    for (int qt = k0; qt < qend; qt += CT_TC_Q) {
      __syncthreads();
      ct_tc_stage(qs, p.q, qt, p.tokens, qstride, qoff, D);
      ct_tc_stage(ds, p.dout, qt, p.tokens, qstride, qoff, D);
      for (int i = threadIdx.x; i < CT_TC_Q; i += blockDim.x) {
        const bool in = qt + i < p.tokens;
        lses[i] = in ? p.lse[static_cast<int64_t>(qt + i) * p.heads + h] : 0.0f;
        deltas[i] = in ? p.delta[static_cast<int64_t>(qt + i) * p.heads + h] : 0.0f;
      }
      __syncthreads();
      // S^T (16 keys x 64 queries) = K Q^T and dP^T = V dO^T, then P^T and dS^T in place.
      float s[CT_TC_Q / 8][4], dp[CT_TC_Q / 8][4];
      ct_tc_rows_product(s, ka, qs, D, g, t);
      ct_tc_rows_product(dp, va, ds, D, g, t);
#pragma unroll
      for (int n = 0; n < CT_TC_Q / 8; n++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const int x = e >> 1, ii = n * 8 + 2 * t + (e & 1), i = qt + ii;
          const bool ok = valid[x] && i >= keys[x] && i < ends[x];
          const float pv = ok ? expf(__fsub_rn(__fmul_rn(p.scale, s[n][e]), lses[ii])) : 0.0f;
          s[n][e] = pv;
          dp[n][e] = __fmul_rn(pv, __fsub_rn(dp[n][e], deltas[ii]));
        }
      }
      // dv += P^T dO, dk += dS^T Q: the accumulators of P^T and dS^T as A (k = queries).
      ct_tc_acc_product(dv, s, ds, D, g, t);
      ct_tc_acc_product(dk, dp, qs, D, g, t);
    }
  }
#pragma unroll
  for (int x = 0; x < 2; x++) {
    if (!valid[x]) continue;
    float* dko = p.dk + keys[x] * kstride + koff;
    float* dvo = p.dv + keys[x] * kstride + koff;
#pragma unroll
    for (int n = 0; n < D / 8; n++) {
#pragma unroll
      for (int e = 0; e < 2; e++) {
        dko[n * 8 + 2 * t + e] = __fmul_rn(p.scale, dk[n][2 * x + e]);
        dvo[n * 8 + 2 * t + e] = dv[n][2 * x + e];
      }
    }
  }
}

// The kernels: one body per head_dim class. head_dim 64 and 128 (the common ones) are compile-
// time constants, so every fragment loop unrolls and the accumulators stay in registers; other
// multiples of 16 run the generic body (runtime loop bounds: its arrays live in local memory).
// The shared tiles are declared here once, for whichever body runs.
#define CT_TC_DISPATCH(name)                                                           \
  extern "C" __global__ void __launch_bounds__(128) name(ct_attn_train_params p) {       \
    CT_SHARED(uint16_t, ta, CT_TC_K * CT_TC_LD);                                       \
    CT_SHARED(uint16_t, tb, CT_TC_K * CT_TC_LD);                                       \
    CT_SHARED(float, fa, CT_TC_Q);                                                     \
    CT_SHARED(float, fb, CT_TC_Q);                                                     \
    switch (p.head_dim) {                                                              \
      case 64: name##_body<64>(p, ta, tb, fa, fb); break;                              \
      case 128: name##_body<128>(p, ta, tb, fa, fb); break;                            \
      default: name##_body<0>(p, ta, tb, fa, fb); break;                               \
    }                                                                                  \
  }
CT_TC_DISPATCH(ct_attn_fwd_tc)
CT_TC_DISPATCH(ct_attn_bwd_dq_tc)
CT_TC_DISPATCH(ct_attn_bwd_dkv_tc)
