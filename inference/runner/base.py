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
from inference.device import peak_memory_during, resolve_dtype
from inference.engine.sampler import Sampler, torch_argmax
from inference.engine.scheduler import SchedulerOutput
from inference.kv_planner import ModelShape
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
    ids = first + tok.encode(kv_quant.CALIBRATION_TEXT)
    return [t for t in ids if t < vocab_size][:max_len]  # a tokenizer wider than the model


_PROMPT_STARTS = ("<|im_start|>", "<|begin_of_text|>", "<s>")


class ActivationReserve(NamedTuple):
    """Memory kept out of the KV pool for a step's activations: measured by warm-up steps at
    the largest sizes the scheduler makes (``ModelRunner.profile_reserve``), beside what
    ``docqa kv-budget`` plans for them."""

    prefill_bytes: int | None  # the warm-up prompt chunk's peak above the weights (None: no
    decode_bytes: int | None  # measure here); the warm-up decode step's
    planned_bytes: int  # kv_planner's runtime reserve for the same step sizes
    prefill_tokens: int  # the warm-up prompt chunk's tokens
    decode_seqs: int  # the warm-up decode step's sequences
    decode_context: int  # and the keys each of them attended

    @property
    def measured_bytes(self) -> int | None:
        """The larger of the two steps' peaks (one step runs at a time)."""
        if self.prefill_bytes is None or self.decode_bytes is None:
            return None
        return max(self.prefill_bytes, self.decode_bytes)

    def log_line(self) -> str:
        if self.measured_bytes is None:
            measured = "not measured here"
        else:
            measured = (
                f"{self.measured_bytes / 2**20:.0f} MiB measured (a prompt chunk of "
                f"{self.prefill_tokens} tokens: {self.prefill_bytes / 2**20:.0f} MiB; a decode "
                f"step of {self.decode_seqs} sequences at {self.decode_context} keys: "
                f"{self.decode_bytes / 2**20:.0f} MiB)"
            )
        return (
            f"activation reserve: {measured}, {self.planned_bytes / 2**20:.0f} MiB planned "
            "(kv-budget's estimate)"
        )


class RunnerOutput(NamedTuple):
    # one per sampled row of the step (``SchedulerOutput.sampling_rows``), in row order
    sampled_token_ids: list[int]
    logits: torch.Tensor  # [R, vocab] float32: those rows' logits
    model_s: float  # seconds of the forward pass


class ModelRunner:
    """One device's model, KV pool, input buffers and sampler (module docstring).

    Subclasses provide ``resolve_backend``, ``make_ops``, ``kv_budget_bytes``,
    ``allocate_cache`` and ``copy_slots``, and may replace ``synchronize``, ``argmax`` (a
    plain function, so the sampler holding it never holds the runner) and
    ``profile_context``.

    Start-up order: the model, an 8-bit pool's scales, warm-up steps at the largest sizes on
    a scratch pool (``profile_reserve``: the activations' peak, measured before the pool is
    sized), then the KV pool from what is left (``kv_budget_bytes``), then the input buffers."""

    argmax = staticmethod(torch_argmax)  # greedy tokens of logits rows [R, vocab] float32

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
        self.reserve = self.profile_reserve()
        log.info(self.reserve.log_line())
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

    def scratch_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A small pool of the KV dtype (an 8-bit one with the engine's scales) for warm-up
        steps before the real pool exists."""
        cfg, bs = self.model_config, self.config.block_size
        shape = (num_blocks, bs, cfg.num_kv_heads, cfg.head_dim)
        caches = [
            (self.allocate_cache(shape), self.allocate_cache(shape)) for _ in range(cfg.num_layers)
        ]
        if self.kv_scales is not None:
            sc = self.kv_scales
            for layer, (kc, vc) in enumerate(caches):
                kv_quant.attach(kc, sc.scale[layer, 0], sc.inv[layer, 0])
                kv_quant.attach(vc, sc.scale[layer, 1], sc.inv[layer, 1])
        return caches

    def interpreted(self) -> bool:
        """Whether the attention kernels run under Triton's interpreter (a GPU's kernels on
        CPU tensors, for tests): the start-up steps then stay small and nothing is timed."""
        return self.attention_backend == "triton" and self.device.type == "cpu"

    def profile_context(self) -> int:
        """Keys each row of the decode warm-up attends: the longest context, where the
        attention's working memory grows with it (a GPU's decode partitions)."""
        return self.max_model_len

    @torch.inference_mode()
    def profile_reserve(self) -> ActivationReserve:
        """Warm-up steps at the largest sizes the scheduler makes, on a scratch pool, their
        peak memory measured (``device.peak_memory_during``): a prompt chunk of
        ``max_num_batched_tokens`` tokens (at most the context), then a decode step of
        ``max_num_seqs`` sequences at ``profile_context()`` keys each (their slots -1: nothing
        stored; their tables all block 0), every row's logits computed. Then, with
        ``calibrate_prefill_cost``, prompt chunks of three sizes timed on the same pool
        (``prefill_samples``), so the engine's prefill cost model is fitted before its first
        request: an eighth and half of the token budget, and two whole budgets in two steps,
        the second over the first."""
        cfg, bs, config = self.model_config, self.config.block_size, self.config
        tokens = min(config.max_num_batched_tokens, self.max_model_len)
        seqs = min(config.max_num_seqs, config.max_num_batched_tokens)
        ctx = max(1, min(self.profile_context(), self.max_model_len))
        dev = self.device
        calibrate = config.calibrate_prefill_cost
        if self.interpreted():  # kernels run in Python: a token's worth of each, nothing timed
            tokens, seqs, calibrate = min(tokens, bs), min(seqs, 2), False
        room = min(2 * tokens, self.max_model_len - 1)
        caches = self.scratch_caches(-(-room // bs) + 1)

        def prefill(n: int, context: int = 0, every_row: bool = False) -> None:
            """A chunk of ``n`` tokens after ``context`` ones, into blocks 0, 1, ...; the
            last row's logits, or ``every_row``'s (a verification's)."""
            seq = context + n
            ids = (
                torch.arange(context, seq, dtype=torch.int64, device=dev) * 7919
            ) % cfg.vocab_size
            meta = AttentionMetadata.build([list(range(-(-seq // bs)))], [seq], [n], bs, dev)
            if every_row:
                last = torch.arange(n, dtype=torch.int64, device=dev)
            else:
                last = torch.tensor([n - 1], dtype=torch.int64, device=dev)
            pos = torch.arange(context, seq, device=dev)
            self.model.forward(ids, pos, meta, caches, last)
            self.synchronize()

        def decode() -> None:
            table = [0] * -(-ctx // bs)
            meta = AttentionMetadata.build([table] * seqs, [ctx] * seqs, [1] * seqs, bs, dev,
                                           is_decode=[True] * seqs)  # fmt: skip
            meta.slot_mapping.fill_(-1)
            rows = torch.arange(seqs, dtype=torch.int64, device=dev)
            pos = torch.full((seqs,), ctx - 1, dtype=torch.int64, device=dev)
            self.model.forward(rows % cfg.vocab_size, pos, meta, caches, rows)
            self.synchronize()

        prefill_bytes = peak_memory_during(dev, lambda: prefill(tokens))
        decode_bytes = peak_memory_during(dev, decode)
        self.prefill_samples = []
        self.row_samples = []
        if calibrate:
            t0 = time.perf_counter()
            sizes = [(max(16, tokens // 8), 0), (max(32, tokens // 2), 0), (tokens, 0)]
            if room >= 2 * tokens:
                sizes.append((tokens, tokens))
            for n, context in sizes:
                n = min(n, room - context)
                t = time.perf_counter()
                prefill(n, context)
                self.prefill_samples.append(([(n, context)], time.perf_counter() - t))
            log.info(
                "prefill steps timed at start for the cost model: %s in %.2f s",
                ", ".join(
                    f"{n} tokens after {c}: {s * 1000:.0f} ms"
                    for ((n, c),), s in self.prefill_samples
                ),  # fmt: skip
                time.perf_counter() - t0,
            )
            if config.speculate != "off" and self.rows_invariant():
                context = max(bs, min(tokens, room - 64))  # a manual's worth of keys
                self.row_samples = self.time_rows(prefill, min(room - context, 64), context)
        shape = ModelShape(
            num_layers=cfg.num_layers,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            vocab_size=cfg.vocab_size,
        )
        planned = shape.runtime_reserve_bytes(self.dtype.itemsize, tokens, seqs)
        return ActivationReserve(prefill_bytes, decode_bytes, planned, tokens, seqs, ctx)

    def time_rows(self, prefill, max_rows: int, context: int) -> list[tuple[int, float]]:
        """A step's cost by its rows, for speculation's policy (``speculate.StepCost``):
        chunks of 1, 2, 4, ... ``max_rows`` tokens after ``context`` ones, every row's logits
        computed (a verification's), the faster of two passes each."""
        t0 = time.perf_counter()
        sizes = [r for r in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if r <= max_rows]
        samples = []
        for rows in sizes:
            best = float("inf")
            for _ in range(2):
                t = time.perf_counter()
                prefill(rows, context, every_row=True)
                best = min(best, time.perf_counter() - t)
            samples.append((rows, best))
        log.info(
            "steps of 1 to %d rows timed for speculation in %.2f s: %s",
            sizes[-1],
            time.perf_counter() - t0,
            ", ".join(f"{r}: {s * 1000:.1f} ms" for r, s in samples),
        )
        return samples

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

    def rows_invariant(self) -> bool:
        """Whether a token's logits are the same bits in a step of any shape: as a decode
        token, as a row of a prompt chunk, beside any other requests (what lets speculation
        verify drafts without changing an answer)."""
        return False

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
        reqs, positions = sched.sampling_rows()
        tokens = self.sampler(logits, reqs, positions) if reqs else []
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
