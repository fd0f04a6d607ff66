// sample_topk.cu: token sampling for rows with top-k / top-p truncation, one block of
// CT_ROW_THREADS threads per row. It skips rows with truncated = 0, which are ct_sample's.
// CPU twin: src/ops/sample/cpu.rs sample_row (its truncated branch). The steps follow the CPU's:
//   1. Candidates: N = top_k when top-k truncates (top_k < V), else min(V, CT_TOPK_CAP). A top_k
//      above CT_TOPK_CAP is left to the host.
//   2. Select the N best tokens in the CPU's total order (z descending by f32::total_cmp, ties
//      by lower id). A 4-digit radix select on ct_order_key finds the threshold key; it counts
//      only, so it is exact. The tokens above the threshold and the first ties in id order are
//      gathered through a block scan, then bitonic-sorted in shared memory.
//   3. Thread 0 walks the sorted candidates as the CPU does:
//      - the mass to reach: the top-k mass, summed in sorted order (without top-k: exp(lse) of
//        the whole row);
//      - the shortest prefix whose mass reaches top_p of it;
//      - the inverse CDF over that prefix, with u from Philox.
//      A prefix that needs more than the N sorted candidates (possible only without top-k)
//      leaves the row to the host.
// Each weight is the CPU's, bit for bit (ct_exp_f32(z/T - max), widened to double), and the
// candidates' weights are summed in the CPU's order. One thing differs: the whole-row sum (used
// only without top-k) is reduced per chunk and then across chunks. So the drawn token equals the CPU's unless u or top_p lies within rounding distance of a
// boundary. Not yet run on a GPU; src/ops/hostemu/blocks.rs runs it under host
// emulation against the CPU twin.
#include "row_stats.cuh"

// Exclusive prefix sum over the block of one value per thread, in thread order; *total gets the
// block's sum. scratch: 32 words.
__device__ __forceinline__ uint32_t ct_block_exclusive_scan(uint32_t v, uint32_t* scratch, uint32_t* total) {
  const int lane = threadIdx.x % CT_WARP, warp = threadIdx.x / CT_WARP;
  const int nwarps = (blockDim.x + CT_WARP - 1) / CT_WARP;
  uint32_t incl = v;
  for (int d = 1; d < CT_WARP; d <<= 1) {
    const uint32_t o = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += o;
  }
  __syncthreads();  // a previous call may still be reading scratch
  if (lane == CT_WARP - 1) scratch[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    uint32_t t = lane < nwarps ? scratch[lane] : 0u;
    for (int d = 1; d < CT_WARP; d <<= 1) {
      const uint32_t o = __shfl_up_sync(0xffffffffu, t, d);
      if (lane >= d) t += o;
    }
    scratch[lane] = t;  // inclusive over warps (every lane read its slot before the shuffles)
  }
  __syncthreads();
  *total = scratch[nwarps - 1];
  return (warp > 0 ? scratch[warp - 1] : 0u) + incl - v;
}

// Sort key of token i with value key k: descending order = key descending, then id ascending.
__device__ __forceinline__ unsigned long long ct_cand(uint32_t k, int i) {
  return (static_cast<unsigned long long>(k) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(i));
}
__device__ __forceinline__ int ct_cand_id(unsigned long long c) {
  return static_cast<int>(0xFFFFFFFFu - static_cast<uint32_t>(c & 0xFFFFFFFFull));
}

extern "C" __global__ void __launch_bounds__(CT_ROW_THREADS) ct_sample_topk(ct_sample_params p) {
  CT_SHARED(unsigned long long, cand, CT_TOPK_CAP);  // (N) sorted candidates, best first
  CT_SHARED(float, wts, CT_TOPK_CAP);                // (N) exp(z/T - max) of each candidate
  CT_SHARED(uint32_t, hist, 256);
  CT_SHARED(uint32_t, scratch, 32);
  CT_SHARED_VAR(uint32_t, sel_prefix);
  CT_SHARED_VAR(uint32_t, sel_remaining);
  const int row = blockIdx.x;
  if (row >= p.rows) return;
  const ct_sample_row sp = p.params[row];
  if (!sp.truncated) return;
  const int V = p.vocab, tid = threadIdx.x;
  const float T = sp.temperature;
  const bool truncate_k = sp.top_k > 0 && sp.top_k < static_cast<uint32_t>(V);
  if (!(T > 0.0f) || (truncate_k && sp.top_k > CT_TOPK_CAP)) {
    if (tid == 0) p.host_rows[row] = 1;
    return;
  }
  const int k_eff = truncate_k ? static_cast<int>(sp.top_k) : V;  // the CPU's k
  const int N = min(k_eff, CT_TOPK_CAP);
  const float* z = p.logits + static_cast<int64_t>(row) * V;
  const RowStats st = ct_row_stats(z, V, T, nullptr);

  // 1. Radix select, most significant digit first: after the loop, `prefix` is the key of the
  //    N-th best token and `remaining` how many tokens with exactly that key belong to the top N.
  uint32_t prefix = 0, mask = 0, remaining = static_cast<uint32_t>(N);
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = tid; b < 256; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    for (int i = tid; i < V; i += blockDim.x) {
      const uint32_t k = ct_order_key(z[i]);
      if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 0xFFu], 1u);
    }
    __syncthreads();
    if (tid == 0) {
      uint32_t above = 0;
      int b = 255;
      for (; b > 0; b--) {
        if (above + hist[b] >= remaining) break;
        above += hist[b];
      }
      sel_prefix = prefix | (static_cast<uint32_t>(b) << shift);
      sel_remaining = remaining - above;
    }
    __syncthreads();
    prefix = sel_prefix;
    remaining = sel_remaining;
    mask |= 0xFFu << shift;
  }

  // 2. Gather: every thread scans its contiguous chunk of ids, so a block scan orders the ties
  //    by id. Tokens above the threshold fill [0, above), the first `remaining` ties follow.
  const int chunk = (V + blockDim.x - 1) / blockDim.x;
  const int begin = min(V, tid * chunk), end = min(V, begin + chunk);
  uint32_t n_gt = 0, n_eq = 0;
  for (int i = begin; i < end; i++) {
    const uint32_t k = ct_order_key(z[i]);
    n_gt += k > prefix;
    n_eq += k == prefix;
  }
  uint32_t total_gt = 0, total_eq = 0;
  uint32_t gt_at = ct_block_exclusive_scan(n_gt, scratch, &total_gt);
  uint32_t eq_at = ct_block_exclusive_scan(n_eq, scratch, &total_eq);
  const uint32_t above = static_cast<uint32_t>(N) - remaining;  // == total_gt
  for (int i = begin; i < end; i++) {
    const uint32_t k = ct_order_key(z[i]);
    if (k > prefix) {
      cand[gt_at++] = ct_cand(k, i);
    } else if (k == prefix) {
      if (eq_at < remaining) cand[above + eq_at] = ct_cand(k, i);
      eq_at++;
    }
  }
  int P = 1;
  while (P < N) P <<= 1;
  for (int j = N + tid; j < P; j += blockDim.x) cand[j] = 0ull;  // below every real candidate
  __syncthreads();

  // Bitonic sort of cand[0, P), descending.
  for (int size = 2; size <= P; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = tid; i < P; i += blockDim.x) {
        const int j = i ^ stride;
        if (j > i) {
          const unsigned long long a = cand[i], b = cand[j];
          const bool descending = (i & size) == 0;
          if (descending ? a < b : a > b) {
            cand[i] = b;
            cand[j] = a;
          }
        }
      }
      __syncthreads();
    }
  }
  for (int j = tid; j < N; j += blockDim.x) wts[j] = ct_exp_f32(__fsub_rn(__fdiv_rn(z[ct_cand_id(cand[j])], T), st.mx));
  __syncthreads();

  // 3. The CPU's walk (sample.rs), on one thread.
  if (tid != 0) return;
  double cand_total = 0.0;
  if (truncate_k) {
    for (int j = 0; j < N; j++) cand_total += static_cast<double>(wts[j]);
  } else {
    cand_total = exp(log(st.sum));
  }
  const double goal = static_cast<double>(sp.top_p) * cand_total;
  double kept_sum = 0.0;
  int kept = -1;
  for (int j = 0; j < N; j++) {
    kept_sum += static_cast<double>(wts[j]);
    if (kept_sum >= goal || (sp.top_p >= 1.0f && j + 1 == N)) {
      kept = j + 1;
      break;
    }
  }
  if (kept < 0) {
    if (N < k_eff) {  // the prefix is longer than the sorted candidates
      p.host_rows[row] = 1;
      return;
    }
    kept = N;  // rounding left the mass just short of the goal: keep every candidate
  }
  const uint4 r = ct_philox(make_uint4(sp.position, sp.sample, static_cast<uint32_t>(sp.request),
                                       static_cast<uint32_t>(sp.request >> 32)),
                            ct_seed_key(sp.seed));
  const double target = ct_uniform_f64(r.x, r.y) * kept_sum;
  double acc = 0.0;
  int pick = ct_cand_id(cand[0]);
  for (int j = 0; j < kept; j++) {
    const double wi = static_cast<double>(wts[j]);
    const int id = ct_cand_id(cand[j]);
    if (wi > 0.0) pick = id;
    acc += wi;
    if (acc > target) {
      pick = id;
      break;
    }
  }
  p.tokens[row] = static_cast<uint32_t>(pick);
  p.logprobs[row] = static_cast<float>(static_cast<double>(__fsub_rn(__fdiv_rn(z[pick], T), st.mx)) - log(kept_sum));
  p.host_rows[row] = 0;
}
