// gemm_nvfp4_sm100.cu: NVFP4 W4A4 block-scaled GEMM for Blackwell (compiled for sm_100a and
// sm_103a): E2M1 operands with one E4M3 scale per 16 values along K, tcgen05 block-scaled MMA
// (OpClassBlockScaledTensorOp), 1-SM 128x128x256 tiles, no clusters, FP32 accumulation.
// d (m, n) f32 = alpha * (a . sfa) (m, k) . (b . sfb) (n, k)^T, alpha = global scale of the
// activations * global scale of the weights. The scales must be in CUTLASS's tiled layout
// (ct_swizzle_sf in csrc/kernels/quantize.cu writes it; ct_nvfp4_sf_bytes_sm100a reports the
// sizes CUTLASS expects, which the device check compares with the Rust-side formula).
// CPU twin: src/ops/linear/cpu.rs linear_q on an NVFP4 fake-quantized input (the same products
// q_a*bs_a*q_w*bs_w, exact in FP32; the sum in a different order). Needs k % 32 == 0 and
// n % 4 == 0. Compiles with the pinned toolchain; not yet run on a GPU.
#include "cute/tensor.hpp"
#include "cutlass/detail/sm100_blockscaled_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/numeric_types.h"
#include "launch.cuh"

namespace colotrain_nvfp4_sm100 {
using namespace cute;

using Nvfp4 = cutlass::nv_float4_t<cutlass::float_e2m1_t>;
constexpr int kAlignAB = 32;  // 16 bytes of packed E2M1
constexpr int kAlignD = 4;
using MmaTile = Shape<_128, _128, _256>;
using Cluster = Shape<_1, _1, _1>;

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm100, cutlass::arch::OpClassTensorOp, MmaTile, Cluster,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    void, cutlass::layout::RowMajor, kAlignD,
    float, cutlass::layout::RowMajor, kAlignD,
    cutlass::epilogue::collective::EpilogueScheduleAuto>::CollectiveOp;

using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm100, cutlass::arch::OpClassBlockScaledTensorOp,
    Nvfp4, cutlass::layout::RowMajor, kAlignAB,
    Nvfp4, cutlass::layout::ColumnMajor, kAlignAB,
    float, MmaTile, Cluster,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::collective::KernelScheduleAuto>::CollectiveOp;

using Gemm = cutlass::gemm::device::GemmUniversalAdapter<
    cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue, void>>;
using SfConfig = typename Mainloop::Sm1xxBlkScaledConfig;
}  // namespace colotrain_nvfp4_sm100

extern "C" int ct_nvfp4_gemm_sm100a(const ct_gemm_lp_args* p, void* workspace, size_t* workspace_bytes, void* stream) {
  using namespace colotrain_nvfp4_sm100;
  using Kernel = Gemm::GemmKernel;
  using Data = typename Nvfp4::DataType;
  using Scale = typename Nvfp4::ScaleFactorType;
  return colotrain::run_gemm<Gemm>(p, workspace, workspace_bytes, stream, [p](int m, int n, int k) {
    auto sa = cutlass::make_cute_packed_stride(Kernel::StrideA{}, {m, k, 1});
    auto sb = cutlass::make_cute_packed_stride(Kernel::StrideB{}, {n, k, 1});
    auto lsfa = SfConfig::tile_atom_to_shape_SFA(cute::make_shape(m, n, k, 1));
    auto lsfb = SfConfig::tile_atom_to_shape_SFB(cute::make_shape(m, n, k, 1));
    typename Mainloop::Arguments a{static_cast<const Data*>(p->a), sa, static_cast<const Data*>(p->b), sb,
                                   static_cast<const Scale*>(p->sfa), lsfa, static_cast<const Scale*>(p->sfb), lsfb};
    return a;
  });
}

extern "C" void ct_nvfp4_sf_bytes_sm100a(int32_t m, int32_t n, int32_t k, size_t* sfa_bytes, size_t* sfb_bytes) {
  using namespace colotrain_nvfp4_sm100;
  auto lsfa = SfConfig::tile_atom_to_shape_SFA(cute::make_shape(m, n, k, 1));
  auto lsfb = SfConfig::tile_atom_to_shape_SFB(cute::make_shape(m, n, k, 1));
  if (sfa_bytes) *sfa_bytes = static_cast<size_t>(cute::size(cute::filter_zeros(lsfa)));
  if (sfb_bytes) *sfb_bytes = static_cast<size_t>(cute::size(cute::filter_zeros(lsfb)));
}
