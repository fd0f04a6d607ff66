# Source this (bash/zsh) to use the pinned toolchain installed by install_toolchain.sh:
#   source third_party/env.sh
# Exports CUDA_HOME, PATH (nvcc, ptxas), CUTLASS_INCLUDE and CUTLASS_UTIL_INCLUDE.
if [ -n "${BASH_SOURCE[0]:-}" ]; then
  _colotrain_tp="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
else
  _colotrain_tp="$(cd "$(dirname "$0")" && pwd)"   # zsh: $0 is the sourced file
fi
if [ ! -x "$_colotrain_tp/.toolchain/cuda/bin/nvcc" ]; then
  echo "third_party/env.sh: toolchain missing; run: bash $_colotrain_tp/install_toolchain.sh" >&2
fi
export CUDA_HOME="$_colotrain_tp/.toolchain/cuda"
export CUDA_PATH="$CUDA_HOME"
export CUTLASS_INCLUDE="$_colotrain_tp/.toolchain/cutlass-include"
export CUTLASS_UTIL_INCLUDE="$_colotrain_tp/.toolchain/cutlass-util-include"
case ":$PATH:" in
  *":$CUDA_HOME/bin:"*) ;;
  *) export PATH="$CUDA_HOME/bin:$PATH" ;;
esac
unset _colotrain_tp
