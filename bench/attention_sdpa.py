#!/usr/bin/env python3
"""PyTorch's side of the device check's attention timing (bench/device_check.sh runs it next to
`colotrain device-check --groups attention`): causal scaled-dot-product attention at the same
shape — one sequence of T tokens, 28 query heads over 4 KV heads of 128 (Qwen2.5-7B, GQA 7:1),
BF16 — forward, and forward + backward, timed with CUDA events (mean of ITERS after a warm-up).
Prints one JSON object. Needs torch with CUDA; prints {"skipped": why} otherwise."""
import json
import os
import sys


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
    t = int(os.environ.get("T", "16384"))
    heads, kv, d = 28, 4, 128
    iters = int(os.environ.get("ITERS", "3"))
    dev = torch.device("cuda")
    torch.manual_seed(0)
    q = torch.randn(1, heads, t, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, kv, t, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, kv, t, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(1, heads, t, d, device=dev, dtype=torch.bfloat16)

    def fwd():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def fwd_bwd():
        o = fwd()
        o.backward(dout)

    def timed(f):
        f()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            f()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters

    with torch.no_grad():
        fwd_ms = timed(fwd)
    fb_ms = timed(fwd_bwd)
    flop = 4.0 * t * t / 2 * heads * d
    print(json.dumps({
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "shape": {"tokens": t, "heads": heads, "kv_heads": kv, "head_dim": d, "dtype": "bf16"},
        "sdpa_forward_ms": fwd_ms,
        "sdpa_forward_tflops": flop / (fwd_ms * 1e-3) / 1e12,
        "sdpa_forward_backward_ms": fb_ms,
        "sdpa_backward_ms": fb_ms - fwd_ms,
    }))


if __name__ == "__main__":
    sys.exit(main())
