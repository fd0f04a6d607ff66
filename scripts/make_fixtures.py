#!/usr/bin/env python3
"""Generate the reference fixtures that colotrain's Rust tests compare against.

What it produces (all under ``tests/fixtures/``):

* section ``models``
  - ``models/<name>/``: three tiny, randomly initialised Hugging Face checkpoints
    written by ``save_pretrained(..., safe_serialization=True)`` in float32
    (``config.json``, ``generation_config.json``, ``model.safetensors`` or a
    sharded ``model.safetensors.index.json`` + ``model-0000x-of-0000y.safetensors``):
      * ``llama_gqa``          LlamaForCausalLM, GQA 6q/2kv, llama3 rope scaling, untied head
      * ``qwen2_tied_sharded`` Qwen2ForCausalLM, q/k/v biases, tied embeddings, sharded
      * ``qwen3_headdim``      Qwen3ForCausalLM, head_dim 32 != hidden/heads, q_norm/k_norm
  - ``ref/<name>.safetensors``: reference tensors computed by transformers
    (eager attention, float32) after reloading the saved directory:
      ``input_ids`` i64 [2,24], ``logits`` f32 [2,24,V], ``logprobs`` f32 [2,23],
      ``greedy_prompt`` i64 [8], ``greedy_tokens`` i64 [24], ``greedy_min_margin`` f32 [1]
  - ``ref/<name>.json``: model name, architecture, config fields, library versions, seeds.

* section ``grads`` (needs the ``models`` section's checkpoints)
  Gradient references for the training objectives, one pair of files per model
  (computed by autograd in float32, eager attention, on the checkpoint as
  reloaded by ``AutoModelForCausalLM.from_pretrained``):
  - ``grads/<name>_rollouts.jsonl``: 4 rollouts, one JSON object per line with
    exactly the fields ``prompt_tokens``, ``response_tokens``,
    ``sampler_logprobs``, ``teacher_logprobs`` (one per response token, drawn as
    -U(0.05, 3.0) and rounded to 6 decimals), ``group`` (0,0,1,1) and
    ``reward`` (1,0,0,1); prompt lengths 3,5,4,6, response lengths 4,2,7,3.
    Everything below uses the logprobs as parsed back from this file, as float32.
  - ``grads/<name>.safetensors`` (float32). Each rollout's prompt+response is run
    through the model alone (batch 1, no padding); the scored rows are positions
    t = prompt_len-1 .. len-2 predicting token t+1 (exactly the response tokens),
    concatenated over the 4 rollouts: M = N = 16 rows, B = 4 sequences, n_i =
    response length of rollout i, logp_t = log_softmax(logits_t)[target_t]
    (live, with grad), sg() = detach, A_t = teacher_logprob_t - sg(logp_t):
      ``logp_t1`` [M]                 logp_t at temperature 1
      ``coef`` [M]                    random N(0, 1) coefficients
      ``loss.coef`` [1]               sum_i -coef_i * log_softmax(logits_i / 0.7)[target_i]
      ``loss.sft_token_mean``         -(1/N) sum_t logp_t
      ``loss.opd_token_mean``         sum_t -(1/N) sg(A_t) logp_t
      ``loss.opd_seq_mean_token_mean``  sum_i sum_{t in i} -(1/(B n_i)) sg(A_t) logp_t
      ``loss.opd_seq_mean_token_sum``   sum_i sum_{t in i} -(1/B) sg(A_t) logp_t
      ``grad.<obj>.<param>``          d loss.<obj> / d param, for every tensor of the
                                      checkpoint, named and shaped as in the
                                      checkpoint (tied qwen2: only
                                      ``model.embed_tokens.weight``, holding the total
                                      gradient of embedding + LM head; no ``lm_head.weight``)
      ``grad_norm.<obj>`` [1]         global L2 norm over all ``grad.<obj>.*``
                                      (accumulated in float64, stored float32)
    where <obj> is one of coef, sft_token_mean, opd_token_mean,
    opd_seq_mean_token_mean, opd_seq_mean_token_sum.

* section ``quant`` (numpy + ml_dtypes only; no model needed)
  Bit-exact references for the FP8/FP4 quantizers, under ``quant/``. Rounding is
  round-to-nearest-even (RNE) as done by ml_dtypes' float32 casts; every ml_dtypes
  result is also cross-checked against an independent exact RNE reference.
  E2M1 codes are ``sign << 3 | magnitude index`` (magnitudes 0, 0.5, 1, 1.5, 2, 3,
  4, 6 -> index 0..7); ml_dtypes stores one float4_e2m1fn per byte with the code
  in the low nibble and the high nibble zero. Signs are preserved through
  rounding: a negative value that rounds to zero gives -0 (E4M3 0x80, E2M1 code 8).
  - ``quant/formats.safetensors``: for ``F`` in ``e4m3`` (float8_e4m3fn), ``e5m2``
    (float8_e5m2), ``e2m1`` (float4_e2m1fn):
      ``F.x`` f32 [n]         every finite value of F (both signs, +-0), every
                              midpoint between consecutive magnitudes (incl. 0 and
                              the smallest subnormal, and max and the next binade
                              step) with its float32 neighbours, values below the
                              smallest subnormal, float32 subnormals, max,
                              nextafter(max), 2*max, 1e30, float32 max, inf (both
                              signs), then 2000 random values log-uniform in
                              magnitude over [smallest subnormal / 4, max], random
                              sign. No NaN.
      ``F.bits`` u8 [n]       ``x.astype(F)`` viewed as uint8 (ml_dtypes: out of
                              range gives NaN 0x7f|sign for e4m3, inf 0x7c|sign for
                              e5m2, saturation to +-6 for e2m1)
      ``F.sat_bits`` u8 [n]   saturating RNE (PTX ``cvt.rn.satfinite``): as ``bits``,
                              except |x| > max (incl. inf) gives +-max
  - ``quant/nvfp4.safetensors``: NVFP4 (E2M1 values, one E4M3 scale per 16
    consecutive elements along the last axis, one float32 global scale), all in
    float32 arithmetic in exactly this order:
      amax = max|x|; global = amax / 2688 (1 if amax == 0); denom6 = 6 * global;
      per block: bs = e4m3_satfinite(bamax / denom6), 1 if that is 0;
      denom = bs * global; q = e2m1(clip(x / denom, -6, 6));
      deq = (q * bs) * global.
    Tensors ``NAME.x`` f32 [R, K], ``NAME.packed`` u8 [R, K/2] (element 2i in the
    low nibble, 2i+1 in the high nibble), ``NAME.scales`` u8 [R, K/16] (E4M3 bits,
    after the 0 -> 1 replacement), ``NAME.global`` f32 [1], ``NAME.deq`` f32 [R, K]
    for NAME in ``normal`` [8, 64], ``mixed`` [4, 128] (a x1e-3 row, a x1e3 row, an
    all-zero block, a block with a 1000 outlier, a row with per-block magnitudes
    from 1e-3 to 3, covering E4M3-subnormal scales), ``ties`` [2, 32] (power-of-two
    global so that x / denom is exactly an E2M1 midpoint for most elements; two
    blocks whose scale bamax / denom6 is itself an exact E4M3 midpoint) and
    ``zeros`` [2, 32].
  - ``quant/fp8.safetensors``: per-tensor E4M3: scale = amax / 448 (1 if amax ==
    0), bits = e4m3_satfinite(x / scale), deq = e4m3(bits) * scale. Tensors
    ``NAME.x``, ``NAME.bits`` u8, ``NAME.scale`` f32 [1], ``NAME.deq`` for NAME in
    ``fp8_normal`` [8, 64] and ``fp8_mixed`` [4, 32] (one row x1e4).
  - ``quant/meta.json``: versions, seeds and the conventions above.

* section ``rl`` (needs the ``models`` section's ``qwen3_headdim`` checkpoint)
  RL objective references on ``models/qwen3_headdim`` (float32, eager attention,
  loaded and scored exactly as in ``grads``; temperature 1: plain log_softmax):
  - ``rl/rollouts.jsonl``: 6 rollouts, one JSON object per line with exactly the
    fields ``prompt_tokens``, ``response_tokens``, ``group`` (0,0,1,1,2,2),
    ``reward`` (1,0,0,1,1,1), ``sampler_logprobs``, ``sampler_topk_ids`` (per
    response token, K = 4 distinct ids) and ``sampler_topk_logprobs`` (per token,
    4 values -U(0.1, 4.0) rounded to 6 decimals); prompt lengths 3,3,4,4,5,5,
    response lengths 7,3,5,1,6,4; all tokens and top-k ids in [3, vocab), drawn
    from one torch.Generator seeded 6001 (tokens first, then the top-k).
    ``sampler_logprobs`` b_t = round(logp_t - gap_t, 6), with logp_t the model's
    own logprob and gap_t the designed learner-sampler gap (``RL_GAPS``), so
    delta_t = logp_t - b_t equals gap_t to ~1e-6 and sits >= 2e-3 away from every
    TRIAGE threshold (except one exact 0.00 gap in an A = 0 response).
    Everything below uses the file as parsed back, as float32.
  - ``rl/params.json``: the constants (GRPO eps_low 0.2 / eps_high 0.28, TIS cap
    2, TRIAGE W = 3, tau_tail -1, K_tail 2, tau_sev -0.4, tau_neg -0.1, w_sev 0.2,
    w_neg 0.6, tau_rep -0.05, beta 0.1, lambda_rep 0.5, k_rep 0, update index 0;
    REINFORCE offset 0.15), the designed gaps and N_rep.
  - ``rl/qwen3_headdim.safetensors`` (float32). M = 26 scored rows (the response
    tokens, concatenated), G = 6, n_i = response length, gamma_i = 1/(G n_i)
    (seq-mean-token-mean), logp live, logp_old = sg(logp), rho = exp(logp -
    logp_old) (1 in value, carries the gradient), delta = logp - b; advantages,
    TIS weights and gate weights detached:
      ``logp`` [M], ``delta`` [M] (detached)
      ``advantages.grpo`` [6]      (r - mean_g) / (sample std_g + 1e-6)
      ``loss.grpo``                sum_i gamma_i sum_t -min(rho A, clip(rho, 0.8, 1.28) A)
      ``loss.grpo_tis``            as grpo with each token times v_t = min(exp(logp_old - b), 2)
      ``loss.triage``              L_PG + L_rep: L_PG = sum_i (1/G) sum_t w_t l_t / sum_t w_t
                                   (l_t the grpo_tis token loss; gate weights w_t from the
                                   W-token segments of A < 0 responses: segment mean vs
                                   tau_sev / tau_neg, tail count below tau_tail, applied to
                                   delta_t < 0 tokens); L_rep = (lambda / N_rep) sum over the
                                   A > 0 segments of phi_beta(relu(tau_rep - mean(delta_live))),
                                   phi_beta(q) = beta^2 (sqrt(1 + (q/beta)^2) - 1), N_rep = number
                                   of W-token segments over all 6 responses
      ``loss.reinforce_offset``    sum_i gamma_i sum_t -rho (r_i + 0.15)
      ``loss.reinforce_centered``  -sum_t c_t (logp_t - sum_{v in topk_t} q_v log_softmax_t[v]),
                                   c_t = gamma_i (r_i + 0.15), q the normalized top-k distribution
      ``triage.w`` [M]             gate weight w_t (1 outside A < 0 negative-gap tokens)
      ``triage.alpha`` [M]         w_t n_i / sum_{t in i} w_t
      ``triage.psi`` [M]           (lambda / N_rep)(1 / n_R) q / sqrt(1 + (q/beta)^2) on tokens
                                   of A > 0 segments with q > 0, else 0 (= -dL_rep/dlogp_t)
      ``grad.<obj>.<param>``       full gradient, for every checkpoint tensor
      ``grad_norm.<obj>`` [1]      as in ``grads``
    for <obj> in grpo, grpo_tis, triage, reinforce_offset, reinforce_centered.

Later sections are added as further ``section_*`` functions and registered in
``SECTIONS``.

How to run (from the repository root; needs network access to PyPI once, no GPU):

    python -m venv /tmp/venv-fixtures
    . /tmp/venv-fixtures/bin/activate
    pip install -r scripts/requirements-fixtures.txt
    python scripts/make_fixtures.py              # all sections
    python scripts/make_fixtures.py --only models
    python scripts/make_fixtures.py --only grads  # reuses tests/fixtures/models/
    python scripts/make_fixtures.py --only quant  # numpy/ml_dtypes only, seconds
    python scripts/make_fixtures.py --only rl     # reuses tests/fixtures/models/qwen3_headdim

The outputs are committed to the repository; CI does NOT run this script (it
needs PyTorch/transformers, which CI does not install). Re-run it only when a
fixture has to change, and commit the regenerated files.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import save_file as save_numpy  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURES = REPO_ROOT / "tests" / "fixtures"

BOS_ID, EOS_ID, PAD_ID = 1, 2, 0

# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def _setup_torch() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.set_default_dtype(torch.float32)


def _uses_rope_parameters(config_cls) -> bool:
    """transformers >= 5 takes a ``rope_parameters`` dict; older versions take
    ``rope_theta`` + ``rope_scaling`` at top level."""
    return "rope_parameters" in inspect.signature(config_cls.__init__).parameters


def _rope_kwargs(config_cls, rope_theta: float, scaling: dict | None) -> dict:
    if _uses_rope_parameters(config_cls):
        params = {"rope_type": "default", "rope_theta": rope_theta}
        if scaling is not None:
            params = {**scaling, "rope_theta": rope_theta}
        return {"rope_parameters": params}
    kw = {"rope_theta": rope_theta}
    if scaling is not None:
        kw["rope_scaling"] = dict(scaling)
    return kw


def _dtype_kw() -> dict:
    """``dtype=`` in transformers >= 4.56/5, ``torch_dtype=`` before."""
    sig = inspect.signature(AutoModelForCausalLM.from_pretrained)
    major = int(transformers.__version__.split(".")[0])
    if major >= 5 or "dtype" in sig.parameters:
        return {"dtype": torch.float32}
    return {"torch_dtype": torch.float32}


@torch.no_grad()
def _reinit(model: torch.nn.Module, seed: int) -> None:
    """2-D weights ~ N(0, 0.2^2); biases ~ N(0, 0.1^2); norm weights = 1 + N(0, 0.1^2).

    ``named_parameters`` de-duplicates tied parameters, so a tied lm_head is
    initialised once (through the embedding)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        elif name.endswith(".bias"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        elif p.dim() == 1 and "norm" in name and name.endswith(".weight"):
            p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.1)
        else:
            raise RuntimeError(f"unhandled parameter {name} {tuple(p.shape)}")


def _greedy_config(max_new: int) -> GenerationConfig:
    return GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new,
        min_new_tokens=max_new,
        bos_token_id=None,
        eos_token_id=None,  # never stop early and never suppress any token
        pad_token_id=PAD_ID,
        temperature=None,
        top_p=None,
        top_k=None,
        output_logits=True,  # raw (unprocessed) logits, for the margin
        return_dict_in_generate=True,
    )


@torch.no_grad()
def _greedy(model, prompt: torch.Tensor, max_new: int):
    """Return (new_tokens[max_new], min_margin) via model.generate, cross-checked
    against a plain no-cache argmax loop."""
    out = model.generate(
        prompt[None],
        generation_config=_greedy_config(max_new),
    )
    tokens = out.sequences[0, prompt.numel():].clone()
    assert tokens.numel() == max_new, tokens.shape
    raw = torch.stack([lg[0] for lg in out.logits])  # [max_new, V], unprocessed
    assert torch.equal(raw.argmax(-1), tokens), "generate did not pick the raw argmax"
    top2 = raw.topk(2, dim=-1).values
    margin = float((top2[:, 0] - top2[:, 1]).min())

    # independent full-recompute loop (no KV cache)
    seq = prompt.clone()
    for _ in range(max_new):
        nxt = model(seq[None]).logits[0, -1].argmax()
        seq = torch.cat([seq, nxt[None]])
    manual = seq[prompt.numel():]
    assert torch.equal(manual, tokens), f"generate {tokens} != manual {manual}"
    return tokens, margin


def _config_summary(saved_cfg: dict) -> dict:
    """The relevant fields exactly as written to config.json (not the config
    object's attributes: transformers 5 exposes e.g. a ``rope_scaling`` alias
    attribute that is not in the file)."""
    keys = [
        "model_type", "architectures", "hidden_size", "num_attention_heads",
        "num_key_value_heads", "head_dim", "intermediate_size", "num_hidden_layers",
        "vocab_size", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
        "attention_bias", "rope_theta", "rope_scaling", "rope_parameters",
        "hidden_act", "bos_token_id", "eos_token_id", "pad_token_id", "dtype",
        "torch_dtype", "use_sliding_window", "sliding_window", "layer_types",
    ]
    return {k: saved_cfg[k] for k in keys if k in saved_cfg}


# ---------------------------------------------------------------------------
# section: models
# ---------------------------------------------------------------------------

SEQ_LEN = 24
BATCH = 2
PROMPT_LEN = 8
MAX_NEW = 24
MIN_MARGIN = 1e-3


def _model_specs():
    return [
        dict(
            name="llama_gqa",
            cls=LlamaForCausalLM,
            config=LlamaConfig(
                hidden_size=96,
                num_attention_heads=6,
                num_key_value_heads=2,
                head_dim=16,
                intermediate_size=160,
                num_hidden_layers=2,
                vocab_size=199,
                max_position_embeddings=256,
                tie_word_embeddings=False,
                rms_norm_eps=1e-5,
                attention_bias=False,
                hidden_act="silu",
                bos_token_id=BOS_ID,
                eos_token_id=EOS_ID,
                pad_token_id=PAD_ID,
                **_rope_kwargs(
                    LlamaConfig,
                    10000.0,
                    {
                        "rope_type": "llama3",
                        "factor": 8.0,
                        "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 32,
                    },
                ),
            ),
            init_seed=1001,
            input_seed=2001,
            prompt_seed=3001,
            shard=None,
        ),
        dict(
            name="qwen2_tied_sharded",
            cls=Qwen2ForCausalLM,
            config=Qwen2Config(
                hidden_size=64,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=128,
                num_hidden_layers=2,
                vocab_size=160,
                max_position_embeddings=256,
                tie_word_embeddings=True,
                rms_norm_eps=1e-6,
                hidden_act="silu",
                use_sliding_window=False,
                bos_token_id=BOS_ID,
                eos_token_id=EOS_ID,
                pad_token_id=PAD_ID,
                **_rope_kwargs(Qwen2Config, 1000000.0, None),
            ),
            init_seed=1002,
            input_seed=2002,
            prompt_seed=3002,
            shard="100KB",
        ),
        dict(
            name="qwen3_headdim",
            cls=Qwen3ForCausalLM,
            config=Qwen3Config(
                hidden_size=64,
                num_attention_heads=4,
                num_key_value_heads=1,
                head_dim=32,
                intermediate_size=96,
                num_hidden_layers=3,
                vocab_size=181,
                max_position_embeddings=256,
                tie_word_embeddings=False,
                rms_norm_eps=1e-6,
                attention_bias=False,
                hidden_act="silu",
                use_sliding_window=False,
                bos_token_id=BOS_ID,
                eos_token_id=EOS_ID,
                pad_token_id=PAD_ID,
                **_rope_kwargs(Qwen3Config, 1000000.0, None),
            ),
            init_seed=1003,
            input_seed=2003,
            prompt_seed=3003,
            shard=None,
        ),
    ]


def _build_and_save(spec: dict, out_dir: Path) -> None:
    torch.manual_seed(spec["init_seed"])
    cfg = spec["config"]
    model = spec["cls"](cfg).to(torch.float32).eval()
    _reinit(model, spec["init_seed"])
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    kw = {"safe_serialization": True}
    if spec["shard"]:
        kw["max_shard_size"] = spec["shard"]
    model.save_pretrained(out_dir, **kw)
    if not (out_dir / "generation_config.json").exists():
        model.generation_config.save_pretrained(out_dir)


@torch.no_grad()
def _compute_refs(spec: dict, model_dir: Path, ref_dir: Path) -> dict:
    name = spec["name"]
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="eager", **_dtype_kw()
    ).eval()
    assert type(model) is spec["cls"], type(model)
    for p in model.parameters():
        assert p.dtype == torch.float32
    vocab = model.config.vocab_size

    g = torch.Generator().manual_seed(spec["input_seed"])
    input_ids = torch.randint(0, vocab, (BATCH, SEQ_LEN), generator=g, dtype=torch.int64)
    logits = model(input_ids).logits.to(torch.float32).contiguous()
    assert logits.shape == (BATCH, SEQ_LEN, vocab)
    lp = torch.log_softmax(logits, dim=-1)
    logprobs = lp[:, :-1].gather(-1, input_ids[:, 1:, None])[..., 0].contiguous()

    prompt_seed = spec["prompt_seed"]
    tried = []
    while True:
        g = torch.Generator().manual_seed(prompt_seed)
        prompt = torch.randint(0, vocab, (PROMPT_LEN,), generator=g, dtype=torch.int64)
        tokens, margin = _greedy(model, prompt, MAX_NEW)
        tried.append((prompt_seed, margin))
        if margin >= MIN_MARGIN:
            break
        print(f"  [{name}] prompt seed {prompt_seed}: margin {margin:.3e} < {MIN_MARGIN}, retrying")
        prompt_seed += 1
        if len(tried) > 50:
            raise RuntimeError(f"{name}: no prompt seed with margin >= {MIN_MARGIN}")

    ref_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        "input_ids": input_ids.contiguous(),
        "logits": logits,
        "logprobs": logprobs.to(torch.float32),
        "greedy_prompt": prompt.contiguous(),
        "greedy_tokens": tokens.to(torch.int64).contiguous(),
        "greedy_min_margin": torch.tensor([margin], dtype=torch.float32),
    }
    save_file(tensors, str(ref_dir / f"{name}.safetensors"))

    saved_cfg = json.loads((model_dir / "config.json").read_text())
    rope_spelling = (
        "rope_parameters" if "rope_parameters" in saved_cfg
        else "rope_theta+rope_scaling" if "rope_theta" in saved_cfg
        else "unknown"
    )
    files = sorted(p.name for p in model_dir.iterdir())
    meta = {
        "name": name,
        "architecture": spec["cls"].__name__,
        "model_dir": str(model_dir.relative_to(REPO_ROOT)),
        "model_files": files,
        "config": _config_summary(saved_cfg),
        "config_json_rope_spelling": rope_spelling,
        "attn_implementation": "eager",
        "dtype": "float32",
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "seeds": {
            "init": spec["init_seed"],
            "input_ids": spec["input_seed"],
            "greedy_prompt": prompt_seed,
            "greedy_prompt_seeds_tried": [s for s, _ in tried],
        },
        "reference": {
            "input_ids": [BATCH, SEQ_LEN],
            "greedy_prompt_len": PROMPT_LEN,
            "greedy_max_new_tokens": MAX_NEW,
            "greedy_min_margin": margin,
            "weight_init": "2-D ~ N(0, 0.2^2); bias ~ N(0, 0.1^2); norm weight = 1 + N(0, 0.1^2)",
        },
    }
    (ref_dir / f"{name}.json").write_text(json.dumps(meta, indent=2, sort_keys=False) + "\n")
    print(
        f"  [{name}] rope spelling in config.json: {rope_spelling}; "
        f"greedy margin {margin:.4f} (prompt seed {prompt_seed}); files: {files}"
    )
    return meta


def section_models() -> None:
    models_root = FIXTURES / "models"
    ref_root = FIXTURES / "ref"
    for spec in _model_specs():
        print(f"[models] {spec['name']} ({spec['cls'].__name__})")
        model_dir = models_root / spec["name"]
        _build_and_save(spec, model_dir)
        _compute_refs(spec, model_dir, ref_root)


# ---------------------------------------------------------------------------
# section: grads
# ---------------------------------------------------------------------------

GRAD_MODELS = ["llama_gqa", "qwen2_tied_sharded", "qwen3_headdim"]
GRAD_SEEDS = {  # name -> (rollout seed, coef seed)
    "llama_gqa": (4001, 5001),
    "qwen2_tied_sharded": (4002, 5002),
    "qwen3_headdim": (4003, 5003),
}
ROLLOUT_PROMPT_LENS = [3, 5, 4, 6]
ROLLOUT_RESPONSE_LENS = [4, 2, 7, 3]
ROLLOUT_GROUPS = [0, 0, 1, 1]
ROLLOUT_REWARDS = [1, 0, 0, 1]
LOGPROB_LO, LOGPROB_HI = 0.05, 3.0
COEF_TEMPERATURE = 0.7
GRAD_OBJECTIVES = [
    "coef",
    "sft_token_mean",
    "opd_token_mean",
    "opd_seq_mean_token_mean",
    "opd_seq_mean_token_sum",
]
# Full gradients are stored only for these (model, objective) pairs, to keep the fixtures at a
# few MB; every objective's loss and gradient norm are stored for every model.
FULL_GRADS = {
    "llama_gqa": {"coef", "opd_token_mean"},
    "qwen2_tied_sharded": {"coef", "sft_token_mean", "opd_seq_mean_token_mean"},
    "qwen3_headdim": {"coef", "opd_seq_mean_token_sum"},
}


def _make_rollouts(vocab: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rollouts = []
    for plen, rlen, group, reward in zip(
        ROLLOUT_PROMPT_LENS, ROLLOUT_RESPONSE_LENS, ROLLOUT_GROUPS, ROLLOUT_REWARDS
    ):
        prompt = torch.randint(0, vocab, (plen,), generator=g, dtype=torch.int64)
        response = torch.randint(0, vocab, (rlen,), generator=g, dtype=torch.int64)
        u = torch.rand((2, rlen), generator=g, dtype=torch.float64)
        lps = -(LOGPROB_LO + (LOGPROB_HI - LOGPROB_LO) * u)
        rollouts.append({
            "prompt_tokens": [int(x) for x in prompt],
            "response_tokens": [int(x) for x in response],
            "sampler_logprobs": [round(float(x), 6) for x in lps[0]],
            "teacher_logprobs": [round(float(x), 6) for x in lps[1]],
            "group": group,
            "reward": reward,
        })
    return rollouts


def _checkpoint_shapes(model_dir: Path) -> dict:
    """Tensor name -> shape over every ``*.safetensors`` file of the directory."""
    shapes = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                assert k not in shapes, f"{k} twice in {model_dir}"
                shapes[k] = tuple(h.get_slice(k).get_shape())
    return shapes


def _scored_logits(model, rollouts: list[dict]):
    """Run every rollout alone (batch 1, no padding); return the logits of the
    scored rows [M, V] (with grad) and their targets [M] (the response tokens)."""
    rows, targets = [], []
    for r in rollouts:
        p, resp = r["prompt_tokens"], r["response_tokens"]
        seq = torch.tensor(p + resp, dtype=torch.int64)
        logits = model(seq[None]).logits[0]  # [L, V]
        rows.append(logits[len(p) - 1 : len(seq) - 1])
        targets.append(seq[len(p) :])
    return torch.cat(rows).to(torch.float32), torch.cat(targets)


def _grad_losses(logits, targets, coef, teacher, seq_index, resp_lens) -> dict:
    """The scalar objectives (see the module docstring), from scored logits."""
    n_tok = targets.numel()
    n_seq = len(resp_lens)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]
    logp_t = torch.log_softmax(logits / COEF_TEMPERATURE, dim=-1).gather(-1, targets[:, None])[:, 0]
    adv = (teacher - logp.detach()).detach()
    n_i = torch.tensor(resp_lens, dtype=torch.float32)[seq_index]
    losses = {
        "coef": (-coef * logp_t).sum(),
        "sft_token_mean": -logp.sum() / n_tok,
        "opd_token_mean": (-(1.0 / n_tok) * adv * logp).sum(),
        "opd_seq_mean_token_mean": (-(1.0 / (n_seq * n_i)) * adv * logp).sum(),
        "opd_seq_mean_token_sum": (-(1.0 / n_seq) * adv * logp).sum(),
    }
    assert list(losses) == GRAD_OBJECTIVES
    return losses, logp


def _load_grad_model(model_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="eager", **_dtype_kw()
    ).eval()
    for p in model.parameters():
        assert p.dtype == torch.float32
        p.requires_grad_(True)
    return model


def _grad_inputs(rollouts: list[dict], coef_seed: int):
    """Tensors derived from the rollouts as parsed back from JSON (float32)."""
    resp_lens = [len(r["response_tokens"]) for r in rollouts]
    teacher = torch.tensor(
        [x for r in rollouts for x in r["teacher_logprobs"]], dtype=torch.float32
    )
    seq_index = torch.cat(
        [torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(resp_lens)]
    )
    g = torch.Generator().manual_seed(coef_seed)
    coef = torch.randn((sum(resp_lens),), generator=g, dtype=torch.float32)
    return coef, teacher, seq_index, resp_lens


def _compute_grads(name: str, model_dir: Path, out_dir: Path) -> dict:
    rollout_seed, coef_seed = GRAD_SEEDS[name]
    model = _load_grad_model(model_dir)
    vocab = model.config.vocab_size

    rollouts = _make_rollouts(vocab, rollout_seed)
    jsonl = out_dir / f"{name}_rollouts.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rollouts))
    rollouts = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(rollouts) == len(ROLLOUT_PROMPT_LENS)

    coef, teacher, seq_index, resp_lens = _grad_inputs(rollouts, coef_seed)
    logits, targets = _scored_logits(model, rollouts)
    m = sum(resp_lens)
    assert logits.shape == (m, vocab) and targets.shape == (m,)
    losses, logp = _grad_losses(logits, targets, coef, teacher, seq_index, resp_lens)

    # parameter names: named_parameters() de-duplicates tied parameters, so a
    # tied lm_head only appears as model.embed_tokens.weight (total gradient)
    named = list(model.named_parameters())
    ckpt = _checkpoint_shapes(model_dir)
    names = [n for n, _ in named]
    assert sorted(names) == sorted(ckpt), (
        f"{name}: parameter names {sorted(set(names) ^ set(ckpt))} differ from the checkpoint"
    )
    if model.config.tie_word_embeddings:
        assert "lm_head.weight" not in ckpt and "lm_head.weight" not in names

    tensors = {
        "logp_t1": logp.detach().contiguous(),
        "coef": coef.contiguous(),
    }
    summary = {}
    for obj, loss in losses.items():
        grads = torch.autograd.grad(loss, [p for _, p in named], retain_graph=True)
        sq = 0.0
        for (pname, p), gr in zip(named, grads):
            assert gr is not None, f"{name}: no gradient for {pname}"
            assert tuple(gr.shape) == ckpt[pname] == tuple(p.shape), pname
            assert gr.dtype == torch.float32 and torch.isfinite(gr).all(), pname
            if obj in FULL_GRADS[name]:
                tensors[f"grad.{obj}.{pname}"] = gr.detach().contiguous()
            sq += float(gr.detach().double().pow(2).sum())
        norm = sq ** 0.5
        tensors[f"loss.{obj}"] = loss.detach().reshape(1).contiguous()
        tensors[f"grad_norm.{obj}"] = torch.tensor([norm], dtype=torch.float32)
        max_abs = max(float(g.abs().max()) for g in grads)
        summary[obj] = {"loss": float(loss.detach()), "grad_norm": norm, "max_abs_grad": max_abs}
        print(f"  [{name}] {obj:<24} loss {float(loss.detach()): .6f}  grad norm {norm:.6f}  max|grad| {max_abs:.6f}")

    save_file(tensors, str(out_dir / f"{name}.safetensors"))
    return summary


def section_grads() -> None:
    models_root = FIXTURES / "models"
    out_dir = FIXTURES / "grads"
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in GRAD_MODELS:
        model_dir = models_root / name
        if not (model_dir / "config.json").exists():
            raise RuntimeError(f"{model_dir} missing: run the 'models' section first")
        print(f"[grads] {name}")
        _compute_grads(name, model_dir, out_dir)


# ---------------------------------------------------------------------------
# section: rl
# ---------------------------------------------------------------------------

RL_MODEL = "qwen3_headdim"
RL_SEED = 6001
RL_GROUPS = [0, 0, 1, 1, 2, 2]
RL_REWARDS = [1, 0, 0, 1, 1, 1]
RL_PROMPT_LENS = [3, 3, 4, 4, 5, 5]
RL_RESPONSE_LENS = [7, 3, 5, 1, 6, 4]
RL_TOPK = 4
RL_TOPK_LO, RL_TOPK_HI = 0.1, 4.0
RL_FIRST_TOKEN = 3  # tokens are drawn from [3, vocab): never pad/bos/eos
# designed learner-sampler gaps delta_t = logp_t - sampler_logprob_t, per response
RL_GAPS = [
    [-0.30, -0.02, 0.40, -0.25, -0.35, 0.05, -0.50],  # r0, A > 0
    # r1, A < 0. Third gap was -1.60 in the first design: its segment mean -0.633 then hit
    # w_sev (the tail count 1 gives w_tail 0.6, not binding) and no segment reached w_neg;
    # -0.60 makes the mean -0.30, in [tau_sev, tau_neg), with no tail token.
    [-0.50, 0.20, -0.60],
    [-1.50, -2.00, -0.30, 0.60, -0.03],               # r2, A < 0
    [-0.20],                                          # r3, A > 0
    # r4, A = 0. -0.45 and -0.08 were -0.40 (= tau_sev) and -0.05 (= tau_rep) in the first
    # design; moved off the thresholds (margin check below). 0.00 stays exactly on 0.
    [0.30, -0.45, 1.20, -0.08, 0.00, -2.50],
    [0.10, 0.90, -0.70, -0.15],                       # r5, A = 0
]
RL_PARAMS = {
    "temperature": 1.0,
    "grpo": {"eps_low": 0.2, "eps_high": 0.28, "adv_eps": 1e-6, "std": "sample (n-1)"},
    "tis_cap": 2.0,
    "loss_agg": "seq-mean-token-mean",
    "triage": {
        "segment_len": 3,
        "tau_tail": -1.0,
        "k_tail": 2,
        "tau_sev": -0.4,
        "tau_neg": -0.1,
        "w_sev": 0.2,
        "w_neg": 0.6,
        "tau_rep": -0.05,
        "beta": 0.1,
        "lambda_rep": 0.5,
        "k_rep": 0,
        "update_index": 0,
    },
    "reinforce": {"offset": 0.15},
}
RL_OBJECTIVES = ["grpo", "grpo_tis", "triage", "reinforce_offset", "reinforce_centered"]
RL_GAP_TOL = 1e-4        # |delta - designed gap|
RL_THRESHOLD_MARGIN = 2e-3
RL_ZERO_GAP_TOL = 1e-5   # the designed 0.00 gap (in r4, A = 0, so it never matters)


def _make_rl_rollouts(vocab: int) -> list[dict]:
    """Tokens and sampler top-k; ``sampler_logprobs`` are filled in later from the model."""
    g = torch.Generator().manual_seed(RL_SEED)
    rollouts = []
    for plen, rlen, group, reward in zip(RL_PROMPT_LENS, RL_RESPONSE_LENS, RL_GROUPS, RL_REWARDS):
        prompt = torch.randint(RL_FIRST_TOKEN, vocab, (plen,), generator=g, dtype=torch.int64)
        response = torch.randint(RL_FIRST_TOKEN, vocab, (rlen,), generator=g, dtype=torch.int64)
        rollouts.append({
            "prompt_tokens": [int(x) for x in prompt],
            "response_tokens": [int(x) for x in response],
            "group": group,
            "reward": reward,
        })
    for r in rollouts:
        ids, lps = [], []
        for _ in r["response_tokens"]:
            perm = torch.randperm(vocab - RL_FIRST_TOKEN, generator=g)[:RL_TOPK] + RL_FIRST_TOKEN
            u = torch.rand((RL_TOPK,), generator=g, dtype=torch.float64)
            lp = -(RL_TOPK_LO + (RL_TOPK_HI - RL_TOPK_LO) * u)
            ids.append([int(x) for x in perm])
            lps.append([round(float(x), 6) for x in lp])
        r["sampler_topk_ids"] = ids
        r["sampler_topk_logprobs"] = lps
    return rollouts


def _segments(n: int, w: int) -> list[range]:
    return [range(s, min(s + w, n)) for s in range(0, n, w)]


def _rl_losses(logits, targets, rollouts, b, topk_ids, topk_q):
    """The five RL objectives (see the module docstring) and the TRIAGE per-token values."""
    P = RL_PARAMS
    T = P["triage"]
    G = len(rollouts)
    lens = [len(r["response_tokens"]) for r in rollouts]
    starts = np.cumsum([0] + lens)
    seq_index = torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(lens)])
    n_i = torch.tensor(lens, dtype=torch.float32)[seq_index]
    gamma = 1.0 / (G * n_i)

    lsm = torch.log_softmax(logits, dim=-1)
    logp = lsm.gather(-1, targets[:, None])[:, 0]
    logp_old = logp.detach()
    ratio = torch.exp(logp - logp_old)
    delta_live = logp - b
    delta = delta_live.detach()

    # GRPO advantages: (r - mean_g) / (sample std_g + eps)
    rewards = torch.tensor([float(r["reward"]) for r in rollouts], dtype=torch.float32)
    groups = [r["group"] for r in rollouts]
    adv = torch.zeros(G, dtype=torch.float32)
    for gid in sorted(set(groups)):
        idx = torch.tensor([i for i in range(G) if groups[i] == gid])
        rg = rewards[idx]
        adv[idx] = (rg - rg.mean()) / (rg.std(unbiased=True) + P["grpo"]["adv_eps"])
    A_t = adv[seq_index]

    lo, hi = 1.0 - P["grpo"]["eps_low"], 1.0 + P["grpo"]["eps_high"]
    pg = -torch.minimum(ratio * A_t, torch.clamp(ratio, lo, hi) * A_t)  # per-token GRPO loss
    tis_v = torch.clamp(torch.exp(logp_old - b), max=P["tis_cap"]).detach()
    pg_tis = tis_v * pg

    # TRIAGE gate weights (A < 0 responses, W-token segments of the detached delta)
    W = T["segment_len"]
    w = torch.ones_like(delta)
    gate_info = []
    for i in range(G):
        if not float(adv[i]) < 0:
            continue
        for seg in _segments(lens[i], W):
            d = delta[starts[i] + seg.start : starts[i] + seg.stop]
            mean = float(d.mean())
            k = int((d < T["tau_tail"]).sum())
            if mean < T["tau_sev"]:
                w_mean = T["w_sev"]
            elif mean < T["tau_neg"]:
                w_mean = T["w_neg"]
            else:
                w_mean = 1.0
            w_tail = 1.0 - (1.0 - T["w_sev"]) * min(k / T["k_tail"], 1.0)
            w_s = min(w_mean, w_tail)
            gate_info.append((i, seg.start, mean, k, w_mean, w_tail, w_s))
            for t in seg:
                if float(delta[starts[i] + t]) < 0:
                    w[starts[i] + t] = w_s
    w_sum = torch.zeros(G, dtype=torch.float32).index_add_(0, seq_index, w)
    alpha = w * n_i / w_sum[seq_index]
    l_pg = ((1.0 / G) * w * pg_tis / w_sum[seq_index]).sum()

    # TRIAGE repair: W-token segments of every response; penalty on A > 0 segments only
    beta, lam = T["beta"], T["lambda_rep"]
    assert T["update_index"] >= T["k_rep"]  # repair active
    all_segs = [(i, seg) for i in range(G) for seg in _segments(lens[i], W)]
    n_rep = len(all_segs)
    l_rep = torch.zeros((), dtype=torch.float32)
    psi = torch.zeros_like(delta)
    rep_info = []
    for i, seg in all_segs:
        if not float(adv[i]) > 0:
            continue
        sl = slice(starts[i] + seg.start, starts[i] + seg.stop)
        q_live = torch.relu(T["tau_rep"] - delta_live[sl].mean())
        l_rep = l_rep + beta ** 2 * (torch.sqrt(1.0 + (q_live / beta) ** 2) - 1.0)
        q = max(T["tau_rep"] - float(delta[sl].mean()), 0.0)
        n_r = len(seg)
        if q > 0:
            psi[sl] = (lam / n_rep) * (1.0 / n_r) * q / (1.0 + (q / beta) ** 2) ** 0.5
        rep_info.append((i, seg.start, n_r, float(delta[sl].mean()), q))
    l_rep = (lam / n_rep) * l_rep

    # REINFORCE with a reward offset, and its top-k score-centred variant
    a_rf = (rewards + P["reinforce"]["offset"])[seq_index]
    c = (gamma * a_rf).detach()
    lp_topk = lsm.gather(-1, topk_ids)  # [M, K]
    centred = logp - (topk_q * lp_topk).sum(-1)

    losses = {
        "grpo": (gamma * pg).sum(),
        "grpo_tis": (gamma * pg_tis).sum(),
        "triage": l_pg + l_rep,
        "reinforce_offset": (gamma * (-ratio * a_rf)).sum(),
        "reinforce_centered": -(c * centred).sum(),
    }
    assert list(losses) == RL_OBJECTIVES
    extra = dict(
        logp=logp, delta=delta, adv=adv, A_t=A_t, w=w, alpha=alpha, psi=psi, tis_v=tis_v,
        gamma=gamma, seq_index=seq_index, n_rep=n_rep, l_pg=l_pg, l_rep=l_rep,
        gate_info=gate_info, rep_info=rep_info, starts=starts, lens=lens,
    )
    return losses, extra


def _rl_checks(losses, ex, gaps_flat) -> None:
    """Sanity checks on the designed scenario (see the section's brief in the docstring)."""
    T = RL_PARAMS["triage"]
    delta, adv, w, alpha, psi = ex["delta"], ex["adv"], ex["w"], ex["alpha"], ex["psi"]
    lens, starts, seq_index = ex["lens"], ex["starts"], ex["seq_index"]
    # delta is the designed gap, and never near a threshold (except the exact 0.00 gap)
    thresholds = [T["tau_tail"], T["tau_sev"], T["tau_neg"], T["tau_rep"], 0.0]
    for t, (d, gap) in enumerate(zip(delta.tolist(), gaps_flat)):
        assert abs(d - gap) < RL_GAP_TOL, (t, d, gap)
        if gap == 0.0:
            # rounding b to 6 decimals leaves |delta| <= ~5e-7 (+ float32): the sign is
            # arbitrary, which is harmless because this token is in r4 (A = 0)
            assert abs(d) < RL_ZERO_GAP_TOL and float(adv[int(seq_index[t])]) == 0.0, (t, d)
            continue
        for th in thresholds:
            assert abs(d - th) > RL_THRESHOLD_MARGIN, (t, d, th)
    # segment means are off the thresholds they are compared with
    for i in range(len(lens)):
        for seg in _segments(lens[i], T["segment_len"]):
            m = float(delta[starts[i] + seg.start : starts[i] + seg.stop].mean())
            for th in (T["tau_sev"], T["tau_neg"], T["tau_rep"], 0.0):
                assert abs(m - th) > RL_THRESHOLD_MARGIN, (i, seg, m, th)
    # alpha averages to 1 over each response
    for i in range(len(lens)):
        a = alpha[starts[i] : starts[i + 1]].double().mean()
        assert abs(float(a) - 1.0) < 1e-6, (i, float(a))
    neg = (adv[seq_index] < 0) & (delta < 0)
    wl = w.tolist()
    assert any(abs(x - T["w_sev"]) < 1e-7 for x in wl), "no token at w_sev"
    assert any(abs(x - T["w_neg"]) < 1e-7 for x in wl), "no token at w_neg"
    assert bool((w[neg] == 1.0).any()), "no A<0 negative-gap token keeps weight 1"
    assert bool((w[~neg] == 1.0).all())
    qs = [q for (_, _, _, _, q) in ex["rep_info"]]
    assert any(q > 0 for q in qs) and any(q == 0 for q in qs), qs
    for i, s, n_r, _, _ in ex["rep_info"]:
        bound = T["lambda_rep"] * T["beta"] / (ex["n_rep"] * n_r)
        assert bool((psi[starts[i] + s : starts[i] + s + n_r] <= bound).all())
    assert bool((ex["tis_v"] == RL_PARAMS["tis_cap"]).any()), "no TIS weight capped"
    assert float(adv[4]) == 0.0 and float(adv[5]) == 0.0

    # cross-check the closed-form coefficients against autograd through logp
    logp, gamma, A_t, v = ex["logp"], ex["gamma"], ex["A_t"], ex["tis_v"]
    d_grpo = torch.autograd.grad(losses["grpo"], logp, retain_graph=True)[0]
    assert torch.allclose(d_grpo, -gamma * A_t, atol=1e-7, rtol=1e-5)
    assert bool((d_grpo[seq_index >= 4] == 0).all()), "A=0 responses have grpo coefficients"
    d_tis = torch.autograd.grad(losses["grpo_tis"], logp, retain_graph=True)[0]
    assert torch.allclose(d_tis, -gamma * v * A_t, atol=1e-7, rtol=1e-5)
    d_pg = torch.autograd.grad(ex["l_pg"], logp, retain_graph=True)[0]
    assert torch.allclose(d_pg, -gamma * ex["alpha"] * v * A_t, atol=1e-7, rtol=1e-5)
    d_rep = torch.autograd.grad(ex["l_rep"], logp, retain_graph=True)[0]
    assert torch.allclose(d_rep, -psi, atol=1e-8, rtol=1e-5), (d_rep, psi)


def section_rl() -> None:
    model_dir = FIXTURES / "models" / RL_MODEL
    if not (model_dir / "config.json").exists():
        raise RuntimeError(f"{model_dir} missing: run the 'models' section first")
    out_dir = FIXTURES / "rl"
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"[rl] {RL_MODEL}")
    model = _load_grad_model(model_dir)
    vocab = model.config.vocab_size
    assert [len(g) for g in RL_GAPS] == RL_RESPONSE_LENS

    # sampler logprobs b_t = round(logp_t - gap_t, 6) from the model's own logp
    rollouts = _make_rl_rollouts(vocab)
    with torch.no_grad():
        logits0, _ = _scored_logits(model, rollouts)
        targets0 = torch.tensor([t for r in rollouts for t in r["response_tokens"]])
        lp0 = torch.log_softmax(logits0, -1).gather(-1, targets0[:, None])[:, 0]
    gaps_flat = [x for g in RL_GAPS for x in g]
    b_all = [round(float(lp) - gap, 6) for lp, gap in zip(lp0.tolist(), gaps_flat)]
    pos = 0
    for r in rollouts:
        n = len(r["response_tokens"])
        r["sampler_logprobs"] = b_all[pos : pos + n]
        pos += n
    keys = ["prompt_tokens", "response_tokens", "group", "reward", "sampler_logprobs",
            "sampler_topk_ids", "sampler_topk_logprobs"]
    jsonl = out_dir / "rollouts.jsonl"
    jsonl.write_text("".join(json.dumps({k: r[k] for k in keys}) + "\n" for r in rollouts))
    rollouts = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(rollouts) == len(RL_RESPONSE_LENS)
    for r in rollouts:
        assert list(r) == keys
        for ids, lps in zip(r["sampler_topk_ids"], r["sampler_topk_logprobs"]):
            assert len(set(ids)) == RL_TOPK and all(RL_FIRST_TOKEN <= x < vocab for x in ids)
            assert len(lps) == RL_TOPK and all(x < 0 for x in lps)

    # everything below from the file as parsed back, as float32
    b = torch.tensor([x for r in rollouts for x in r["sampler_logprobs"]], dtype=torch.float32)
    topk_ids = torch.tensor([ids for r in rollouts for ids in r["sampler_topk_ids"]])
    topk_lp = torch.tensor(
        [lps for r in rollouts for lps in r["sampler_topk_logprobs"]], dtype=torch.float32
    )
    topk_q = torch.softmax(topk_lp, dim=-1).detach()
    logits, targets = _scored_logits(model, rollouts)
    m = sum(RL_RESPONSE_LENS)
    assert logits.shape == (m, vocab) and targets.shape == (m,) and topk_ids.shape == (m, RL_TOPK)
    losses, ex = _rl_losses(logits, targets, rollouts, b, topk_ids, topk_q)
    _rl_checks(losses, ex, gaps_flat)

    params = {
        "model": RL_MODEL,
        "seed": RL_SEED,
        "num_responses": len(RL_RESPONSE_LENS),
        "groups": RL_GROUPS,
        "rewards": RL_REWARDS,
        "prompt_lens": RL_PROMPT_LENS,
        "response_lens": RL_RESPONSE_LENS,
        "topk": RL_TOPK,
        **RL_PARAMS,
        "designed_gaps": RL_GAPS,
        "gap_tolerance": RL_GAP_TOL,
        "n_repair_segments": ex["n_rep"],
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__},
    }
    (out_dir / "params.json").write_text(json.dumps(params, indent=2) + "\n")

    named = list(model.named_parameters())
    ckpt = _checkpoint_shapes(model_dir)
    names = [n for n, _ in named]
    assert sorted(names) == sorted(ckpt), sorted(set(names) ^ set(ckpt))

    tensors = {
        "logp": ex["logp"].detach().contiguous(),
        "delta": ex["delta"].contiguous(),
        "advantages.grpo": ex["adv"].contiguous(),
        "triage.w": ex["w"].contiguous(),
        "triage.alpha": ex["alpha"].contiguous(),
        "triage.psi": ex["psi"].contiguous(),
    }
    for obj, loss in losses.items():
        grads = torch.autograd.grad(loss, [p for _, p in named], retain_graph=True)
        sq = 0.0
        for (pname, p), gr in zip(named, grads):
            assert gr is not None, f"no gradient for {pname}"
            assert tuple(gr.shape) == ckpt[pname] == tuple(p.shape), pname
            assert gr.dtype == torch.float32 and torch.isfinite(gr).all(), pname
            tensors[f"grad.{obj}.{pname}"] = gr.detach().contiguous()
            sq += float(gr.detach().double().pow(2).sum())
        norm = sq ** 0.5
        tensors[f"loss.{obj}"] = loss.detach().reshape(1).contiguous()
        tensors[f"grad_norm.{obj}"] = torch.tensor([norm], dtype=torch.float32)
        print(f"  [rl] {obj:<20} loss {float(loss.detach()): .8f}  grad norm {norm:.8f}")
    out = out_dir / f"{RL_MODEL}.safetensors"
    save_file(tensors, str(out))

    print(f"  [rl] advantages {[round(float(a), 6) for a in ex['adv']]}, "
          f"N_rep {ex['n_rep']}, L_PG {float(ex['l_pg'].detach()):.8f}, L_rep {float(ex['l_rep'].detach()):.8e}")
    for i, s, mean, k, wm, wt, ws in ex["gate_info"]:
        print(f"  [rl] gate r{i} seg@{s}: mean {mean:+.4f} tail {k} -> "
              f"w_mean {wm} w_tail {wt:.2f} w {ws}")
    for i, s, n_r, mean, q in ex["rep_info"]:
        print(f"  [rl] repair r{i} seg@{s} (n {n_r}): mean {mean:+.4f} q {q:.4f}")
    for i, n in enumerate(ex["lens"]):
        sl = slice(ex["starts"][i], ex["starts"][i + 1])
        print(f"  [rl] r{i} delta {[round(x, 5) for x in ex['delta'][sl].tolist()]}")
        print(f"        w {[round(x, 6) for x in ex['w'][sl].tolist()]} "
              f"alpha {[round(x, 6) for x in ex['alpha'][sl].tolist()]}")
        print(f"        psi {[float(f'{x:.6g}') for x in ex['psi'][sl].tolist()]} "
              f"tis_v {[round(x, 4) for x in ex['tis_v'][sl].tolist()]}")
    total = sum(p.stat().st_size for p in out_dir.iterdir())
    print(f"  [rl] {total} bytes in {out_dir.relative_to(REPO_ROOT)}")


# ---------------------------------------------------------------------------
# section: quant
# ---------------------------------------------------------------------------

# short name -> (ml_dtypes type, sign bit, ml_dtypes' result for an overflow: "nan", "inf"
# or "saturate")
QUANT_FORMATS = {
    "e4m3": (ml_dtypes.float8_e4m3fn, 0x80, "nan"),
    "e5m2": (ml_dtypes.float8_e5m2, 0x80, "inf"),
    "e2m1": (ml_dtypes.float4_e2m1fn, 0x08, "saturate"),
}
QUANT_SEEDS = {
    "formats": {"e4m3": 6001, "e5m2": 6002, "e2m1": 6003},
    "nvfp4": {"normal": 6101, "mixed": 6102},
    "fp8": {"fp8_normal": 6201, "fp8_mixed": 6202},
}
QUANT_RANDOM_PER_FORMAT = 2000
NVFP4_BLOCK = 16
NVFP4_GLOBAL_DIV = np.float32(6.0 * 448.0)  # 2688
E2M1_MAX = np.float32(6.0)
E4M3_MAX = np.float32(448.0)
F32 = np.float32


class _Fmt:
    """The finite values of one element format, for the independent RNE reference."""

    def __init__(self, short: str):
        dtype, sign, overflow = QUANT_FORMATS[short]
        self.short, self.dtype, self.sign, self.overflow = short, dtype, sign, overflow
        ncodes = 256 if np.dtype(dtype).itemsize == 1 and sign == 0x80 else 16
        codes = np.arange(ncodes, dtype=np.uint8)
        vals = codes.view(dtype).astype(np.float64)
        pos = (codes < sign) & np.isfinite(vals)
        # positive codes 0..max_code are the magnitudes in increasing order
        self.mags = vals[pos]
        assert np.all(np.diff(self.mags) > 0) and self.mags[0] == 0
        self.max_code = int(np.count_nonzero(pos)) - 1
        assert np.array_equal(np.nonzero(pos)[0], np.arange(self.max_code + 1))
        self.max = float(self.mags[-1])
        assert self.max == float(ml_dtypes.finfo(dtype).max)
        self.sub = float(ml_dtypes.finfo(dtype).smallest_subnormal)
        assert self.sub == self.mags[1]
        # the value the next code would have if the binade continued (480, 61440+4096
        # -> 65536, 8): the upper end of max's rounding interval
        self.virtual = 2.0 * self.max - float(self.mags[-2])
        self.ext = np.append(self.mags, self.virtual)

    def rne_ref(self, x: np.ndarray, saturate: bool) -> np.ndarray:
        """Exact RNE of float32 ``x`` (no NaN) to this format's bit patterns, computed
        in float64 (every float32, value and midpoint here is exact in float64)."""
        x = np.asarray(x, dtype=np.float32)
        assert not np.isnan(x).any()
        neg = np.signbit(x)
        a = np.abs(x.astype(np.float64))
        i = np.clip(np.searchsorted(self.ext, a, side="right") - 1, 0, len(self.ext) - 2)
        lo, hi = self.ext[i], self.ext[i + 1]
        mid = (lo + hi) / 2.0
        idx = np.where(a < mid, i, i + 1)
        tie = a == mid
        idx = np.where(tie, np.where(i % 2 == 0, i, i + 1), idx)
        over = (idx > self.max_code) | (a >= self.ext[-1])
        out = idx.astype(np.int64)
        if saturate or self.overflow == "saturate":
            out = np.where(over, self.max_code, out)
        elif self.overflow == "nan":
            out = np.where(over, 0x7F, out)  # e4m3fn NaN (sign kept)
        else:
            out = np.where(over, self.max_code + 1, out)  # e5m2 inf
        return (out | np.where(neg, self.sign, 0)).astype(np.uint8)

    def cast(self, x: np.ndarray) -> np.ndarray:
        """ml_dtypes' conversion of float32 ``x``, as bit patterns."""
        x = np.asarray(x, dtype=np.float32)
        return x.astype(self.dtype).view(np.uint8)

    def cast_sat(self, x: np.ndarray) -> np.ndarray:
        """Saturating RNE (cvt.rn.satfinite): ml_dtypes for |x| <= max, else +-max."""
        x = np.asarray(x, dtype=np.float32)
        bits = self.cast(x).copy()
        over = np.abs(x) > F32(self.max)
        sign = np.where(np.signbit(x[over]), self.sign, 0).astype(np.uint8)
        bits[over] = np.uint8(self.max_code) | sign
        return bits

    def decode(self, bits: np.ndarray) -> np.ndarray:
        return np.asarray(bits, dtype=np.uint8).view(self.dtype).astype(np.float32)


def _f32_neighbours(v: np.ndarray) -> np.ndarray:
    v = np.asarray(v, dtype=np.float32)
    return np.concatenate([
        v,
        np.nextafter(v, F32(np.inf)),
        np.nextafter(v, F32(-np.inf)),
    ])


def _format_inputs(fmt: _Fmt, seed: int) -> np.ndarray:
    mags = fmt.mags.astype(np.float32)
    mids = ((fmt.ext[:-1] + fmt.ext[1:]) / 2.0)
    assert np.array_equal(mids.astype(np.float32).astype(np.float64), mids)
    sub, mx = fmt.sub, fmt.max
    f32 = np.finfo(np.float32)
    special = np.array([
        # between 0 and the smallest subnormal (below, at and above half of it)
        0.125 * sub, 0.25 * sub, 0.375 * sub, 0.49 * sub, 0.51 * sub, 0.75 * sub, 0.99 * sub,
        # far below: tiny float32 normals and subnormals
        1e-30, float(f32.smallest_normal), float(f32.smallest_subnormal), 1e-40,
        # around max
        mx, 1.01 * mx, (mx + fmt.virtual) / 2.0, 0.99 * fmt.virtual, fmt.virtual,
        1.5 * mx, 2.0 * mx, 1e30, float(f32.max), np.inf,
    ], dtype=np.float32)
    pos = np.concatenate([mags, _f32_neighbours(mids), special,
                          np.nextafter(F32(mx), F32(np.inf))[None]])
    structured = np.concatenate([pos, -pos])
    # de-duplicate by bit pattern, keeping the first occurrence (+0 and -0 both stay)
    _, first = np.unique(structured.view(np.uint32), return_index=True)
    structured = structured[np.sort(first)]

    rng = np.random.default_rng(seed)
    lo, hi = np.log2(sub / 4.0), np.log2(mx)
    mag = np.exp2(rng.uniform(lo, hi, QUANT_RANDOM_PER_FORMAT)).astype(np.float32)
    mag = np.minimum(mag, F32(mx))
    sign = np.where(rng.random(QUANT_RANDOM_PER_FORMAT) < 0.5, F32(-1.0), F32(1.0))
    x = np.concatenate([structured, sign * mag]).astype(np.float32)
    assert not np.isnan(x).any()
    return x


def _quant_formats(out_dir: Path) -> dict:
    tensors, summary = {}, {}
    for short in QUANT_FORMATS:
        fmt = _Fmt(short)
        x = _format_inputs(fmt, QUANT_SEEDS["formats"][short])
        bits = fmt.cast(x)
        sat = fmt.cast_sat(x)
        ref = fmt.rne_ref(x, saturate=False)
        ref_sat = fmt.rne_ref(x, saturate=True)
        bad = np.nonzero(bits != ref)[0]
        assert bad.size == 0, (short, x[bad][:8], bits[bad][:8], ref[bad][:8])
        bad = np.nonzero(sat != ref_sat)[0]
        assert bad.size == 0, (short, x[bad][:8], sat[bad][:8], ref_sat[bad][:8])
        over = np.abs(x) > F32(fmt.max)
        in_range = ~over
        assert np.array_equal(bits[in_range], sat[in_range])
        # values that round back to the same magnitude are exact; ties went to even codes
        mids = ((fmt.ext[:-1] + fmt.ext[1:]) / 2.0).astype(np.float32)
        tie_codes = sat[np.isin(np.abs(x), mids)] & ~np.uint8(fmt.sign)
        assert np.all((tie_codes % 2 == 0) | (tie_codes == fmt.max_code)), tie_codes
        if short == "e2m1":
            assert np.all(bits < 16), "ml_dtypes float4_e2m1fn byte has a high nibble"
        tensors[f"{short}.x"] = x
        tensors[f"{short}.bits"] = bits
        tensors[f"{short}.sat_bits"] = sat
        overflow_bits = sorted({int(b) for b in bits[over]})
        summary[short] = {
            "ml_dtypes_type": fmt.dtype.__name__,
            "n": int(x.size),
            "n_structured": int(x.size - QUANT_RANDOM_PER_FORMAT),
            "max": fmt.max,
            "smallest_subnormal": fmt.sub,
            "max_code": fmt.max_code,
            "n_out_of_range_inputs": int(over.sum()),
            "ml_dtypes_overflow": fmt.overflow,
            "ml_dtypes_overflow_bits": [f"0x{b:02x}" for b in overflow_bits],
        }
        print(f"  [quant/formats] {short}: {x.size} inputs ({int(over.sum())} beyond max; "
              f"ml_dtypes gives {summary[short]['ml_dtypes_overflow_bits']} there)")
    save_numpy(tensors, str(out_dir / "formats.safetensors"))
    return summary


_E4M3 = None
_E2M1 = None


def _fmts():
    global _E4M3, _E2M1
    if _E4M3 is None:
        _E4M3, _E2M1 = _Fmt("e4m3"), _Fmt("e2m1")
    return _E4M3, _E2M1


def _nvfp4_quantize(x: np.ndarray, global_scale=None, use_ref: bool = False) -> dict:
    """NVFP4 in float32 in the documented operation order. ``use_ref`` rounds with the
    independent reference instead of ml_dtypes."""
    e4m3, e2m1 = _fmts()
    x = np.asarray(x, dtype=np.float32)
    rows, k = x.shape
    assert k % NVFP4_BLOCK == 0
    if global_scale is None:
        amax = np.max(np.abs(x))
        global_scale = (amax / NVFP4_GLOBAL_DIV) if amax > 0 else F32(1.0)
    g = F32(global_scale)
    denom6 = F32(F32(6.0) * g)
    xb = x.reshape(rows, k // NVFP4_BLOCK, NVFP4_BLOCK)
    bamax = np.max(np.abs(xb), axis=-1)
    bs_f = (bamax / denom6).astype(np.float32)
    s_bits = e4m3.rne_ref(bs_f, saturate=True) if use_ref else e4m3.cast_sat(bs_f)
    s_bits = s_bits.reshape(bamax.shape)
    s_bits = np.where((s_bits & 0x7F) == 0, e4m3.cast(F32(1.0)), s_bits).astype(np.uint8)
    bs = e4m3.decode(s_bits)
    denom = (bs * g).astype(np.float32)
    v = np.clip((xb / denom[..., None]).astype(np.float32), -E2M1_MAX, E2M1_MAX)
    codes = e2m1.rne_ref(v, saturate=True) if use_ref else e2m1.cast(v)
    q = e2m1.decode(codes)
    deq = ((q * bs[..., None]).astype(np.float32) * g).astype(np.float32)
    codes = codes.reshape(rows, k)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return {
        "x": x,
        "packed": packed,
        "scales": s_bits.astype(np.uint8),
        "global": np.array([g], dtype=np.float32),
        "deq": deq.reshape(rows, k),
        "_codes": codes,
        "_v": v.reshape(rows, k),
        "_denom": denom,
    }


def _nvfp4_inputs() -> dict:
    seeds = QUANT_SEEDS["nvfp4"]
    out = {}
    rng = np.random.default_rng(seeds["normal"])
    out["normal"] = rng.standard_normal((8, 64)).astype(np.float32)

    rng = np.random.default_rng(seeds["mixed"])
    m = rng.standard_normal((4, 128)).astype(np.float32)
    m[1] *= F32(1e-3)
    m[2] *= F32(1e3)
    m[0, 16:32] = 0.0  # an all-zero block
    m[0, 48:64] = rng.standard_normal(16).astype(np.float32) * F32(0.01)
    m[0, 53] = F32(1000.0)  # a single outlier among small values
    # row 3: each block at its own magnitude, 1e-3 .. 3 (E4M3 subnormal and normal scales)
    for b, e in enumerate(np.linspace(-3.0, np.log10(3.0), 8)):
        m[3, 16 * b:16 * (b + 1)] *= F32(10.0 ** e)
    out["mixed"] = m

    # ties: global = 2^-3 exactly (amax = 2688 * 2^-3 = 336), so with an exact block scale
    # bs, denom = bs * 2^-3 exactly and x = t * denom gives x / denom == t exactly
    g = 0.125
    mid_t = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    blocks = [
        # (scale the block max asks for, scale it gets, the 16th element in units of denom)
        (448.0, 448.0, 0.0),                 # holds the tensor amax (6 * 448 * g = 336)
        (1.0, 1.0, -6.0),
        (3.5 * 2.0 ** -9, 2.0 ** -7, 3.0),   # E4M3-subnormal tie 3.5 * 2^-9 -> 4 * 2^-9
        (13.5, 14.0, -0.5),                  # E4M3 tie 13.5 (13 odd, 14 even) -> 14
    ]
    t = np.zeros((2, 32), dtype=np.float32)
    for b, (want, got, extra) in enumerate(blocks):
        r, c = divmod(b, 2)
        denom = got * g
        vals = [6.0 * want * g]
        vals += [s * m_ * denom for m_ in mid_t for s in (1.0, -1.0)]
        vals += [extra * denom]
        assert len(vals) == NVFP4_BLOCK
        vals = np.array(vals, dtype=np.float64)
        # shuffle deterministically so the max and the ties sit in both nibbles
        perm = np.random.default_rng(6103 + b).permutation(NVFP4_BLOCK)
        vals = vals[perm]
        assert np.array_equal(vals.astype(np.float32).astype(np.float64), vals)
        t[r, 16 * c:16 * (c + 1)] = vals.astype(np.float32)
    out["ties"] = t
    out["zeros"] = np.zeros((2, 32), dtype=np.float32)
    return out


def _check_nvfp4(name: str, res: dict) -> dict:
    e4m3, e2m1 = _fmts()
    x, deq, g = res["x"], res["deq"], res["global"][0]
    # the independent RNE reference gives the same bits
    ref = _nvfp4_quantize(x, use_ref=True)
    for key in ("packed", "scales", "global", "deq"):
        assert np.array_equal(res[key].view(np.uint8), ref[key].view(np.uint8)), (name, key)
    # error bound: RNE to E2M1 in units of denom (half a step: 0.25 below 2, 0.5 below 4,
    # 1 up to 6) plus whatever was clipped above 6, with float32 slack
    rows, k = x.shape
    denom = np.repeat(res["_denom"], NVFP4_BLOCK, axis=-1).reshape(rows, k).astype(np.float64)
    u = np.abs(x.astype(np.float64)) / denom
    half = np.where(u <= 2, 0.25, np.where(u <= 4, 0.5, 1.0))
    bound = denom * (half + np.maximum(u - 6.0, 0.0)) * (1 + 1e-6) + 1e-30
    err = np.abs(deq.astype(np.float64) - x.astype(np.float64))
    assert np.all(err <= bound), (name, float((err / bound).max()))
    # with an E4M3-normal scale the clip excess is at most 6 / (1 - 2^-4) - 6
    bs = e4m3.decode(res["scales"])
    normal_scale = np.repeat(bs >= 2.0 ** -6, NVFP4_BLOCK, axis=-1).reshape(rows, k)
    assert np.all(u[normal_scale] <= 6.0 / (1 - 2.0 ** -4) * (1 + 1e-6)), name
    # decode from the packed bytes reproduces deq
    codes = np.empty((rows, k), dtype=np.uint8)
    codes[:, 0::2] = res["packed"] & 0x0F
    codes[:, 1::2] = res["packed"] >> 4
    assert np.array_equal(codes, res["_codes"])
    q = e2m1.decode(codes).reshape(rows, k // NVFP4_BLOCK, NVFP4_BLOCK)
    deq2 = ((q * bs[..., None]).astype(np.float32) * g).astype(np.float32).reshape(rows, k)
    assert np.array_equal(deq2.view(np.uint32), deq.view(np.uint32)), name
    # re-quantizing deq with the same global scale is the identity on every block whose
    # scale is an E4M3 normal (its max then quantizes to +-6, so the scale re-derives); a
    # block with a subnormal scale may have a smaller max code and then change
    again = _nvfp4_quantize(deq, global_scale=g)
    same_blk = (
        np.all((again["_codes"] == res["_codes"]).reshape(rows, -1, NVFP4_BLOCK), axis=-1)
        & (again["scales"] == res["scales"])
    )
    assert np.array_equal(
        again["deq"].view(np.uint32)[same_blk.repeat(NVFP4_BLOCK, axis=-1)],
        deq.view(np.uint32)[same_blk.repeat(NVFP4_BLOCK, axis=-1)])
    assert np.all(same_blk[bs >= 2.0 ** -6]), (name, np.argwhere(~same_blk))
    n_not_idem = int(np.count_nonzero(~same_blk))
    # ... and with the global scale recomputed from deq (reported, not required)
    again_full = _nvfp4_quantize(deq)
    full_idem = all(
        np.array_equal(again_full[k_].view(np.uint8), res[k_].view(np.uint8))
        for k_ in ("packed", "scales", "global", "deq")
    )
    v = res["_v"]
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
    n_ties = int(np.isin(np.abs(v), mids).sum())
    n_negzero = int(np.count_nonzero(res["_codes"] == 8))
    scale_hist = sorted({float(s) for s in bs.ravel()})
    info = {
        "shape": list(x.shape),
        "global": float(g),
        "n_exact_e2m1_ties": n_ties,
        "n_negative_zero_codes": n_negzero,
        "n_subnormal_e4m3_scales": int(np.count_nonzero(bs < 2.0 ** -6)),
        "n_scales_replaced_by_1": int(np.count_nonzero(
            (e4m3.cast_sat((np.max(np.abs(x.reshape(rows, -1, NVFP4_BLOCK)), -1)
                            / F32(F32(6.0) * g)).astype(np.float32)) & 0x7F) == 0)),
        "requant_same_global_changed_blocks": n_not_idem,
        "requant_with_recomputed_global_identical": bool(full_idem),
        "max_rel_err_vs_block_amax": float(np.max(
            err.reshape(rows, -1, NVFP4_BLOCK).max(-1)
            / np.maximum(np.abs(x.astype(np.float64)).reshape(rows, -1, NVFP4_BLOCK).max(-1),
                         1e-300))),
    }
    print(f"  [quant/nvfp4] {name} {tuple(x.shape)}: global {float(g):.6g}, "
          f"{n_ties} exact ties, {n_negzero} -0 codes, "
          f"{info['n_subnormal_e4m3_scales']} subnormal scales, "
          f"{info['n_scales_replaced_by_1']} scales 0->1, {len(scale_hist)} distinct scales, "
          f"requant: {n_not_idem} blocks change (same global), "
          f"identical with recomputed global: {full_idem}")
    return info


def _quant_nvfp4(out_dir: Path) -> dict:
    tensors, summary = {}, {}
    for name, x in _nvfp4_inputs().items():
        res = _nvfp4_quantize(x)
        summary[name] = _check_nvfp4(name, res)
        for key in ("x", "packed", "scales", "global", "deq"):
            tensors[f"{name}.{key}"] = np.ascontiguousarray(res[key])
    z = tensors["zeros.global"], tensors["zeros.scales"], tensors["zeros.packed"]
    assert z[0][0] == 1.0 and np.all(z[1] == 0x38) and np.all(z[2] == 0)
    t = _nvfp4_quantize(tensors["ties.x"])
    assert t["global"][0] == F32(0.125)
    ties_scales = [float(s) for s in _fmts()[0].decode(t["scales"]).ravel()]
    assert ties_scales == [448.0, 1.0, 2.0 ** -7, 14.0], ties_scales
    save_numpy(tensors, str(out_dir / "nvfp4.safetensors"))
    return summary


def _fp8_quantize(x: np.ndarray) -> dict:
    e4m3, _ = _fmts()
    x = np.asarray(x, dtype=np.float32)
    amax = np.max(np.abs(x))
    scale = (amax / E4M3_MAX) if amax > 0 else F32(1.0)
    scale = F32(scale)
    v = (x / scale).astype(np.float32)
    bits = e4m3.cast_sat(v)
    assert np.array_equal(bits, e4m3.rne_ref(v, saturate=True))
    deq = (e4m3.decode(bits) * scale).astype(np.float32)
    return {"x": x, "bits": bits, "scale": np.array([scale], dtype=np.float32), "deq": deq}


def _quant_fp8(out_dir: Path) -> dict:
    seeds = QUANT_SEEDS["fp8"]
    inputs = {
        "fp8_normal": np.random.default_rng(seeds["fp8_normal"]).standard_normal((8, 64)),
    }
    m = np.random.default_rng(seeds["fp8_mixed"]).standard_normal((4, 32))
    m[2] *= 1e4
    inputs["fp8_mixed"] = m
    tensors, summary = {}, {}
    for name, x in inputs.items():
        res = _fp8_quantize(x.astype(np.float32))
        x, deq, s = res["x"], res["deq"], float(res["scale"][0])
        # |deq - x| <= half an E4M3 step: 2^-4 relative (normal) or 2^-10 * scale (subnormal)
        err = np.abs(deq.astype(np.float64) - x.astype(np.float64))
        bound = np.maximum(np.abs(x.astype(np.float64)) * 2.0 ** -4, 2.0 ** -10 * s) * (1 + 1e-6)
        assert np.all(err <= bound), name
        again = _fp8_quantize(deq)
        assert np.array_equal(again["bits"], res["bits"]), name
        n_sub = int(np.count_nonzero((res["bits"] & 0x78) == 0))
        summary[name] = {"shape": list(x.shape), "scale": s, "n_subnormal_or_zero": n_sub,
                         "n_negative_zero": int(np.count_nonzero(res["bits"] == 0x80))}
        print(f"  [quant/fp8] {name} {tuple(x.shape)}: scale {s:.6g}, "
              f"{n_sub} subnormal/zero codes, {summary[name]['n_negative_zero']} -0")
        for key in ("x", "bits", "scale", "deq"):
            tensors[f"{name}.{key}"] = np.ascontiguousarray(res[key])
    save_numpy(tensors, str(out_dir / "fp8.safetensors"))
    return summary


def section_quant() -> None:
    out_dir = FIXTURES / "quant"
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"[quant] numpy {np.__version__}, ml_dtypes {ml_dtypes.__version__}")
    # float4_e2m1fn byte layout: the code in the low nibble, high nibble zero
    e2m1_bytes = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn)
    assert e2m1_bytes.astype(np.float32).tolist() == [
        0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert np.array_equal(e2m1_bytes.astype(np.float32).astype(ml_dtypes.float4_e2m1fn)
                          .view(np.uint8), np.arange(16, dtype=np.uint8))
    meta = {
        "versions": {"python": sys.version.split()[0], "numpy": np.__version__,
                     "ml_dtypes": ml_dtypes.__version__},
        "seeds": QUANT_SEEDS,
        "rounding": "round to nearest, ties to even, from float32 (single rounding)",
        "e2m1_code": "sign << 3 | index of magnitude in [0, 0.5, 1, 1.5, 2, 3, 4, 6]; "
                     "ml_dtypes float4_e2m1fn stores it in the low nibble of a byte, high nibble 0",
        "nvfp4_packing": "byte i of a row = code[2i] | code[2i+1] << 4",
        "negative_zero": "signs are kept: negative values that round to 0 give -0 "
                         "(e4m3 0x80, e5m2 0x80, e2m1 code 8), and deq is then -0.0",
        "formats": _quant_formats(out_dir),
        "nvfp4": _quant_nvfp4(out_dir),
        "fp8": _quant_fp8(out_dir),
    }
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    total = sum(p.stat().st_size for p in out_dir.iterdir())
    print(f"  [quant] {total} bytes in {out_dir.relative_to(REPO_ROOT)}")


SECTIONS = {
    "models": section_models,
    "grads": section_grads,
    "quant": section_quant,
    "rl": section_rl,
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--only",
        choices=sorted(SECTIONS),
        action="append",
        help="run only this section (repeatable); default: all sections",
    )
    args = ap.parse_args(argv)
    _setup_torch()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    for name in args.only or list(SECTIONS):
        SECTIONS[name]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
