"""Benchmark models: random weights of a known shape with the default model's tokenizer, so the
whole service runs on a machine that has no weight files (a GPU lent for a benchmark).

``random:NAME`` names one, NAME a shape of ``inference.kv_sizing.KNOWN_CONFIGS`` (``llama-3-8b``,
``smollm2-135m``, ...). Its directory, ``$DOCQA_HOME/models/random-NAME``, holds a config.json
of that shape and the default model's tokenizer files, and nothing else; the engine draws the
weights from a fixed seed (``EngineConfig.random_weights_seed``), so two replicas draw the same
ones and share a prefix-cache fingerprint. Answers are noise: the service accepts such a model
only when told it is benchmarking (``--benchmark-weights``) and says so in ``/v1/engine``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from inference.errors import ModelError
from inference.kv_sizing import KNOWN_CONFIGS
from inference.model.model_import import default_model_dir, import_default_model, models_dir

PREFIX = "random:"
SEED = 0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# what a known shape's entry leaves out: the Llama defaults of its family
_ROPE_THETA = {"llama-3-8b": 500000.0, "llama-3-70b": 500000.0, "qwen2-7b": 1000000.0}


def is_benchmark_model(spec: str | Path | None) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def benchmark_config(name: str, tokenizer_vocab: int, bos: int | None, eos) -> dict:
    """The config.json of shape ``name``: its vocabulary at least the tokenizer's, so every id
    the tokenizer gives is in it."""
    if name not in KNOWN_CONFIGS:
        raise ModelError(
            f"unknown benchmark shape {name!r}; known: {', '.join(sorted(KNOWN_CONFIGS))}"
        )
    shape = dict(KNOWN_CONFIGS[name])
    heads = shape["num_attention_heads"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **shape,
        "head_dim": shape.get("head_dim") or shape["hidden_size"] // heads,
        "vocab_size": max(shape["vocab_size"], tokenizer_vocab),
        "rms_norm_eps": 1e-5,
        "rope_theta": _ROPE_THETA.get(name, 10000.0),
        "bos_token_id": bos,
        "eos_token_id": eos,
    }


def benchmark_model_dir(spec: str) -> Path:
    """The directory of ``random:NAME`` (module docstring), written on first use. A directory
    already holding its config and tokenizer is used as it is (carried to a machine without
    the default model or a network)."""
    name = spec[len(PREFIX) :].strip().lower()
    out = models_dir() / f"random-{name}"
    if (out / "config.json").is_file() and all((out / f).is_file() for f in TOKENIZER_FILES):
        return out
    src = default_model_dir()
    if not all((src / f).is_file() for f in TOKENIZER_FILES):
        src = import_default_model()
    src_cfg = json.loads((src / "config.json").read_text())
    tok = json.loads((src / "tokenizer.json").read_text())
    ids = [*tok.get("model", {}).get("vocab", {}).values()]
    ids += [t["id"] for t in tok.get("added_tokens", [])]
    vocab = max(ids, default=-1) + 1  # the largest id the tokenizer gives, plus one
    cfg = benchmark_config(
        name,
        max(vocab, int(src_cfg.get("vocab_size", 0))),
        src_cfg.get("bos_token_id"),
        src_cfg.get("eos_token_id"),
    )
    out.mkdir(parents=True, exist_ok=True)
    for f in TOKENIZER_FILES:
        shutil.copyfile(src / f, out / f)
    tmp = out / "config.json.tmp"
    tmp.write_text(json.dumps(cfg, indent=2) + "\n")
    tmp.replace(out / "config.json")
    return out
