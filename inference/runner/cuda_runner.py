"""The CUDA runner: the KV pool in device memory sized from what the device has free, torch's
products and norms, and the Triton attention kernels (``inference/kernels/triton``).

This is where a GPU's step work lives: the persistent input buffers are pinned on the host and
mirrored on the device (``runner/inputs.py``), and the step waits for the device once, after
the forward pass.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from inference import kv_quant
from inference.attention.backends import TorchBackend, TritonBackend
from inference.engine.scheduler import SchedulerOutput
from inference.model.ops import ModelOps, torch_ops
from inference.runner.base import ModelRunner
from inference.runner.graphs import capture_sizes, padded_size

log = logging.getLogger("docqa.engine")

# device memory kept out of the KV pool for activations and the allocator's slack
_ACTIVATION_RESERVE = 2**30


def fused_rotary_store(qkv, positions, rotary, num_heads, num_kv_heads, meta, k_cache, v_cache):
    """Rotary embedding and the K/V store in one Triton kernel (``kernels/triton/fused.py``)."""
    from inference.kernels.triton import fused

    return fused.rotary_store(
        qkv,
        positions,
        rotary.cos,
        rotary.sin,
        num_heads,
        num_kv_heads,
        meta.slot_mapping,
        k_cache,
        v_cache,
    )


def cuda_ops(device: torch.device, backend_name: str, batch_invariant: bool = False) -> ModelOps:
    """The vendor library's products around the Triton kernels: attention, and the fused
    element-wise steps (RMSNorm with the residual add, rotary embedding with the K/V store,
    SiLU-mul; one row per program). ``torch``: torch's operations around the torch reference
    (checks). ``batch_invariant``: the products through ``kernels/triton/invariant.py`` too, so
    a row's result never depends on the batch."""
    if backend_name != "triton":
        return torch_ops(device, TorchBackend(flash=False), name=f"cuda|attention={backend_name}")
    from inference.kernels.triton import fused, invariant

    ops = dataclasses.replace(
        torch_ops(device, TritonBackend()),
        add_rms_norm=invariant.add_rms_norm,
        rotary_store=fused_rotary_store,
        silu_mul=fused.silu_mul,
        name="cuda|attention=triton|fused",
    )
    if not batch_invariant:
        return ops
    return dataclasses.replace(
        ops,
        linear=lambda weight, bias, lm_head: invariant.InvariantLinear(weight, bias),
        name="cuda|attention=triton|fused|invariant",
        mode="batch-invariant",
    )


class CUDARunner(ModelRunner):
    def __init__(self, config, device: torch.device):
        super().__init__(config, device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_sizes: list[int] = []
        self.use_graphs = False  # replay captured decode steps (bench/gpu.py turns it off)
        if config.cuda_graphs:
            self.capture_graphs()

    def capture_graphs(self) -> None:
        """A graph per padded decode batch size (``graphs.capture_sizes``), largest first, in
        one memory pool: each step's inputs are views of the persistent buffers, so a replay
        reads what ``InputBuffers.prepare`` copied there. Each size runs once eagerly first
        (the kernels compile outside the capture)."""
        if self.attention_backend != "triton":
            raise ValueError("CUDA graphs need the triton attention backend")
        sizes = capture_sizes(self.config.max_num_seqs)
        pool = torch.cuda.graph_pool_handle()
        free0 = torch.cuda.mem_get_info(self.device)[0]
        t0 = time.perf_counter()
        empty = SchedulerOutput([], [])
        for b in reversed(sizes):
            x = self.inputs.prepare(empty, pad_to=b)  # every row padding: nothing stored
            args = (x.input_ids, x.positions, x.meta, self.kv_caches, x.logits_indices)
            self.model.forward(*args)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model.forward(*args)
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize(self.device)
        self.graph_sizes = sizes
        self.use_graphs = True
        used = free0 - torch.cuda.mem_get_info(self.device)[0]
        log.info(
            "CUDA graphs for decode steps of %s sequences: captured in %.1f s, %.0f MiB",
            ",".join(map(str, sizes)),
            time.perf_counter() - t0,
            used / 2**20,
        )

    def run_model(self, sched: SchedulerOutput) -> torch.Tensor:
        """A decode step that a captured size holds replays its graph (rows past the step's
        padding); other steps run eagerly."""
        n = len(sched.chunks)
        b = padded_size(n, self.graph_sizes) if self.use_graphs else None
        if b is None or not all(c.is_decode for c in sched.chunks):
            return super().run_model(sched)
        self.inputs.prepare(sched, pad_to=b)
        graph, out = self.graphs[b]
        graph.replay()
        return out[:n]

    def resolve_backend(self, name: str) -> str:
        if name == "auto":
            return "triton"
        if name == "cpu":
            raise ValueError("the cpu attention backend runs on the CPU")
        return name

    def make_ops(self) -> ModelOps:
        return cuda_ops(self.device, self.attention_backend, self.config.batch_invariant)

    def kv_budget_bytes(self) -> int:
        """The share ``gpu_memory_utilization`` of the device's memory, less what is in use
        (the weights, loaded by now) and a reserve for activations."""
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        return int(total * self.config.gpu_memory_utilization - used - _ACTIVATION_RESERVE)

    def allocate_cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)

    def copy_slots(self, src: int, dst: int, n: int) -> None:
        for pair in self.kv_caches:
            for c in map(kv_quant.raw, pair):  # bytes: fp8 tensors take few of torch's ops
                c[dst, :n] = c[src, :n]

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
