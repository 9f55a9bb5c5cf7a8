"""The CUDA runner: the KV pool in device memory sized from what the device has free after the
weights and the measured activations, the Triton kernels (``inference/kernels/triton``) for
attention and the element-wise steps, torch's products (or the batch-invariant Triton ones),
and decode steps replayed from CUDA graphs (``runner/graphs.py``).

The persistent input buffers are pinned on the host and mirrored on the device
(``runner/inputs.py``), and the step waits for the device once, after the forward pass.

On a CPU device (``TRITON_INTERPRET=1``, the tests) the same ops table runs under Triton's
interpreter: the pool is ``kv_cache_gib`` of host memory and there are no graphs.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from inference import kv_quant
from inference.attention.backends import TorchBackend, TritonBackend
from inference.engine.scheduler import SchedulerOutput
from inference.kernels.triton.common import check_block_size
from inference.model.ops import ModelOps, torch_ops
from inference.runner.base import ModelRunner
from inference.runner.graphs import DecodeGraphs

log = logging.getLogger("docqa.engine")

_INTERPRETED_KV_GIB = 0.05  # the pool under the interpreter where kv_cache_gib is not given


def triton_rotary_store(qkv, positions, rotary, num_heads, num_kv_heads, meta, k_cache, v_cache):
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
        rotary_store=triton_rotary_store,
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
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("the CUDA runner runs on a CPU only under TRITON_INTERPRET=1")
        if config.cuda_graphs and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        super().__init__(config, device)
        self.graphs = DecodeGraphs(self.inputs, device)
        # how decode steps run: "graphs" (replayed where a captured size holds them),
        # "eager-padded" (the graphs' padded inputs, run eagerly: bench/gpu.py compares the
        # two), "eager"
        self.decode_mode = "eager"
        if config.cuda_graphs:
            self.graphs.capture(self.model, self.kv_caches, config.max_num_seqs)
            self.decode_mode = "graphs"

    def rows_invariant(self) -> bool:
        """In the batch-invariant mode (kernels/triton/invariant.py) only."""
        return self.config.batch_invariant

    def run_model(self, sched: SchedulerOutput) -> torch.Tensor:
        """A decode step that a captured size holds replays its graph (rows past the step's
        padding); other steps run eagerly."""
        size = self.graphs.padded(sched) if self.decode_mode != "eager" else None
        if size is None:
            return super().run_model(sched)
        if self.decode_mode == "graphs":
            return self.graphs.replay(sched, size)
        x = self.inputs.prepare(sched, pad_to=size)
        logits = self.model.forward(
            x.input_ids, x.positions, x.meta, self.kv_caches, x.logits_indices
        )
        return logits[: len(sched.chunks)]

    def profile_context(self) -> int:
        """The longest context on a GPU with the Triton kernels (the decode partitions'
        working memory grows with it); one block under the interpreter, where that would take
        minutes, and for the torch reference (checks)."""
        if self.device.type == "cuda" and self.attention_backend == "triton":
            return self.max_model_len
        return self.config.block_size

    def resolve_backend(self, name: str) -> str:
        if name == "cpu":
            raise ValueError("the cpu attention backend runs on the CPU")
        name = "triton" if name == "auto" else name
        if name == "triton":
            check_block_size(self.config.block_size)
        return name

    def make_ops(self) -> ModelOps:
        return cuda_ops(self.device, self.attention_backend, self.config.batch_invariant)

    def kv_budget_bytes(self) -> int:
        """The share ``gpu_memory_utilization`` of the device's memory, less what is in use
        (the weights, loaded by now) and the measured activation reserve: the larger warm-up
        step's peak, or both where decode steps are captured (the graphs' pool holds a decode
        step's activations apart from the eager steps'). Under the interpreter:
        ``kv_cache_gib``."""
        if self.device.type != "cuda":
            return int((self.config.kv_cache_gib or _INTERPRETED_KV_GIB) * 2**30)
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        r = self.reserve
        if r.measured_bytes is None:
            reserve = r.planned_bytes
        elif self.config.cuda_graphs:
            reserve = r.prefill_bytes + r.decode_bytes
        else:
            reserve = r.measured_bytes
        return int(total * self.config.gpu_memory_utilization - used - reserve)

    def allocate_cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)

    def copy_slots(self, src: int, dst: int, n: int) -> None:
        for pair in self.kv_caches:
            for c in map(kv_quant.raw, pair):  # bytes: fp8 tensors take few of torch's ops
                c[dst, :n] = c[src, :n]

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
