"""Which batch sizes a decode step's captured graph is padded to.

A CUDA graph replays kernels whose shapes were fixed at capture, so decode steps are captured
at a few batch sizes and a step of ``n`` sequences replays the smallest that holds it, its
rows past ``n`` padding (``InputBuffers.prepare(pad_to=...)``: slot -1, context 0, never
sampled). The sizes: 1, 2, 4 and 8, then steps of 8 up to 64 and of 16 beyond, up to
``max_num_seqs``.
"""

from __future__ import annotations

import bisect


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
