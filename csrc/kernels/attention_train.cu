// attention_train.cu: causal grouped-query attention for training, over packed sequences: the
// forward saving the log-sum-exp, and the flash-attention backward that recomputes the
// probabilities from it (no T x T matrix in memory). CPU twin: src/ops/attention/grad.rs
// (fwd / bwd; the same formulas, sums in another order, CUDA's expf / logf). CUDA cores, one
// block per (row, head) with tiles of CT_AT_TILE keys: the checked reference and fallback of
// the training attention, not its fast path (a tensor-core kernel or cuDNN's fused attention
// is). Not yet run on a GPU.
#include "common.cuh"

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
  for (int a = 0, d = threadIdx.x; d < D; a++, d += blockDim.x) p.o[qrow + d] = acc[a];
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
