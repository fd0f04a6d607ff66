// launch.cuh: the one host-side path shared by every CUTLASS GEMM of colotrain (csrc/cutlass/):
// build the arguments of a GemmUniversalAdapter from ct_gemm_lp_args, answer the workspace
// query, check can_implement, initialize and run on the caller's stream. The launchers return
// 0 or a cutlass::Status code; CT_CUTLASS_UNSUPPORTED when the shape breaks the kernel's TMA
// alignment (the Rust side then takes the emulated path). Not yet run on a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda_runtime.h>

#include "colotrain_kernels.h"
#include "cutlass/cutlass.h"
#include "cutlass/util/packed_stride.hpp"

#define CT_CUTLASS_UNSUPPORTED (-1)

namespace colotrain {

// D (m, n) = alpha * A (m, k) . B (n, k)^T with A row-major, B "column-major" (stored (n, k), k
// contiguous), D row-major f32, no C operand. `make_mainloop` builds the mainloop arguments from
// the problem (plain for FP8, with the scale-factor layouts for block-scaled formats).
template <class Gemm, class MainloopArgsFn>
int run_gemm(const ct_gemm_lp_args* p, void* workspace, size_t* workspace_bytes, void* stream,
             MainloopArgsFn make_mainloop) {
  if (p == nullptr || p->m <= 0 || p->n <= 0 || p->k <= 0) return CT_CUTLASS_UNSUPPORTED;
  using Kernel = typename Gemm::GemmKernel;
  const int m = p->m, n = p->n, k = p->k;
  auto stride_c = cutlass::make_cute_packed_stride(typename Kernel::StrideC{}, {m, n, 1});
  auto stride_d = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, {m, n, 1});
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      make_mainloop(m, n, k),
      {{p->alpha, 0.0f}, nullptr, stride_c, p->d, stride_d}};
  if (workspace_bytes != nullptr) {
    *workspace_bytes = Gemm::get_workspace_size(args);
    return 0;
  }
  Gemm gemm;
  cutlass::Status st = gemm.can_implement(args);
  if (st != cutlass::Status::kSuccess) return CT_CUTLASS_UNSUPPORTED;
  st = gemm.initialize(args, workspace, static_cast<cudaStream_t>(stream));
  if (st != cutlass::Status::kSuccess) return static_cast<int>(st);
  st = gemm.run(static_cast<cudaStream_t>(stream));
  if (st != cutlass::Status::kSuccess) return static_cast<int>(st);
  return cudaGetLastError() == cudaSuccess ? 0 : static_cast<int>(cutlass::Status::kErrorInternal);
}

}  // namespace colotrain
