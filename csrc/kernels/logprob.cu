// logprob.cu: fused log-softmax + gather. CPU twin: src/ops/logprob/cpu.rs (log_softmax_gather,
// row_log_normalizer); launcher: src/ops/logprob/cuda.rs. Same order of operations as the CPU:
//   - scale by 1/T in f32, the max in f32;
//   - weights ct_exp_f32(z/T - max) (the CPU's exp_f32, bit for bit), summed in double;
//   - log-prob = (z_y/T - max) - log(sum).
// One difference, at the rounding level: the double sum is reduced per thread chunk and then
// across chunks (not in the CPU's 16-lane order). Not yet run on a GPU.
#include "row_stats.cuh"

// One block of CT_ROW_THREADS threads per row.
extern "C" __global__ void __launch_bounds__(CT_ROW_THREADS) ct_log_softmax_gather(ct_logprob_params p) {
  const int row = blockIdx.x;
  if (row >= p.rows) return;
  const float* z = p.logits + static_cast<int64_t>(row) * p.vocab;
  const RowStats st = ct_row_stats(z, p.vocab, p.temperature, nullptr);
  if (threadIdx.x == 0) {
    const uint32_t y = p.targets[row];
    if (y >= static_cast<uint32_t>(p.vocab)) {
      ct_set_error(p.err, CT_ERR_TARGET);
      p.out[row] = __uint_as_float(0x7FC00000u);
    } else {
      const float zy = __fsub_rn(__fdiv_rn(z[y], p.temperature), st.mx);
      p.out[row] = static_cast<float>(static_cast<double>(zy) - log(st.sum));
    }
  }
}
