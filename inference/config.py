"""The engine's configuration: typed, frozen, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from inference.engine.speculate import SPECULATE_MODES, SpeculationConfig
from prefix_store import TierConfig

BLOCK_SIZES = (8, 16, 32, 64, 128)


@dataclass(frozen=True)
class EngineConfig:
    model_dir: Path
    dtype: str = "auto"  # compute dtype: auto | float32 | bfloat16
    kv_dtype: str | None = None  # defaults to the compute dtype
    device: str | None = None  # cpu | cuda; None picks cuda when available
    block_size: int = 16  # tokens per KV block
    kv_cache_gib: float | None = None  # CPU pool size; None: a quarter of free memory, <= 4 GiB
    gpu_memory_utilization: float = 0.9  # CUDA: share of the device memory docqa may use
    max_model_len: int | None = None  # None = the model's context length
    max_num_batched_tokens: int = 512  # tokens a step carries, decodes and prompt chunks
    max_num_seqs: int = 64  # requests running at once
    prefill_tokens_with_decodes: int = 0  # SchedulerConfig.prefill_tokens_with_decodes
    pin_budget: float = 0.25  # share of the KV pool that pinned prefixes may hold
    attention_backend: str | None = (
        None  # auto | torch | cpu | triton (env DOCQA_ATTENTION_BACKEND)
    )
    random_weights_seed: int | None = None  # benchmarks: random weights, no weight files
    num_threads: int | None = None  # torch CPU threads; None keeps torch's default
    kv_tier: TierConfig | None = None  # second tier of the prefix cache (Redis); None: off
    # CUDA: products and norms whose rows never depend on the batch (kernels/triton/invariant);
    # the CPU's are invariant by construction
    batch_invariant: bool = False
    # CUDA: decode steps replayed from graphs captured at start (runner/graphs.py)
    cuda_graphs: bool = False
    # a few prompts computed at start to fit the prefill cost model (``ttft_saved_ms``) before
    # the first question (ModelRunner.profile_reserve)
    calibrate_prefill_cost: bool = True
    # prompt-lookup speculation (engine/speculate.py): drafts from the request's own tokens,
    # verified in the step; the answers are the same with it or without (``off``)
    speculate: str = "off"
    speculation: SpeculationConfig = SpeculationConfig()

    def __post_init__(self):
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(
                f"block_size must be one of {', '.join(map(str, BLOCK_SIZES))}; "
                f"got {self.block_size}"
            )
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be positive, got {self.kv_cache_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.speculate not in SPECULATE_MODES:
            raise ValueError(
                f"speculate must be one of {', '.join(SPECULATE_MODES)}; got {self.speculate!r}"
            )
        if not 0 <= self.pin_budget <= 1:
            raise ValueError(f"pin_budget must be in [0, 1], got {self.pin_budget}")
