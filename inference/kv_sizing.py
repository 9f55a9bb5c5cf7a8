"""KV cache arithmetic, in the words vLLM users know.

bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference.model.config import ModelConfig

# Well-known configurations for ``docqa kv-budget NAME`` (architecture fields only: the KV
# shape, and what the weights' size needs).
KNOWN_CONFIGS: dict[str, dict] = {
    "smollm2-135m": dict(
        num_hidden_layers=30,
        num_attention_heads=9,
        hidden_size=576,
        intermediate_size=1536,
        vocab_size=49152,
        tie_word_embeddings=True,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        torch_dtype="bfloat16",
    ),
    "llama-2-7b": dict(
        num_hidden_layers=32,
        num_attention_heads=32,
        hidden_size=4096,
        intermediate_size=11008,
        vocab_size=32000,
        num_key_value_heads=32,
        head_dim=128,
        max_position_embeddings=4096,
        torch_dtype="float16",
    ),
    "llama-3-8b": dict(
        num_hidden_layers=32,
        num_attention_heads=32,
        hidden_size=4096,
        intermediate_size=14336,
        vocab_size=128256,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=8192,
        torch_dtype="bfloat16",
    ),
    "llama-3-70b": dict(
        num_hidden_layers=80,
        num_attention_heads=64,
        hidden_size=8192,
        intermediate_size=28672,
        vocab_size=128256,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=8192,
        torch_dtype="bfloat16",
    ),
    "mistral-7b": dict(
        num_hidden_layers=32,
        num_attention_heads=32,
        hidden_size=4096,
        intermediate_size=14336,
        vocab_size=32000,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=32768,
        torch_dtype="bfloat16",
    ),
    "qwen2-7b": dict(
        num_hidden_layers=28,
        num_attention_heads=28,
        hidden_size=3584,
        intermediate_size=18944,
        vocab_size=152064,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=32768,
        torch_dtype="bfloat16",
    ),
}


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype
) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=kv_dtype).element_size()


@dataclass(frozen=True)
class KVCacheSpec:
    """The sized KV pool of one engine (known only at run time)."""

    block_size: int  # tokens per block
    num_blocks: int
    bytes_per_token: int
    max_model_len: int  # tokens one request may hold

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_block * self.num_blocks

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """How many requests of ``max_model_len`` tokens fit at once."""
        per_req_blocks = -(-self.max_model_len // self.block_size)
        return self.num_blocks / per_req_blocks

    def log_lines(self) -> list[str]:
        return [
            f"KV cache: {self.bytes_per_token / 1024:.2f} KiB per token",
            f"KV cache size: {self.num_tokens:,} tokens",
            f"Maximum concurrency for {self.max_model_len:,} tokens per request: "
            f"{self.max_concurrency:.2f}x",
        ]


def size_kv_cache(
    cfg: ModelConfig, kv_dtype: torch.dtype, block_size: int, budget_bytes: int, max_model_len: int
) -> KVCacheSpec:
    bpt = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_dtype)
    num_blocks = budget_bytes // (bpt * block_size)
    if num_blocks < 1:
        raise ValueError(
            f"a KV budget of {budget_bytes / 2**20:.1f} MiB holds no block of {block_size} tokens "
            f"({bpt * block_size / 2**20:.2f} MiB per block)"
        )
    return KVCacheSpec(block_size, int(num_blocks), bpt, max_model_len)


def format_bytes(n: float) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.2f} MiB"
    return f"{n / 2**10:.2f} KiB"
