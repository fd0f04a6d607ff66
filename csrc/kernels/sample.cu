// sample.cu: token sampling of greedy and untruncated rows (rows with top-k / top-p are
// sample_topk.cu's). CPU twin: src/ops/sample/cpu.rs (sample_row); launcher:
// src/ops/sample/cuda.rs. Same order of operations as the CPU (see logprob.cu for the
// normalizer); sampling draws the same Philox uniform (key = seed, counter = (position, sample,
// request lo, request hi)) and walks the CDF in token-id order with the CPU's
// `acc > u * exp(log(sum))` rule. The double sum is reduced per thread chunk and then across
// chunks (not in the CPU's 16-lane order), so the drawn token equals the CPU's unless u falls
// within rounding distance of a CDF boundary. Not yet run on a GPU.
#include "row_stats.cuh"

// Whether candidate (v, i) beats the current best (bv, bi) of a greedy argmax: a larger value,
// or an equal value at a lower id; NaN only beats nothing (bi < 0) and loses to any number.
__device__ __forceinline__ bool ct_better(float v, int i, float bv, int bi) {
  if (i < 0) return false;
  if (bi < 0) return true;
  if (isnan(v)) return false;
  if (isnan(bv)) return true;
  return v > bv || (v == bv && i < bi);
}

// One block of CT_ROW_THREADS threads per row.
extern "C" __global__ void __launch_bounds__(CT_ROW_THREADS) ct_sample(ct_sample_params p) {
  CT_SHARED(double, chunk_sums, CT_ROW_THREADS);
  CT_SHARED(float, best_v, 32);
  CT_SHARED(int, best_i, 32);
  CT_SHARED_VAR(int, pick);
  const int row = blockIdx.x;
  if (row >= p.rows) return;
  const ct_sample_row sp = p.params[row];
  if (sp.truncated) return;  // ct_sample_topk's row
  const float* z = p.logits + static_cast<int64_t>(row) * p.vocab;
  const int V = p.vocab;
  const int tid = threadIdx.x, lane = tid % CT_WARP, warp = tid / CT_WARP;
  const int chunk = (V + blockDim.x - 1) / blockDim.x;
  const int begin = tid * chunk, end = min(V, begin + chunk);

  if (sp.temperature == 0.0f) {
    // Greedy: the first maximum (lowest id among equal values; NaN never wins).
    float bv = -INFINITY;
    int bi = -1;
    for (int i = begin; i < end; i++) {
      if (ct_better(z[i], i, bv, bi)) {
        bv = z[i];
        bi = i;
      }
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ct_better(ov, oi, bv, bi)) {
        bv = ov;
        bi = oi;
      }
    }
    if (lane == 0) {
      best_v[warp] = bv;
      best_i[warp] = bi;
    }
    __syncthreads();
    if (tid == 0) {
      float v = best_v[0];
      int b = best_i[0];
      for (int w = 1; w < static_cast<int>(blockDim.x / CT_WARP); w++) {
        if (ct_better(best_v[w], best_i[w], v, b)) {
          v = best_v[w];
          b = best_i[w];
        }
      }
      pick = b < 0 ? 0 : b;
    }
    __syncthreads();
    const RowStats st = ct_row_stats(z, V, 1.0f, nullptr);
    if (tid == 0) {
      p.tokens[row] = static_cast<uint32_t>(pick);
      p.logprobs[row] = static_cast<float>(static_cast<double>(__fsub_rn(z[pick], st.mx)) - log(st.sum));
    }
    return;
  }

  const float T = sp.temperature;
  const RowStats st = ct_row_stats(z, V, T, chunk_sums);
  __syncthreads();
  const uint4 r = ct_philox(make_uint4(sp.position, sp.sample, static_cast<uint32_t>(sp.request),
                                       static_cast<uint32_t>(sp.request >> 32)),
                            ct_seed_key(sp.seed));
  const double u = ct_uniform_f64(r.x, r.y);
  const double lse = log(st.sum);
  const double target = u * exp(lse);
  if (tid == 0) {
    // Inclusive prefix of the chunk sums, left to right.
    double acc = 0.0;
    for (int c = 0; c < static_cast<int>(blockDim.x); c++) {
      acc += chunk_sums[c];
      chunk_sums[c] = acc;
    }
    pick = -1;
  }
  __syncthreads();
  // The chunk where the running sum first exceeds the target scans its own values.
  const double incl = chunk_sums[tid];
  const double excl = tid == 0 ? 0.0 : chunk_sums[tid - 1];
  if (begin < end && incl > target && excl <= target) {
    double acc = excl;
    int last_nonzero = -1;
    for (int i = begin; i < end; i++) {
      const double w = static_cast<double>(ct_exp_f32(__fsub_rn(__fdiv_rn(z[i], T), st.mx)));
      if (w > 0.0) last_nonzero = i;
      acc += w;
      if (acc > target) {
        last_nonzero = i;
        break;
      }
    }
    if (last_nonzero >= 0) atomicMin(reinterpret_cast<unsigned int*>(&pick), static_cast<unsigned int>(last_nonzero));
  }
  __syncthreads();
  if (pick < 0) {
    // Rounding left the target at or above the total: the last token of nonzero weight (as
    // the CPU's fallback).
    int last = -1;
    for (int i = begin; i < end; i++) {
      if (ct_exp_f32(__fsub_rn(__fdiv_rn(z[i], T), st.mx)) > 0.0f) last = i;
    }
    for (int o = 16; o > 0; o >>= 1) last = max(last, __shfl_xor_sync(0xffffffffu, last, o));
    if (lane == 0) best_i[warp] = last;
    __syncthreads();
    if (tid == 0) {
      int b = 0;
      for (int w = 0; w < static_cast<int>(blockDim.x / CT_WARP); w++) b = max(b, best_i[w]);
      pick = b;
    }
    __syncthreads();
  }
  if (tid == 0) {
    const float zi = __fsub_rn(__fdiv_rn(z[pick], T), st.mx);
    p.tokens[row] = static_cast<uint32_t>(pick);
    p.logprobs[row] = static_cast<float>(static_cast<double>(zi) - lse);
  }
}
