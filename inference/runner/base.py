"""The model-runner boundary: the engine's step is schedule, ``runner.execute(scheduler
output)``, post-process.

A runner owns one device's side of the engine: the model and its ops table, the KV pool
(sizing, allocation, slot copies, block reads and writes for the second tier), the persistent
input buffers it fills each step, the forward pass and the sampler. ``CPURunner`` and
``CUDARunner`` differ in the pool's memory, the ops table, the attention backends they accept
and how they wait for the device; the rest is here.
"""

from __future__ import annotations

import logging
import os
import time
from typing import NamedTuple

import numpy as np
import torch

from inference import kv_quant
from inference.attention.backends import BACKENDS
from inference.attention.metadata import AttentionMetadata
from inference.config import EngineConfig
from inference.device import resolve_dtype
from inference.engine.sampler import Sampler, torch_argmax
from inference.engine.scheduler import SchedulerOutput
from inference.kv_quant import KVScales
from inference.kv_sizing import KVCacheSpec, size_kv_cache
from inference.model.config import ModelConfig, dtype_name, parse_dtype
from inference.model.llama import LlamaModel
from inference.model.ops import ModelOps
from inference.runner.inputs import InputBuffers

log = logging.getLogger("docqa.engine")


def resolve_kv_dtype(name: str | None, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype: ``name`` (a float dtype, or an 8-bit one: ``int8``, ``fp8``),
    else the compute dtype."""
    if not name:
        return dtype
    kv8 = kv_quant.parse_kv_dtype(name)
    if kv8 is not None:
        return kv8
    try:
        return parse_dtype(name)
    except ValueError:
        raise ValueError(
            f"unknown KV dtype {name!r}; choose one of float32, bfloat16, float16, "
            f"{', '.join(kv_quant.KV8_NAMES)}"
        ) from None


def calibration_ids(model_dir, vocab_size: int, max_len: int) -> list[int]:
    """``kv_quant.CALIBRATION_TEXT`` as the model's token ids (a fixed sequence of ids where
    the model has no tokenizer file)."""
    from inference.model.tokenizer import TextTokenizer

    try:
        tok = TextTokenizer(model_dir)
    except Exception:  # noqa: BLE001 - any model without a usable tokenizer
        return [(i * 7919) % vocab_size for i in range(1, 513)][:max_len]
    # a prompt starts with its template's first special token: the first position's K/V are
    # often the largest a model writes
    first = [t for t in map(tok.special_id, _PROMPT_STARTS) if t is not None][:1]
    return (first + tok.encode(kv_quant.CALIBRATION_TEXT))[:max_len]


_PROMPT_STARTS = ("<|im_start|>", "<|begin_of_text|>", "<s>")


class RunnerOutput(NamedTuple):
    sampled_token_ids: list[int]  # one per sampling chunk of the step, in chunk order
    logits: torch.Tensor  # [R, vocab] float32: those chunks' next-token logits
    model_s: float  # seconds of the forward pass


class ModelRunner:
    """One device's model, KV pool, input buffers and sampler (module docstring).

    Subclasses provide ``resolve_backend``, ``make_ops``, ``kv_budget_bytes``,
    ``allocate_cache`` and ``copy_slots``, and may replace ``synchronize`` and ``argmax``."""

    def __init__(self, config: EngineConfig, device: torch.device):
        self.config = config
        self.device = device
        model_dir = config.model_dir
        self.model_config = cfg = ModelConfig.from_file(model_dir)
        self.dtype = self.resolve_dtype(config.dtype)
        self.kv_dtype = resolve_kv_dtype(config.kv_dtype, self.dtype)
        name = config.attention_backend or os.environ.get("DOCQA_ATTENTION_BACKEND") or "auto"
        if name.lower() not in BACKENDS:
            raise ValueError(
                f"attention backend must be one of {', '.join(BACKENDS)}, got {name!r}"
            )
        self.attention_backend = self.resolve_backend(name.lower())
        t0 = time.perf_counter()
        ops = self.make_ops()
        if config.random_weights_seed is not None:
            self.model = LlamaModel.random(model_dir, self.dtype, ops, config.random_weights_seed)
        else:
            self.model = LlamaModel.from_pretrained(model_dir, self.dtype, ops)
        held = ", ".join(
            f"{kind} {size / 2**20:.1f} MiB" for kind, size in self.model.linear_storage().items()
        )
        log.info(
            "loaded %s (%s, %s) in %.1f s; linear weights: %s",
            model_dir.name,
            dtype_name(self.dtype),
            device,
            time.perf_counter() - t0,
            held,
        )
        max_len = cfg.max_position_embeddings
        if config.max_model_len:
            max_len = min(max_len, config.max_model_len)
        self.max_model_len = max_len
        # an 8-bit pool's fixed scales, from the model's own K/V over a calibration text
        self.kv_scales: KVScales | None = None
        if kv_quant.is_kv8(self.kv_dtype):
            t0 = time.perf_counter()
            self.kv_scales = KVScales.from_amax(self.calibrate_kv_amax(), self.kv_dtype)
            log.info(
                "KV cache %s: scales %s, calibrated in %.2f s",
                dtype_name(self.kv_dtype),
                self.kv_scales.log_range(),
                time.perf_counter() - t0,
            )
        self.kv_spec: KVCacheSpec = size_kv_cache(
            cfg, self.kv_dtype, config.block_size, self.kv_budget_bytes(), max_len
        )
        shape = (self.kv_spec.num_blocks, config.block_size, cfg.num_kv_heads, cfg.head_dim)
        # per layer (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_caches = [
            (self.allocate_cache(shape), self.allocate_cache(shape)) for _ in range(cfg.num_layers)
        ]
        if self.kv_scales is not None:
            sc = self.kv_scales
            for layer, (kc, vc) in enumerate(self.kv_caches):
                kv_quant.attach(kc, sc.scale[layer, 0], sc.inv[layer, 0])
                kv_quant.attach(vc, sc.scale[layer, 1], sc.inv[layer, 1])
        for line in self.kv_spec.log_lines():
            log.info(line)
        self.inputs = InputBuffers(
            config.max_num_batched_tokens,
            config.max_num_seqs,
            -(-max_len // config.block_size),
            config.block_size,
            device,
        )
        self.sampler = Sampler(self.argmax)

    @torch.inference_mode()
    def calibrate_kv_amax(self) -> torch.Tensor:
        """The largest magnitude of each K and V channel over ``kv_quant.CALIBRATION_TEXT``,
        computed by this runner's model into a small pool of the compute dtype:
        [layers, 2 (K, V), kv_heads, head_dim] float32."""
        cfg, bs = self.model_config, self.config.block_size
        ids = calibration_ids(self.config.model_dir, cfg.vocab_size, self.max_model_len)
        n = len(ids)
        blocks = -(-n // bs)
        shape = (blocks, bs, cfg.num_kv_heads, cfg.head_dim)
        caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(cfg.num_layers)
        ]
        meta = AttentionMetadata.build([list(range(blocks))], [n], [n], bs, self.device)
        self.model.forward(
            torch.tensor(ids, dtype=torch.int64, device=self.device),
            torch.arange(n, dtype=torch.int64, device=self.device),
            meta,
            caches,
            torch.tensor([n - 1], dtype=torch.int64, device=self.device),
        )
        amax = [
            torch.stack([kv_quant.amax_of_cache(kc, n), kv_quant.amax_of_cache(vc, n)])
            for kc, vc in caches
        ]
        return torch.stack(amax).cpu()

    def compute_signature(self) -> str:
        """What computes and stores the KV bits (part of the prefix cache's fingerprint): the
        model's kernels, and an 8-bit pool's scales."""
        sig = self.model.compute_signature()
        if self.kv_scales is not None:
            sig += f"|kv-scales={self.kv_scales.digest()}"
        return sig

    # -- per device -------------------------------------------------------------------------------
    def resolve_dtype(self, dtype: str) -> torch.dtype:
        """The compute dtype ``dtype`` (``auto`` included) means on this runner's device."""
        return resolve_dtype(dtype, self.device)

    def resolve_backend(self, name: str) -> str:
        """The attention backend ``name`` (``auto``, ``torch``, ``cpu``, ``triton``) means
        here; ValueError where it cannot run."""
        raise NotImplementedError

    def make_ops(self) -> ModelOps:
        raise NotImplementedError

    def kv_budget_bytes(self) -> int:
        raise NotImplementedError

    def allocate_cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        """One layer's K or V cache, zero."""
        raise NotImplementedError

    def copy_slots(self, src: int, dst: int, n: int) -> None:
        """The KV of block ``src``'s first ``n`` slots into block ``dst``, every layer (a
        prompt's start that a cached block holds: the same bits computing it would give)."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait for the device's queued work."""

    def argmax(self, logits: torch.Tensor) -> list[int]:
        """Greedy tokens of logits rows [R, vocab] float32."""
        return torch_argmax(logits)

    # -- the step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run one scheduled step: fill the input buffers, the forward pass (K/V of every new
        token stored in the pool), and the next token of each chunk that ends at its request's
        last token."""
        t0 = time.perf_counter()
        logits = self.run_model(sched)
        self.synchronize()
        model_s = time.perf_counter() - t0
        sampling = sched.sampling
        tokens = self.sampler(logits, sampling) if sampling else []
        return RunnerOutput(tokens, logits, model_s)

    def run_model(self, sched: SchedulerOutput) -> torch.Tensor:
        """The step's forward pass: its inputs into the persistent buffers, then the model;
        the sampled rows' logits [R, vocab] float32."""
        x = self.inputs.prepare(sched)
        return self.model.forward(
            x.input_ids, x.positions, x.meta, self.kv_caches, x.logits_indices
        )

    # -- the pool --------------------------------------------------------------------------------
    def allocated_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.kv_caches)

    def _block_buffer(self, n: int, device: torch.device) -> torch.Tensor:
        """Room for ``n`` blocks' K/V of every layer, in the second tier's payload layout
        [block, layer, k|v, token, kv head, dim]."""
        cfg = self.model_config
        shape = (n, cfg.num_layers, 2, self.kv_spec.block_size, cfg.num_kv_heads, cfg.head_dim)
        dtype = torch.uint8 if kv_quant.is_kv8(self.kv_dtype) else self.kv_dtype
        return torch.empty(shape, dtype=dtype, device=device)

    def _raw_caches(self):
        """Each layer's caches, 8-bit ones as their bytes (fp8 tensors take few of torch's
        indexing ops)."""
        return [(kv_quant.raw(kc), kv_quant.raw(vc)) for kc, vc in self.kv_caches]

    def read_blocks(self, block_ids: list[int]) -> np.ndarray:
        """The K/V of these blocks, every layer, as bytes on the host: [n, payload bytes]."""
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        data = self._block_buffer(len(block_ids), self.device)
        for layer, (kc, vc) in enumerate(self._raw_caches()):
            data[:, layer, 0] = kc[ids]
            data[:, layer, 1] = vc[ids]
        return data.cpu().view(len(block_ids), -1).view(torch.uint8).numpy()

    def write_blocks(self, block_ids: list[int], payloads: list) -> None:
        """Write ``read_blocks``' bytes (one payload per block) into these blocks."""
        data = self._block_buffer(len(block_ids), torch.device("cpu"))
        raw = data.view(len(block_ids), -1).view(torch.uint8).numpy()
        for row, payload in zip(raw, payloads, strict=True):
            row[:] = np.frombuffer(payload, dtype=np.uint8)
        data = data.to(self.device)
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        for layer, (kc, vc) in enumerate(self._raw_caches()):
            kc.index_copy_(0, ids, data[:, layer, 0])
            vc.index_copy_(0, ids, data[:, layer, 1])

    def close(self) -> None:
        """Release what the runner holds beyond its tensors (nothing here)."""
