#!/usr/bin/env bash
# Decode throughput of `colotrain generate` against transformers' generate() on CPU, side by side
# in one run: the same ~25M-parameter qwen2-shaped model (f32), the same prompts (16 tokens),
# batch sizes 1, 8 and 32, 128 new tokens (greedy, EOS ignored), the same thread count.
#
# Usage: bench/decode_vs_transformers.sh            (PYTHON=python with torch + transformers)
# Env:   PYTHON (default python3), THREADS (default 2), NEW (default 128), OUT (default runs/bench-decode),
#        REPS (default 3: best of REPS runs per cell, the two sides alternating; these VMs are noisy)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
THREADS=${THREADS:-2}
NEW=${NEW:-128}
REPS=${REPS:-3}
OUT=${OUT:-runs/bench-decode}
BIN=target/release/colotrain
cargo build --release --quiet
mkdir -p "$OUT"
MODEL=$OUT/qwen2-25m
if [ ! -f "$MODEL/config.json" ]; then
  # 8 layers, hidden 384, 6 heads / 2 KV heads, MLP 1024, vocab 32000, tied: 24.9M parameters.
  $BIN init-tiny --arch qwen2 --out "$MODEL" --layers 8 --hidden 384 --heads 6 --kv-heads 2 \
    --intermediate 1024 --vocab 32000 --tie --std 0.05 --seed 1 >/dev/null
fi
$PY - "$OUT" <<'PY'
import json, random, sys
random.seed(0)
for b in (1, 8, 32):
    with open(f"{sys.argv[1]}/prompts-{b}.jsonl", "w") as f:
        for _ in range(b):
            f.write(json.dumps({"tokens": [random.randrange(32, 127) for _ in range(16)]}) + "\n")
PY
printf '%-6s %14s %14s %8s %8s\n' batch colotrain_tok/s hf_tok/s ratio paired | tee "$OUT/table.txt"
for B in 1 8 32; do
  P=$OUT/prompts-$B.jsonl
  # Each rep runs colotrain, then transformers, so that both sides of a pair see the same state
  # of this noisy machine. colotrain: the engine's own timer (prefill + decode, model load
  # excluded); transformers: generate() alone, after a warm-up (bench/hf_generate.py).
  ours=() theirs=()
  for _ in $(seq "$REPS"); do
    line=$($BIN generate --model "$MODEL" --prompts "$P" --temperature 0 --ignore-eos \
      --max-new-tokens "$NEW" --device "cpu:$THREADS" --out "$OUT/gen-$B.jsonl" 2>&1 | grep '^generated')
    ours+=("$(echo "$line" | sed -E 's/.*\(([0-9.]+) tokens\/s\).*/\1/')")
    theirs+=("$($PY bench/hf_generate.py --model "$MODEL" --prompts "$P" --max-new-tokens "$NEW" --threads "$THREADS" | $PY -c 'import json,sys; print(json.load(sys.stdin)["tokens_per_s"])')")
  done
  # ratio: best of REPS over best of REPS; paired: the median of the REPS per-pair ratios.
  $PY - "$B" "${ours[*]}" "${theirs[*]}" <<'PY' | tee -a "$OUT/table.txt"
import statistics, sys
b, ours, theirs = sys.argv[1], [float(x) for x in sys.argv[2].split()], [float(x) for x in sys.argv[3].split()]
paired = statistics.median(o / t for o, t in zip(ours, theirs))
print(f"{b:<6} {max(ours):14.1f} {max(theirs):14.1f} {max(ours) / max(theirs):8.2f} {paired:8.2f}")
PY
done
