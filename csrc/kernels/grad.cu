// grad.cu: the backward kernels of the layers around the GEMMs, for training on the device.
// CPU twins (src/ops/<op>/grad.rs, the trainer's f32 loops):
//   ct_rmsnorm_train, ct_rmsnorm_bwd, ct_rmsnorm_dw <- ops/norm/grad.rs fwd / bwd (the row sums
//       reduced across the block: equal within f32 rounding; dw in the chunked order of
//       ops::reduction_chunk_rows, as the CPU: bit-exact)
//   ct_swiglu_bwd   <- ops/elementwise/grad.rs swiglu_bwd (CUDA's expf vs the host's exp: ulps)
//   ct_rope_bwd     <- ops/rope/grad.rs bwd (rotation by -angle; bit-exact, ct_rope_params)
//   ct_col_sum      <- ops/linear/grad.rs bias_grad (the chunked order: bit-exact)
//   ct_embed_bwd    <- ops/elementwise/grad.rs embed_bwd (tokens in order: bit-exact)
// Not yet run on a GPU.
#include "common.cuh"

// One block per row.
extern "C" __global__ void ct_rmsnorm_train(ct_rmsnorm_train_params p) {
  CT_SHARED(float, scratch, 32);
  const int64_t row = blockIdx.x;
  const float* x = p.x + row * p.cols;
  const int64_t y0 = row * p.cols;
  float ss = 0.0f;
  for (int j = threadIdx.x; j < p.cols; j += blockDim.x) ss = __fadd_rn(ss, __fmul_rn(x[j], x[j]));
  ss = ct_block_sum(ss, scratch);
  const float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, static_cast<float>(p.cols)), p.eps)));
  for (int j = threadIdx.x; j < p.cols; j += blockDim.x)
    ct_store(p.y, p.y_dtype, y0 + j, __fmul_rn(__fmul_rn(x[j], r), ct_load(p.w, p.w_dtype, j)));
  if (threadIdx.x == 0) p.rstd[row] = r;
}

// One block per row.
extern "C" __global__ void ct_rmsnorm_bwd(ct_rmsnorm_bwd_params p) {
  CT_SHARED(float, scratch, 32);
  const int64_t row = blockIdx.x;
  const float* x = p.x + row * p.cols;
  const float* dy = p.dy + row * p.cols;
  float* dx = p.dx + row * p.cols;
  const float r = p.rstd[row];
  float dot = 0.0f;
  for (int j = threadIdx.x; j < p.cols; j += blockDim.x) dot = __fadd_rn(dot, __fmul_rn(__fmul_rn(ct_load(p.w, p.w_dtype, j), dy[j]), x[j]));
  dot = ct_block_sum(dot, scratch);
  const float k = __fdiv_rn(__fmul_rn(__fmul_rn(__fmul_rn(r, r), r), dot), static_cast<float>(p.cols));
  for (int j = threadIdx.x; j < p.cols; j += blockDim.x) {
    const float g = __fsub_rn(__fmul_rn(__fmul_rn(r, ct_load(p.w, p.w_dtype, j)), dy[j]), __fmul_rn(k, x[j]));
    dx[j] = p.accumulate ? __fadd_rn(dx[j], g) : g;
  }
}

// Grid (column blocks, chunks): one thread per (column, chunk), the chunk's rows in order,
// from 0 into partial; partial NULL (one chunk of every row): from dw[j] onto dw.
extern "C" __global__ void ct_rmsnorm_dw(ct_rmsnorm_bwd_params p) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= p.cols) return;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * p.chunk_rows;
  const int64_t r1 = min(r0 + p.chunk_rows, static_cast<int64_t>(p.rows));
  float acc = p.partial == nullptr ? p.dw[j] : 0.0f;
  for (int64_t row = r0; row < r1; row++) {
    const int64_t i = row * p.cols + j;
    acc = __fadd_rn(acc, __fmul_rn(__fmul_rn(p.dy[i], p.x[i]), p.rstd[row]));
  }
  if (p.partial == nullptr) p.dw[j] = acc;
  else p.partial[static_cast<int64_t>(blockIdx.y) * p.cols + j] = acc;
}

extern "C" __global__ void ct_swiglu_bwd(ct_swiglu_bwd_params p) {
  CT_GRID_LOOP(i, p.n) {
    const float g = p.g[i], da = p.da[i];
    const float s = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-g)));
    ct_store(p.du, p.out_dtype, i, __fmul_rn(da, __fmul_rn(g, s)));
    ct_store(p.dg, p.out_dtype, i,
             __fmul_rn(__fmul_rn(__fmul_rn(da, p.u[i]), s), __fadd_rn(1.0f, __fmul_rn(g, __fsub_rn(1.0f, s)))));
  }
}

// One thread per (row, head, i < half): rotates the pair (i, i + half) by -angle.
extern "C" __global__ void ct_rope_bwd(ct_rope_params p) {
  const int64_t n = static_cast<int64_t>(p.rows) * p.heads * p.half;
  CT_GRID_LOOP(idx, n) {
    const int i = static_cast<int>(idx % p.half);
    const int64_t rh = idx / p.half;
    const int64_t row = rh / p.heads;
    float* h = p.x + rh * 2 * p.half;
    const float c = p.cos[row * p.half + i], s = -p.sin[row * p.half + i];
    const float a = h[i], b = h[i + p.half];
    h[i] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    h[i + p.half] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
  }
}

// Grid (column blocks, chunks): one thread per (column, chunk), the chunk's rows in order,
// from 0 into partial; partial NULL (one chunk of every row): from out[j] onto out.
extern "C" __global__ void ct_col_sum(ct_col_sum_params p) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= p.cols) return;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * p.chunk_rows;
  const int64_t r1 = min(r0 + p.chunk_rows, static_cast<int64_t>(p.rows));
  float acc = p.partial == nullptr ? p.out[j] : 0.0f;
  for (int64_t row = r0; row < r1; row++) acc = __fadd_rn(acc, p.x[row * p.cols + j]);
  if (p.partial == nullptr) p.out[j] = acc;
  else p.partial[static_cast<int64_t>(blockIdx.y) * p.cols + j] = acc;
}

// One thread per column, tokens in order.
extern "C" __global__ void ct_embed_bwd(ct_embed_bwd_params p) {
  CT_GRID_LOOP(j, static_cast<int64_t>(p.cols)) {
    for (int64_t t = 0; t < p.tokens; t++) {
      const uint32_t id = p.ids[t];
      if (p.has_skip && id == p.skip) continue;
      if (id >= static_cast<uint32_t>(p.vocab)) {
        ct_set_error(p.err, CT_ERR_TOKEN_ID);
        continue;
      }
      float* o = p.dtable + static_cast<int64_t>(id) * p.cols + j;
      *o = __fadd_rn(*o, p.dx[t * p.cols + j]);
    }
  }
}
