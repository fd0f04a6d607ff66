// attention_tc.cuh: the tensor-core tiles shared by the training attention (attention_train.cu:
// ct_attn_fwd_tc and its backward) and the paged prefill attention (attention_prefill.cu:
// ct_prefill_attention_tc): mma.sync m16n8k16 on BF16 operands with FP32 accumulation, a
// block of 4 warps taking 16 query rows each, key / value tiles of CT_TC_K rows staged in
// shared memory as BF16 bits. Fragment layouts: the PTX ISA's "Matrix Fragments for
// mma.m16n8k16" (lane = 4 g + t: the thread holds rows g and g + 8 of A and C).
#pragma once

#include "common.cuh"

#define CT_TC_Q 64
#define CT_TC_K 64
#define CT_TC_MAX_D 128
#define CT_TC_LD (CT_TC_MAX_D + 8)  // shared row stride (bf16 values): staggers the banks

// Stages rows row0 .. row0 + CT_TC_K - 1 (zeros past `tokens`) of a (tokens, stride) f32 tensor,
// columns off .. off + D - 1, into dst (CT_TC_K x CT_TC_LD bf16 bits). All threads of the block.
__device__ __forceinline__ void ct_tc_stage(uint16_t* dst, const float* src, int row0, int tokens, int64_t stride,
                                            int64_t off, int D) {
  for (int idx = threadIdx.x; idx < CT_TC_K * D; idx += blockDim.x) {
    const int jj = idx / D, d = idx % D, j = row0 + jj;
    dst[jj * CT_TC_LD + d] = static_cast<uint16_t>(ct_bf16_bits(j < tokens ? src[j * stride + off + d] : 0.0f));
  }
}

// B fragment of B[k][n] = tile[n][k] (the tile's rows are B's columns: K for S = QK^T): rows
// n8 * 8 .. + 7, columns st * 16 .. + 15.
__device__ __forceinline__ void ct_tc_b_rows(uint32_t* b, const uint16_t* tile, int n8, int st, int g, int t) {
  const uint16_t* r = tile + (n8 * 8 + g) * CT_TC_LD + st * 16 + 2 * t;
  b[0] = r[0] | (static_cast<uint32_t>(r[1]) << 16);
  b[1] = r[8] | (static_cast<uint32_t>(r[9]) << 16);
}

// B fragment of B[k][n] = tile[k][n] (the tile's rows run along k: V for O += PV): rows
// kk * 16 .. + 15, columns n8 * 8 .. + 7.
__device__ __forceinline__ void ct_tc_b_cols(uint32_t* b, const uint16_t* tile, int kk, int n8, int g, int t) {
  const uint16_t* c = tile + (kk * 16 + 2 * t) * CT_TC_LD + n8 * 8 + g;
  b[0] = c[0] | (static_cast<uint32_t>(c[CT_TC_LD]) << 16);
  b[1] = c[8 * CT_TC_LD] | (static_cast<uint32_t>(c[9 * CT_TC_LD]) << 16);
}

// The A fragment of columns 16 kk .. 16 kk + 15 of a 16-row accumulator block s[n8][4] (C layout
// of n-tiles 2 kk and 2 kk + 1), rounded to bf16.
__device__ __forceinline__ void ct_tc_acc_a(uint32_t* a, const float (*s)[4], int kk) {
  a[0] = ct_pack_bf16(s[2 * kk][0], s[2 * kk][1]);
  a[1] = ct_pack_bf16(s[2 * kk][2], s[2 * kk][3]);
  a[2] = ct_pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  a[3] = ct_pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// s (16 x 64: 8 n-tiles of the warp's 16 rows) = A . tile^T over D dims: A the warp's rows as
// fragments (D / 16), the tile's 64 rows the columns (S = Q K^T, dP = dO V^T, and transposed).
__device__ __forceinline__ void ct_tc_rows_product(float (*s)[4], const uint32_t (*a)[4], const uint16_t* tile, int D,
                                                   int g, int t) {
#pragma unroll
  for (int n = 0; n < CT_TC_K / 8; n++) {
    s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int st = 0; st < D / 16; st++) {
      uint32_t b[2];
      ct_tc_b_rows(b, tile, n, st, g, t);
      ct_mma_16816(s[n], a[st], b, s[n]);
    }
  }
}

// acc (16 x D: D / 8 n-tiles) += w . tile: w the warp's 16 x 64 accumulators (rounded to bf16 as
// the A operand, k = the tile's 64 rows), the tile's columns the output dims (O += P V,
// dq += dS K, dv += P^T dO, dk += dS^T Q).
__device__ __forceinline__ void ct_tc_acc_product(float (*acc)[4], const float (*w)[4], const uint16_t* tile, int D,
                                                  int g, int t) {
#pragma unroll
  for (int kk = 0; kk < CT_TC_K / 16; kk++) {
    uint32_t a[4];
    ct_tc_acc_a(a, w, kk);
#pragma unroll
    for (int n = 0; n < D / 8; n++) {
      uint32_t b[2];
      ct_tc_b_cols(b, tile, kk, n, g, t);
      ct_mma_16816(acc[n], a, b, acc[n]);
    }
  }
}

// One key tile of the online softmax of the thread's row x (0: g, 1: g + 8; its 4-lane group
// holds the row's CT_TC_K scores): s holds the tile's scaled scores, -inf where a key is out of
// the row's reach. The row's running max m[x] and sum l[x] advance, its accumulators o (D / 8
// n-tiles) are rescaled to the new max, and s becomes the tile's exp(score − max).
__device__ __forceinline__ void ct_tc_softmax_tile(float (*s)[4], float (*o)[4], float* m, float* l, int x, int D) {
  float mx = -INFINITY;
#pragma unroll
  for (int n = 0; n < CT_TC_K / 8; n++) mx = fmaxf(mx, fmaxf(s[n][2 * x], s[n][2 * x + 1]));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float mnew = fmaxf(m[x], mx);
  const float corr = mnew == -INFINITY ? 1.0f : expf(__fsub_rn(m[x], mnew));
  l[x] = __fmul_rn(l[x], corr);
#pragma unroll
  for (int n = 0; n < D / 8; n++) {
    o[n][2 * x] = __fmul_rn(o[n][2 * x], corr);
    o[n][2 * x + 1] = __fmul_rn(o[n][2 * x + 1], corr);
  }
#pragma unroll
  for (int n = 0; n < CT_TC_K / 8; n++) {
#pragma unroll
    for (int e = 0; e < 2; e++) {
      const float v = s[n][2 * x + e];
      const float pv = v == -INFINITY ? 0.0f : expf(__fsub_rn(v, mnew));
      s[n][2 * x + e] = pv;
      l[x] = __fadd_rn(l[x], pv);
    }
  }
  m[x] = mnew;
}

// The end of row x's online softmax: its sum l over the 4-lane group (returned; every lane
// calls, the shuffles need them all), and, when `valid`, out[at + d] = o / sum for the thread's
// columns d of the row (at: the row's first value), stored in `dtype` (ct_store's rounding).
__device__ __forceinline__ float ct_tc_finish_row(void* out, int dtype, int64_t at, const float (*o)[4], float l, int x,
                                                  bool valid, int D, int t) {
  float L = l;
  L = __fadd_rn(L, __shfl_xor_sync(0xffffffffu, L, 1));
  L = __fadd_rn(L, __shfl_xor_sync(0xffffffffu, L, 2));
  if (valid) {
#pragma unroll
    for (int n = 0; n < D / 8; n++) {
      ct_store(out, dtype, at + n * 8 + 2 * t, __fdiv_rn(o[n][2 * x], L));
      ct_store(out, dtype, at + n * 8 + 2 * t + 1, __fdiv_rn(o[n][2 * x + 1], L));
    }
  }
  return L;
}

// The A fragments (D / 16 of them) of 16 rows of f32 values: rp[x] points at the thread's row g
// (x = 0) or g + 8 (x = 1), zeros where !valid[x].
__device__ __forceinline__ void ct_tc_load_a_rows(uint32_t (*a)[4], const float* const* rp, const bool* valid, int D,
                                                  int t) {
#pragma unroll
  for (int s = 0; s < D / 16; s++) {
#pragma unroll
    for (int r = 0; r < 4; r++) {
      const int x = r & 1, col = s * 16 + 2 * t + 8 * (r >> 1);
      a[s][r] = valid[x] ? ct_pack_bf16(rp[x][col], rp[x][col + 1]) : 0u;
    }
  }
}

// The same of a (tokens, stride) f32 tensor at column off: rows[x] the thread's two rows.
__device__ __forceinline__ void ct_tc_load_a(uint32_t (*a)[4], const float* src, const int* rows, const bool* valid,
                                             int64_t stride, int64_t off, int D, int t) {
  const float* rp[2] = {src + rows[0] * stride + off, src + rows[1] * stride + off};
  ct_tc_load_a_rows(a, rp, valid, D, t);
}
