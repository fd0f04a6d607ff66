// shim.h: host emulation of the CUDA built-ins used by the element-wise kernels, so that
// csrc/kernels/{quantize,attention,norm_rope}.cu compile with a plain C++ compiler and run on
// one host thread (gridDim = blockDim = 1: every grid-stride loop visits every element). The
// _rn intrinsics become single IEEE f32 operations (volatile, so never contracted into FMAs);
// __shfl_xor_sync returns the caller's own value, which is only right for the idempotent max
// reductions (ct_amax) — kernels that sum across threads are not emulated. Used by the unit
// test in src/device/cuda/hostemu.rs: it checks the kernels' arithmetic and indexing against
// the CPU quantizers bit for bit without a GPU; it says nothing about the GPU itself.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#define __device__
#define __global__
#define __forceinline__ inline
#define __shared__
#define __launch_bounds__(...)

struct ct_dim3 {
  unsigned x, y, z;
};
static ct_dim3 blockIdx{0, 0, 0}, threadIdx{0, 0, 0}, blockDim{1, 1, 1}, gridDim{1, 1, 1};
struct uint4 {
  uint32_t x, y, z, w;
};
struct uint2 {
  uint32_t x, y;
};
inline uint4 make_uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return {a, b, c, d}; }
inline uint2 make_uint2(uint32_t a, uint32_t b) { return {a, b}; }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline uint32_t __float_as_uint(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t __umulhi(uint32_t a, uint32_t b) { return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32); }
template <class T>
inline T __shfl_xor_sync(unsigned, T v, int) { return v; }
inline unsigned atomicMax(uint32_t* p, uint32_t v) { unsigned o = *p; if (v > o) *p = v; return o; }
inline unsigned atomicCAS(uint32_t* p, uint32_t c, uint32_t v) { unsigned o = *p; if (o == c) *p = v; return o; }
inline void __syncthreads() {}
using std::isnan;
using std::max;
using std::min;
using std::signbit;

// BF16 by bits (round to nearest even, NaN kept quiet); F16 is not emulated.
struct __nv_bfloat16 {
  uint16_t b;
};
struct __half {
  uint16_t b;
};
inline float __bfloat162float(__nv_bfloat16 h) { return __uint_as_float(static_cast<uint32_t>(h.b) << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {static_cast<uint16_t>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return {static_cast<uint16_t>(u >> 16)};
}
inline float __half2float(__half) { return NAN; }
inline __half __float2half_rn(float) { return {0x7e00}; }
