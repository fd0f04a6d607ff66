// lm_head.cu: the fused LM-head loss, one chunk of rows at a time (src/ops/lm_head/cuda.rs runs
// the GEMMs around it: z = h.Wh^T before, dWh += dz^T.h and dh = dz.Wh after). CPU twin:
// src/ops/lm_head/grad.rs (normalize + stats, grad_centered), the same formulas; the sums here
// are in double and reduced across the block (the CPU sums f32 in row order), the exponential
// is common.cuh's ct_exp_f32: equal to the CPU within the device check's tolerances, not bit
// for bit. Not yet run on a GPU.
#include "common.cuh"

#define CT_LM_THREADS 1024

// The row's coefficient at ratio 1 from its log-prob lp (the header's one pass): the double
// operations of src/objective/opd.rs (w * ((teacher - logp) + offset), the ratio's factor 1
// left out: exact), sft.rs (w) and grpo.rs's base with TIS (((w * v) * a) * rho), each
// correctly rounded and none contracted into an FMA.
__device__ __forceinline__ float ct_lm_coef(const ct_lm_params& p, int row, float lp) {
  const uint32_t den = p.coef_den[row];
  const double w = den == 0u ? 0.0 : __ddiv_rn(1.0, static_cast<double>(den));
  if (p.coef_adv != nullptr) {
    const double l = static_cast<double>(lp);
    const double v = fmin(exp(__dsub_rn(l, static_cast<double>(p.coef_sampler[row]))), p.coef_cap);
    const double rho = exp(__dsub_rn(l, l));
    return __double2float_rn(__dmul_rn(__dmul_rn(__dmul_rn(w, v), p.coef_adv[row]), rho));
  }
  if (p.coef_teacher == nullptr) return __double2float_rn(w);
  const double a = __dsub_rn(static_cast<double>(p.coef_teacher[row]), static_cast<double>(lp));
  return __double2float_rn(__dmul_rn(w, __dadd_rn(a, p.coef_offset)));
}

// One block of CT_LM_THREADS per row.
extern "C" __global__ void __launch_bounds__(CT_LM_THREADS) ct_lm_stats(ct_lm_params p) {
  CT_SHARED(float, fscratch, 32);
  CT_SHARED(double, dscratch, 32);
  const int row = blockIdx.x;
  float* z = p.z + static_cast<int64_t>(row) * p.vocab;
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < p.vocab; j += blockDim.x) {
    const float x = __fmul_rn(z[j], p.inv_t);
    z[j] = x;
    mx = fmaxf(mx, x);
  }
  mx = ct_block_max(mx, fscratch);
  double s = 0.0;
  for (int j = threadIdx.x; j < p.vocab; j += blockDim.x) s += static_cast<double>(ct_exp_f32(__fsub_rn(z[j], mx)));
  s = ct_block_sum_f64(s, dscratch);
  const float lse = static_cast<float>(static_cast<double>(mx) + log(s));
  double e = 0.0;
  if (p.entropy != nullptr) {
    for (int j = threadIdx.x; j < p.vocab; j += blockDim.x) {
      e += static_cast<double>(ct_exp_f32(__fsub_rn(z[j], lse))) * static_cast<double>(z[j]);
    }
    e = ct_block_sum_f64(e, dscratch);
  }
  if (threadIdx.x == 0) {
    p.lse[row] = lse;
    if (p.entropy != nullptr) p.entropy[row] = static_cast<float>(static_cast<double>(lse) - e);
    if (p.logp != nullptr || p.coef_den != nullptr) {
      const uint32_t y = p.targets[row];
      float lp = __uint_as_float(0x7FC00000u);
      if (y >= static_cast<uint32_t>(p.vocab)) {
        ct_set_error(p.err, CT_ERR_TARGET);
      } else {
        lp = __fsub_rn(z[y], lse);
      }
      if (p.logp != nullptr) p.logp[row] = lp;
      if (p.coef_den != nullptr) p.coef_out[row] = ct_lm_coef(p, row, lp);
    }
  }
}

// One block per row; after ct_lm_stats on the same z.
extern "C" __global__ void ct_lm_dz(ct_lm_params p) {
  const int row = blockIdx.x;
  float* z = p.z + static_cast<int64_t>(row) * p.vocab;
  const float l = p.lse[row], c = p.coef[row];
  const float k = __fmul_rn(c, p.inv_t);
  const uint32_t y = p.targets[row];
  const bool ok = y < static_cast<uint32_t>(p.vocab);
  if (threadIdx.x == 0) {
    if (!ok) ct_set_error(p.err, CT_ERR_TARGET);
    float loss = ok ? -__fmul_rn(c, __fsub_rn(z[y], l)) : __uint_as_float(0x7FC00000u);
    for (int i = 0; i < p.center_k; i++) {
      const int64_t at = static_cast<int64_t>(row) * p.center_k + i;
      const uint32_t id = p.center_ids[at];
      if (id >= static_cast<uint32_t>(p.vocab)) {
        ct_set_error(p.err, CT_ERR_TARGET);
        continue;
      }
      loss = __fadd_rn(loss, __fmul_rn(__fmul_rn(c, p.center_probs[at]), __fsub_rn(z[id], l)));
    }
    p.loss[row] = loss;
  }
  __syncthreads();
  if (p.dz_bf16 != nullptr) {
    // The same f32 values as below (the target's k subtracted), stored rounded to BF16.
    for (int j = threadIdx.x; j < p.vocab; j += blockDim.x) {
      float g = __fmul_rn(k, ct_exp_f32(__fsub_rn(z[j], l)));
      if (ok && static_cast<uint32_t>(j) == y) g = __fsub_rn(g, k);
      ct_store(p.dz_bf16, CT_DTYPE_BF16, static_cast<int64_t>(row) * p.vocab + j, g);
    }
    return;
  }
  for (int j = threadIdx.x; j < p.vocab; j += blockDim.x) {
    z[j] = p.center_k > 0 ? 0.0f : __fmul_rn(k, ct_exp_f32(__fsub_rn(z[j], l)));
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int i = 0; i < p.center_k; i++) {
      const int64_t at = static_cast<int64_t>(row) * p.center_k + i;
      const uint32_t id = p.center_ids[at];
      if (id < static_cast<uint32_t>(p.vocab)) z[id] = __fadd_rn(z[id], __fmul_rn(k, p.center_probs[at]));
    }
    if (ok) z[y] = __fsub_rn(z[y], k);
  }
}
