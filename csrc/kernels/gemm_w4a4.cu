// gemm_w4a4.cu: the W4A4 NVFP4 GEMM of decode steps on Hopper, which has no FP4 tensor cores.
//   ct_gemm_w4a4 <- src/ops/linear/cuda_lowp.rs's emulated path (both operands decoded to
//                   their BF16 unit values, a BF16 GEMM with FP32 accumulation, alpha): the
//                   same products, decoded from the codes in registers instead of read from
//                   the weight's kept BF16 copy (0.5625 bytes a weight value instead of 2).
// A code times its block scale has at most 2 + 4 significant bits: exact in BF16. So the
// mma.sync m16n8k16 (BF16 operands, FP32 accumulation) multiplies exactly the values the
// emulated GEMM multiplies; only the FP32 accumulation differs (its order, and the tensor
// cores' own accumulation, as in the emulated path's cuBLAS GEMM).
//
// A block: CT_W4A4_WARPS warps over CT_W4A4_COLS weight rows (output columns, CT_W4A4_NT
// n-tiles of 8) and every activation row (m <= 16 * CT_W4A4_MT, in m-tiles of 16). Warp w
// takes the 128-value chunks c = w, w + warps, ... of K; the warps' partial sums are then
// added in warp order (deterministic). In a chunk, lane (g, t) (g = lane / 4, t = lane % 4)
// loads 16 bytes, codes 32t .. 32t + 31, of weight row g of each n-tile and of activation
// rows g and g + 8 of each m-tile, and their two block scales. K-step s (0..7) of the chunk
// feeds the mma's k = 2t, 2t + 1 with codes 32t + 4s + {0, 1} and k = 2t + 8, 2t + 9 with
// codes 32t + 4s + {2, 3}: one permutation of the chunk's K for both operands, which leaves
// every dot product's terms unchanged.
//
// Split-K (p.splits > 1, when n / 32 blocks leave SMs idle: a decode step's down projection):
// blockIdx.y takes one contiguous range of the chunks, its warps as above, and writes its sum
// to p.part; ct_gemm_w4a4_merge adds the ranges in order and applies alpha.
#include "common.cuh"

#define CT_W4A4_WARPS 8
#define CT_W4A4_NT 4
#define CT_W4A4_COLS (8 * CT_W4A4_NT)
#define CT_W4A4_MT 4
#define CT_W4A4_CHUNK 128

// The 16 bytes at p (16-byte aligned) as four little-endian words: codes 8j .. 8j + 7 in w[j].
__device__ __forceinline__ void ct_w4a4_load16(uint32_t* w, const uint8_t* p) {
#ifdef CT_HOSTEMU
  memcpy(w, p, 16);
#else
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
#endif
}

// The value of E2M1 code c (bit 3 the sign) from its bits, as ct_e2m1_value's table gives it
// (the table, indexed at run time, would sit in local memory in the inner loop).
__device__ __forceinline__ float ct_w4a4_e2m1(uint32_t c) {
  const uint32_t e = (c >> 1) & 3u, m = c & 1u;
  const uint32_t mag = e ? ((126u + e) << 23) | (m << 22) : (m ? 0x3F000000u : 0u);
  return __uint_as_float(mag | ((c & 8u) << 28));
}

// Codes nib and nib + 1 of a word times their block scale, as one mma register of two BF16.
// The products are exact in BF16 (above), so their f32 bits end in 16 zeros: truncation is
// the rounding.
__device__ __forceinline__ uint32_t ct_w4a4_pair(uint32_t word, int nib, float bs) {
  const float lo = __fmul_rn(ct_w4a4_e2m1(word >> (4 * nib)), bs);
  const float hi = __fmul_rn(ct_w4a4_e2m1(word >> (4 * nib + 4)), bs);
  return (__float_as_uint(lo) >> 16) | (__float_as_uint(hi) & 0xFFFF0000u);
}

extern "C" __global__ void __launch_bounds__(CT_W4A4_WARPS* CT_WARP) ct_gemm_w4a4(ct_gemm_w4a4_params p) {
  const int warp = threadIdx.x / CT_WARP, lane = threadIdx.x % CT_WARP, g = lane / 4, t = lane % 4;
  const int col0 = blockIdx.x * CT_W4A4_COLS;
  const int tiles = (p.m + 15) / 16;
  const int64_t row_bytes = p.k / 2, row_scales = p.k / 16;
  float acc[CT_W4A4_MT][CT_W4A4_NT][4] = {};
  // This block's chunks of K: all of them, or (split-K) range blockIdx.y of p.splits.
  const int chunks = p.k / CT_W4A4_CHUNK, per = (chunks + p.splits - 1) / p.splits;
  const int c0 = static_cast<int>(blockIdx.y) * per, c1 = min(chunks, c0 + per);
  for (int c = c0 + warp; c < c1; c += CT_W4A4_WARPS) {
    const int64_t cb = static_cast<int64_t>(c) * (CT_W4A4_CHUNK / 2) + 16 * t;  // this lane's bytes
    const int64_t sb = static_cast<int64_t>(c) * (CT_W4A4_CHUNK / 16) + 2 * t;  // its two scales
    uint32_t w[CT_W4A4_NT][4];
    float ws[CT_W4A4_NT][2];
#pragma unroll
    for (int nt = 0; nt < CT_W4A4_NT; nt++) {
      const int64_t row = col0 + nt * 8 + g;
      ct_w4a4_load16(w[nt], p.w_codes + row * row_bytes + cb);
      ws[nt][0] = ct_e4m3_decode(p.w_scales[row * row_scales + sb]);
      ws[nt][1] = ct_e4m3_decode(p.w_scales[row * row_scales + sb + 1]);
    }
    uint32_t a[CT_W4A4_MT][2][4];
    float as[CT_W4A4_MT][2][2];
#pragma unroll
    for (int mt = 0; mt < CT_W4A4_MT; mt++) {
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const int64_t row = mt * 16 + g + 8 * h;
        if (mt < tiles && row < p.m) {
          ct_w4a4_load16(a[mt][h], p.a_codes + row * row_bytes + cb);
          as[mt][h][0] = ct_e4m3_decode(p.a_scales[row * row_scales + sb]);
          as[mt][h][1] = ct_e4m3_decode(p.a_scales[row * row_scales + sb + 1]);
        } else {
          a[mt][h][0] = a[mt][h][1] = a[mt][h][2] = a[mt][h][3] = 0u;  // code 0: value 0
          as[mt][h][0] = as[mt][h][1] = 0.0f;
        }
      }
    }
#pragma unroll
    for (int s = 0; s < CT_W4A4_CHUNK / 16; s++) {
      const int word = s / 2, nib = (s % 2) * 4, blk = s / 4;
      uint32_t b[CT_W4A4_NT][2];
#pragma unroll
      for (int nt = 0; nt < CT_W4A4_NT; nt++) {
        b[nt][0] = ct_w4a4_pair(w[nt][word], nib, ws[nt][blk]);
        b[nt][1] = ct_w4a4_pair(w[nt][word], nib + 2, ws[nt][blk]);
      }
#pragma unroll
      for (int mt = 0; mt < CT_W4A4_MT; mt++) {
        if (mt >= tiles) break;  // the same for every lane: the warp stays converged
        const uint32_t fa[4] = {
            ct_w4a4_pair(a[mt][0][word], nib, as[mt][0][blk]), ct_w4a4_pair(a[mt][1][word], nib, as[mt][1][blk]),
            ct_w4a4_pair(a[mt][0][word], nib + 2, as[mt][0][blk]),
            ct_w4a4_pair(a[mt][1][word], nib + 2, as[mt][1][blk])};
#pragma unroll
        for (int nt = 0; nt < CT_W4A4_NT; nt++) ct_mma_16816(acc[mt][nt], fa, b[nt], acc[mt][nt]);
      }
    }
  }
  // One m-tile at a time: every warp's partial sums to shared memory, then each output the sum
  // over the warps in order. Accumulator i of lane (g, t) in n-tile nt is row g + 8 * (i / 2),
  // column nt * 8 + 2t + i % 2.
  CT_SHARED(float, part, CT_W4A4_WARPS * CT_W4A4_NT * CT_WARP * 4);  // 16 KB
#pragma unroll
  for (int mt = 0; mt < CT_W4A4_MT; mt++) {
    if (mt >= tiles) break;
#pragma unroll
    for (int nt = 0; nt < CT_W4A4_NT; nt++) {
#pragma unroll
      for (int i = 0; i < 4; i++) part[((warp * CT_W4A4_NT + nt) * CT_WARP + lane) * 4 + i] = acc[mt][nt][i];
    }
    __syncthreads();
    for (int o = threadIdx.x; o < 16 * CT_W4A4_COLS; o += blockDim.x) {
      const int r = o / CT_W4A4_COLS, col = o % CT_W4A4_COLS, nt = col / 8, cc = col % 8;
      const int src = (r % 8) * 4 + cc / 2, i = (r / 8) * 2 + cc % 2;
      float sum = 0.0f;
      for (int w = 0; w < CT_W4A4_WARPS; w++) sum = __fadd_rn(sum, part[((w * CT_W4A4_NT + nt) * CT_WARP + src) * 4 + i]);
      const int64_t row = mt * 16 + r;
      if (row >= p.m) continue;
      if (p.splits > 1) p.part[(blockIdx.y * static_cast<int64_t>(p.m) + row) * p.n + col0 + col] = sum;
      else p.y[row * p.n + col0 + col] = __fmul_rn(p.alpha, sum);
    }
    __syncthreads();
  }
}

// Split-K's second pass: y = alpha * the splits' sums added in split order from 0 (one thread
// per output value).
extern "C" __global__ void ct_gemm_w4a4_merge(ct_gemm_w4a4_params p) {
  const int64_t mn = static_cast<int64_t>(p.m) * p.n;
  CT_GRID_LOOP(i, mn) {
    float sum = 0.0f;
    for (int s = 0; s < p.splits; s++) sum = __fadd_rn(sum, p.part[s * mn + i]);
    p.y[i] = __fmul_rn(p.alpha, sum);
  }
}
