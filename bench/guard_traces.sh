#!/usr/bin/env bash
# The mismatch guard on the tiny OPD job, off and on, side by side, for two rollout engines:
# FP8 W8A8 (weights and activations in FP8, scales calibrated before training: near this
# budget's upper end) and weight noise σ = 0.3 (far above it). The guard watches d_n against
# this model and task's budget bracket B_emp = [0.00332, 0.00451] (bench/budget_sweep.sh,
# README "Mismatch budgets") as an EMA; with consistent views, two breaches in a row fall back
# to bf16 in place. Prints d_n, the guard's state and the held-out KL of both runs at a few
# steps, and the guard's events.
#
# Usage: bench/guard_traces.sh        Env: STEPS (default 150), OUT (default runs/guard-traces)
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-150}
OUT=${OUT:-runs/guard-traces}
cargo build --release --quiet
BIN=$(mktemp -d)/colotrain
cp target/release/colotrain "$BIN"
mkdir -p "$OUT"
pair() { # name, [engine] lines to append, the ladder's first rung
  local name=$1 engine=$2 rung=$3
  for g in off on; do
    cfg=$OUT/$name-$g.toml
    sed -e "s/^steps = .*/steps = $STEPS/" -e "s/^every = 50/every = 25/" -e "s/^name = .*/name = \"$name-$g\"/" \
        -e "s|^\[run\]|[run]\nout_dir = \"$OUT/$name-$g\"|" -e '/^recipe = "bf16"/d' configs/tiny-opd.toml > "$cfg"
    printf '%b\n\n[guard]\nenabled = %s\nfallback = ["%s", "bf16"]\nline = "bracket"\nbracket = [0.00332, 0.00451]\n' \
      "$engine" "$([ $g = on ] && echo true || echo false)" "$rung" >> "$cfg"
    rm -rf "${OUT:?}/$name-$g"
    echo "== $name, guard $g"
    $BIN train --config "$cfg" 2>&1 | grep -E "held-out KL|guard |seconds/step" || true
  done
  python3 - "$OUT" "$name" <<'PY'
import json, sys
out, name = sys.argv[1], sys.argv[2]
def load(g):
    return {m["step"]: m for m in map(json.loads, open(f"{out}/{name}-{g}/metrics.jsonl"))}
off, on = load("off"), load("on")
steps = sorted(s for s in on if s > 0)
show = {s for s in steps if s in (1, 2, 3, 5, 10) or s % 25 == 0}
events = [(s, e) for s in steps for e in on[s].get("guard", {}).get("events", [])]
show = sorted(show | {s for s, _ in events})
print(f"{name}: guard off vs on")
print(f"{'step':>5} {'d_n (off)':>11} {'d_n (on)':>11} {'EMA (on)':>10} {'serving (on)':>13} {'KL (off)':>9} {'KL (on)':>9}")
for s in show:
    a, b = off[s], on[s]
    kl = lambda m: f"{m['heldout_kl']:.4f}" if "heldout_kl" in m else ""
    print(f"{s:>5} {a['mismatch']['d_n']:>11.5f} {b['mismatch']['d_n']:>11.5f} {b['guard']['windowed']:>10.5f} "
          f"{b['guard']['state']:>13} {kl(a):>9} {kl(b):>9}")
print(f"line = {on[steps[0]]['guard']['line']:.5f} nats/token; events:")
for s, e in events:
    e = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in e.items()}
    print(f"  step {s}: {json.dumps(e)}")
PY
}
pair fp8 'recipe = "fp8"' fp8
pair noise-0.3 'recipe = "bf16"\nnoise_sigma = 0.3' noise=0.3
