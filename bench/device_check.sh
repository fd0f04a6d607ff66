#!/usr/bin/env bash
# The device check of the CUDA backend, on a GPU machine: every CUDA op against its CPU twin on
# fresh random inputs, then GEMM (BF16 / FP8 / NVFP4 vs cuBLASLt), decode (1.5B-shaped model,
# batch 1 / 64 / 256 vs the bandwidth bound) and resync (7B-shaped model per recipe vs a copy)
# timings. Prints one report and writes it as JSON. Needs no Rust toolchain: it runs a colotrain
# binary built elsewhere with `cargo build --release --features cuda` (kernels for
# sm_90a / sm_100a / sm_103a by default) and copied here.
#
# Usage: bench/device_check.sh [device-check options, e.g. --checks-only]
# Env:   BIN       the binary (default target/release/colotrain)
#        OUT       output folder (default runs/device-check)
#        DEVICE    CUDA ordinal (default 0)
#        CUDA_LIBS folder holding libcublasLt.so.13 (default: searched in the usual places and
#                  in the site-packages of python3's pip wheels, e.g. nvidia-cublas)
#        LIMIT     seconds before the run is stopped (default 470: the whole script stays under
#                  8 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/colotrain}
OUT=${OUT:-runs/device-check}
LIMIT=${LIMIT:-470}
if [ ! -x "$BIN" ]; then
  echo "device_check: no binary at $BIN; build it with 'cargo build --release --features cuda' and copy it here" >&2
  exit 1
fi
mkdir -p "$OUT"

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
if LIB=$(find_cublaslt); then
  export LD_LIBRARY_PATH="$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "libcublasLt.so.13 from $LIB"
else
  echo "device_check: libcublasLt.so.13 not found; set CUDA_LIBS (or install the nvidia-cublas wheel for CUDA 13)" >&2
fi
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

set +e
timeout "$LIMIT" "$BIN" device-check --device "${DEVICE:-0}" --out "$OUT/report.json" "$@" 2>&1 | tee "$OUT/report.txt"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" = 124 ]; then
  echo "device_check: stopped after $LIMIT s (partial output in $OUT/report.txt)" >&2
fi
exit "$rc"
