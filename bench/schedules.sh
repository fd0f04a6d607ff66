#!/usr/bin/env bash
# Seed 000 Table 8 / Figure 10 at tiny scale: the built-in tiny OPD job on 1 and 2 CPU devices,
# synchronous and asynchronous (staleness k = 1, 2, 4; colocated: every device generates and
# trains, time-shared; split on 2 devices: device 0 generates while device 1 trains), then one
# table, side by side from one run of this script: where the trainer's average step goes (its
# wait for rollouts, teacher scoring, reward, training, resync), updates/hour and the ratio to
# the first row, generated tokens/s, per-device utilization; and the Figure-10-style plot
# ($OUT/breakdown.svg).
#
# Usage: bench/schedules.sh        Env: STEPS (default 60), OUT (default runs/schedules)
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-60}
OUT=${OUT:-runs/schedules}
cargo build --release --quiet
# A private copy: rebuilding while the benchmark runs must not swap the binary under it.
BIN=$(mktemp -d)/colotrain
cp target/release/colotrain "$BIN"
rm -rf "${OUT:?}"
mkdir -p "$OUT/configs"
runs=()
run() { # name, devices, mode, placement, k
  local name=$1 devices=$2 mode=$3 placement=$4 k=$5
  local cfg=$OUT/configs/$name.toml
  sed -e "s/^steps = .*/steps = $STEPS/" -e "s/^every = 50/every = 0/" -e "s/^heldout_size = .*/heldout_size = 16/" \
      -e "s/^name = .*/name = \"$name\"/" -e "s|^\[run\]|[run]\nout_dir = \"$OUT/$name\"\ndevices = $devices|" \
      configs/tiny-opd.toml > "$cfg"
  printf '\n[schedule]\nmode = "%s"\nplacement = "%s"\nmax_staleness = %s\nrollout_devices = 1\n' "$mode" "$placement" "$k" >> "$cfg"
  echo "== $name"
  $BIN train --config "$cfg" 2>&1 | grep -E "seconds/step" || true
  runs+=("$OUT/$name")
}
run sync-1dev 1 sync colocated 1
for k in 1 2 4; do run async-k$k-1dev 1 async colocated $k; done
run sync-2dev 2 sync colocated 1
for k in 1 2 4; do run async-k$k-2dev 2 async colocated $k; done
for k in 1 2 4; do run split-k$k-2dev 2 async split $k; done
echo
$BIN report "${runs[@]}" --out "$OUT" | tee "$OUT/table.txt"
