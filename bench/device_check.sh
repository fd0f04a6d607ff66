#!/usr/bin/env bash
# The device check of the CUDA backend, on a GPU machine: every CUDA op against its CPU twin on
# fresh random inputs (first, with COLOTRAIN_CUDA_SYNC=1), then GEMM (BF16 / FP8 / NVFP4 vs
# cuBLASLt), decode (1.5B-shaped model, batch 1 / 64 / 256 vs the bandwidth bound), resync
# (7B-shaped model per recipe vs a copy) and training attention (16k tokens, CUDA-core vs
# tensor-core forward, backward; then PyTorch's SDPA at the same shape,
# bench/attention_sdpa.py), fused loss and training-step (1.5B-shaped, 8 x 2048 tokens; then
# PyTorch eager at the same shape, bench/train_step_torch.py) timings, and last a short colocated
# OPD job (1.5B-shaped, sync vs async k = 4) next to the launch ledger's model of its step. Each group runs in its own process: a failing,
# crashing or hanging group is reported and the next one runs. Rows are printed and the JSON
# report rewritten as they arrive. `device-check --list` names the groups.
#
# Needs no Rust toolchain: it runs a colotrain binary built elsewhere and copied here, stripped
# (it must fit the 64 MiB a device session may carry; CI checks it stays under 60 MiB). The
# default build carries cubins for sm_90a, sm_100a and sm_103a (17 MiB stripped); for an
# H200 / H100 alone, Hopper's kernels suffice and build faster:
#   COLOTRAIN_CUDA_ARCHS=sm_90a cargo build --release --features cuda
#   strip -o colotrain-gpu target/release/colotrain      # then BIN=colotrain-gpu
#
# Before a GPU is lent, the same script runs on the simulated GPU, the checks only:
#   DEVICE=cuda-sim:0 bench/device_check.sh --checks-only      (COLOTRAIN_SIM_ARCH=sm_100a: B300)
#
# Usage: bench/device_check.sh [device-check options, e.g. --checks-only, --groups dense,quant]
# Env:   BIN       the binary (default target/release/colotrain)
#        OUT       output folder (default runs/device-check)
#        DEVICE    CUDA ordinal, cuda:K or cuda-sim:K (default 0)
#        CUDA_LIBS folder holding libcublasLt.so.13 (default: searched in the usual places and
#                  in the site-packages of python3's pip wheels, e.g. nvidia-cublas)
#        LIMIT     seconds before the whole run is stopped (default 290: under 5 minutes); one
#                  group is stopped after GROUP_LIMIT seconds (default 120)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/colotrain}
OUT=${OUT:-runs/device-check}
LIMIT=${LIMIT:-290}
if [ ! -x "$BIN" ]; then
  echo "device_check: no binary at $BIN; build it with 'cargo build --release --features cuda' and copy it here" >&2
  exit 1
fi
mkdir -p "$OUT"
size=$(stat -c %s "$BIN")
echo "binary $BIN: $((size / 1048576)) MiB"
if [ "$size" -gt $((60 * 1048576)) ]; then
  echo "device_check: the binary is over 60 MiB; strip it or build only sm_90a (see the header of this script)" >&2
fi

# libcuda.so.1 comes with the driver (usually already on the loader path); libcublasLt.so.13
# with a CUDA 13 toolkit or the nvidia-cublas wheel. Put the first folder that has it in front.
find_cublaslt() {
  local d
  for d in ${CUDA_LIBS:-} ${CUDA_HOME:+$CUDA_HOME/lib64} /usr/local/cuda/lib64 /usr/local/cuda-13*/lib64 \
           /usr/local/cuda-13*/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu; do
    [ -e "$d/libcublasLt.so.13" ] && { echo "$d"; return 0; }
  done
  if command -v python3 >/dev/null 2>&1; then
    for d in $(python3 -c 'import site; print(" ".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null); do
      for l in "$d"/nvidia/*/lib "$d"/nvidia/cublas/lib; do
        [ -e "$l/libcublasLt.so.13" ] && { echo "$l"; return 0; }
      done
    done
  fi
  return 1
}
case "${DEVICE:-0}" in
  cuda-sim*) echo "simulated GPU: no driver, no cuBLASLt needed" ;;
  *)
    if LIB=$(find_cublaslt); then
      export LD_LIBRARY_PATH="$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      echo "libcublasLt.so.13 from $LIB"
    else
      echo "device_check: libcublasLt.so.13 not found; set CUDA_LIBS (or install the nvidia-cublas wheel for CUDA 13)" >&2
    fi
    # NCCL (the device collective's rows): cudarc opens libnccl.so (or .so.1, .so.9-13), never
    # NCCL's soname libnccl.so.2, which is all the nvidia-nccl wheel and apt's libnccl2 ship:
    # link the first one found (the wheels', then the system's ldconfig cache) under $OUT/lib.
    NCCL2=""
    if command -v python3 >/dev/null 2>&1; then
      for d in $(python3 -c 'import site; print(" ".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null); do
        for f in "$d"/nvidia/nccl/lib/libnccl.so.2 "$d"/nvidia/*/lib/libnccl.so.2; do
          if [ -z "$NCCL2" ] && [ -e "$f" ]; then NCCL2=$f; fi
        done
      done
    fi
    if [ -z "$NCCL2" ] && command -v ldconfig >/dev/null 2>&1; then
      NCCL2=$(ldconfig -p 2>/dev/null | awk '/libnccl\.so\.2 / {print $NF; exit}')
    fi
    if [ -n "$NCCL2" ]; then
      mkdir -p "$OUT/lib" && ln -sf "$NCCL2" "$OUT/lib/libnccl.so"
      export LD_LIBRARY_PATH="$(cd "$OUT/lib" && pwd)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      echo "libnccl.so.2 from $NCCL2"
    else
      echo "device_check: libnccl.so.2 not found (pip install nvidia-nccl-cu13): the NCCL rows will fail" >&2
    fi
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    ;;
esac

set +e
timeout "$LIMIT" "$BIN" device-check --device "${DEVICE:-0}" --group-timeout "${GROUP_LIMIT:-120}" \
  --out "$OUT/report.json" "$@" 2>&1 | tee "$OUT/report.txt"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" = 124 ]; then
  echo "device_check: stopped after $LIMIT s (partial output in $OUT/report.txt)" >&2
fi
# PyTorch's SDPA at the attention timing's shape and PyTorch eager's training step at the train
# timing's, side by side in the same run (a GPU with torch only; 60 s and 120 s at most).
case "${DEVICE:-0} $*" in
  cuda-sim*|*--checks-only*) ;;
  *)
    if command -v python3 >/dev/null 2>&1; then
      timeout 60 python3 bench/attention_sdpa.py 2> "$OUT/attention_sdpa.err" | tee "$OUT/attention_sdpa.json" || true
      timeout 120 python3 bench/train_step_torch.py 2> "$OUT/train_step_torch.err" | tee "$OUT/train_step_torch.json" || true
    fi
    ;;
esac
exit "$rc"
