"""Attention backends: the object a model's ops table calls for ``store_kv`` and ``attention``.

- ``TorchBackend``: the reference (``attention/reference.py``), any device.
- ``CPUBackend``: the compiled CPU kernels (``kernels/cpu/attention.py``), with the plan of each
  step's work groups built once and read by every layer.
- ``TritonBackend``: the Triton kernels (``kernels/triton``: ``kv_store``,
  ``decode_attention``, ``prefill_attention``).

Which one runs is the runner's choice (``inference.runner``), made once at start.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from inference.attention.metadata import AttentionMetadata
from inference.attention.reference import paged_attention_reference, store_kv_reference
from inference.device import capturing_graph

BACKENDS = ("auto", "torch", "cpu", "triton")


class TorchBackend:
    """The torch reference; ``flash``: torch's fused CPU attention for each work item (CPU
    tensors), else plain products (any device)."""

    name = "torch"
    # store_kv writes each token's K/V rows into its slot and nothing else, so the model may
    # do that in its own fused pass (the CPU's rotary_store kernel) instead of calling it
    plain_store = True

    def __init__(self, flash: bool = True):
        self.flash = flash

    def store_kv(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        store_kv_reference(key, value, k_cache, v_cache, meta)

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        return paged_attention_reference(q, k_cache, v_cache, meta, scale, flash=self.flash)


def _largest_first(q_rows, seq_of, ctx, starts, shared):
    """A step plan's groups reordered by the keys their tokens walk, most first (ties keep
    their order): the kernels hand units to threads in group order, so the threads end
    together when one manual's answers outnumber the others or a prompt's large groups share
    the step with small decode groups. A token's result does not depend on where its group
    runs."""
    spans = list(itertools.pairwise(starts))
    order = sorted(range(len(spans)), key=lambda g: -sum(ctx[spans[g][0] : spans[g][1]]))
    if order == list(range(len(spans))):
        return q_rows, seq_of, ctx, starts, shared
    picked = [t for g in order for t in range(*spans[g])]
    new_starts = [0]
    for g in order:
        new_starts.append(new_starts[-1] + spans[g][1] - spans[g][0])
    return (
        [q_rows[t] for t in picked],
        [seq_of[t] for t in picked],
        [ctx[t] for t in picked],
        new_starts,
        [shared[g] for g in order],
    )


def _prompt_groups(n: int, per: int, full: bool) -> list[tuple[int, int]]:
    """A prompt chunk of ``n`` tokens cut into groups of at most ``per`` consecutive tokens:
    (first, count) each. ``full``: groups of ``per`` tokens and one of the rest, for the bf16
    kernel, whose units take their query rows 16 at a time: a unit of ``per`` tokens fills
    its blocks of rows (a 36-token question in groups of 16, 16 and 4 tokens has 21 blocks of
    16 rows to compute over its context where groups of 12 had 27). Else as few groups as
    ``per`` allows, of even sizes."""
    if full:
        return [(c, min(per, n - c)) for c in range(0, n, per)]
    parts = -(-n // per)
    return [(n * j // parts, n * (j + 1) // parts - n * j // parts) for j in range(parts)]


class StepPlan(NamedTuple):
    """The CPU kernels' tokens and work groups for one step, in group order (every layer's)."""

    q_rows: torch.Tensor  # [T] int64: each token's row among the step's tokens
    tables: torch.Tensor  # [T, max_blocks] int32: each token's block table
    ctx: torch.Tensor  # [T] int32: keys each token attends, its own included
    group_start: torch.Tensor  # [G + 1] int32: each group's first token, then the end
    group_shared: torch.Tensor  # [G] int32: keys a group's tokens walk together


class CPUBackend(TorchBackend):
    """Attention through the compiled CPU kernels (``kernels/cpu/attention.py``), which
    read each token's context in place from the pool in rounds of 64 keys from key 0.

    bf16 on AVX512-BF16 (the default on such CPUs): every token of the step, prompt and decode
    alike, in one call per layer (``attention_bf16``), written in place into the
    layer's output. A work unit is one KV head of a group of tokens: up to
    ``bf16_unit_rows() // group`` tokens (32 where the tile unit runs it, else 16),
    consecutive tokens of one prompt chunk (full groups, then the rest), or decode tokens whose
    contexts start with the same blocks (``decode_groups``). A token's result is
    the same bits as a prompt token or a decode token, alone or in any batch.

    Other dtypes (float32) and shapes: every token of the step, prompt and decode alike,
    through ``decode_attention`` where it takes the shape (units of up to
    ``48 // group`` tokens on its register-tiled float32 path, x86 with FMA, else
    ``16 // group``), else the torch path; there too a token's result is the same
    bits as a prompt token or a decode token, alone or in any batch."""

    name = "cpu"

    def __init__(self):
        super().__init__(flash=True)
        from inference.kernels.cpu import attention

        self.k = attention

    def _decode_tokens(self, meta: AttentionMetadata, bs: int, group: int, max_rows: int):
        """The step's decode tokens in the kernel's group order: (rows of q, sequences,
        context lengths, group starts, keys each group shares) (``decode_groups``)."""
        rows, seqs = [], []
        start = 0
        for i, (ql, dec) in enumerate(zip(meta.query_lens_list, meta.is_decode_list, strict=True)):
            if dec:
                rows.append(start)
                seqs.append(i)
            start += ql
        if not rows:
            return [], [], [], [0], []
        ctx = [meta.seq_lens_list[i] for i in seqs]
        tables = [meta.block_tables[i, : meta.num_blocks_list[i]].tolist() for i in seqs]
        order, starts, shared = self.k.decode_groups(tables, ctx, bs, group, max_rows)
        return (
            [rows[o] for o in order],
            [seqs[o] for o in order],
            [ctx[o] for o in order],
            starts,
            shared,
        )

    def plan(
        self, meta: AttentionMetadata, device, bs: int, group: int, bf16: bool, tiled: bool = False
    ) -> StepPlan:
        """A kernel's tokens and groups for this step (built once, used by every layer):
        prompt chunks first, cut into groups of consecutive tokens (``_prompt_groups``), then
        the decode tokens grouped by shared leading blocks; then
        the groups with the most keys to walk first (``_largest_first``). A prompt group shares
        its chunk's table: for the bf16 kernel and the register-tiled float32 one every key of
        the group (its last token's context), for the other float32 one the whole rounds of its
        first token's context."""
        key = "cpu-bf16" if bf16 else "cpu-f32-tiled" if tiled else "cpu-f32"
        plan = meta.scratch.get(key)
        if plan is not None:
            return plan
        # units that walk a prompt chunk's last context for all its tokens (each masked at
        # its own), or only the whole rounds of its first token's
        whole = bf16 or tiled
        k = self.k
        max_rows = k.bf16_unit_rows() if bf16 else k.TILED_MAX_ROWS if tiled else k.MAX_ROWS
        per = max(1, max_rows // group)
        q_rows: list[int] = []
        seq_of: list[int] = []
        ctx: list[int] = []
        starts, shared = [0], []
        start = 0
        for i, (sl, ql, dec) in enumerate(
            zip(meta.seq_lens_list, meta.query_lens_list, meta.is_decode_list, strict=True)
        ):
            if not dec:
                first = sl - ql  # position of the chunk's first token
                for c, n in _prompt_groups(ql, per, full=bf16):
                    q_rows.extend(range(start + c, start + c + n))
                    seq_of.extend([i] * n)
                    ctx.extend(range(first + c + 1, first + c + n + 1))
                    starts.append(len(q_rows))
                    if whole:
                        shared.append(first + c + n)  # every key of the group
                    else:
                        shared.append((first + c + 1) // self.k.ROUND * self.k.ROUND)
            start += ql
        d_rows, d_seqs, d_ctx, d_starts, d_shared = self._decode_tokens(meta, bs, group, max_rows)
        starts.extend(len(q_rows) + x for x in d_starts[1:])
        shared.extend(d_shared)
        q_rows += d_rows
        seq_of += d_seqs
        ctx += d_ctx
        q_rows, seq_of, ctx, starts, shared = _largest_first(q_rows, seq_of, ctx, starts, shared)
        seqs = torch.tensor(seq_of, dtype=torch.int64, device=device)
        plan = StepPlan(
            torch.tensor(q_rows, dtype=torch.int64, device=device),
            meta.block_tables.index_select(0, seqs),
            torch.tensor(ctx, dtype=torch.int32, device=device),
            torch.tensor(starts, dtype=torch.int32),
            torch.tensor(shared, dtype=torch.int32),
        )
        meta.scratch[key] = plan
        return plan

    @staticmethod
    def offsets(meta: AttentionMetadata, rows: torch.Tensor, stride: int) -> torch.Tensor:
        """Each token's first element in a tensor whose rows are ``stride`` apart (the same
        for every layer of a step: worked out once)."""
        key = ("cpu-offsets", rows.data_ptr(), stride)
        off = meta.scratch.get(key)
        if off is None:
            off = meta.scratch[key] = rows * stride
        return off

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        num_heads, d = q.shape[1], q.shape[2]
        nb, bs, kvh, _ = k_cache.shape
        group = num_heads // kvh
        if self.k.bf16_kernel_supports(q.dtype, k_cache.dtype, num_heads, kvh, d):
            rows, tables, ctx, starts, shared = self.plan(meta, q.device, bs, group, True)
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            offsets = (
                self.offsets(meta, rows, q.stride(0)),
                self.offsets(meta, rows, out.stride(0)),
            )
            return self.k.attention_bf16(
                q, rows, k_cache, v_cache, tables, ctx, scale, starts, shared, out, offsets
            )
        if not self.k.decode_kernel_supports(q.dtype, k_cache.dtype, num_heads, kvh, d, bs):
            return paged_attention_reference(q, k_cache, v_cache, meta, scale)
        tiled = self.k.decode_attention_tiled(q.dtype, k_cache.dtype, d)
        rows, tables, ctx, starts, shared = self.plan(meta, q.device, bs, group, False, tiled)
        o = self.k.decode_attention(
            q,
            rows,
            k_cache,
            v_cache,
            tables,
            ctx,
            scale,
            starts,
            shared,
            self.offsets(meta, rows, q.stride(0)),
        )
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        out.index_copy_(0, rows, o.to(out.dtype))
        return out


class TritonBackend:
    """The Triton kernels: decode tokens through ``paged_decode_attention``, prompt chunks
    through ``paged_prefill_attention``, each on its own rows, so a decode token's result does
    not depend on whether prompt chunks share its step. A step's index tensors are built on
    the host and copied without waiting for the device (``meta.to_device``)."""

    name = "triton"
    plain_store = False  # the store is one of the kernels (store_kv): always called

    def __init__(self):
        from inference.kernels.triton import decode_attention, kv_store, prefill_attention

        self.decode = decode_attention.paged_decode_attention
        self.prefill = prefill_attention.paged_prefill_attention
        self._store = kv_store.store_kv

    def store_kv(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        self._store(key, value, k_cache, v_cache, meta.slot_mapping)

    def _split(self, meta: AttentionMetadata, device):
        """The step's decode rows and prompt chunks apart, as index tensors (once a step)."""
        plan = meta.scratch.get("triton")
        if plan is not None:
            return plan
        dec_rows, dec_seqs, pre_rows, pre_seqs, cu = [], [], [], [], [0]
        start = 0
        for i, (ql, dec) in enumerate(zip(meta.query_lens_list, meta.is_decode_list, strict=True)):
            if dec:
                dec_rows.append(start)
                dec_seqs.append(i)
            else:
                pre_rows.extend(range(start, start + ql))
                pre_seqs.append(i)
                cu.append(cu[-1] + ql)
            start += ql
        bt, sl = meta.block_tables, meta.seq_lens
        plan = {"dec": None, "pre": None}
        if dec_seqs:
            rows, seqs = meta.to_device(dec_rows), meta.to_device(dec_seqs)
            ctx = max(meta.seq_lens_list[i] for i in dec_seqs)
            plan["dec"] = (rows, bt.index_select(0, seqs), sl.index_select(0, seqs), ctx)
        if pre_seqs:
            rows, seqs = meta.to_device(pre_rows), meta.to_device(pre_seqs)
            cu_t = meta.to_device(cu, torch.int32)
            max_q = max(meta.query_lens_list[i] for i in pre_seqs)
            plan["pre"] = (rows, bt.index_select(0, seqs), cu_t, sl.index_select(0, seqs), max_q)
        meta.scratch["triton"] = plan
        return plan

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        decode_only = meta.scratch.get("decode-only")
        if decode_only is None:  # once per step, for every layer
            decode_only = meta.scratch["decode-only"] = all(meta.is_decode_list)
        if decode_only:  # one token a sequence, in order: the step's own tensors
            # (no tensor made from host lists, so a CUDA graph can capture the step; a
            # captured grid holds the tables' whole width, an eager one the step's contexts)
            ctx = None if capturing_graph(q) else max(meta.seq_lens_list, default=0)
            return self.decode(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, max_seq_len=ctx
            )
        p = self._split(meta, q.device)
        out = torch.empty_like(q)
        if p["dec"] is not None:
            rows, tables, lens, ctx = p["dec"]
            o = self.decode(
                q.index_select(0, rows), k_cache, v_cache, tables, lens, scale, max_seq_len=ctx
            )
            out.index_copy_(0, rows, o)
        if p["pre"] is not None:
            rows, tables, cu, lens, max_q = p["pre"]
            o = self.prefill(
                q.index_select(0, rows), k_cache, v_cache, tables, cu, lens, scale,
                max_query_len=max_q,
            )  # fmt: skip
            out.index_copy_(0, rows, o)
        return out
