#!/usr/bin/env bash
# Installs the pinned CUDA 13.0 compile-only toolchain (nvcc, cicc, ptxas, CUDA headers, CCCL)
# and the CUTLASS 4.2.0 headers from PyPI into third_party/.toolchain/ (git-ignored).
# No GPU and no system CUDA are needed. Idempotent: a second run with the same pins is a no-op.
#
#   bash third_party/install_toolchain.sh          # install (or verify) the toolchain
#   FORCE=1 bash third_party/install_toolchain.sh  # wipe and reinstall
#
# Afterwards: `source third_party/env.sh`, or let build.rs find
# third_party/.toolchain/cuda/bin/nvcc by itself. See third_party/README.md.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TC="$HERE/.toolchain"
SITE="$TC/site"           # pip --target folder (wheels unpacked as-is)
ROOT="$TC/cuda"           # CUDA_HOME-like root: bin/ include/ nvvm/ lib/ lib64/
STAMP="$TC/.installed"
PYTHON="${PYTHON:-python3}"

# Exact pins. Every package is installed with --no-deps, so nothing else comes in:
#  - nvidia-cuda-nvcc depends on an unpinned nvidia-nvvm: pip would pick the newest (13.5.x),
#    whose cicc emits PTX 9.5 that the 13.0 ptxas rejects ("Unsupported .version 9.5"), so nvvm
#    is pinned to the nvcc version here;
#  - nvidia-cutlass depends on cuda-python, numpy, scipy, ... which the headers do not need.
PINS=(
  "nvidia-cuda-nvcc==13.0.88"
  "nvidia-nvvm==13.0.88"
  "nvidia-cuda-runtime==13.0.96"
  "nvidia-cuda-crt==13.0.88"
  "nvidia-cuda-cccl==13.0.85"
  "nvidia-cutlass==4.2.0.0"
  "nvidia-nvtx==13.0.85"
)
WANT="$(printf '%s\n' "${PINS[@]}")"

if [[ "${FORCE:-0}" == "1" ]]; then
  rm -rf "$TC"
fi

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$ROOT/bin/nvcc" ]]; then
  echo "toolchain already installed in $TC"
else
  echo "installing pinned CUDA toolchain into $TC"
  rm -rf "$SITE" "$ROOT" "$STAMP"
  mkdir -p "$TC"
  "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile \
    --target "$SITE" "${PINS[@]}"

  # All nvidia-* 13.x wheels unpack into one tree, site/nvidia/cu13/{bin,include,lib,nvvm},
  # and nvcc.profile locates cicc/libdevice/headers relative to bin/ (TOP = bin/..), so that
  # tree already works as CUDA_HOME. The root below only gives it a stable name, plus lib64/
  # (which build scripts and loaders conventionally look for) without touching the pip tree.
  CU="$SITE/nvidia/cu13"
  for p in bin/nvcc bin/ptxas nvvm/bin/cicc nvvm/libdevice/libdevice.10.bc \
           include/cuda_runtime.h include/crt/host_config.h include/cuda_fp8.h \
           include/cuda_fp4.h include/cuda_bf16.h include/cccl/cuda/std/cstdint; do
    [[ -e "$CU/$p" ]] || { echo "error: expected $CU/$p after install" >&2; exit 1; }
  done
  # nvcc computes TOP as "<dir of nvcc>/.." and the kernel resolves ".." through the bin
  # symlink, so TOP is the physical site/nvidia/cu13; nvcc.profile links with -L$TOP/lib64
  # (libcudart_static.a, libcudadevrt.a), which the wheel ships as lib/ only.
  ln -sfn lib "$CU/lib64"
  mkdir -p "$ROOT"
  for d in bin include nvvm lib; do
    ln -sfn "../site/nvidia/cu13/$d" "$ROOT/$d"
  done
  ln -sfn "../site/nvidia/cu13/lib" "$ROOT/lib64"

  CUT="$SITE/cutlass_library/source"
  [[ -f "$CUT/include/cutlass/gemm/device/gemm_universal_adapter.h" && -d "$CUT/include/cute" ]] \
    || { echo "error: CUTLASS headers not found under $CUT/include" >&2; exit 1; }
  # Stable names for the CUTLASS include roots (include/ has cutlass/ and cute/;
  # tools/util/include has cutlass/util/*, used by host-side helpers only).
  ln -sfn "site/cutlass_library/source/include" "$TC/cutlass-include"
  ln -sfn "site/cutlass_library/source/tools/util/include" "$TC/cutlass-util-include"

  printf '%s\n' "$WANT" > "$STAMP"
fi

"$ROOT/bin/nvcc" --version | tail -n 2
echo "CUDA_HOME=$ROOT"
echo "CUTLASS_INCLUDE=$TC/cutlass-include"
