// optimizer.cu: the optimizer step on the device, over the FP32 master, its moments and the
// flat gradient, in chunks of one tensor each (multi-tensor: one launch for every parameter).
// CPU twins (bit-exact: the same f32 operations in the same order, _rn intrinsics so nvcc
// never contracts them into FMAs):
//   ct_optim          <- src/ops/optim/cpu.rs update (AdamW / SGD, clipping) and compute_from_master
//                        (the compute weights rounded from the master, each tensor's amax of them)
//   ct_sum_sq(+finish) <- src/ops/optim/cpu.rs sum_sq (f64; the order differs, so not bitwise)
// The compute weights are each parameter's own tensor (the engine's buffers): each chunk
// carries the address of its part, so one launch covers every parameter.
// The per-tensor amax is what a quantized engine's in-place requantize needs before it can
// quantize (FP8's scale, NVFP4's global scale): reduced here while the weights are written,
// the requantize reads the weights once. (The per-16 NVFP4 block amax needs no pass of its
// own: the quantize kernel reads the 16 values of a block anyway.) Not yet run on a GPU.
#include "common.cuh"

extern "C" __global__ void ct_sum_sq(ct_sum_sq_params p) {
  CT_SHARED(double, scratch, 32);
  const int64_t start = static_cast<int64_t>(blockIdx.x) * p.per_block;
  const int64_t end = min(p.n, start + p.per_block);
  double acc = 0.0;
  for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) {
    const double g = static_cast<double>(p.g[i]);
    acc += g * g;
  }
  const double total = ct_block_sum_f64(acc, scratch);
  if (threadIdx.x == 0) p.partial[blockIdx.x] = total;
}

// One block.
extern "C" __global__ void ct_sum_sq_finish(ct_sum_sq_params p) {
  CT_SHARED(double, scratch, 32);
  double acc = 0.0;
  for (int i = threadIdx.x; i < p.blocks; i += blockDim.x) acc += p.partial[i];
  const double total = ct_block_sum_f64(acc, scratch);
  if (threadIdx.x == 0) p.out[0] = total;
}

// One block per chunk; every thread reaches the block reduction (no early return).
extern "C" __global__ void ct_optim(ct_optim_params p) {
  CT_SHARED(float, scratch, 32);
  const ct_opt_chunk c = p.chunks[blockIdx.x];
  float amax = 0.0f;
  for (int32_t j = threadIdx.x; j < c.len; j += blockDim.x) {
    const int64_t i = c.start + j;
    const float g = __fmul_rn(p.grad[i], p.clip);
    p.grad[i] = g;
    float w = p.master[i];
    if (p.adamw) {
      w = __fmul_rn(w, p.decay);
      const float m = __fadd_rn(__fmul_rn(p.b1, p.m[i]), __fmul_rn(p.omb1, g));
      const float v = __fadd_rn(__fmul_rn(p.b2, p.v[i]), __fmul_rn(__fmul_rn(p.omb2, g), g));
      p.m[i] = m;
      p.v[i] = v;
      const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), p.bc2_sqrt), p.eps);
      w = __fsub_rn(w, __fdiv_rn(__fmul_rn(p.step_size, m), denom));
    } else {
      const float gd = p.wd != 0.0f ? __fadd_rn(g, __fmul_rn(p.wd, w)) : g;
      w = __fsub_rn(w, __fmul_rn(p.lr, gd));
    }
    p.master[i] = w;
    if (c.compute != nullptr) {
      ct_store(c.compute, p.compute_dtype, j, w);
      amax = fmaxf(amax, fabsf(ct_load(c.compute, p.compute_dtype, j)));
    }
  }
  if (p.amax_bits != nullptr) {
    const float m = ct_block_max(amax, scratch);
    if (threadIdx.x == 0) atomicMax(&p.amax_bits[c.tensor], __float_as_uint(m));
  }
}
