"""The CPU runner: a KV pool of anonymous memory mapped in the background, the compiled C
kernels (``inference/kernels/cpu``) where they build, and torch's operations where not.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import math
import mmap
import os
import sys
import threading

import torch

from inference import kv_quant
from inference.attention.backends import CPUBackend, TorchBackend, TritonBackend
from inference.config import EngineConfig
from inference.kernels.cpu import attention, build, elementwise
from inference.kernels.cpu.forward import CPUForward
from inference.kernels.cpu.linear_layer import LINEAR_MAX_SLAB, LINEAR_ROW_SLAB, CPULinear
from inference.model.ops import ModelOps, rotate_then_store, torch_add_rms_norm, torch_silu_mul
from inference.runner.base import ModelRunner

log = logging.getLogger("docqa.engine")

_MADV_POPULATE_WRITE = 23  # Linux 5.14 and later
_PREFAULT_CHUNK = 32 << 20


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def default_kv_cache_gib() -> float:
    """A quarter of the memory available now, at most 4 GiB."""
    return min(4.0, available_memory_bytes() / 4 / 2**30)


def zeroed_kv_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in anonymous pages, zero by definition and mapped by the OS at
    their first write, so the pool costs no time at start (``prefault_pool`` then maps them
    in the background)."""
    count = math.prod(shape)
    pages = mmap.mmap(-1, max(count * dtype.itemsize, 1))  # the tensor keeps the mapping alive
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)


def prefault_pool(tensors: list[torch.Tensor]) -> threading.Thread | None:
    """Map every page of a CPU pool on a thread of the lowest priority, a chunk at a time: a
    block first written during a step would otherwise take its page faults inside the step.
    ``MADV_POPULATE_WRITE`` maps a page as a write would and leaves its contents alone, so the
    engine may write blocks meanwhile; where the kernel lacks it (before Linux 5.14) pages are
    mapped at their first write. Returns the thread (it holds the tensors until it is done),
    or None off Linux. At exit a thread still mapping stops after its chunk and is joined
    (``_stop_prefaults``)."""
    if not tensors or not sys.platform.startswith("linux"):
        return None
    stop = threading.Event()

    def run() -> None:
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        libc = ctypes.CDLL(None, use_errno=True)  # a foreign call: the GIL is released
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        for t in tensors:
            addr, size = t.data_ptr(), t.nbytes
            for off in range(0, size, _PREFAULT_CHUNK):
                n = min(_PREFAULT_CHUNK, size - off)
                if stop.is_set() or libc.madvise(addr + off, n, _MADV_POPULATE_WRITE) != 0:
                    return

    for done in [t for t in _prefaults if not t.is_alive()]:
        del _prefaults[done]
    thread = threading.Thread(target=run, name="docqa-kv-prefault", daemon=True)
    _prefaults[thread] = stop
    thread.start()
    return thread


_prefaults: dict[threading.Thread, threading.Event] = {}  # mapping threads, and their stops


@atexit.register
def _stop_prefaults() -> None:
    """Stop the mapping threads and wait until each has ended, its tensors dropped, before
    the interpreter finalizes: a daemon thread that drops the last reference to a pool's
    tensors while it finalizes takes the GIL inside torch's destructor, and the thread's
    forced exit there aborts the process ("terminate called without an active exception",
    SIGABRT; one in 30-70 runs of ``bench/speculation.py --steps-only`` on a tiny model, a
    process of a few seconds)."""
    for thread, stop in list(_prefaults.items()):
        stop.set()
        thread.join()


def cpu_rotary_store(qkv, positions, rotary, num_heads, num_kv_heads, meta, k_cache, v_cache):
    """Rotary embedding and the K/V store in one pass per token (elementwise.c)."""
    n, d = qkv.shape[0], rotary.cos.shape[1]
    if n:
        elementwise.rotary_store(
            qkv,
            num_heads,
            num_kv_heads,
            positions,
            rotary.cos,
            rotary.sin,
            meta.slot_mapping,
            k_cache,
            v_cache,
        )
    return qkv[:, : num_heads * d].view(n, num_heads, d)


def cpu_ops(
    dtype: torch.dtype, kv_dtype: torch.dtype, backend_name: str, hidden_size: int
) -> ModelOps:
    """The CPU's ops table: products through ``CPULinear``; where the element-wise kernels take
    the activations, the fused steps (residual add with RMSNorm, SiLU times up, rotary with the
    K/V store where the cache is in the compute dtype and the backend stores plainly) and, where
    every part has a kernel, the layers in one compiled call; torch's operations elsewhere."""
    backend = {"cpu": CPUBackend, "torch": TorchBackend, "triton": TritonBackend}[backend_name]()
    bf16 = dtype == torch.bfloat16
    row_slab = LINEAR_ROW_SLAB if bf16 else None

    def linear(weight, bias, lm_head: bool) -> CPULinear:
        return CPULinear(weight, bias, row_slab, None if lm_head or not bf16 else LINEAR_MAX_SLAB)

    fused = elementwise.fused_elementwise_supports(dtype, hidden_size)
    rotary = rotate_then_store(backend)
    # the fused store writes caches of the compute dtype, and 8-bit ones
    stores = kv_dtype == dtype or kv_quant.is_kv8(kv_dtype)
    if fused and stores and backend.plain_store:
        rotary = cpu_rotary_store
    attn = backend_name
    if backend_name == "cpu" and attention.decode_attention_library().amx:
        attn += "-amx"
    return ModelOps(
        device=torch.device("cpu"),
        linear=linear,
        add_rms_norm=elementwise.add_rms_norm if fused else torch_add_rms_norm,
        rotary_store=rotary,
        attention=backend,
        silu_mul=elementwise.silu_mul if fused else torch_silu_mul,
        layer_loop=(lambda model, kv: CPUForward.build(model, kv, backend)) if fused else None,
        name=f"cpu|attention={attn}|elementwise={'fused' if fused else 'torch'}",
    )


class CPURunner(ModelRunner):
    def __init__(self, config: EngineConfig):
        build.prebuild()  # compiled beside the model's loading where not yet built
        super().__init__(config, torch.device("cpu"))
        caches = [t for pair in self.kv_caches for t in pair]
        # each cache's address, for copy_slots; their pages mapped in the background
        self._cache_ptrs = [t.data_ptr() for t in caches]
        self.prefault = prefault_pool(caches)
        loop = self.model.layer_loop(self.kv_caches)  # built now, not in the first prefill
        log.info("decoder layers: %s", "one compiled call a step" if loop else "Python")
        if kv_quant.is_kv8(self.kv_dtype) and loop is None:
            log.warning(
                "the %s KV cache is read by the torch reference here (the compiled kernels read "
                "8-bit caches on CPUs with AVX512-BF16, or AVX2 with F16C): slower than a "
                "16-bit cache",
                self.kv_dtype,
            )

    def resolve_backend(self, name: str) -> str:
        """``auto``: the compiled kernels (``cpu``) where they build, else the torch reference;
        ``triton`` runs under Triton's interpreter only (``TRITON_INTERPRET=1``, tests)."""
        if name == "auto":
            return "cpu" if attention.kernels_available() else "torch"
        if name == "cpu" and not attention.kernels_available():
            raise ValueError(
                "the cpu attention backend needs its kernel built with a C compiler "
                "(set CC or install gcc), or DOCQA_CPU_KERNELS=0 was set"
            )
        if name == "triton":
            if os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError("the triton backend needs a CUDA device (or TRITON_INTERPRET=1)")
            from inference.kernels.triton.common import check_block_size

            check_block_size(self.config.block_size)
        return name

    def make_ops(self) -> ModelOps:
        cfg = self.model_config
        return cpu_ops(self.dtype, self.kv_dtype, self.attention_backend, cfg.hidden_size)

    def kv_budget_bytes(self) -> int:
        gib = self.config.kv_cache_gib or default_kv_cache_gib()
        return int(gib * 2**30)

    def allocate_cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        return zeroed_kv_tensor(shape, self.kv_dtype)

    def copy_slots(self, src: int, dst: int, n: int) -> None:
        """``ModelRunner.copy_slots`` as bytes, one copy per cache (csrc/README.md, "Slot
        copies", has what this saves over torch's indexing)."""
        kc = self.kv_caches[0][0]
        blocks, size = kc.shape[:2]
        if not (0 <= src < blocks and 0 <= dst < blocks and 0 <= n <= size):
            raise IndexError(f"slots {n} of block {src} into {dst}: {blocks} blocks of {size}")
        slot = kc.stride(1) * kc.element_size()
        block = kc.stride(0) * kc.element_size()
        for base in self._cache_ptrs:
            ctypes.memmove(base + dst * block, base + src * block, n * slot)

    argmax = staticmethod(elementwise.argmax_rows)

    def rows_invariant(self) -> bool:
        """The compiled kernels' rows are invariant by construction (attention: a token's
        result is the same as a prompt or decode token, alone or in any batch; products:
        ``CPULinear``); the torch reference's attention makes no such promise."""
        return self.attention_backend == "cpu"

    def profile_context(self) -> int:
        """The CPU kernels' working memory does not grow with the context: one block."""
        return self.config.block_size
