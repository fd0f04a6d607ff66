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

Later sections (gradients, quantization, ...) are added as further ``section_*``
functions and registered in ``SECTIONS``.

How to run (from the repository root; needs network access to PyPI once, no GPU):

    python -m venv /tmp/venv-fixtures
    . /tmp/venv-fixtures/bin/activate
    pip install -r scripts/requirements-fixtures.txt
    python scripts/make_fixtures.py              # all sections
    python scripts/make_fixtures.py --only models

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

import torch  # noqa: E402
import transformers  # noqa: E402
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


SECTIONS = {
    "models": section_models,
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
