"""Decode steps replayed from CUDA graphs: which batch sizes are captured, and the capture.

A CUDA graph replays kernels whose shapes were fixed at capture, so decode steps are captured
at a few batch sizes and a step of ``n`` sequences replays the smallest that holds it, its
rows past ``n`` padding (``InputBuffers.prepare(pad_to=...)``: slot -1, context 0, never
sampled). The sizes: 1, 2, 4 and 8, then steps of 8 up to 64 and of 16 beyond, up to
``max_num_seqs``.

Memory: the graphs share one memory pool, captured largest first so the smaller ones reuse
its blocks, and write their logits into one output buffer ``[max_num_seqs, vocab]`` float32
(a graph's own output would otherwise stay allocated per size). What they hold is about the
activations of the largest decode step, which the runner measures before it sizes the KV pool
(``ModelRunner.profile_reserve``), so the graphs never take memory from the pool.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from inference.engine.scheduler import SchedulerOutput

log = logging.getLogger("docqa.engine")


def capture_sizes(max_num_seqs: int) -> list[int]:
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    s = 8
    while s < max_num_seqs:
        s += 8 if s < 64 else 16
        sizes.append(min(s, max_num_seqs))
    return sorted({*sizes, max_num_seqs})


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``n`` sequences, or None (run eagerly)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) and n >= 1 else None


class DecodeGraphs:
    """One captured decode step per padded batch size (module docstring), over a runner's
    input buffers (held here; never the runner itself, so nothing keeps it alive)."""

    def __init__(self, inputs, device: torch.device):
        self.inputs = inputs  # the runner's InputBuffers
        self.device = device
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.sizes: list[int] = []
        self.output: torch.Tensor | None = None  # [max size, vocab] float32, shared
        self.bytes = 0  # device memory the capture took

    def capture(self, model, kv_caches, max_num_seqs: int) -> None:
        """Capture every size, largest first, in one pool. Each step's inputs are views of the
        persistent buffers, so a replay reads what ``InputBuffers.prepare`` copied there; each
        size runs once eagerly first (the kernels compile outside the capture)."""
        device = self.device
        sizes = capture_sizes(max_num_seqs)
        free0 = torch.cuda.mem_get_info(device)[0]
        t0 = time.perf_counter()
        self.output = torch.empty(
            sizes[-1], model.cfg.vocab_size, dtype=torch.float32, device=device
        )
        pool = torch.cuda.graph_pool_handle()
        empty = SchedulerOutput([], [])
        for b in reversed(sizes):
            x = self.inputs.prepare(empty, pad_to=b)  # every row padding: nothing stored
            args = (x.input_ids, x.positions, x.meta, kv_caches, x.logits_indices)
            model.forward(*args)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.output[:b].copy_(model.forward(*args))
            self.graphs[b] = graph
        torch.cuda.synchronize(device)
        self.sizes = sizes
        self.bytes = free0 - torch.cuda.mem_get_info(device)[0]
        log.info(
            "CUDA graphs for decode steps of %s sequences: captured in %.1f s, %.0f MiB "
            "(%.0f MiB of it the shared logits)",
            ",".join(map(str, sizes)),
            time.perf_counter() - t0,
            self.bytes / 2**20,
            self.output.nbytes / 2**20,
        )

    def padded(self, sched: SchedulerOutput) -> int | None:
        """The captured size a step replays at, or None (a step with prompt tokens, or more
        sequences than the largest size)."""
        if not self.graphs or not all(c.is_decode for c in sched.chunks):
            return None
        return padded_size(len(sched.chunks), self.sizes)

    def replay(self, sched: SchedulerOutput, size: int) -> torch.Tensor:
        """The step's logits [n, vocab] float32 from the graph of ``size`` rows (a view of the
        shared output, valid until the next replay)."""
        self.inputs.prepare(sched, pad_to=size)
        self.graphs[size].replay()
        return self.output[: len(sched.chunks)]
