// sim.cpp: the kernels of csrc/kernels compiled for the host, as one static library for the
// simulated GPU (`--device cuda-sim`, src/device/cuda/sim/). One C entry point runs kernel
// `id` (the order of `Kernel` in src/device/cuda/kernels.rs, asserted there) with its real
// launch shape through ct_emu::launch (shim.h: blocks in turn, a block's threads as fibers,
// shared memory poisoned per block, the thread order varied by `order`). The caller passes
// the kernel's parameter struct by address; the device pointers inside it are host addresses
// (the simulator's device memory is host memory). Not thread-safe: the shim's state is global,
// so the Rust side runs one launch at a time.
// Build (build.rs): c++ -std=c++17 -O2 -ffp-contract=off -include shim.h -Iinclude -I../include sim.cpp
#include "../kernels/attention.cu"
#include "../kernels/attention_prefill.cu"
#include "../kernels/attention_train.cu"
#include "../kernels/elementwise.cu"
#include "../kernels/gemm_w4a4.cu"
#include "../kernels/grad.cu"
#include "../kernels/lm_head.cu"
#include "../kernels/logprob.cu"
#include "../kernels/norm.cu"
#include "../kernels/optimizer.cu"
#include "../kernels/quantize.cu"
#include "../kernels/rope.cu"
#include "../kernels/sample.cu"
#include "../kernels/sample_topk.cu"

template <class P>
static void run(void (*kernel)(P), unsigned gx, unsigned gy, unsigned bx, size_t smem, const void* params) {
  P p;
  std::memcpy(&p, params, sizeof(P));
  ct_emu::launch(kernel, gx, gy, bx, smem, p);
}

// Returns 0, or -1 for an unknown kernel id. `order`: ct_emu::schedule (0 by thread index,
// 1 reversed, 2 shuffled).
extern "C" int ct_sim_launch(int id, unsigned gx, unsigned gy, unsigned bx, size_t smem, int order,
                             const void* params) {
  ct_emu::schedule = order;
  switch (id) {
    case 0: run(ct_rmsnorm, gx, gy, bx, smem, params); break;
    case 1: run(ct_rope_table, gx, gy, bx, smem, params); break;
    case 2: run(ct_rope, gx, gy, bx, smem, params); break;
    case 3: run(ct_embedding, gx, gy, bx, smem, params); break;
    case 4: run(ct_swiglu, gx, gy, bx, smem, params); break;
    case 5: run(ct_gather_rows, gx, gy, bx, smem, params); break;
    case 6: run(ct_add_bias, gx, gy, bx, smem, params); break;
    case 7: run(ct_cast, gx, gy, bx, smem, params); break;
    case 8: run(ct_fill_normal, gx, gy, bx, smem, params); break;
    case 9: run(ct_kv_write, gx, gy, bx, smem, params); break;
    case 10: run(ct_paged_attention, gx, gy, bx, smem, params); break;
    case 11: run(ct_prefill_attention, gx, gy, bx, smem, params); break;
    case 12: run(ct_log_softmax_gather, gx, gy, bx, smem, params); break;
    case 13: run(ct_sample, gx, gy, bx, smem, params); break;
    case 14: run(ct_sample_topk, gx, gy, bx, smem, params); break;
    case 15: run(ct_amax, gx, gy, bx, smem, params); break;
    case 16: run(ct_quant_fp8, gx, gy, bx, smem, params); break;
    case 17: run(ct_quant_nvfp4, gx, gy, bx, smem, params); break;
    case 18: run(ct_dequant, gx, gy, bx, smem, params); break;
    case 19: run(ct_swizzle_sf, gx, gy, bx, smem, params); break;
    case 20: run(ct_optim, gx, gy, bx, smem, params); break;
    case 21: run(ct_sum_sq, gx, gy, bx, smem, params); break;
    case 22: run(ct_sum_sq_finish, gx, gy, bx, smem, params); break;
    case 23: run(ct_scatter_add_rows, gx, gy, bx, smem, params); break;
    case 24: run(ct_lm_stats, gx, gy, bx, smem, params); break;
    case 25: run(ct_lm_dz, gx, gy, bx, smem, params); break;
    case 26: run(ct_rmsnorm_train, gx, gy, bx, smem, params); break;
    case 27: run(ct_rmsnorm_bwd, gx, gy, bx, smem, params); break;
    case 28: run(ct_rmsnorm_dw, gx, gy, bx, smem, params); break;
    case 29: run(ct_swiglu_bwd, gx, gy, bx, smem, params); break;
    case 30: run(ct_rope_bwd, gx, gy, bx, smem, params); break;
    case 31: run(ct_col_sum, gx, gy, bx, smem, params); break;
    case 32: run(ct_embed_bwd, gx, gy, bx, smem, params); break;
    case 33: run(ct_attn_fwd, gx, gy, bx, smem, params); break;
    case 34: run(ct_attn_bwd_dq, gx, gy, bx, smem, params); break;
    case 35: run(ct_attn_bwd_dkv, gx, gy, bx, smem, params); break;
    case 36: run(ct_attn_fwd_tc, gx, gy, bx, smem, params); break;
    case 37: run(ct_attn_bwd_dq_tc, gx, gy, bx, smem, params); break;
    case 38: run(ct_attn_bwd_dkv_tc, gx, gy, bx, smem, params); break;
    case 39: run(ct_nvfp4_scale_out, gx, gy, bx, smem, params); break;
    case 40: run(ct_gemm_w4a4, gx, gy, bx, smem, params); break;
    case 41: run(ct_prefill_attention_tc, gx, gy, bx, smem, params); break;
    case 42: run(ct_attention_merge, gx, gy, bx, smem, params); break;
    case 43: run(ct_gemm_w4a4_merge, gx, gy, bx, smem, params); break;
    case 44: run(ct_qk_rope_kv, gx, gy, bx, smem, params); break;
    default: return -1;
  }
  return 0;
}
