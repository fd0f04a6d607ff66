#!/usr/bin/env bash
# Seed 000's Table 6 at tiny scale: the built-in tiny OPD job under the standard engine, stale
# weights (k = 1, 2, 4), the FP8 KV cache on every layer at scale 1, the same with the first
# layer's cache in BF16, the FP8 and NVFP4 recipes, and three weight-noise levels; then each
# engine's mismatch level D(c), its held-out degradation Δ(c) against the standard run at the same
# step with the 95% problem-paired interval and the primary rule (fail iff Δ ≥ 20% and the
# interval excludes zero), the bracket B_emp, and the offline admission check's prediction for
# each engine next to its outcome.
#
# Usage: bench/budget_sweep.sh        Env: STEPS (default 150), OUT (default runs/budget-sweep)
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-150}
OUT=${OUT:-runs/budget-sweep}
cargo build --release --quiet
# A private copy: rebuilding while the sweep runs must not swap the binary under it.
BIN=$(mktemp -d)/colotrain
cp target/release/colotrain "$BIN"
mkdir -p "$OUT/configs"
run() { # name, extra [engine] lines
  local name=$1; shift
  local cfg=$OUT/configs/$name.toml
  sed -e "s/^steps = .*/steps = $STEPS/" -e "s/^every = 50/every = $STEPS/" -e "s/^name = .*/name = \"$name\"/" \
      -e "s|^\[run\]|[run]\nout_dir = \"$OUT/$name\"|" configs/tiny-opd.toml > "$cfg"
  # [engine] is the config's last section: replace its keys, then append.
  for line in "$@"; do
    key=${line%% =*}
    grep -v "^$key = " "$cfg" > "$cfg.tmp" && mv "$cfg.tmp" "$cfg"
    echo "$line" >> "$cfg"
  done
  if [ -f "$OUT/$name/checkpoint-$(printf %06d "$STEPS")/trainer_state.json" ]; then
    echo "== $name: done already"; return; fi
  rm -rf "${OUT:?}/$name"
  echo "== $name"
  $BIN train --config "$cfg" 2>&1 | grep -E "held-out KL|seconds/step" || true
}
run standard
run stale-1 "staleness = 1"
run stale-2 "staleness = 2"
run stale-4 "staleness = 4"
run fp8-kv-scale1 'recipe = "fp8-kv"' 'kv_scale = 1.0'
run fp8-kv-scale1-first-bf16 'recipe = "fp8-kv"' 'kv_scale = 1.0' 'keep_bf16 = ["first-layer-kv"]'
run fp8 'recipe = "fp8"'
run nvfp4 'recipe = "nvfp4"'
run noise-0.1 "noise_sigma = 0.1"
run noise-0.3 "noise_sigma = 0.3"
run noise-1.0 "noise_sigma = 1.0"
echo
$BIN eval --reference "$OUT/standard" --admit --budget \
  "$OUT/stale-1" "$OUT/stale-2" "$OUT/stale-4" "$OUT/fp8-kv-scale1" "$OUT/fp8-kv-scale1-first-bf16" \
  "$OUT/fp8" "$OUT/nvfp4" "$OUT/noise-0.1" "$OUT/noise-0.3" "$OUT/noise-1.0" | tee "$OUT/table.txt"
