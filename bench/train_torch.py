#!/usr/bin/env python3
"""PyTorch eager side of `colotrain bench train`: one OPD step (forward, token-mean k1 loss in
policy-gradient form, backward, AdamW) on CPU for the rollouts colotrain wrote, timed the same way
(1 warm-up step, then the median of --reps steps). Prints one JSON line with tokens/s."""
import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("--model", required=True)
ap.add_argument("--rollouts", required=True)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--reps", type=int, default=3)
args = ap.parse_args()
torch.set_num_threads(args.threads)
model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
rows = [json.loads(l) for l in open(args.rollouts)]
ids = torch.tensor([r["prompt_tokens"] + r["response_tokens"] for r in rows])
plen = len(rows[0]["prompt_tokens"])
teacher = torch.tensor([r["teacher_logprobs"] for r in rows])
n_tok = ids.numel()


def step():
    logits = model(ids).logits[:, plen - 1 : -1, :]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, plen:, None])[..., 0]
    adv = (teacher - logp).detach()
    loss = -(adv * logp).sum() / logp.numel()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


step()
times = []
for _ in range(args.reps):
    t0 = time.perf_counter()
    step()
    times.append(time.perf_counter() - t0)
med = statistics.median(times)
print(json.dumps({"tokens": n_tok, "seconds": med, "tokens_per_s": n_tok / med}))
