// norm.cu: RMSNorm (plain, fused residual add, per-head). CPU twin: src/ops/norm/cpu.rs
// (rmsnorm, add_rmsnorm, head_rmsnorm); launcher: src/ops/norm/cuda.rs. All arithmetic in f32 as
// on the CPU; the sum of squares is a parallel reduction (a different summation order from the
// CPU's sequential sum, so results agree to rounding, not bit for bit). Not yet run on a GPU.
#include "common.cuh"
// One block per row; blockDim.x (256, NORM_THREADS in kernels.rs) threads stride over the columns.
extern "C" __global__ void __launch_bounds__(256) ct_rmsnorm(ct_rmsnorm_params p) {
  CT_SHARED(float, scratch, 32);
  const int row = blockIdx.x;
  if (row >= p.rows) return;
  float* x = p.x + static_cast<int64_t>(row) * p.cols;
  const int64_t y0 = static_cast<int64_t>(row) * p.cols;
  const float* r = p.r ? p.r + static_cast<int64_t>(row) * p.cols : nullptr;
  float ss = 0.0f;
  for (int j = threadIdx.x; j < p.cols; j += blockDim.x) {
    float v = x[j];
    if (r) {
      v = __fadd_rn(v, r[j]);
      x[j] = v;
    }
    ss = __fadd_rn(ss, __fmul_rn(v, v));
  }
  const float rstd = ct_rms_rstd(ss, p.cols, p.eps, scratch);
  for (int j = threadIdx.x; j < p.cols; j += blockDim.x) {
    // The same thread wrote x[j] above (when r): no cross-thread dependency.
    ct_store(p.y, p.y_dtype, y0 + j, __fmul_rn(__fmul_rn(x[j], rstd), ct_load(p.w, p.w_dtype, j)));
  }
}
