"""The engine: model + paged KV pool + prefix cache + scheduler, advanced one step at a time.

``LLMEngine.step()`` runs one batch (decodes and prompt chunks together), registers newly full
blocks in the prefix cache once their KV is written, samples where a sequence reached its end,
and returns the requests that finished. It is synchronous and single-threaded; front ends call
it from one thread.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from inference.attention import AttentionMetadata, make_backend, resolve_backend
from inference.config import ModelConfig, dtype_name, parse_dtype
from inference.errors import DocqaError, ModelError, PromptTooLongError
from inference.kv_sizing import KVCacheSpec, size_kv_cache
from inference.metrics import PrefillCostModel, RequestMetrics
from inference.model import LlamaModel, model_fingerprint
from inference.sampling import SamplingParams, sample
from inference.scheduler import Scheduler, SchedulerConfig
from inference.sequence import Request
from inference.tokenizer import TextTokenizer
from prefix_store import KVCacheManager

log = logging.getLogger("docqa.engine")

# end-of-turn markers of the chat templates docqa lays out (prompts/templates.py)
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<|endoftext|>")


def _is_decode(req: Request, n: int, ctx: int) -> bool:
    """One new token that follows a sampled token (not a chunk of the prompt)."""
    return n == 1 and ctx == req.num_tokens - 1 and ctx >= req.num_prompt_tokens


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on CUDA and on CPU (measured faster here, answers unchanged:
    bench/ttft.py and tests/test_real_model.py)."""
    if dtype == "auto":
        return torch.bfloat16
    return parse_dtype(dtype)


def _available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def default_cpu_kv_gib() -> float:
    """A quarter of the memory available now, at most 4 GiB."""
    return min(4.0, _available_memory_bytes() / 4 / 2**30)


@dataclass(frozen=True)
class EngineConfig:
    model_dir: Path
    dtype: str = "auto"  # compute dtype: auto | float32 | bfloat16
    kv_dtype: str | None = None  # defaults to the compute dtype
    device: str | None = None  # cpu | cuda; None picks cuda when available
    block_size: int = 16
    kv_cache_gib: float | None = None  # CPU pool size; None = default_cpu_kv_gib()
    gpu_memory_utilization: float = 0.9  # CUDA: share of the device memory docqa may use
    max_model_len: int | None = None  # None = the model's context length
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    pin_budget: float = 0.25  # share of the KV pool that pinned prefixes may hold
    attention_backend: str | None = None  # auto | torch | triton (env DOCQA_ATTENTION_BACKEND)
    random_weights_seed: int | None = None  # benchmarks: random weights, no weight files
    num_threads: int | None = None  # torch CPU threads; None keeps torch's default

    def __post_init__(self):
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128; got {self.block_size}")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be positive, got {self.kv_cache_gib}")


class PinBudgetError(DocqaError):
    code = "pin_budget_exceeded"

    def __init__(self, message: str, limit: int):
        super().__init__(message)
        self.limit = limit


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        model_dir = Path(config.model_dir)
        if not (model_dir / "config.json").is_file():
            raise ModelError(f"no model at {model_dir} (expected a directory with config.json)")
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device) if config.device else default_device()
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_dtype = parse_dtype(config.kv_dtype) if config.kv_dtype else self.dtype
        self.model_dir = model_dir
        self.model_config = ModelConfig.from_file(model_dir)
        self.tokenizer = TextTokenizer(model_dir)
        t0 = time.perf_counter()
        if config.random_weights_seed is not None:
            self.model = LlamaModel.random(
                model_dir, self.dtype, self.device, config.random_weights_seed
            )
        else:
            self.model = LlamaModel.from_pretrained(model_dir, self.dtype, self.device)
        self.attention_backend = resolve_backend(config.attention_backend, self.device)
        self.model.attn_backend = make_backend(self.attention_backend)
        log.info(
            "loaded %s (%s, %s) in %.1f s",
            model_dir.name,
            dtype_name(self.dtype),
            self.device,
            time.perf_counter() - t0,
        )
        cfg = self.model_config
        max_len = cfg.max_position_embeddings
        if config.max_model_len:
            max_len = min(max_len, config.max_model_len)
        self.max_model_len = max_len
        self.kv_spec = size_kv_cache(
            cfg, self.kv_dtype, config.block_size, self._kv_budget_bytes(), max_len
        )
        shape = (self.kv_spec.num_blocks, config.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
            )
            for _ in range(cfg.num_layers)
        ]
        for line in self.kv_spec.log_lines():
            log.info(line)
        self.fingerprint = model_fingerprint(
            model_dir, self.dtype, self.kv_dtype, config.block_size, config.random_weights_seed
        )
        self.kv_manager = KVCacheManager(
            self.kv_spec.num_blocks, config.block_size, self.fingerprint
        )
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs), self.kv_manager
        )
        self.cost_model = PrefillCostModel()
        eos = set(cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        for t in _END_OF_TURN:
            tid = self.tokenizer.special_id(t)
            if tid is not None and t in self.tokenizer.chat_template:
                eos.add(tid)
        self.eos_token_ids = frozenset(eos)
        self.requests: dict[str, Request] = {}
        # counters (CONTRACTS.md metric table)
        self.prompt_tokens_computed = 0
        self.generation_tokens = 0
        self.num_steps = 0
        self.num_cancelled = 0
        # the last step, for metrics: (sequences, prefill tokens, decode tokens, seconds)
        self.last_step: tuple[int, int, int, float] | None = None
        self.pinned: dict[str, int] = {}  # pin key -> blocks held

    def _kv_budget_bytes(self) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            return int(total * self.config.gpu_memory_utilization - used - 2**30)
        gib = self.config.kv_cache_gib or default_cpu_kv_gib()
        return int(gib * 2**30)

    def kv_cache_allocated_bytes(self) -> int:
        return sum(
            k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv_caches
        )

    # -- requests -----------------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        namespace: bytes = b"",
        use_cache: bool = True,
        keep_logits: bool = False,
    ) -> Request:
        """Queue a request. ``use_cache=False`` is cache "bypass": nothing is read from the
        prefix cache and nothing of this request is registered in it."""
        n = len(prompt_token_ids)
        if n == 0:
            raise PromptTooLongError("the prompt is empty", self.max_model_len)
        if n >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt is {n:,} tokens; this model's context is {self.max_model_len:,} tokens "
                "(one position must stay free for the answer)",
                self.max_model_len,
            )
        bad = [t for t in prompt_token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ModelError(
                f"token id {bad[0]} is outside the vocabulary "
                f"(0..{self.model_config.vocab_size - 1})"
            )
        rid = request_id or f"req_{uuid.uuid4().hex[:16]}"
        gen = None
        if not params.greedy:
            gen = torch.Generator()
            gen.manual_seed(
                params.seed
                if params.seed is not None
                else int.from_bytes(os.urandom(8), "little") >> 1
            )
        req = Request(
            rid,
            list(prompt_token_ids),
            params,
            namespace=namespace,
            use_cache=use_cache,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            generator=gen,
            keep_logits=keep_logits,
        )
        self.scheduler.add(req, reserved_blocks=self.num_pinned_blocks)
        self.requests[rid] = req
        return req

    def abort(self, request_id: str) -> None:
        """Cancel a request; its blocks are freed at once."""
        req = self.requests.pop(request_id, None)
        if req is not None and not req.finished:
            self.scheduler.abort(req)
            req.finish_reason = "abort"
            self.num_cancelled += 1

    # -- pinning --------------------------------------------------------------------------------
    @property
    def num_pinned_blocks(self) -> int:
        return sum(self.pinned.values())

    @property
    def pin_budget_blocks(self) -> int:
        return int(self.kv_spec.num_blocks * self.config.pin_budget)

    def pin(self, key: str, token_ids: list[int], namespace: bytes = b"") -> int:
        """Keep the cached full blocks of ``token_ids`` out of eviction until ``unpin(key)``.

        Returns the tokens pinned (the cached prefix, in full blocks). Raises DocqaError when
        the pin budget would be exceeded. Pinning again under the same key re-pins."""
        self.unpin(key)
        kv = self.kv_manager
        cached = kv.find_cached_prefix(list(token_ids) + [0], namespace)
        n = len(cached.blocks)
        if n == 0:
            return 0
        budget = self.pin_budget_blocks
        if self.num_pinned_blocks + n > budget:
            raise PinBudgetError(
                f"pinning {n:,} blocks would exceed the pin budget of {budget:,} blocks "
                f"({self.config.pin_budget:.0%} of the pool; {self.num_pinned_blocks:,} pinned)",
                budget,
            )
        kv.allocate(f"pin:{key}", cached.num_cached_tokens, cached, namespace)
        self.pinned[key] = n
        return cached.num_cached_tokens

    def unpin(self, key: str) -> bool:
        if key not in self.pinned:
            return False
        self.kv_manager.free(f"pin:{key}")
        del self.pinned[key]
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # -- one step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Request]:
        out = self.scheduler.schedule()
        if not out.chunks:
            return []
        input_ids: list[int] = []
        positions: list[int] = []
        tables, seq_lens, q_lens, logits_rows, decodes = [], [], [], [], []
        sampling: list[Request] = []
        chunk_tokens: list[list[int]] = []
        for req, n, ctx in out.chunks:
            decodes.append(_is_decode(req, n, ctx))
            toks = req.all_token_ids  # built once per chunk, reused for registration below
            chunk_tokens.append(toks)
            input_ids.extend(toks[ctx : ctx + n])
            positions.extend(range(ctx, ctx + n))
            tables.append(self.kv_manager.block_ids(req.request_id))
            seq_lens.append(ctx + n)
            q_lens.append(n)
            if ctx + n == req.num_tokens:
                logits_rows.append(len(input_ids) - 1)
                sampling.append(req)
        meta = AttentionMetadata.build(
            tables, seq_lens, q_lens, self.kv_spec.block_size, self.device, decodes
        )
        dev = self.device
        t0 = time.perf_counter()
        logits = self.model.forward(
            torch.tensor(input_ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            meta,
            self.kv_caches,
            torch.tensor(logits_rows, dtype=torch.int64, device=dev),
        )
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dt = time.perf_counter() - t0
        self.num_steps += 1
        n_decode = sum(decodes)
        self.last_step = (len(out.chunks), len(input_ids) - n_decode, n_decode, dt)
        prefill_chunks = []
        bs = self.kv_spec.block_size
        for (req, n, ctx), is_decode, toks in zip(out.chunks, decodes, chunk_tokens, strict=True):
            if not is_decode:
                self.prompt_tokens_computed += n
                req.times.prefill_s += dt
                prefill_chunks.append((n, ctx))
            req.num_computed_tokens = ctx + n
            if (ctx + n) // bs > ctx // bs:  # a block became full: hash and index it
                self.kv_manager.register_computed(req.request_id, toks, ctx + n)
        if prefill_chunks and len(prefill_chunks) == len(out.chunks):
            self.cost_model.observe(prefill_chunks, dt)
        finished = []
        now = time.perf_counter()
        for row, req in enumerate(sampling):
            if req.keep_logits:
                req.logits.append(logits[row].clone())
            tok = sample(logits[row], req.params, req.generator)
            req.output_token_ids.append(tok)
            self.generation_tokens += 1
            if req.times.first_token is None:
                req.times.first_token = now
            reason = None
            if tok in req.eos_token_ids and not req.params.ignore_eos:
                reason = "stop"
            elif (
                len(req.output_token_ids) >= req.params.max_tokens
                or req.num_tokens >= req.max_model_len
            ):
                reason = "length"
            if reason:
                self.scheduler.finish(req, reason)
                finished.append(req)
        return finished

    # -- reporting ----------------------------------------------------------------------------
    def request_metrics(self, req: Request) -> RequestMetrics:
        t = req.times
        end = t.finished or time.perf_counter()
        first = t.first_token or end
        n_out = len(req.output_token_ids)
        decode_ms = (end - first) * 1000 if t.first_token else 0.0
        return RequestMetrics(
            queue_ms=((t.first_scheduled or end) - t.arrival) * 1000,
            ttft_ms=(first - t.arrival) * 1000,
            prefill_ms=t.prefill_s * 1000,
            decode_ms=decode_ms,
            tpot_ms=decode_ms / (n_out - 1) if n_out > 1 else 0.0,
            e2e_ms=(end - t.arrival) * 1000,
            ttft_saved_ms=self.cost_model.saved_ms(
                req.num_prompt_tokens, max(req.num_cached_tokens, 0)
            ),
        )

    def release(self, req: Request) -> None:
        """Forget a finished request (its blocks are already freed)."""
        self.requests.pop(req.request_id, None)

    @property
    def spec(self) -> KVCacheSpec:
        return self.kv_spec
