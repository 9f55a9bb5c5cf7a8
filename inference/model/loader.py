"""Loading a model's weights (safetensors, or random weights of a named shape) and its
fingerprint: the content hash the prefix cache seeds every hash chain with.

The fingerprint hashes content, never paths: config.json, each weight file's sha256 and
tokenizer.json, plus the compute dtype, the KV dtype, the block size and what computes the KV
bits (``ModelOps.name`` and the linear layers' kernels). Two replicas that imported the same
model and compute it the same way agree, and KV computed one way is never served to an engine
computing another.
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

import torch
from safetensors import safe_open

from inference.errors import ModelError
from inference.model.config import ModelConfig, dtype_name


def weight_files(model_dir: Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelError(f"{model_dir} holds no .safetensors weights")
    return files


def load_weights(model_dir: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors files, by Hugging Face name, on the CPU;
    with ``dtype``, each converted as it is read (a float32 file of an imported GGUF never
    sits in memory whole beside its bfloat16 copy)."""
    tensors: dict[str, torch.Tensor] = {}
    for f in weight_files(model_dir):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open has no __iter__
                t = sf.get_tensor(name)
                tensors[name] = t if dtype is None else t.to(dtype)
    return tensors


def random_weights(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random weights of the shape ``cfg`` describes, made on ``device`` (benchmarks of large
    shapes without weight files): N(0, 0.02) products, norms of ones."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, d = cfg.hidden_size, cfg.head_dim
    shapes = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (cfg.num_heads * d, h),
                p + "self_attn.k_proj.weight": (cfg.num_kv_heads * d, h),
                p + "self_attn.v_proj.weight": (cfg.num_kv_heads * d, h),
                p + "self_attn.o_proj.weight": (h, cfg.num_heads * d),
                p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
                p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
                p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
            }
        )
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
    sd = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            sd[name] = torch.ones(shape, dtype=dtype, device=device)
        else:
            t = torch.empty(shape, dtype=dtype, device=device)
            sd[name] = t.normal_(0.0, 0.02, generator=gen)
    return sd


def file_sha256(path: Path) -> str:
    """sha256 of a file, cached beside it by size and mtime (weights are large)."""
    st = path.stat()
    sidecar = path.with_name(path.name + ".sha256")
    key = f"{st.st_size}:{st.st_mtime_ns}"
    if sidecar.is_file():
        parts = sidecar.read_text().split()
        if len(parts) == 2 and parts[0] == key:
            return parts[1]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    digest = h.hexdigest()
    with contextlib.suppress(OSError):
        sidecar.write_text(f"{key} {digest}\n")
    return digest


def model_fingerprint(
    model_dir: Path,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    block_size: int,
    random_seed: int | None = None,
    compute: str = "",
) -> bytes:
    """Content hash of a model as the prefix cache sees it (module docstring). ``compute``
    names what computes the KV bits (``LlamaModel.compute_signature``)."""
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    h.update((model_dir / "config.json").read_bytes())
    if random_seed is not None:
        h.update(f"random-weights:{random_seed}".encode())
    else:
        for f in weight_files(model_dir):
            h.update(bytes.fromhex(file_sha256(f)))
    tok = model_dir / "tokenizer.json"
    if tok.is_file():
        h.update(tok.read_bytes())
    h.update(f"{dtype_name(dtype)}|{dtype_name(kv_dtype)}|{block_size}".encode())
    if compute:
        h.update(b"|" + compute.encode())
    return h.digest()
