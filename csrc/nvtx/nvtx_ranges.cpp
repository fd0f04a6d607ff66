// NVTX ranges for the tracing layer of src/device/cuda/nvtx.rs: push/pop of named ranges on the
// calling thread. NVTX v3 is header-only (nvidia-nvtx, pinned in third_party/): with no tool
// attached (no NVTX_INJECTION64_PATH, as set by Nsight Systems) every call is a cheap no-op.
// Host code only; built by build.rs into libcolotrain_cutlass.a.
#include <nvtx3/nvToolsExt.h>

extern "C" void ct_nvtx_push(const char* name) { nvtxRangePushA(name); }
extern "C" void ct_nvtx_pop() { nvtxRangePop(); }
