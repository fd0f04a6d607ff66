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

Later sections (quantization, ...) are added as further ``section_*``
functions and registered in ``SECTIONS``.

How to run (from the repository root; needs network access to PyPI once, no GPU):

    python -m venv /tmp/venv-fixtures
    . /tmp/venv-fixtures/bin/activate
    pip install -r scripts/requirements-fixtures.txt
    python scripts/make_fixtures.py              # all sections
    python scripts/make_fixtures.py --only models
    python scripts/make_fixtures.py --only grads  # reuses tests/fixtures/models/

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
from safetensors import safe_open  # noqa: E402
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


SECTIONS = {
    "models": section_models,
    "grads": section_grads,
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
