#!/usr/bin/env python3
"""Times transformers' generate() on CPU for the decode benchmark (bench/decode_vs_transformers.sh).

Reads the same prompts file colotrain reads ({"tokens": [...]} per line), generates
--max-new-tokens tokens per prompt greedily (EOS disabled, like colotrain's --ignore-eos) in one
batch, and prints one JSON line: {"batch", "new_tokens", "seconds", "tokens_per_s"}.
Warm-up: one untimed generate of 4 tokens. Needs torch and transformers (scripts/requirements-fixtures.txt).
"""
import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("--model", required=True)
ap.add_argument("--prompts", required=True)
ap.add_argument("--max-new-tokens", type=int, default=128)
ap.add_argument("--threads", type=int, default=2)
args = ap.parse_args()

torch.set_num_threads(args.threads)
model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
rows = [json.loads(l)["tokens"] for l in open(args.prompts) if l.strip()]
assert len({len(r) for r in rows}) == 1, "equal-length prompts (no padding)"
ids = torch.tensor(rows, dtype=torch.long)
mask = torch.ones_like(ids)
kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=mask)
with torch.inference_mode():
    model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, **kw)
    dt = time.perf_counter() - t0
new = (out.shape[1] - ids.shape[1]) * ids.shape[0]
print(json.dumps({"batch": ids.shape[0], "new_tokens": new, "seconds": dt, "tokens_per_s": new / dt}))
