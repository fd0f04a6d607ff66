// row_stats.cuh: the statistics of one row of logits that scoring and both sampling kernels
// share: max_j z_j / T and the normalizer sum_j exp(z_j / T - max) in double (CPU twin:
// src/ops/logprob/cpu.rs row_log_normalizer; the sum is reduced per thread chunk and then across
// chunks, not in the CPU's 16-lane order; the exponential is common.cuh's ct_exp_f32), and
// the float -> orderable key map of the top-k kernel.
#pragma once
#include "common.cuh"

#define CT_ROW_THREADS 1024

struct RowStats {
  float mx;
  double sum;
};

// max_j z_j / T and sum_j exp(z_j / T - max) in double, over one row, all threads of the block.
// chunk_sums (if not null, CT_ROW_THREADS entries) receives each thread's partial sum over its
// contiguous chunk [tid * chunk, (tid + 1) * chunk).
__device__ inline RowStats ct_row_stats(const float* z, int vocab, float temperature, double* chunk_sums) {
  CT_SHARED(float, fscratch, 32);
  CT_SHARED(double, dscratch, 32);
  const int chunk = (vocab + blockDim.x - 1) / blockDim.x;
  const int begin = threadIdx.x * chunk;
  const int end = min(vocab, begin + chunk);
  float mx = -INFINITY;
  for (int i = begin; i < end; i++) mx = fmaxf(mx, __fdiv_rn(z[i], temperature));
  mx = __fadd_rn(0.0f, ct_block_max(mx, fscratch));  // a zero maximum is +0, as on the CPU
  double s = 0.0;
  for (int i = begin; i < end; i++) s += static_cast<double>(ct_exp_f32(__fsub_rn(__fdiv_rn(z[i], temperature), mx)));
  if (chunk_sums) chunk_sums[threadIdx.x] = s;
  s = ct_block_sum_f64(s, dscratch);
  return RowStats{mx, s};
}

// An unsigned key whose order is Rust's f32::total_cmp: -NaN < -inf < ... < -0 < +0 < ... <
// +inf < +NaN.
__device__ __forceinline__ uint32_t ct_order_key(float v) {
  const uint32_t b = __float_as_uint(v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
