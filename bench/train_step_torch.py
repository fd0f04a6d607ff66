#!/usr/bin/env python3
"""PyTorch eager's side of the device check's training-step timing (bench/device_check.sh runs it
next to `colotrain device-check --groups train`): one OPD step of a random Qwen2-1.5B-shaped model
(28 layers, hidden 1536, 12 heads over 2 KV heads of 128, MLP 8960, vocabulary 151,936, tied
head) on SEQS sequences of SEQ_LEN tokens, the work colotrain's step does:

  per sequence (one micro-batch, gradients accumulated):
    a no-grad forward for the step's log-probs log p(y_t) and entropy (colotrain's stats pass),
    the forward with autograd, loss = -sum_t c_t * log p(y_t) / tokens with the OPD coefficient
    c_t = log q_teacher(y_t) - log p(y_t) (detached), its backward;
  then the global gradient norm with clipping at 1 and one fused AdamW step
  (torch.optim.AdamW(fused=True)) on the FP32 parameters.

The usual mixed-precision recipe: FP32 parameters and optimizer state, BF16 autocast for the
matmuls, SDPA (is_causal, enable_gqa) for attention, log-softmax over the full logits. Timed with
CUDA events, the mean of ITERS steps after one warm-up; peak memory as the rise above what is
allocated after the warm-up (as colotrain reports it) and in total. Prints one JSON object; prints
{"skipped": why} without torch or CUDA."""
import json
import os
import time


def main() -> None:
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        print(json.dumps({"skipped": f"no torch: {e}"}))
        return
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "torch sees no CUDA device"}))
        return
    seqs = int(os.environ.get("SEQS", "8"))
    seq_len = int(os.environ.get("SEQ_LEN", "2048"))
    iters = int(os.environ.get("ITERS", "3"))
    layers, hidden, heads, kv, hd, inter, vocab = 28, 1536, 12, 2, 128, 8960, 151936
    dev = torch.device("cuda")
    torch.manual_seed(0)

    def lin(o, i, bias=False):
        w = torch.nn.Parameter(torch.randn(o, i, device=dev) * 0.02)
        b = torch.nn.Parameter(torch.zeros(o, device=dev)) if bias else None
        return w, b

    params = []
    emb = torch.nn.Parameter(torch.randn(vocab, hidden, device=dev) * 0.02)
    params.append(emb)
    blocks = []
    for _ in range(layers):
        blk = {
            "ln1": torch.nn.Parameter(torch.ones(hidden, device=dev)),
            "ln2": torch.nn.Parameter(torch.ones(hidden, device=dev)),
            "q": lin(heads * hd, hidden, True),
            "k": lin(kv * hd, hidden, True),
            "v": lin(kv * hd, hidden, True),
            "o": lin(hidden, heads * hd),
            "gate": lin(inter, hidden),
            "up": lin(inter, hidden),
            "down": lin(hidden, inter),
        }
        for v in blk.values():
            params.extend([p for p in (v if isinstance(v, tuple) else (v,)) if p is not None])
        blocks.append(blk)
    norm_f = torch.nn.Parameter(torch.ones(hidden, device=dev))
    params.append(norm_f)
    opt = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.01, fused=True)

    pos = torch.arange(seq_len, device=dev, dtype=torch.float32)
    inv = 1.0 / (1e6 ** (torch.arange(0, hd, 2, device=dev, dtype=torch.float32) / hd))
    ang = torch.outer(pos, inv)
    # BF16 tables: q and k stay BF16 under autocast (an FP32 table would promote them).
    cos, sin = torch.cat([ang.cos()] * 2, -1).bfloat16(), torch.cat([ang.sin()] * 2, -1).bfloat16()

    def rope(x):  # (1, h, T, hd)
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def rms(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w

    def logprobs(ids, targets, entropy=False):
        x = F.embedding(ids, emb)
        for b in blocks:
            h = rms(x, b["ln1"])
            q = F.linear(h, *b["q"]).view(1, seq_len, heads, hd).transpose(1, 2)
            k = F.linear(h, *b["k"]).view(1, seq_len, kv, hd).transpose(1, 2)
            v = F.linear(h, *b["v"]).view(1, seq_len, kv, hd).transpose(1, 2)
            a = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True, enable_gqa=True)
            x = x + F.linear(a.transpose(1, 2).reshape(1, seq_len, heads * hd), b["o"][0])
            h = rms(x, b["ln2"])
            x = x + F.linear(F.silu(F.linear(h, b["gate"][0])) * F.linear(h, b["up"][0]), b["down"][0])
        logits = F.linear(rms(x, norm_f), emb).float()
        lsm = torch.log_softmax(logits, -1)
        lp = lsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        # colotrain's stats pass also reports the entropy.
        return (lp, -(lsm.exp() * lsm).sum(-1)) if entropy else lp

    g = torch.Generator(device=dev).manual_seed(31)
    ids = [torch.randint(0, vocab, (1, seq_len), device=dev, generator=g) for _ in range(seqs)]
    teacher = [torch.randn(1, seq_len, device=dev, generator=g) - 12.0 for _ in range(seqs)]
    tokens = seqs * seq_len

    def step():
        for x, t in zip(ids, teacher):
            tgt = torch.roll(x, -1, 1)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                with torch.no_grad():
                    old, _ = logprobs(x, tgt, entropy=True)
                lp = logprobs(x, tgt)
                loss = -((t - old) * lp).sum() / tokens
            loss.backward()
        # The global gradient norm and clipping, as colotrain's optimizer step does.
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    # colotrain reports the rise above what the trainer holds after a warm-up step.
    base = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.time()
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / iters
    print(
        json.dumps(
            {
                "what": f"PyTorch eager {torch.__version__}, OPD step, 1.5B-shaped, {seqs} x {seq_len} tokens, AdamW fused",
                "gpu": torch.cuda.get_device_name(),
                "ms": round(ms, 2),
                "tokens_per_s": round(tokens / (ms * 1e-3), 1),
                "peak_gib": round((torch.cuda.max_memory_allocated() - base) / 2**30, 2),
                "total_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                "wall_s": round(time.time() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
