// elementwise.cu: row-wise data movement and activations.
// CPU twins: src/ops/elementwise/cpu.rs (embedding, swiglu, gather_rows); the bias add and the f32
// -> BF16/F16 cast are the pieces of src/ops/linear/cuda.rs's linear that run around the cuBLASLt
// GEMM (bias: y += b as in the CPU loop; cast: the GEMM's BF16 input, round to nearest even as
// half::bf16::from_f32). fill_normal has no CPU twin: it makes the device check's random inputs.
// Out-of-range ids are reported through the error word and their rows set to NaN (the CPU
// twin returns an error before writing). ct_scatter_add_rows is the fused loss's dh[rows] += dhc
// (src/ops/lm_head/grad.rs grad_centered's last loop). Not yet run on a GPU.
#include "common.cuh"

// One thread per output element (row, col).
extern "C" __global__ void ct_embedding(ct_embedding_params p) {
  const int64_t n = static_cast<int64_t>(p.rows) * p.cols;
  CT_GRID_LOOP(idx, n) {
    const int64_t row = idx / p.cols, col = idx % p.cols;
    const uint32_t id = p.ids[row];
    if (id >= static_cast<uint32_t>(p.vocab)) {
      ct_set_error(p.err, CT_ERR_TOKEN_ID);
      p.out[idx] = __uint_as_float(0x7FC00000u);
    } else {
      p.out[idx] = ct_load(p.table, p.dtype, static_cast<int64_t>(id) * p.cols + col);
    }
  }
}

// silu(g) * u with silu(g) = g / (1 + exp(-g)), exp being ct_exp_f32: the CPU's bits.
extern "C" __global__ void ct_swiglu(ct_swiglu_params p) {
  CT_GRID_LOOP(i, p.n) {
    ct_store(p.out, p.out_dtype, i, ct_silu_mul(p.gate[i], p.up[i]));
  }
}

extern "C" __global__ void ct_gather_rows(ct_gather_rows_params p) {
  const int64_t n = static_cast<int64_t>(p.rows) * p.cols;
  CT_GRID_LOOP(idx, n) {
    const int64_t row = idx / p.cols, col = idx % p.cols;
    const uint32_t src_row = p.idx[row];
    if (src_row >= static_cast<uint32_t>(p.src_rows)) {
      ct_set_error(p.err, CT_ERR_GATHER_ROW);
      p.dst[idx] = __uint_as_float(0x7FC00000u);
    } else {
      p.dst[idx] = p.src[static_cast<int64_t>(src_row) * p.cols + col];
    }
  }
}

// One thread per (row, column of the three segments side by side).
extern "C" __global__ void ct_add_bias(ct_add_bias_params p) {
  const int64_t w = static_cast<int64_t>(p.cols0) + p.cols1 + p.cols2;
  const int64_t n = static_cast<int64_t>(p.rows) * w;
  CT_GRID_LOOP(idx, n) {
    const int64_t row = idx / w;
    int64_t col = idx % w;
    float* y = p.y0;
    const void* b = p.bias0;
    int64_t cols = p.cols0;
    if (col >= p.cols0) {
      col -= p.cols0;
      if (col < p.cols1) {
        y = p.y1;
        b = p.bias1;
        cols = p.cols1;
      } else {
        col -= p.cols1;
        y = p.y2;
        b = p.bias2;
        cols = p.cols2;
      }
    }
    y[row * cols + col] = __fadd_rn(y[row * cols + col], ct_load(b, p.dtype, col));
  }
}

// ct_quant_nvfp4's global scale from an amax (or the fixed value when positive).
__device__ __forceinline__ float ct_nvfp4_global(const uint32_t* amax_bits, int64_t slot, float fixed) {
  if (fixed > 0.0f) return fixed;
  const float amax = __uint_as_float(amax_bits[slot]);
  return amax > 0.0f ? __fdiv_rn(amax, 2688.0f) : 1.0f;
}

// One thread per value, or with rht per 16-column block; with scalars, one thread.
extern "C" __global__ void ct_nvfp4_scale_out(ct_nvfp4_scale_out_params p) {
  const int64_t n = static_cast<int64_t>(p.rows) * p.cols;
  const float gc = ct_nvfp4_global(p.col_amax, 0, p.col_fixed);
  if (p.scalars) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      p.scalars[0] = __fmul_rn(ct_nvfp4_global(p.row_amax, 0, p.row_fixed), gc);
      p.scalars[1] = p.accumulate ? 1.0f : 0.0f;
    }
    return;
  }
  if (!p.rht) {
    CT_GRID_LOOP(idx, n) {
      const int64_t row = idx / p.cols;
      const float gr = ct_nvfp4_global(p.row_amax, p.per_row ? row : 0, p.row_fixed);
      const float v = __fmul_rn(__fmul_rn(p.src[idx], gr), gc);
      p.dst[idx] = p.accumulate ? __fadd_rn(p.dst[idx], v) : v;
    }
    return;
  }
  const float ones[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  CT_GRID_LOOP(b, n / 16) {
    const int64_t row = (b * 16) / p.cols;
    const float gr = ct_nvfp4_global(p.row_amax, p.per_row ? row : 0, p.row_fixed);
    float y[16];
#pragma unroll
    for (int i = 0; i < 16; i++) y[i] = __fmul_rn(__fmul_rn(p.src[b * 16 + i], gr), gc);
    ct_rht16(y, ones);
#pragma unroll
    for (int i = 0; i < 16; i++) {
      const float v = __fmul_rn(y[i], p.signs[i]);
      p.dst[b * 16 + i] = p.accumulate ? __fadd_rn(p.dst[b * 16 + i], v) : v;
    }
  }
}

extern "C" __global__ void ct_cast(ct_cast_params p) {
  if (p.row_amax) {
    CT_GRID_LOOP(i, p.n) { ct_store(p.y, p.dtype, i, __fmul_rn(p.x[i], ct_nvfp4_global(p.row_amax, i / p.cols, 0.0f))); }
    return;
  }
  CT_GRID_LOOP(i, p.n) { ct_store(p.y, p.dtype, i, p.x[i]); }
}

// Box-Muller on Philox uniforms: pair i/2 uses block (i/2, stream) of key seed.
extern "C" __global__ void ct_fill_normal(ct_fill_normal_params p) {
  const int64_t pairs = (p.n + 1) / 2;
  CT_GRID_LOOP(j, pairs) {
    const uint4 r = ct_philox(make_uint4(static_cast<uint32_t>(j), static_cast<uint32_t>(j >> 32),
                                         static_cast<uint32_t>(p.stream), static_cast<uint32_t>(p.stream >> 32)),
                              ct_seed_key(p.seed));
    const double u1 = 1.0 - ct_uniform_f64(r.x, r.y);  // (0, 1]
    const double u2 = ct_uniform_f64(r.z, r.w);
    const double rad = sqrt(-2.0 * log(u1));
    const double z0 = rad * cos(6.283185307179586 * u2), z1 = rad * sin(6.283185307179586 * u2);
    ct_store(p.out, p.dtype, 2 * j, p.mean + p.std * static_cast<float>(z0));
    if (2 * j + 1 < p.n) ct_store(p.out, p.dtype, 2 * j + 1, p.mean + p.std * static_cast<float>(z1));
  }
}

// Grid-stride over rows x cols; the destination rows are distinct (see the header), so each
// value has one writer.
extern "C" __global__ void ct_scatter_add_rows(ct_scatter_add_rows_params p) {
  const int64_t n = static_cast<int64_t>(p.rows) * p.cols;
  CT_GRID_LOOP(i, n) {
    const int64_t r = i / p.cols, c = i % p.cols;
    const uint32_t d = p.idx[r];
    if (d >= static_cast<uint32_t>(p.dst_rows)) {
      ct_set_error(p.err, CT_ERR_GATHER_ROW);
      continue;
    }
    float* o = p.dst + static_cast<int64_t>(d) * p.cols + c;
    *o = __fadd_rn(*o, p.src[i]);
  }
}
