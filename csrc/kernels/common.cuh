// common.cuh: device helpers shared by the kernels in csrc/kernels/: element loads by dtype,
// block reductions, and bit-exact ports of the CPU's number formats and random numbers:
//   - ct_e4m3_encode / ct_e4m3_decode   <- src/formats/fp8.rs (encode_e4m3_fast, E4M3.encode/decode)
//   - ct_e2m1_encode / ct_e2m1_sr       <- src/formats/fp8.rs encode_e2m1_fast, nvfp4.rs sr_e2m1
//   - ct_rht16                          <- src/formats/nvfp4.rs rht_block
//   - ct_philox / ct_uniform_f64        <- src/rand.rs philox4x32_10, uniform_f64
//   - ct_exp_f32                        <- src/ops/vecmath.rs exp_f32 (softmax, SwiGLU)
// Bit-exactness needs the same f32 operations in the same order, so these use the _rn
// intrinsics, which nvcc never contracts into FMAs. Not yet run on a GPU.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "colotrain_kernels.h"

#define CT_WARP 32

// Shared memory of a kernel: dynamic, a static array, a static scalar. The host emulation
// defines its own (it poisons the static ones before each block's first use).
#ifndef CT_DYNAMIC_SMEM
#define CT_DYNAMIC_SMEM(T, name) extern __shared__ T name[]
#define CT_SHARED(T, name, n) __shared__ T name[n]
#define CT_SHARED_VAR(T, name) __shared__ T name
#endif

__device__ __forceinline__ float ct_load(const void* p, int dtype, int64_t i) {
  switch (dtype) {
    case CT_DTYPE_BF16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case CT_DTYPE_F16:
      return __half2float(static_cast<const __half*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

__device__ __forceinline__ void ct_store(void* p, int dtype, int64_t i, float v) {
  switch (dtype) {
    case CT_DTYPE_BF16:
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
      break;
    case CT_DTYPE_F16:
      static_cast<__half*>(p)[i] = __float2half_rn(v);
      break;
    default:
      static_cast<float*>(p)[i] = v;
  }
}

// Records the first error code of this launch sequence (the host resets the word to 0).
__device__ __forceinline__ void ct_set_error(uint32_t* err, uint32_t code) {
  if (err != nullptr) atomicCAS(err, 0u, code);
}

// ---- reductions (blockDim.x a multiple of 32, at most 1024) ---------------------------------

__device__ __forceinline__ float ct_warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ double ct_warp_sum_f64(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// max ignoring NaN (like Rust's f32::max).
__device__ __forceinline__ float ct_warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide sum; `scratch` holds 32 floats. Every thread gets the result.
__device__ __forceinline__ float ct_block_sum(float v, float* scratch) {
  const int lane = threadIdx.x % CT_WARP, warp = threadIdx.x / CT_WARP;
  const int nwarps = (blockDim.x + CT_WARP - 1) / CT_WARP;
  v = ct_warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float t = lane < nwarps ? scratch[lane] : 0.0f;
  return ct_warp_sum(t);
}

// RMSNorm's 1 / sqrt(mean(x²) + eps) from each thread's partial sum of squares `ss` (every
// thread of the block calls it): the block sum, then each step rounded as on the CPU. One
// definition for ct_rmsnorm and ct_qk_rope_kv, so a head's norm has the same bits in both.
__device__ __forceinline__ float ct_rms_rstd(float ss, int cols, float eps, float* scratch) {
  ss = ct_block_sum(ss, scratch);
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, static_cast<float>(cols)), eps)));
}

// HF rotate_half RoPE of pair (i, i + half) of head h (ct_rope and ct_qk_rope_kv).
__device__ __forceinline__ void ct_rope_pair(float* h, int i, int half, float c, float s) {
  const float a = h[i], b = h[i + half];
  h[i] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
  h[i + half] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

__device__ __forceinline__ double ct_block_sum_f64(double v, double* scratch) {
  const int lane = threadIdx.x % CT_WARP, warp = threadIdx.x / CT_WARP;
  const int nwarps = (blockDim.x + CT_WARP - 1) / CT_WARP;
  v = ct_warp_sum_f64(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  double t = lane < nwarps ? scratch[lane] : 0.0;
  return ct_warp_sum_f64(t);
}

__device__ __forceinline__ float ct_block_max(float v, float* scratch) {
  const int lane = threadIdx.x % CT_WARP, warp = threadIdx.x / CT_WARP;
  const int nwarps = (blockDim.x + CT_WARP - 1) / CT_WARP;
  v = ct_warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float t = lane < nwarps ? scratch[lane] : -INFINITY;
  return ct_warp_max(t);
}

// src/ops/vecmath.rs exp_f32, bit for bit: the same f32 operations in the same order, the
// multiply-adds fused (__fmaf_rn), the constants spelled as there.
__device__ __forceinline__ float ct_exp_f32(float x) {
  if (isnan(x)) return x;
  if (x > 88.72283f) return INFINITY;
  const float xc = fmaxf(x, -104.0f);
  const float n = rintf(__fmul_rn(xc, 1.44269504088896340736f));
  float r = __fmaf_rn(-n, 0.6933594f, xc);
  r = __fmaf_rn(-n, -2.1219444e-4f, r);
  float p = 1.9875691e-4f;
  p = __fmaf_rn(p, r, 1.3981999e-3f);
  p = __fmaf_rn(p, r, 8.333452e-3f);
  p = __fmaf_rn(p, r, 4.1665796e-2f);
  p = __fmaf_rn(p, r, 1.6666665e-1f);
  p = __fmaf_rn(p, r, 0.5f);
  const float y = __fadd_rn(__fmaf_rn(p, __fmul_rn(r, r), r), 1.0f);
  const int ni = static_cast<int>(n);
  const int a = ni >> 1, b = ni - a;
  return __fmul_rn(__fmul_rn(y, __int_as_float((a + 127) << 23)), __int_as_float((b + 127) << 23));
}

// SwiGLU of one (gate, up) pair: silu(g) * u, src/ops/elementwise swiglu's f32 operations in
// its order (ct_swiglu, and the quantizers that read gate and up for a down projection's input).
__device__ __forceinline__ float ct_silu_mul(float g, float u) {
  return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, ct_exp_f32(-g))), u);
}

// Value i of a quantizer's input: x[i] in its dtype, or with `up` (f32 x = the gate) their
// SwiGLU.
__device__ __forceinline__ float ct_quant_input(const void* x, int dtype, const float* up, int64_t i) {
  return up ? ct_silu_mul(static_cast<const float*>(x)[i], up[i]) : ct_load(x, dtype, i);
}

// ---- attention ---------------------------------------------------------------------------

// One online-softmax step of one query over a tile of jn scores (flash-style): the running max
// *m and sum *l absorb the tile, the scores become their weights exp(s - m_new), and the
// returned factor rescales the running output. Masked scores are -inf and get weight 0.
__device__ __forceinline__ float ct_online_softmax(float* scores, int jn, float* m, float* l) {
  float tile_max = -INFINITY;
  for (int j = 0; j < jn; j++) tile_max = fmaxf(tile_max, scores[j]);
  const float m_new = fmaxf(*m, tile_max);
  const float c = ct_exp_f32(__fsub_rn(*m, m_new));
  float sum = *l * c;
  for (int j = 0; j < jn; j++) {
    const float e = ct_exp_f32(__fsub_rn(scores[j], m_new));
    scores[j] = e;
    sum += e;
  }
  *m = m_new;
  *l = sum;
  return c;
}

// ---- FP8 E4M3 (fn: bias 7, max 448) ---------------------------------------------------------

// The value of an E4M3 code (0x7F / 0xFF: NaN), exact.
__device__ __forceinline__ float ct_e4m3_decode(uint32_t c) {
  const uint32_t mag = c & 0x7Fu;
  float v;
  if (mag == 0x7Fu) {
    v = __uint_as_float(0x7FC00000u);
  } else if ((mag >> 3) == 0) {
    v = __fmul_rn(static_cast<float>(mag & 7u), 1.0f / 512.0f);  // subnormal: m * 2^-9
  } else {
    v = __uint_as_float((((mag >> 3) + 120u) << 23) | ((mag & 7u) << 20));
  }
  return (c & 0x80u) ? -v : v;
}

// encode_e4m3_fast: round to nearest even, saturating at 448 (NaN saturates too).
__device__ __forceinline__ uint32_t ct_e4m3_encode(float x) {
  const uint32_t bits = __float_as_uint(x);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t abs = bits & 0x7FFFFFFFu;
  const uint32_t rounded = (abs + 0x7FFFFu + ((abs >> 20) & 1u)) >> 20;
  const int32_t normal_i = static_cast<int32_t>(rounded) - (120 << 3);
  const uint32_t normal = static_cast<uint32_t>(normal_i < 0x7E ? normal_i : 0x7E);
  const float sub_f = __fadd_rn(__fmul_rn(__uint_as_float(abs), 512.0f), 12582912.0f);
  const uint32_t sub = __float_as_uint(sub_f) - 0x4B400000u;
  uint32_t mag = abs < 0x3C800000u ? sub : normal;
  mag = abs >= 0x47800000u ? 0x7Eu : mag;
  return sign | mag;
}

// E4M3.encode: as above, but NaN encodes as the NaN code (the KV cache and fake-quant paths).
__device__ __forceinline__ uint32_t ct_e4m3_encode_nan(float x) {
  const uint32_t bits = __float_as_uint(x);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return ((bits >> 24) & 0x80u) | 0x7Fu;
  return ct_e4m3_encode(x);
}

// ---- E2M1 -----------------------------------------------------------------------------------

__device__ __forceinline__ float ct_e2m1_value(uint32_t code) {
  const float mags[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float v = mags[code & 7u];
  return (code & 8u) ? -v : v;
}

// encode_e2m1_fast: RNE thresholds, saturating at 6.
__device__ __forceinline__ uint32_t ct_e2m1_encode(float v) {
  const float a = fabsf(v);
  const uint32_t code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                        (a >= 3.5f) + (a > 5.0f);
  return ((__float_as_uint(v) >> 28) & 0x8u) | code;
}

// Rust's f32::clamp (NaN passes through).
__device__ __forceinline__ float ct_clamp(float v, float lo, float hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

// sr_e2m1: stochastic rounding between the two neighbouring magnitudes (|v| <= 6).
__device__ __forceinline__ uint32_t ct_e2m1_sr(float v, double u) {
  const float mags[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float a = fminf(fabsf(v), 6.0f);
  int lo = 0;
  while (lo + 1 < 8 && mags[lo + 1] <= a) lo++;
  int code = lo;
  if (!(lo == 7 || a == mags[lo])) {
    const float p = __fdiv_rn(__fsub_rn(a, mags[lo]), __fsub_rn(mags[lo + 1], mags[lo]));
    if (u < static_cast<double>(p)) code = lo + 1;
  }
  return (signbit(v) ? 8u : 0u) | static_cast<uint32_t>(code);
}

// ---- random Hadamard transform on 16 values -------------------------------------------------

__device__ __forceinline__ void ct_rht16(float* x, const float* signs) {
#pragma unroll
  for (int i = 0; i < 16; i++) x[i] = __fmul_rn(x[i], signs[i]);
#pragma unroll
  for (int h = 1; h < 16; h *= 2) {
#pragma unroll
    for (int i = 0; i < 16; i += 2 * h) {
#pragma unroll
      for (int j = i; j < i + h; j++) {
        const float a = x[j], b = x[j + h];
        x[j] = __fadd_rn(a, b);
        x[j + h] = __fsub_rn(a, b);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 16; i++) x[i] = __fmul_rn(x[i], 0.25f);
}

// ---- Philox 4x32-10 -------------------------------------------------------------------------

__device__ __forceinline__ uint4 ct_philox(uint4 c, uint2 k) {
  const uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#pragma unroll
  for (int r = 0; r < 10; r++) {
    if (r > 0) {
      k.x += W0;
      k.y += W1;
    }
    const uint32_t hi0 = __umulhi(M0, c.x), lo0 = M0 * c.x;
    const uint32_t hi1 = __umulhi(M1, c.z), lo1 = M1 * c.z;
    c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
  }
  return c;
}

__device__ __forceinline__ uint2 ct_seed_key(uint64_t seed) {
  return make_uint2(static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// A double in [0, 1) from 53 random bits, exact.
__device__ __forceinline__ double ct_uniform_f64(uint32_t a, uint32_t b) {
  const uint64_t bits = ((static_cast<uint64_t>(a) << 32) | b) >> 11;
  return static_cast<double>(bits) * (1.0 / 9007199254740992.0);
}

// Grid-stride loop over [0, n).
#define CT_GRID_LOOP(i, n)                                                      \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; \
       i < (n); i += static_cast<int64_t>(gridDim.x) * blockDim.x)

// d = a . b + c on the tensor cores, one warp: mma.sync m16n8k16, BF16 operands (a: 4 registers,
// b: 2, each two bf16 with the lower column in the lower half), FP32 accumulators (sm_80+).
// The host emulation (shim.h ct_emu_mma_16816) rebuilds the warp's matrices from the same
// fragment layout.
__device__ __forceinline__ void ct_mma_16816(float* d, const uint32_t* a, const uint32_t* b, const float* c) {
#ifdef CT_HOSTEMU
  ct_emu_mma_16816(d, a, b, c);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
        "f"(c[3]));
#endif
}

// The bf16 bits of x (round to nearest even) and two of them packed into one mma register.
__device__ __forceinline__ uint32_t ct_bf16_bits(float x) {
  const __nv_bfloat16 b = __float2bfloat16_rn(x);
  uint16_t u;
  memcpy(&u, &b, 2);
  return u;
}
__device__ __forceinline__ uint32_t ct_pack_bf16(float lo, float hi) { return ct_bf16_bits(lo) | (ct_bf16_bits(hi) << 16); }
