// shim.h: host emulation of the CUDA built-ins used by csrc/kernels, so that the kernels
// compile with a plain C++ compiler and run on the host. Two ways to run a kernel:
//   - call it directly: one thread, gridDim = blockDim = 1 (every grid-stride loop visits every
//     element; shuffles return the caller's value, right only for idempotent max reductions).
//     main.cpp runs the element-wise kernels this way;
//   - ct_emu::launch(kernel, grid, block, smem_bytes, params): the real grid shape. Blocks run
//     one after another; the threads of a block are cooperative fibers (ucontext) on this one
//     OS thread, switched only at __syncthreads and at the warp exchanges of the shuffles. So
//     shared memory (static storage here, poisoned for every block) serves the running block,
//     atomics need no locks and runs are deterministic. Threads run between barriers in the
//     order ct_emu::schedule picks (by index, reversed, shuffled): blocks.cpp runs every kernel
//     under all three and requires the same bytes, which exposes shared-memory races. Reported instead of hanging
//     or passing: lanes of a warp waiting at different shuffles or barriers, a shuffle with
//     exited lanes, threads at different __syncthreads, writes past the dynamic shared memory
//     and stack overflows. Threads that return leave the barriers (as exited threads do on
//     the GPU). blocks.cpp runs the block-level kernels (reductions, sampling, attention).
// The _rn intrinsics become single IEEE f32 / f64 operations (volatile, so never contracted
// into FMAs); expf/logf/exp/log are the host libm's, which may differ from CUDA's by an ulp. Used by
// the unit tests in src/ops/hostemu/: they check the kernels' arithmetic, indexing and
// synchronization against the CPU twins without a GPU; they say nothing about the GPU itself.
#pragma once
#include <setjmp.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <vector>

#define CT_HOSTEMU 1
#define __device__
#define __global__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __restrict__
// Shared memory (common.cuh's CT_DYNAMIC_SMEM / CT_SHARED / CT_SHARED_VAR on the GPU): dynamic
// shared memory is one buffer poisoned before every block; a static array or scalar is a plain
// static, poisoned by the first thread of each block that reaches its declaration.
#define CT_DYNAMIC_SMEM(T, name) T* name = reinterpret_cast<T*>(ct_emu::dyn_smem.data())
#define CT_SHARED(T, name, n) \
  static T name[n];           \
  ct_emu::poison_static(name, sizeof(name))
#define CT_SHARED_VAR(T, name) \
  static T name;               \
  ct_emu::poison_static(&name, sizeof(name))

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
inline double __dadd_rn(double a, double b) { volatile double r = a + b; return r; }
inline double __dsub_rn(double a, double b) { volatile double r = a - b; return r; }
inline double __dmul_rn(double a, double b) { volatile double r = a * b; return r; }
inline double __ddiv_rn(double a, double b) { volatile double r = a / b; return r; }
inline float __double2float_rn(double a) { volatile float r = static_cast<float>(a); return r; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline uint32_t __float_as_uint(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int32_t i) { float f; std::memcpy(&f, &i, 4); return f; }
inline uint32_t __umulhi(uint32_t a, uint32_t b) { return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32); }
using std::isnan;
using std::max;
using std::min;
using std::signbit;

namespace ct_emu {
enum State { kRunning, kAtBlockBarrier, kAtWarpBarrier, kDone };
struct Fiber {
  ucontext_t ctx;  // only to start the fiber on its stack
  jmp_buf jb;      // where it resumes after parking
  bool started;
  std::vector<char> stack;
  State state;
  unsigned tid;
  uint64_t shuffles, barriers;  // warp exchanges and __syncthreads passed so far
};
inline std::vector<Fiber> fibers;        // the threads of the running block (empty: direct call)
inline size_t current = 0;               // index of the running fiber
inline ucontext_t scheduler;
// The scheduler's resume point. Fibers switch with _setjmp / _longjmp, which (unlike
// swapcontext) make no system call to save and restore the signal mask: a 1024-thread block
// passes tens of thousands of switches. swapcontext only starts a fiber on its own stack.
// (Built with _FORTIFY_SOURCE off: its longjmp check refuses jumps between stacks.)
inline jmp_buf sched_jb;
inline std::function<void()> body;       // the kernel call every fiber of the block makes
inline std::vector<uint64_t> exchange;   // one shuffle slot per thread
inline std::vector<uint32_t> mma_slots;  // six per thread: a warp's mma fragments
inline std::vector<unsigned char> dyn_smem;
// Order in which runnable threads run between barriers: 0 by thread index, 1 reversed, 2 a
// shuffle seeded by the block and the launch. A race on shared memory (a read not separated
// from another thread's write by a barrier) shows up as outputs that differ between orders.
inline int schedule = 0;
inline uint64_t launches = 0;
inline uint64_t block_serial = 0;  // counts blocks run, from 1
inline std::map<const void*, uint64_t> poisoned_in;  // static shared array -> block that poisoned it

// Fills shared memory with the 32-bit word 0x7FA5A5A5: a NaN as f32, a huge number as i32 / u32
// (never 0 or -1, the usual initial values), about 1e306 as f64.
inline void poison(void* p, size_t n) {
  const uint32_t word = 0x7FA5A5A5u;
  unsigned char* b = static_cast<unsigned char*>(p);
  for (size_t i = 0; i < n; i++) b[i] = static_cast<unsigned char>(word >> (8 * (i % 4)));
}
// Poisons a static shared array once per block: the first thread to reach its declaration in a
// block does it, before any thread of the block can write it.
inline void poison_static(void* p, size_t n) {
  uint64_t& b = poisoned_in[p];
  if (b != block_serial) {
    poison(p, n);
    b = block_serial;
  }
}
constexpr size_t kCanary = 256;          // bytes checked after every block, past the dynamic
constexpr unsigned char kCanaryByte = 0xA5;  // shared memory and at the far end of each stack

inline void fail(const char* what) {
  std::fprintf(stderr, "hostemu: %s (block %u,%u thread %u)\n", what, blockIdx.x, blockIdx.y, threadIdx.x);
  std::exit(5);
}
// Parks the running fiber in state s and returns to the scheduler.
inline void park(State s) {
  Fiber& f = fibers[current];
  f.state = s;
  if (_setjmp(f.jb) == 0) _longjmp(sched_jb, 1);
}
// A fiber runs the kernel for every block of its launch: after each block it parks as done,
// and the next block resumes it here (so a fiber is started once per launch, not per block).
inline void fiber_entry() {
  for (;;) {
    body();
    Fiber& f = fibers[current];
    f.state = kDone;
    if (_setjmp(f.jb) == 0) _longjmp(sched_jb, 1);  // never returns through uc_link
  }
}
inline void warp_sync() {
  if (fibers.empty()) return;
  fibers[current].shuffles++;
  park(kAtWarpBarrier);
}

// Runs one block to completion: every runnable fiber (in `order`) until it parks or returns,
// then releases each warp whose lanes all wait at the same warp exchange, else the block
// barrier once every live thread waits at the same __syncthreads. Fails on a warp whose lanes
// wait at different exchanges or barriers, or exchange while some of its lanes have exited.
inline void run_block(const std::vector<size_t>& order) {
  const size_t n = fibers.size();
  for (;;) {
    for (size_t i : order) {
      if (fibers[i].state != kRunning) continue;
      current = i;
      threadIdx = {fibers[i].tid, 0, 0};
      if (_setjmp(sched_jb) == 0) {
        Fiber& f = fibers[i];
        if (!f.started) {
          f.started = true;
          if (swapcontext(&scheduler, &f.ctx) != 0) fail("swapcontext failed");
        } else {
          _longjmp(f.jb, 1);
        }
      }
    }
    bool any_live = false, released = false;
    for (size_t w = 0; w < n; w += 32) {
      const size_t end = std::min(n, w + 32);
      size_t at_warp = 0, live = 0;
      for (size_t i = w; i < end; i++) {
        if (fibers[i].state == kDone) continue;
        live++;
        at_warp += fibers[i].state == kAtWarpBarrier;
      }
      any_live |= live > 0;
      if (at_warp == 0) continue;
      threadIdx = {static_cast<unsigned>(w), 0, 0};
      if (at_warp != live) fail("divergent warp: some lanes at a shuffle, others at __syncthreads");
      if (live != end - w) fail("warp shuffle while some lanes of the warp have exited");
      for (size_t i = w; i < end; i++) {
        if (fibers[i].shuffles != fibers[w].shuffles) fail("divergent warp: lanes at different shuffles");
        fibers[i].state = kRunning;
      }
      released = true;
    }
    if (!any_live) return;
    if (released) continue;
    // Every live thread waits at __syncthreads: the same one?
    uint64_t seq = 0;
    bool first = true;
    for (auto& f : fibers) {
      if (f.state != kAtBlockBarrier) continue;
      if (first) seq = f.barriers, first = false;
      if (f.barriers != seq) {
        threadIdx = {f.tid, 0, 0};
        fail("threads wait at different __syncthreads");
      }
      f.state = kRunning;
    }
  }
}

inline bool canary_intact(const unsigned char* p) {
  for (size_t i = 0; i < kCanary; i++)
    if (p[i] != kCanaryByte) return false;
  return true;
}

// kernel<<<grid, block, smem>>>(params) with grid = (gx, gy), block = (bx, 1, 1), under
// `schedule`. Shared memory is poisoned (see poison) for every block: dynamic shared memory
// before it starts, static arrays at their declaration (see poison_static).
template <class P>
void launch(void (*kernel)(P), unsigned gx, unsigned gy, unsigned bx, size_t smem_bytes, const P& params) {
  constexpr size_t kStack = 64 * 1024;
  gridDim = {gx, gy, 1};
  blockDim = {bx, 1, 1};
  dyn_smem.assign(smem_bytes + kCanary, kCanaryByte);
  exchange.assign(bx, 0);
  mma_slots.assign(6 * static_cast<size_t>(bx), 0);
  body = [&] { kernel(params); };
  // Stacks are kept from launch to launch (a 1024-thread block holds 64 MiB of them); only
  // the canary at the far end of each is rewritten.
  static std::vector<std::vector<char>> stacks;
  if (stacks.size() < bx) stacks.resize(bx);
  fibers.assign(bx, Fiber{});
  for (unsigned t = 0; t < bx; t++) {
    if (stacks[t].size() != kStack) stacks[t].assign(kStack, 0);
    std::memset(stacks[t].data(), kCanaryByte, kCanary);
    fibers[t].stack.swap(stacks[t]);
  }
  // One getcontext per launch (it saves the signal mask with a system call); each fiber
  // starts from a copy.
  ucontext_t start_ctx;
  if (getcontext(&start_ctx) != 0) fail("getcontext failed");
  for (unsigned t = 0; t < bx; t++) {
    Fiber& f = fibers[t];
    f.started = false;
    f.ctx = start_ctx;
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = &scheduler;
    makecontext(&f.ctx, fiber_entry, 0);
  }
  std::vector<size_t> order(bx);
  uint64_t rng = 0x9E3779B97F4A7C15ull * (++launches);
  for (unsigned by = 0; by < gy; by++) {
    for (unsigned bxi = 0; bxi < gx; bxi++) {
      blockIdx = {bxi, by, 0};
      block_serial++;
      poison(dyn_smem.data(), smem_bytes);
      for (unsigned t = 0; t < bx; t++) order[t] = schedule == 1 ? bx - 1 - t : t;
      if (schedule == 2) {
        for (unsigned t = bx - 1; t > 0; t--) {
          rng = rng * 6364136223846793005ull + 1442695040888963407ull;
          std::swap(order[t], order[(rng >> 33) % (t + 1)]);
        }
      }
      for (unsigned t = 0; t < bx; t++) {
        Fiber& f = fibers[t];
        f.tid = t;
        f.state = kRunning;
        f.shuffles = f.barriers = 0;
      }
      run_block(order);
      if (!canary_intact(dyn_smem.data() + smem_bytes)) fail("write past the dynamic shared memory");
      for (auto& f : fibers)
        if (!canary_intact(reinterpret_cast<unsigned char*>(f.stack.data()))) fail("a thread overflowed its 64 KiB stack");
    }
  }
  for (unsigned t = 0; t < bx; t++) fibers[t].stack.swap(stacks[t]);
  fibers.clear();
  blockIdx = {0, 0, 0};
  threadIdx = {0, 0, 0};
  blockDim = {1, 1, 1};
  gridDim = {1, 1, 1};
}
}  // namespace ct_emu

inline void __syncthreads() {
  if (ct_emu::fibers.empty()) return;
  ct_emu::fibers[ct_emu::current].barriers++;
  ct_emu::park(ct_emu::kAtBlockBarrier);
}
inline void __syncwarp(unsigned = 0xffffffffu) { ct_emu::warp_sync(); }

// The value of lane `src` of the caller's warp: write, exchange, read, exchange (so no lane
// overwrites its slot before every lane has read).
template <class T>
inline T ct_emu_shfl(T v, unsigned src_lane) {
  static_assert(sizeof(T) <= 8, "shuffle of a value wider than 8 bytes");
  if (ct_emu::fibers.empty()) return v;
  const unsigned base = threadIdx.x & ~31u;
  std::memcpy(&ct_emu::exchange[threadIdx.x], &v, sizeof(T));
  ct_emu::warp_sync();
  T r;
  std::memcpy(&r, &ct_emu::exchange[base + (src_lane & 31u)], sizeof(T));
  ct_emu::warp_sync();
  return r;
}
template <class T>
inline T __shfl_xor_sync(unsigned, T v, int o) { return ct_emu_shfl(v, (threadIdx.x & 31u) ^ static_cast<unsigned>(o)); }
template <class T>
inline T __shfl_sync(unsigned, T v, int src) { return ct_emu_shfl(v, static_cast<unsigned>(src)); }
template <class T>
inline T __shfl_up_sync(unsigned, T v, unsigned d) {
  const unsigned lane = threadIdx.x & 31u;
  const T r = ct_emu_shfl(v, lane >= d ? lane - d : lane);
  return lane >= d ? r : v;
}
inline unsigned __ballot_sync(unsigned, int pred) {
  if (ct_emu::fibers.empty()) return pred ? 1u : 0u;
  const unsigned base = threadIdx.x & ~31u;
  ct_emu::exchange[threadIdx.x] = pred ? 1 : 0;
  ct_emu::warp_sync();
  unsigned m = 0;
  for (unsigned l = 0; l < 32 && base + l < ct_emu::exchange.size(); l++) m |= static_cast<unsigned>(ct_emu::exchange[base + l] & 1) << l;
  ct_emu::warp_sync();
  return m;
}
inline int __popc(unsigned v) { return __builtin_popcount(v); }

// Fibers switch only at barriers, so plain read-modify-writes are atomic here.
inline unsigned atomicMax(uint32_t* p, uint32_t v) { unsigned o = *p; if (v > o) *p = v; return o; }
inline unsigned atomicMin(unsigned* p, unsigned v) { unsigned o = *p; if (v < o) *p = v; return o; }
inline unsigned atomicAdd(unsigned* p, unsigned v) { unsigned o = *p; *p = o + v; return o; }
inline unsigned atomicCAS(uint32_t* p, uint32_t c, uint32_t v) { unsigned o = *p; if (o == c) *p = v; return o; }

// BF16 and F16 by bits (round to nearest even, NaN kept quiet).
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
// IEEE binary16, round to nearest even (subnormals included; NaN stays NaN, quiet, sign kept).
inline float __half2float(__half h) {
  const uint32_t sign = static_cast<uint32_t>(h.b & 0x8000u) << 16, e = (h.b >> 10) & 0x1fu, m = h.b & 0x3ffu;
  if (e == 0x1f) return __uint_as_float(sign | 0x7f800000u | (m << 13));
  if (e != 0) return __uint_as_float(sign | ((e + 112) << 23) | (m << 13));
  const float mag = static_cast<float>(m) * 5.9604644775390625e-8f;  // m · 2^-24, exact
  return sign ? -mag : mag;
}
inline __half __float2half_rn(float f) {
  const uint32_t u = __float_as_uint(f), a = u & 0x7fffffffu;
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  if (a > 0x7f800000u) return {static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu))};
  if (a >= 0x477ff000u) return {static_cast<uint16_t>(sign | 0x7c00u)};  // >= 65520: infinity
  uint32_t r, rem, half_ulp;
  if (a >= 0x38800000u) {  // normal: rebias the exponent, keep 10 mantissa bits
    r = (a - (112u << 23)) >> 13, rem = a & 0x1fffu, half_ulp = 0x1000u;
  } else if (a >= 0x33000000u) {  // subnormal: (mantissa with its leading 1) · 2^(e - 126) units of 2^-24
    const uint32_t e = a >> 23, mant = (a & 0x7fffffu) | 0x800000u, k = 126 - e;
    r = mant >> k, rem = mant & ((1u << k) - 1), half_ulp = 1u << (k - 1);
  } else {
    return {sign};  // below 2^-25 (or exactly it, a tie to the even 0)
  }
  if (rem > half_ulp || (rem == half_ulp && (r & 1u))) r++;
  return {static_cast<uint16_t>(sign | r)};
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, a warp-collective: every lane publishes
// its fragments (a: 4 registers of 2 bf16, b: 2), the warp exchanges, and each lane computes
// its 4 accumulators from the whole A (16 x 16) and B (16 x 8). Fragment layout (PTX ISA,
// "matrix fragments for mma.m16n8k16"), g = lane / 4, t = lane % 4, the lower half of a
// register the lower column: a0 (row g, cols 2t, 2t+1), a1 (row g+8, same cols), a2 (row g,
// cols 2t+8, 2t+9), a3 (row g+8, cols 2t+8, 2t+9); b0 (k 2t, 2t+1; col g), b1 (k 2t+8, 2t+9;
// col g); c/d: c0, c1 (row g, cols 2t, 2t+1), c2, c3 (row g+8, cols 2t, 2t+1). The products of
// bf16 values are exact in f32; the sum runs k = 0..15 after c (the hardware's order is
// unspecified: the kernels' twins are compared within tolerances).
inline void ct_emu_mma_16816(float* d, const uint32_t* a, const uint32_t* b, const float* c) {
  const unsigned lane = threadIdx.x & 31u, base = threadIdx.x & ~31u;
  uint32_t* mine = &ct_emu::mma_slots[6 * static_cast<size_t>(threadIdx.x)];
  for (int i = 0; i < 4; i++) mine[i] = a[i];
  mine[4] = b[0];
  mine[5] = b[1];
  ct_emu::warp_sync();
  auto lo = [](uint32_t r) { return __uint_as_float(r << 16); };
  auto hi = [](uint32_t r) { return __uint_as_float(r & 0xffff0000u); };
  float A[16][16], B[16][8];
  for (unsigned l = 0; l < 32; l++) {
    const uint32_t* f = &ct_emu::mma_slots[6 * static_cast<size_t>(base + l)];
    const unsigned g = l >> 2, t = l & 3u;
    A[g][2 * t] = lo(f[0]), A[g][2 * t + 1] = hi(f[0]);
    A[g + 8][2 * t] = lo(f[1]), A[g + 8][2 * t + 1] = hi(f[1]);
    A[g][2 * t + 8] = lo(f[2]), A[g][2 * t + 9] = hi(f[2]);
    A[g + 8][2 * t + 8] = lo(f[3]), A[g + 8][2 * t + 9] = hi(f[3]);
    B[2 * t][g] = lo(f[4]), B[2 * t + 1][g] = hi(f[4]);
    B[2 * t + 8][g] = lo(f[5]), B[2 * t + 9][g] = hi(f[5]);
  }
  ct_emu::warp_sync();
  const unsigned g = lane >> 2, t = lane & 3u;
  const unsigned rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  for (int i = 0; i < 4; i++) {
    float acc = c[i];
    for (int k = 0; k < 16; k++) acc += A[rows[i]][k] * B[k][cols[i]];
    d[i] = acc;
  }
}
