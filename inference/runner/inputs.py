"""The persistent input buffers a runner fills each step.

A step's inputs (token ids, positions, slot mapping, block tables, sequence lengths, query
offsets, logits rows) are written into buffers allocated once, at their largest (the
scheduler's token budget, its sequence limit, the blocks of a whole context), and the model
reads views of them. On a device other than the CPU the host buffers are pinned and copied to
device buffers of the same shapes, so the device tensors keep their addresses from step to
step (what a captured CUDA graph replays against).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from inference.attention.metadata import AttentionMetadata
from inference.engine.scheduler import SchedulerOutput


class StepInputs(NamedTuple):
    input_ids: torch.Tensor  # [N] int64: the step's new tokens, chunk after chunk
    positions: torch.Tensor  # [N] int64
    meta: AttentionMetadata
    # [R] int64: the rows whose next-token logits are sampled (``SchedulerOutput.sampling_rows``,
    # in order: a chunk's last row, every row of a verification)
    logits_indices: torch.Tensor


class _Buffer:
    """One input, on the host (numpy view for filling) and on the device (the same tensor on
    the CPU)."""

    def __init__(self, shape, dtype, device: torch.device, pin: bool):
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.np = self.host.numpy()
        self.device = (
            self.host if device.type == "cpu" else torch.zeros_like(self.host, device=device)
        )

    def take(self, *size: int) -> torch.Tensor:
        """The device view of the first ``size`` elements (rows, columns), copied from the
        host first where the two differ."""
        index = tuple(slice(0, n) for n in size)
        if self.device is not self.host:
            self.device[index].copy_(self.host[index], non_blocking=True)
        return self.device[index]


class InputBuffers:
    def __init__(
        self,
        max_num_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
    ):
        pin = device.type == "cuda"
        self.block_size = block_size
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.input_ids = _Buffer(max_num_tokens, torch.int64, device, pin)
        self.positions = _Buffer(max_num_tokens, torch.int64, device, pin)
        self.slot_mapping = _Buffer(max_num_tokens, torch.int64, device, pin)
        self.block_tables = _Buffer((max_num_seqs, max_blocks_per_seq), torch.int32, device, pin)
        self.seq_lens = _Buffer(max_num_seqs, torch.int32, device, pin)
        self.cu_seqlens_q = _Buffer(max_num_seqs + 1, torch.int32, device, pin)
        # a row per sampling sequence, or per token of a verification (speculation)
        self.logits_indices = _Buffer(max(max_num_seqs, max_num_tokens), torch.int64, device, pin)

    def prepare(self, sched: SchedulerOutput, pad_to: int | None = None) -> StepInputs:
        """Fill the buffers from the scheduler's chunks; returns views of them.

        ``pad_to`` (a step of decode tokens only, for a captured graph of that many rows):
        rows past the step's own are padding, a decode row each of token 0 at position 0 with
        slot -1 (nothing stored), a context of 0 (nothing attended) and an all-zero block
        table; the block tables take their full width, and every row's logits are computed
        (the padded rows' are never sampled)."""
        bs = self.block_size
        chunks = sched.chunks
        num_seqs = len(chunks)
        if pad_to is not None and (
            pad_to < num_seqs or pad_to > self.max_num_seqs or not all(c.is_decode for c in chunks)
        ):
            raise ValueError(
                f"padding a step of {num_seqs} sequences to {pad_to} rows: decode steps only, "
                f"at most {self.max_num_seqs} rows"
            )
        if num_seqs > self.max_num_seqs or sched.num_tokens > self.max_num_tokens:
            raise ValueError(
                f"a step of {num_seqs} sequences and {sched.num_tokens} tokens; the buffers "
                f"hold {self.max_num_seqs} and {self.max_num_tokens}"
            )
        ids, pos, slots = self.input_ids.np, self.positions.np, self.slot_mapping.np
        tables, seq_lens, cu = self.block_tables.np, self.seq_lens.np, self.cu_seqlens_q.np
        if pad_to is not None:  # the full width: a captured graph's shapes
            width = self.block_tables.np.shape[1]
        else:
            width = max(len(c.block_ids) for c in chunks)
        rows: list[int] = []
        lens, q_lens = [], []
        t = 0
        cu[0] = 0
        for i, c in enumerate(chunks):
            n, ctx, blocks = c.num_new_tokens, c.num_context_tokens, c.block_ids
            if c.draft:  # the request's last token, then its draft
                ids[t : t + n] = c.request.token_ids(ctx, ctx + 1) + list(c.draft)
            else:
                ids[t : t + n] = c.request.token_ids(ctx, ctx + n)
            if n == 1:
                pos[t] = ctx
                slots[t] = blocks[ctx // bs] * bs + ctx % bs
            else:
                p = np.arange(ctx, ctx + n)
                pos[t : t + n] = p
                slots[t : t + n] = np.asarray(blocks, dtype=np.int64)[p // bs] * bs + p % bs
            tables[i, : len(blocks)] = blocks
            tables[i, len(blocks) : width] = 0
            seq_lens[i] = ctx + n
            t += n
            cu[i + 1] = t
            lens.append(ctx + n)
            q_lens.append(n)
            if c.samples:
                rows.extend(range(t - c.num_sampled_rows, t))
        decode = [c.is_decode for c in chunks]
        if pad_to is not None:
            for i in range(num_seqs, pad_to):  # padding rows (docstring)
                ids[t], pos[t], slots[t] = 0, 0, -1
                tables[i, :width] = 0
                seq_lens[i] = 0
                t += 1
                cu[i + 1] = t
                lens.append(0)
                q_lens.append(1)
                decode.append(True)
            rows = list(range(pad_to))
            num_seqs = pad_to
        self.logits_indices.np[: len(rows)] = rows
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping.take(t),
            block_tables=self.block_tables.take(num_seqs, width),
            seq_lens=self.seq_lens.take(num_seqs),
            cu_seqlens_q=self.cu_seqlens_q.take(num_seqs + 1),
            seq_lens_list=lens,
            query_lens_list=q_lens,
            num_blocks_list=[-(-n // bs) for n in lens],
            is_decode_list=decode,
            block_tables_host=self.block_tables.host[:num_seqs, :width],
        )
        return StepInputs(
            self.input_ids.take(t),
            self.positions.take(t),
            meta,
            self.logits_indices.take(len(rows)),
        )
