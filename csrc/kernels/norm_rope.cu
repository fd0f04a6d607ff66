// norm_rope.cu: RMSNorm (plain, fused residual add, per-head) and rotary embeddings.
// CPU twins: src/ops/norm.rs (rmsnorm, add_rmsnorm, head_rmsnorm) and src/ops/rope.rs
// (rope_table, rope). All arithmetic in f32 as on the CPU; the RMSNorm sum of squares is a
// parallel reduction (a different summation order from the CPU's sequential sum, so results
// agree to rounding, not bit for bit). rope is bit-exact with the CPU (same operation order, no
// FMA contraction). rope_table computes the same f32 angle and evaluates cos/sin in double
// like the CPU, but CUDA's double cos/sin (<= 2 ulp) and the host libm may differ in the last
// f64 bit, which changes the f32 result only when it lies that close to a rounding boundary
// (rare). Not yet run on a GPU.
#include "common.cuh"

// One block per row; blockDim.x (256, NORM_THREADS in kernels.rs) threads stride over the columns.
extern "C" __global__ void __launch_bounds__(256) ct_rmsnorm(ct_rmsnorm_params p) {
  CT_SHARED(float, scratch, 32);
  const int row = blockIdx.x;
  if (row >= p.rows) return;
  float* x = p.x + static_cast<int64_t>(row) * p.cols;
  float* y = p.y + static_cast<int64_t>(row) * p.cols;
  const float* r = p.r ? p.r + static_cast<int64_t>(row) * p.cols : nullptr;
  float ss = 0.0f;
  for (int j = threadIdx.x; j < p.cols; j += blockDim.x) {
    float v = x[j];
    if (r) {
      v = __fadd_rn(v, r[j]);
      x[j] = v;
    }
    ss += v * v;
  }
  ss = ct_block_sum(ss, scratch);
  // rstd = 1 / sqrt(ss / C + eps), each step rounded as on the CPU.
  const float rstd = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, static_cast<float>(p.cols)), p.eps)));
  for (int j = threadIdx.x; j < p.cols; j += blockDim.x) {
    // The same thread wrote x[j] above (when r): no cross-thread dependency.
    y[j] = __fmul_rn(__fmul_rn(x[j], rstd), ct_load(p.w, p.w_dtype, j));
  }
}

// One thread per (row, i < half).
extern "C" __global__ void ct_rope_table(ct_rope_table_params p) {
  const int64_t n = static_cast<int64_t>(p.rows) * p.half;
  CT_GRID_LOOP(idx, n) {
    const int64_t row = idx / p.half;
    const int i = static_cast<int>(idx % p.half);
    const float a = __fmul_rn(static_cast<float>(p.pos[row]), p.inv_freq[i]);
    const double ad = static_cast<double>(a);
    p.cos[idx] = static_cast<float>(cos(ad));
    p.sin[idx] = static_cast<float>(sin(ad));
  }
}

// One thread per (row, head, i < half): rotates the pair (i, i + half).
extern "C" __global__ void ct_rope(ct_rope_params p) {
  const int64_t n = static_cast<int64_t>(p.rows) * p.heads * p.half;
  CT_GRID_LOOP(idx, n) {
    const int i = static_cast<int>(idx % p.half);
    const int64_t rh = idx / p.half;  // row * heads + head
    const int64_t row = rh / p.heads;
    float* h = p.x + rh * 2 * p.half;
    const float c = p.cos[row * p.half + i], s = p.sin[row * p.half + i];
    const float a = h[i], b = h[i + p.half];
    h[i] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    h[i + p.half] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
  }
}
