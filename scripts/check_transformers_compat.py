#!/usr/bin/env python3
"""Checks by hand (needs torch + transformers, see requirements-fixtures.txt) that directories
written by colotrain load in transformers unchanged: for each architecture, `colotrain init-tiny`
writes a model; transformers loads it with AutoModelForCausalLM and AutoTokenizer, renders the chat
template, and its per-token log-probs are compared with `colotrain score` on the same ids.

    python scripts/check_transformers_compat.py [--bin target/release/colotrain] [--dir DIR]...

With --dir, checks existing directories (e.g. training checkpoints) instead of fresh tiny models.
Exits non-zero if any model fails to load or differs by more than 1e-3 nats.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ap = argparse.ArgumentParser()
ap.add_argument("--bin", default="target/release/colotrain")
ap.add_argument("--dir", action="append", default=[])
args = ap.parse_args()
tmp = tempfile.mkdtemp(prefix="colotrain-compat-")
dirs = list(args.dir)
if not dirs:
    for arch in ["llama", "qwen2", "qwen3"]:
        d = os.path.join(tmp, arch)
        subprocess.run([args.bin, "init-tiny", "--arch", arch, "--out", d, "--layers", "2", "--hidden", "64",
                        "--std", "0.3", "--dtype", "bf16"], check=True, capture_output=True)
        dirs.append(d)
worst = 0.0
for d in dirs:
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
    tok = AutoTokenizer.from_pretrained(d)
    text = tok.apply_chat_template([{"role": "user", "content": "12+30="}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        lp = torch.log_softmax(m(torch.tensor([ids])).logits[0].float(), -1)
    ref = [lp[t, ids[t + 1]].item() for t in range(len(ids) - 1)]
    inp, out = os.path.join(tmp, "in.jsonl"), os.path.join(tmp, "out.jsonl")
    with open(inp, "w") as f:
        f.write(json.dumps({"tokens": ids}) + "\n")
    subprocess.run([args.bin, "score", "--model", d, "--input", inp, "--out", out], check=True, capture_output=True)
    got = json.loads(open(out).readline())["logprobs"]
    diff = max(abs(a - b) for a, b in zip(got, ref))
    worst = max(worst, diff)
    print(f"{d}: {type(m).__name__} loads; chat template -> {text!r}; max |log-prob diff| = {diff:.2e}")
sys.exit(0 if worst <= 1e-3 else 1)
