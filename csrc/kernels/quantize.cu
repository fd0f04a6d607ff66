// quantize.cu: the fused amax + quantize passes of the low-precision engines, the decoders used
// by the emulated GEMMs, and the scale-factor swizzle of the block-scaled GEMMs.
// CPU twins (bit-exact: same f32 operations in the same order, see common.cuh):
//   ct_amax          <- src/quant/qtensor.rs QTensor::requantize_cpu's amax (with RHT: of the rotated
//                       blocks) and src/ops/elementwise/cpu.rs amax_rows (NaN propagates)
//   ct_quant_fp8     <- qtensor.rs FP8 branch (scale = amax/448, simd::encode_fp8) and
//                       src/ops/quantize/cpu.rs fake_quant_rows FP8 (fixed scale, decoded back)
//   ct_quant_nvfp4   <- src/formats/nvfp4.rs quantize_row (RHT, stochastic rounding keyed by the
//                       flat element index) and fake_quantize_rows (dequantize_into); with
//                       row_k / unrotate: learner_round (per-row globals, the inverse RHT)
//   ct_dequant       <- src/device/tensor.rs CpuFloats::Fp8 / Nvfp4 read_into
// ct_quant_fp8 and ct_quant_nvfp4 with `up` quantize SwiGLU(x, up) (ct_silu_mul, ct_swiglu's
// arithmetic) without writing it: a down projection's input, the bits of ct_swiglu then the
// quantizer.
// One difference from the CPU: the CPU checks the amax for NaN/Inf before writing any code;
// here the amax and the codes are computed in one stream of work and the host checks the amax
// afterwards, so a tensor that holds NaN leaves garbage codes behind (and an error).
// Not yet run on a GPU.
#include "common.cuh"

__device__ __forceinline__ uint32_t ct_abs_bits(float v) { return __float_as_uint(v) & 0x7FFFFFFFu; }

__device__ __forceinline__ void ct_warp_atomic_max(uint32_t local, uint32_t* dst) {
  for (int o = 16; o > 0; o >>= 1) local = max(local, __shfl_xor_sync(0xffffffffu, local, o));
  if (threadIdx.x % CT_WARP == 0) atomicMax(dst, local);
}

// The largest |x| bit pattern of 16-value block b (rotated first under the RHT).
__device__ __forceinline__ uint32_t ct_block_amax16(const ct_amax_params& p, int64_t b) {
  float x[16];
#pragma unroll
  for (int i = 0; i < 16; i++) x[i] = ct_load(p.x, p.dtype, b * 16 + i);
  if (p.rht) ct_rht16(x, p.signs);
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < 16; i++) m = max(m, ct_abs_bits(x[i]));
  return m;
}

// Grid-stride; every thread of every block reaches the warp reduction (no early return).
extern "C" __global__ void ct_amax(ct_amax_params p) {
  if (p.row_k > 0) {
    // One amax per row: each 16-value block into its row's slot (uniform branch).
    const int64_t blocks = p.n / 16;
    CT_GRID_LOOP(b, blocks) { atomicMax(&p.amax_bits[(b * 16) / p.row_k], ct_block_amax16(p, b)); }
    return;
  }
  uint32_t m = 0;
  if (p.rht) {
    const int64_t blocks = p.n / 16;
    CT_GRID_LOOP(b, blocks) { m = max(m, ct_block_amax16(p, b)); }
  } else {
    CT_GRID_LOOP(i, p.n) { m = max(m, ct_abs_bits(ct_load(p.x, p.dtype, i))); }
  }
  ct_warp_atomic_max(m, p.amax_bits);
}

extern "C" __global__ void ct_quant_fp8(ct_quant_fp8_params p) {
  float scale = p.fixed_scale;
  if (!(scale > 0.0f)) {
    const float amax = __uint_as_float(*p.amax_bits);
    scale = amax > 0.0f ? __fdiv_rn(amax, 448.0f) : 1.0f;
  }
  if (p.scale_out && blockIdx.x == 0 && threadIdx.x == 0) *p.scale_out = scale;
  CT_GRID_LOOP(i, p.n) {
    const uint32_t code = ct_e4m3_encode_nan(__fdiv_rn(ct_quant_input(p.x, p.dtype, p.up, i), scale));
    if (p.codes) p.codes[i] = static_cast<uint8_t>(code);
    if (p.dequant) p.dequant[i] = __fmul_rn(ct_e4m3_decode(code), scale);
  }
}

// One thread per 16-value block.
extern "C" __global__ void ct_quant_nvfp4(ct_quant_nvfp4_params p) {
  float global = p.fixed_global;
  if (!(global > 0.0f) && p.row_k == 0) {
    const float amax = __uint_as_float(*p.amax_bits);
    global = amax > 0.0f ? __fdiv_rn(amax, 2688.0f) : 1.0f;
  }
  if (p.global_out && blockIdx.x == 0 && threadIdx.x == 0) *p.global_out = global;
  const int64_t blocks = p.n / 16;
  CT_GRID_LOOP(b, blocks) {
    if (!(p.fixed_global > 0.0f) && p.row_k > 0) {
      const float amax = __uint_as_float(p.amax_bits[(b * 16) / p.row_k]);
      global = amax > 0.0f ? __fdiv_rn(amax, 2688.0f) : 1.0f;
    }
    const float denom6 = __fmul_rn(6.0f, global);
    float x[16];
#pragma unroll
    for (int i = 0; i < 16; i++) x[i] = ct_quant_input(p.x, p.dtype, p.up, b * 16 + i);
    if (p.rht) ct_rht16(x, p.signs);
    uint32_t mb = 0;
#pragma unroll
    for (int i = 0; i < 16; i++) mb = max(mb, ct_abs_bits(x[i]));
    uint32_t bs = ct_e4m3_encode(__fdiv_rn(__uint_as_float(mb), denom6));
    if (bs == 0) bs = 0x38;  // a zero block scale becomes 1.0
    const float bsv = ct_e4m3_decode(bs);
    const float denom = __fmul_rn(bsv, global);
    uint32_t codes[16];
    if (!p.stochastic) {
#pragma unroll
      for (int i = 0; i < 16; i++) codes[i] = ct_e2m1_encode(__fdiv_rn(x[i], denom));
    } else {
      const uint2 key = ct_seed_key(p.sr_seed);
      for (int i = 0; i < 16; i++) {
        const uint64_t idx = static_cast<uint64_t>(b) * 16 + i;
        const uint4 r = ct_philox(make_uint4(static_cast<uint32_t>(idx), static_cast<uint32_t>(idx >> 32), 0x5352u, 0u), key);
        codes[i] = ct_e2m1_sr(ct_clamp(__fdiv_rn(x[i], denom), -6.0f, 6.0f), ct_uniform_f64(r.x, r.y));
      }
    }
    if (p.packed) {
#pragma unroll
      for (int i = 0; i < 8; i++) p.packed[b * 8 + i] = static_cast<uint8_t>(codes[2 * i] | (codes[2 * i + 1] << 4));
    }
    if (p.scales) p.scales[b] = static_cast<uint8_t>(bs);
    if (p.dequant) {
      float y[16];
#pragma unroll
      for (int i = 0; i < 16; i++) y[i] = __fmul_rn(__fmul_rn(ct_e2m1_value(codes[i]), bsv), global);
      if (p.rht && p.unrotate) {
        // The inverse RHT (nvfp4.rs rht_block_inverse): H/4 again, then the signs.
        const float ones[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
        ct_rht16(y, ones);
#pragma unroll
        for (int i = 0; i < 16; i++) y[i] = __fmul_rn(y[i], p.signs[i]);
      }
#pragma unroll
      for (int i = 0; i < 16; i++) p.dequant[b * 16 + i] = y[i];
    }
  }
}

// One thread per value (FP8) or per 16-value block (NVFP4).
extern "C" __global__ void ct_dequant(ct_dequant_params p) {
  const bool unit = p.out_dtype != CT_DTYPE_F32;
  if (p.format == CT_FORMAT_FP8) {
    CT_GRID_LOOP(i, p.n) {
      const float v = ct_e4m3_decode(p.codes[i]);
      ct_store(p.out, p.out_dtype, i, unit ? v : __fmul_rn(v, p.scale));
    }
  } else {
    const int64_t blocks = p.n / 16;
    CT_GRID_LOOP(b, blocks) {
      const float bsv = ct_e4m3_decode(p.scales[b]);
#pragma unroll
      for (int i = 0; i < 16; i++) {
        const uint32_t byte = p.codes[b * 8 + i / 2];
        const uint32_t code = (i % 2 == 0) ? (byte & 0xFu) : (byte >> 4);
        const float qb = __fmul_rn(ct_e2m1_value(code), bsv);
        ct_store(p.out, p.out_dtype, b * 16 + i, unit ? qb : __fmul_rn(qb, p.scale));
      }
    }
  }
}

// One thread per destination byte (padded_rows x padded_cols).
extern "C" __global__ void ct_swizzle_sf(ct_swizzle_sf_params p) {
  const int64_t n = static_cast<int64_t>(p.padded_rows) * p.padded_cols;
  const int col_tiles = p.padded_cols / 4;
  CT_GRID_LOOP(idx, n) {
    const int r = static_cast<int>(idx / p.padded_cols), c = static_cast<int>(idx % p.padded_cols);
    const uint8_t v = (r < p.rows && c < p.sf_cols) ? p.src[static_cast<int64_t>(r) * p.sf_cols + c] : 0;
    const int64_t tile = static_cast<int64_t>(r / 128) * col_tiles + c / 4;
    const int inner = (r % 32) * 16 + ((r % 128) / 32) * 4 + (c % 4);
    p.dst[tile * 512 + inner] = v;
  }
}
