// gemm_fp8_sm100.cu: FP8 E4M3 W8A8 GEMM for Blackwell (compiled for sm_100a and sm_103a),
// CUTLASS collective builders: tcgen05 MMA (accumulators in tensor memory, full FP32), 1-SM
// 128x128x128 tiles, no clusters (any grid works), kernel schedule chosen by the builder.
// d (m, n) f32 = alpha * a (m, k) . b (n, k)^T with alpha = activation scale * weight scale.
// CPU twin: src/ops/linear/cpu.rs linear_q on a fake-quantized input (the same products, FP32
// accumulation in a different order). Needs k % 16 == 0 and n % 4 == 0. Compiles with the
// pinned toolchain; not yet run on a GPU.
#include "cute/tensor.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/numeric_types.h"
#include "launch.cuh"

namespace colotrain_fp8_sm100 {
using namespace cute;

using Fp8 = cutlass::float_e4m3_t;
constexpr int kAlignAB = 16;
constexpr int kAlignD = 4;
using MmaTile = Shape<_128, _128, _128>;
using Cluster = Shape<_1, _1, _1>;

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm100, cutlass::arch::OpClassTensorOp, MmaTile, Cluster,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    void, cutlass::layout::RowMajor, kAlignD,
    float, cutlass::layout::RowMajor, kAlignD,
    cutlass::epilogue::collective::EpilogueScheduleAuto>::CollectiveOp;

using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm100, cutlass::arch::OpClassTensorOp,
    Fp8, cutlass::layout::RowMajor, kAlignAB,
    Fp8, cutlass::layout::ColumnMajor, kAlignAB,
    float, MmaTile, Cluster,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::collective::KernelScheduleAuto>::CollectiveOp;

using Gemm = cutlass::gemm::device::GemmUniversalAdapter<
    cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue, void>>;
}  // namespace colotrain_fp8_sm100

extern "C" int ct_fp8_gemm_sm100a(const ct_gemm_lp_args* p, void* workspace, size_t* workspace_bytes, void* stream) {
  using namespace colotrain_fp8_sm100;
  using Kernel = Gemm::GemmKernel;
  return colotrain::run_gemm<Gemm>(p, workspace, workspace_bytes, stream, [p](int m, int n, int k) {
    auto sa = cutlass::make_cute_packed_stride(Kernel::StrideA{}, {m, k, 1});
    auto sb = cutlass::make_cute_packed_stride(Kernel::StrideB{}, {n, k, 1});
    typename Mainloop::Arguments a{static_cast<const Fp8*>(p->a), sa, static_cast<const Fp8*>(p->b), sb};
    return a;
  });
}
