// rope.cu: rotary embeddings. CPU twin: src/ops/rope/cpu.rs (rope_table, rope); launcher:
// src/ops/rope/cuda.rs. rope is bit-exact with the CPU (same operation order, no FMA
// contraction). rope_table computes the same f32 angle and evaluates cos/sin in double like the
// CPU, but CUDA's double cos/sin (<= 2 ulp) and the host libm may differ in the last f64 bit,
// which changes the f32 result only when it lies that close to a rounding boundary (rare). Not
// yet run on a GPU.
#include "common.cuh"

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
    ct_rope_pair(p.x + rh * 2 * p.half, i, p.half, p.cos[row * p.half + i], p.sin[row * p.half + i]);
  }
}
