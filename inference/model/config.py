"""Model and engine configuration: typed, frozen, validated at construction."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from inference.errors import ModelError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = str(name).replace("torch.", "")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(_DTYPES)}")
    return _DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a Llama-family model (config.json)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q, k and v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before the rotation
    # per-frequency divisors of the rotary frequencies (a GGUF's rope_freqs: Llama 3 scaling)
    rope_freq_factors: tuple[float, ...] | None = None
    torch_dtype: str = "bfloat16"  # the checkpoint's own dtype; the KV dtype defaults to it
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(
                f"rope_freq_factors has {len(self.rope_freq_factors)} entries; head_dim "
                f"{self.head_dim} needs {self.head_dim // 2}"
            )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        archs = d.get("architectures") or []
        mtype = d.get("model_type", "llama")
        if mtype not in MODEL_TYPES and not any(a in ARCHITECTURES for a in archs):
            raise ModelError(f"model type {mtype!r} is not a supported Llama-family model")
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        # transformers >= 5 writes "rope_parameters" (theta inside); checkpoints "rope_scaling"
        rs = d.get("rope_scaling") or d.get("rope_parameters") or None
        rope_theta = d.get("rope_theta") or (rs or {}).get("rope_theta") or 10000.0
        scaling = None
        if rs:
            kind = rs.get("rope_type", rs.get("type"))
            if kind == "llama3":
                scaling = RopeScaling(
                    factor=float(rs["factor"]),
                    low_freq_factor=float(rs["low_freq_factor"]),
                    high_freq_factor=float(rs["high_freq_factor"]),
                    original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
                )
            elif kind not in (None, "default"):
                raise ModelError(f"rope scaling {kind!r} is not supported")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", mtype == "qwen2")),
            qk_norm=bool(d.get("qk_norm", mtype == "qwen3")),
            rope_freq_factors=(
                tuple(float(x) for x in d["rope_freq_factors"])
                if d.get("rope_freq_factors")
                else None
            ),
            torch_dtype=str(d.get("torch_dtype") or "bfloat16"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        path, d = read_config_json(path)
        try:
            return cls.from_dict(d)
        except KeyError as e:
            raise ModelError(f"{path} lacks the field {e.args[0]!r}") from None


def read_config_json(path: str | Path) -> tuple[Path, dict]:
    """A Hugging Face ``config.json`` (``path`` is the file or its directory): the file's path
    and its fields; ModelError when it is missing or not JSON."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ModelError(f"no config.json at {path}")
    try:
        return path, json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelError(f"{path} is not valid JSON ({e})") from None
