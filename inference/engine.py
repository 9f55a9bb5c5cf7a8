"""The engine: model + paged KV pool + prefix cache + scheduler, advanced one step at a time.

``LLMEngine.step()`` runs one batch (decodes and prompt chunks together), registers newly full
blocks in the prefix cache once their KV is written, samples where a sequence reached its end,
and returns the requests that finished. It is synchronous and single-threaded; front ends call
it from one thread.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
import json
import logging
import math
import mmap
import os
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from inference import cpu_kernels
from inference.attention import AttentionMetadata, make_backend, resolve_backend
from inference.config import ModelConfig, dtype_name, parse_dtype
from inference.errors import DocqaError, ModelError, PromptTooLongError
from inference.kv_sizing import KVCacheSpec, size_kv_cache
from inference.metrics import PrefillCostModel, RequestMetrics
from inference.model import LlamaModel, model_fingerprint
from inference.sampling import SamplingParams, sample
from inference.scheduler import Scheduler, SchedulerConfig, is_decode
from inference.sequence import Request
from inference.tokenizer import TextTokenizer
from prefix_store import KVCacheManager, RedisTier, TierBlock, TierConfig

log = logging.getLogger("docqa.engine")

# end-of-turn markers of the chat templates docqa lays out (prompts/templates.py)
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<|endoftext|>")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16: bf16 matrix products run natively (else oneDNN emulates them,
    several times slower than float32)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_kernels.cpu_flags())


# the version of the measurement below: a record written by another version is measured anew
_DTYPE_PROBE_VERSION = 2


def _dtype_record_path() -> Path:
    """Where this machine's answer to ``cpu_bf16_matmul_is_faster`` is kept
    (``cpu_kernels.machine_file``), keyed by the sources of the products it weighs, which of
    them are built here (DOCQA_CPU_KERNELS=0 weighs torch's) and the measurement's version."""
    built = (
        cpu_kernels.linear_f32_panel(),
        cpu_kernels.linear_bf16_panel(),
        cpu_kernels.linear_bf16_amx_available(),
    )
    return cpu_kernels.machine_file(
        "auto-dtype",
        str(_DTYPE_PROBE_VERSION),
        repr(built),
        cpu_kernels.LINEAR_SOURCE.read_bytes().decode(errors="replace"),
        cpu_kernels.AMX_SOURCE.read_bytes().decode(errors="replace"),
    )


def _measure_bf16_against_float32() -> float:
    """bf16 time over float32 time for the products the model would run (inference/layers.py,
    Linear): linear.c in float32 against linear_amx.c where the tile unit is ours, else
    linear.c's bf16 panels; torch's where those do not build. The two run in turn, seven times
    each after a warm-up, on one thread timed in its CPU time (other busy processes cannot
    change it); the median of the seven ratios."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(256, 576, generator=gen)
    w = torch.randn(1536, 576, generator=gen)
    panels = cpu_kernels.linear_f32_panel()
    amx = panels and cpu_kernels.linear_bf16_amx_available()
    if panels and (amx or cpu_kernels.linear_bf16_panel()):
        f32 = functools.partial(cpu_kernels.linear_f32, a, cpu_kernels.pack_linear_f32(w), 1536)
        if amx:
            p16 = cpu_kernels.pack_linear_bf16_amx(w.bfloat16())
            f16 = functools.partial(cpu_kernels.linear_bf16_amx, a.bfloat16(), p16, 1536)
        else:
            p16 = cpu_kernels.pack_linear_bf16(w.bfloat16())
            f16 = functools.partial(cpu_kernels.linear_bf16, a.bfloat16(), p16, 1536)
    else:
        f32 = functools.partial(torch.mm, a, w.T)
        f16 = functools.partial(torch.mm, a.bfloat16(), w.bfloat16().T)

    def timed(product) -> float:
        t = time.thread_time()
        product()
        return max(time.thread_time() - t, 1e-9)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            timed(f32), timed(f16)
            ratios = sorted(timed(f16) / timed(f32) for _ in range(7))
    finally:
        torch.set_num_threads(threads)
    return ratios[len(ratios) // 2]


@functools.cache
def cpu_bf16_matmul_is_faster() -> bool:
    """Whether bf16 matrix products beat float32 ones on this CPU: native bf16 support alone
    does not decide it. With oneDNN's products, measured: a Zen 5 core runs bf16 about 4x
    faster than float32; an AVX512-BF16 Xeon without AMX about 1.8x slower; a CPU that emulates
    bf16 about 3x slower. Where linear.c builds in both dtypes (AVX512-BF16), the kernels the
    model runs are compared instead (``_measure_bf16_against_float32``): linear.c's float32
    panels against linear_amx.c on a CPU with AMX (a Xeon core: bf16 7-8x faster), else against
    linear.c's bf16 panels (a Zen 4 core: bf16 2.5x faster; a Xeon whose AMX its virtual
    machine hides: bf16 1.2-1.3x slower, and 0.8-1.3x from one measurement to the next before
    linear.c's float32 tiles were widened).

    Measured once per machine: the first process writes the answer beside the kernels
    (``_dtype_record_path``) and every later one reads it, so replicas sharing ``DOCQA_HOME``
    (compose's volume, one test run) run one dtype, and with it one prefix-cache fingerprint,
    even where the two dtypes are that close. Where two start together, the first record
    written wins for both. Delete the record to measure again."""
    if not cpu_has_native_bf16():
        return False
    path = _dtype_record_path()
    try:
        record, how = json.loads(path.read_text()), "as measured before"
        if not isinstance(record["bf16_faster"], bool):
            raise ValueError(record)
    except (OSError, ValueError, KeyError, TypeError):
        ratio = _measure_bf16_against_float32()
        mine = {"bf16_faster": ratio < 1.0, "bf16_over_float32_time": round(ratio, 3)}
        record = _keep_first(path, mine)
        how = "measured now" if record == mine else f"as another process measured ({mine} here)"
    log.info(
        "dtype: auto is %s, %s (bf16 products %sx the float32 time; %s)",
        "bfloat16" if record["bf16_faster"] else "float32",
        how,
        record.get("bf16_over_float32_time", "?"),
        path,
    )
    return bool(record["bf16_faster"])


def _keep_first(path: Path, record: dict) -> dict:
    """Writes ``record`` to ``path`` unless another process wrote there first (a temporary
    file, then a hard link, which fails where the name exists); returns the record kept there,
    or ``record`` itself where none can be kept."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
            except OSError:  # a file system without hard links
                os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.warning("could not keep %s in %s (%s)", record, path, e)
        return record


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on CUDA and on CPUs whose bf16 products are faster than float32
    ones (``cpu_bf16_matmul_is_faster``); float32 on other CPUs. Answers are unchanged either
    way in the sense of bench/ttft.py and tests/test_real_model.py."""
    if dtype == "auto":
        if device.type == "cpu" and not cpu_bf16_matmul_is_faster():
            return torch.float32
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


def zeroed_kv_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
    """A KV cache tensor of zeros. On the CPU its memory is anonymous pages, zero by definition
    and mapped by the OS at their first write, so the pool costs no time at start: writing a
    4 GiB pool's zeros took 5.3 s of an 8 s start on a 2-core Zen 4. ``prefault_pool`` then
    maps them in the background."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    size = count * dtype.itemsize
    pages = mmap.mmap(-1, max(size, 1))  # the tensor keeps the mapping alive
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)


_MADV_POPULATE_WRITE = 23  # Linux 5.14 and later
_PREFAULT_CHUNK = 32 << 20


def prefault_pool(tensors: list[torch.Tensor]) -> threading.Thread | None:
    """Map every page of a CPU pool on a thread of the lowest priority, a chunk at a time: a
    block first written during a step would otherwise take its page faults inside the step (a
    cold 580-token prefill's median 3-4% slower, its 90th percentile 13-23%, until the pool
    has been written once). ``MADV_POPULATE_WRITE`` maps a page as a write would and leaves
    its contents alone, so the engine may write blocks meanwhile; where the kernel lacks it
    (before Linux 5.14) pages are mapped at their first write. Returns the thread (it holds
    the tensors until it is done), or None off Linux."""
    if not tensors or not sys.platform.startswith("linux"):
        return None

    def run() -> None:
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        libc = ctypes.CDLL(None, use_errno=True)  # a foreign call: the GIL is released
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        for t in tensors:
            addr, size = t.data_ptr(), t.nbytes
            for off in range(0, size, _PREFAULT_CHUNK):
                n = min(_PREFAULT_CHUNK, size - off)
                if libc.madvise(addr + off, n, _MADV_POPULATE_WRITE) != 0:
                    return

    thread = threading.Thread(target=run, name="docqa-kv-prefault", daemon=True)
    thread.start()
    return thread


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
    prefill_tokens_with_decodes: int = 0  # SchedulerConfig.prefill_tokens_with_decodes
    pin_budget: float = 0.25  # share of the KV pool that pinned prefixes may hold
    attention_backend: str | None = None  # auto | torch | triton (env DOCQA_ATTENTION_BACKEND)
    random_weights_seed: int | None = None  # benchmarks: random weights, no weight files
    num_threads: int | None = None  # torch CPU threads; None keeps torch's default
    kv_tier: TierConfig | None = None  # second tier of the prefix cache (Redis); None: off

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
        if self.device.type == "cpu":
            cpu_kernels.prebuild()  # compiled beside the model's loading where not yet built
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
        held = ", ".join(
            f"{kind} {size / 2**20:.1f} MiB" for kind, size in self.model.linear_storage().items()
        )
        log.info(
            "loaded %s (%s, %s) in %.1f s; linear weights: %s",
            model_dir.name,
            dtype_name(self.dtype),
            self.device,
            time.perf_counter() - t0,
            held,
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
                zeroed_kv_tensor(shape, self.kv_dtype, self.device),
                zeroed_kv_tensor(shape, self.kv_dtype, self.device),
            )
            for _ in range(cfg.num_layers)
        ]
        caches = [t for pair in self.kv_caches for t in pair]
        on_cpu = self.device.type == "cpu"
        # a CPU pool's caches by address, for _copy_slots; their pages mapped in the background
        self._cache_ptrs = [t.data_ptr() for t in caches] if on_cpu else None
        self._prefault = prefault_pool(caches) if on_cpu else None
        for line in self.kv_spec.log_lines():
            log.info(line)
        if self.device.type == "cpu":  # built now, not in the first request's prefill
            compiled = self.model.compiled_layer_loop(self.kv_caches) is not None
            log.info("decoder layers: %s", "one compiled call a step" if compiled else "Python")
        self.fingerprint = model_fingerprint(
            model_dir, self.dtype, self.kv_dtype, config.block_size, config.random_weights_seed
        )
        self.kv_manager = KVCacheManager(
            self.kv_spec.num_blocks, config.block_size, self.fingerprint, self._copy_slots
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_batched_tokens,
                config.max_num_seqs,
                prefill_tokens_with_decodes=config.prefill_tokens_with_decodes,
            ),
            self.kv_manager,
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
        # the last step, for metrics: (sequences, prefill tokens, decode tokens, seconds in the
        # model); None after a step that ran no batch
        self.last_step: tuple[int, int, int, float] | None = None
        self.pinned: dict[str, int] = {}  # pin key -> blocks held
        self.tier: RedisTier | None = None
        if config.kv_tier is not None:
            self.tier = RedisTier(
                config.kv_tier,
                self.fingerprint,
                config.block_size,
                self.kv_spec.bytes_per_token * config.block_size,
            )
        self._tier_pending: list[Request] = []  # requests whose tier lookup is in flight

    def close(self) -> None:
        """Stop the second tier's threads (queued writes are flushed first)."""
        if self.tier is not None:
            self.tier.close()

    def _kv_budget_bytes(self) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            return int(total * self.config.gpu_memory_utilization - used - 2**30)
        gib = self.config.kv_cache_gib or default_cpu_kv_gib()
        return int(gib * 2**30)

    def _copy_slots(self, src: int, dst: int, n: int) -> None:
        """The KV of block ``src``'s first ``n`` slots into block ``dst``, every layer (a
        prompt's start that a cached block holds: the same bits computing it would give).
        On the CPU the slots are moved as bytes, one copy per cache: 0.06 ms for the default
        model's 60 caches on a Zen 3, where two indexing operations per cache through torch
        took 0.46, in every request that starts with a partly cached block."""
        if self._cache_ptrs is not None:
            kc = self.kv_caches[0][0]
            blocks, size = kc.shape[:2]
            if not (0 <= src < blocks and 0 <= dst < blocks and 0 <= n <= size):
                raise IndexError(f"slots {n} of block {src} into {dst}: {blocks} blocks of {size}")
            slot = kc.stride(1) * kc.element_size()
            block = kc.stride(0) * kc.element_size()
            for base in self._cache_ptrs:
                ctypes.memmove(base + dst * block, base + src * block, n * slot)
            return
        for kc, vc in self.kv_caches:
            kc[dst, :n] = kc[src, :n]
            vc[dst, :n] = vc[src, :n]

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
        arrival: float | None = None,
    ) -> Request:
        """Queue a request. ``use_cache=False`` is cache "bypass": nothing is read from the
        prefix cache and nothing of this request is registered in it. ``arrival`` (a
        ``time.perf_counter`` time) is when the request reached the front end, if earlier than
        now: its queue time and TTFT count from there."""
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
        if arrival is not None:
            req.times.arrival = min(arrival, req.times.arrival)
        self.scheduler.add(req, reserved_blocks=self.num_pinned_blocks)
        self.requests[rid] = req
        if self.tier is not None and use_cache and self.tier.up:
            self._start_tier_lookup(req)
        return req

    # -- second tier ------------------------------------------------------------------------------
    def _start_tier_lookup(self, req: Request) -> None:
        """Ask the second tier for the prompt's blocks past the local pool's longest prefix; the
        request is admitted once the answer is in (``_install_tier_blocks``)."""
        kv = self.kv_manager
        hashes = self.scheduler.prompt_hashes(req)
        max_blocks = (req.num_prompt_tokens - 1) // kv.block_size
        k = len(kv.find_cached_prefix(req.prompt_token_ids, req.namespace, hashes).blocks)
        if k >= max_blocks:
            return
        parent = hashes[k - 1] if k else kv.hasher(req.namespace).root
        req.tier_start_block = k
        req.tier_deadline = time.perf_counter() + self.tier.config.lookup_wait_s
        req.tier_fetch = self.tier.fetch(hashes[k:max_blocks], parent)
        self._tier_pending.append(req)

    def _install_tier_blocks(self) -> None:
        """Copy the blocks that finished second-tier lookups found into free device blocks and
        index them, so that admission finds them as a cached prefix."""
        now = time.perf_counter()
        still: list[Request] = []
        for req in self._tier_pending:
            if req.finished:  # aborted while its lookup ran
                req.tier_fetch = None
            elif not req.tier_fetch.done():
                if now > req.tier_deadline:  # a slow Redis: compute instead of waiting
                    req.tier_fetch = None
                    self.tier.lookups_abandoned += 1
                else:
                    still.append(req)
            else:
                fut, req.tier_fetch = req.tier_fetch, None
                found: list[TierBlock] = fut.result()
                if found:
                    self._install(req, found)
        self._tier_pending = still

    def _install(self, req: Request, found: list[TierBlock]) -> None:
        kv = self.kv_manager
        bs = kv.block_size
        hashes = self.scheduler.prompt_hashes(req)
        local = kv.find_cached_prefix(req.prompt_token_ids, req.namespace, hashes)
        k = len(local.blocks)
        if k < req.tier_start_block:  # part of the local prefix was evicted meanwhile
            return
        todo: list[TierBlock] = []
        for i, blk in enumerate(found):
            j = req.tier_start_block + i
            if j < k:  # computed locally meanwhile
                continue
            ids = tuple(req.prompt_token_ids[j * bs : (j + 1) * bs])
            if blk.block_hash != hashes[j] or blk.token_ids != ids:
                break
            todo.append(blk)
        reclaimed = sum(1 for b in local.blocks if b.ref_cnt == 0)
        todo = todo[: max(0, kv.pool.num_free - reclaimed)]
        if not todo:
            return
        # a temporary hold on the local prefix keeps the allocation from evicting it
        hold = f"tier:{req.request_id}"
        end = (k + len(todo)) * bs
        blocks = kv.allocate(hold, end, local, req.namespace)[k:]
        data = self._block_buffer(len(todo), torch.device("cpu"))
        raw = data.view(len(todo), -1).view(torch.uint8).numpy()
        for row, blk in zip(raw, todo, strict=True):
            row[:] = np.frombuffer(blk.payload, dtype=np.uint8)
        data = data.to(self.device)
        ids_t = torch.tensor([b.block_id for b in blocks], dtype=torch.int64, device=self.device)
        for layer, (kc, vc) in enumerate(self.kv_caches):
            kc.index_copy_(0, ids_t, data[:, layer, 0])
            vc.index_copy_(0, ids_t, data[:, layer, 1])
        # indexed like computed blocks (their hashes were checked against the prompt's above)
        indexed: list = []
        kv.register_computed(hold, req.prompt_token_ids, end, indexed)
        req.tier_loaded.update(h for _, h, _, _ in indexed)
        kv.free(hold)

    def _block_buffer(self, n: int, device: torch.device) -> torch.Tensor:
        """Room for ``n`` blocks' K/V of every layer, in the tier's payload layout
        [block, layer, k|v, token, kv head, dim]."""
        cfg = self.model_config
        shape = (n, cfg.num_layers, 2, self.kv_spec.block_size, cfg.num_kv_heads, cfg.head_dim)
        return torch.empty(shape, dtype=self.kv_dtype, device=device)

    def _write_through(self, newly: list) -> None:
        """Hand newly registered blocks to the second tier: their K/V is copied here, on the
        engine thread, before the blocks can be reused; the writes happen on the tier's own
        thread."""
        ids_t = torch.tensor([b.block_id for b, *_ in newly], dtype=torch.int64, device=self.device)
        data = self._block_buffer(len(newly), self.device)
        for layer, (kc, vc) in enumerate(self.kv_caches):
            data[:, layer, 0] = kc[ids_t]
            data[:, layer, 1] = vc[ids_t]
        raw = data.cpu().view(len(newly), -1).view(torch.uint8).numpy()
        self.tier.write(
            [
                TierBlock(h, parent, ids, row)
                for row, (_, h, parent, ids) in zip(raw, newly, strict=True)
            ]
        )

    def write_prefix_to_tier(self, token_ids: list[int], namespace: bytes = b"") -> int:
        """Write the locally cached full blocks of ``token_ids`` to the second tier (again);
        returns the blocks queued. The caller waits on ``tier.flush()``."""
        if self.tier is None:
            return 0
        kv = self.kv_manager
        cached = kv.find_cached_prefix(list(token_ids) + [0], namespace)
        if not cached.blocks:
            return 0
        self._write_through([(b, b.block_hash, b.parent_hash, b.token_ids) for b in cached.blocks])
        return len(cached.blocks)

    def wait_for_tier(self, timeout: float) -> None:
        """Nothing could be scheduled: wait (briefly) for a second-tier lookup to finish
        instead of spinning."""
        pending = [r.tier_fetch for r in self._tier_pending if r.tier_fetch is not None]
        if pending:
            concurrent.futures.wait(
                pending, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED
            )

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
        self.last_step = None
        if self.tier is not None:
            self._install_tier_blocks()
        out = self.scheduler.schedule()
        if not out.chunks:
            if self.tier is not None:
                self.wait_for_tier(0.05)
            return []
        input_ids: list[int] = []
        positions: list[int] = []
        tables, seq_lens, q_lens, logits_rows, decodes = [], [], [], [], []
        sampling: list[Request] = []
        for req, n, ctx in out.chunks:
            decodes.append(is_decode(req, n, ctx))
            input_ids.extend(req.token_ids(ctx, ctx + n))
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
        newly: list | None = [] if self.tier is not None and self.tier.up else None
        for (req, n, ctx), decode in zip(out.chunks, decodes, strict=True):
            if not decode:
                self.prompt_tokens_computed += n
                req.times.prefill_s += dt
                prefill_chunks.append((n, ctx))
            req.num_computed_tokens = ctx + n
            if (ctx + n) // bs > ctx // bs:  # a block became full: hash and index it
                self.kv_manager.register_computed(req.request_id, req.all_token_ids, ctx + n, newly)
        if newly:
            self._write_through(newly)
        if prefill_chunks and len(prefill_chunks) == len(out.chunks):
            self.cost_model.observe(prefill_chunks, dt)
        finished = []
        now = time.perf_counter()
        greedy = None  # every greedy row's token in one argmax
        if any(req.params.greedy for req in sampling):
            greedy = cpu_kernels.argmax_rows(logits)
        for row, req in enumerate(sampling):
            if req.keep_logits:
                req.logits.append(logits[row].clone())
            if req.params.greedy:
                tok = greedy[row]
            else:
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
