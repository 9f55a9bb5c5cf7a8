"""Paged decode attention: one query token per sequence over its whole context.

The context is split into partitions of ``DECODE_PARTITION`` keys from position 0; a program
takes one (sequence, KV head, partition), its KV head's query heads padded to 16 rows, and
walks the partition's blocks with an online softmax; a second kernel merges the partitions
in order. The partition size is fixed, so a sequence's reduction never depends on the batch
or on the block table's width.

Work follows the context, not the table: a partition past its sequence's end stores nothing
and the merge reads only the partitions the context has. Eagerly the grid holds the step's
longest context (``max_seq_len``); a captured CUDA graph, whose grid is fixed, holds the
table's width, and its partitions past each context return at once. Inside a partition the
loop runs to the context's end (no branch per block), so its loads can be pipelined.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inference.kernels.triton.common import (
    LAUNCHES,
    MIN_DOT,
    Launch,
    check_attention,
    dequantize,
    head_scales,
    kv8_args,
    pow2,
)

DECODE_PARTITION = 512  # keys per decode split; fixed for batch invariance


@triton.jit
def attend_block(q, k, v, visible, m_i, l_i, acc, scale, IEEE: tl.constexpr):
    """One block of keys into a running (max, sum, weighted values) per query row."""
    if IEEE:  # noqa: SIM108 - constexpr branch, resolved at compile time
        sc = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        sc = tl.dot(q, tl.trans(k))
    sc = tl.where(visible, sc.to(tl.float32) * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(sc - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:  # noqa: SIM108
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["stride_bt", "max_parts"])
def _decode_partition_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    k_scale_ptr,  # 8-bit caches: [KVH, D] scales
    v_scale_ptr,
    part_out_ptr,  # [num_seqs, num_heads, max_parts, D] fp32
    part_m_ptr,  # [num_seqs, num_heads, max_parts] fp32
    part_l_ptr,
    scale,
    stride_qs,
    stride_qh,
    stride_bt,
    max_parts,
    KVH: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PARTITION: tl.constexpr,
    IEEE: tl.constexpr,
    KV8: tl.constexpr,
):
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + s)
    start = part * PARTITION
    if start < seq_len:
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        heads = kvh * GROUP + g
        g_mask = g < GROUP
        d_mask = d < D
        q = tl.load(
            q_ptr + s * stride_qs + heads[:, None] * stride_qh + d[None, :],
            mask=g_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        k_sc, v_sc = head_scales(k_scale_ptr, v_scale_ptr, kvh, d, d_mask, D, BLOCK_D, KV8)
        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        offs = tl.arange(0, BS)
        end = tl.minimum(start + PARTITION, seq_len)
        for pos0 in range(start, end, BS):
            blk = tl.load(block_tables_ptr + s * stride_bt + pos0 // BS).to(tl.int64)
            row = (blk * BS + offs) * (KVH * D) + kvh * D
            kv_mask = d_mask[None, :]
            k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            k = dequantize(k, k_sc, KV8, q.dtype)
            v = dequantize(v, v_sc, KV8, q.dtype)
            visible = (pos0 + offs)[None, :] < seq_len
            m_i, l_i, acc = attend_block(q, k, v, visible, m_i, l_i, acc, scale, IEEE)
        base = (s * (KVH * GROUP) + heads) * max_parts + part
        tl.store(part_m_ptr + base, m_i, mask=g_mask)
        tl.store(part_l_ptr + base, l_i, mask=g_mask)
        tl.store(
            part_out_ptr + base[:, None] * D + d[None, :],
            acc,
            mask=g_mask[:, None] & d_mask[None, :],
        )


@triton.jit(do_not_specialize=["max_parts"])
def _decode_reduce_kernel(
    part_out_ptr,
    part_m_ptr,
    part_l_ptr,
    seq_lens_ptr,
    out_ptr,
    stride_os,
    stride_oh,
    max_parts,
    NUM_HEADS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PARTITION: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + s)
    n_parts = tl.cdiv(seq_len, PARTITION)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    base = (s * NUM_HEADS + h) * max_parts
    m = tl.full([1], float("-inf"), dtype=tl.float32)
    l = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for p in range(0, n_parts):  # in order: the reduction never depends on the batch
        m_p = tl.load(part_m_ptr + base + p + tl.zeros([1], dtype=tl.int32))
        l_p = tl.load(part_l_ptr + base + p + tl.zeros([1], dtype=tl.int32))
        o_p = tl.load(part_out_ptr + (base + p) * D + d, mask=d_mask, other=0.0)
        m_new = tl.maximum(m, m_p)
        a = tl.exp(m - m_new)
        b = tl.exp(m_p - m_new)
        l = l * a + l_p * b
        acc = acc * a + o_p * b
        m = m_new
    # a context of 0 (a padding row) attends nothing: zeros, not 0 / 0
    res = tl.where(l > 0, acc / tl.maximum(l, 1e-30), 0.0).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + s * stride_os + h * stride_oh + d, res, mask=d_mask)


def decode_launches(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor,  # [num_seqs]
    scale: float,
    out: torch.Tensor | None = None,
    max_seq_len: int | None = None,
) -> tuple[torch.Tensor, list[Launch]]:
    """The output and the two launches (partitions, then their merge) of
    ``paged_decode_attention``; no launch for an empty batch."""
    bs, kvh, d, out = check_attention(q, k_cache, v_cache, block_tables, seq_lens, out, "num_seqs")
    num_seqs, num_heads, _ = q.shape
    if seq_lens.numel() != num_seqs:
        raise ValueError("seq_lens needs one entry per query row")
    if num_seqs == 0:
        return out, []
    width = block_tables.shape[1] * bs
    if max_seq_len is not None and not 0 <= max_seq_len <= width:
        raise ValueError(f"max_seq_len {max_seq_len} outside the block tables' {width} slots")
    max_len = max(1, width if max_seq_len is None else max_seq_len)
    max_parts = -(-max_len // DECODE_PARTITION)
    part_out = torch.empty(num_seqs, num_heads, max_parts, d, dtype=torch.float32, device=q.device)
    part_m = torch.empty(num_seqs, num_heads, max_parts, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    kv8, kc, vc, k_scale, v_scale = kv8_args(k_cache, v_cache)
    partitions = Launch(
        _decode_partition_kernel,
        (num_seqs, kvh, max_parts),
        (
            q,
            kc,
            vc,
            block_tables,
            seq_lens,
            k_scale,
            v_scale,
            part_out,
            part_m,
            part_l,
            scale,
            q.stride(0),
            q.stride(1),
            block_tables.stride(0),
            max_parts,
        ),  # fmt: skip
        dict(
            KVH=kvh,
            GROUP=num_heads // kvh,
            D=d,
            BS=bs,
            BLOCK_G=max(MIN_DOT, pow2(num_heads // kvh)),
            BLOCK_D=max(MIN_DOT, pow2(d)),
            PARTITION=DECODE_PARTITION,
            IEEE=q.dtype == torch.float32,
            KV8=kv8,
            enable_fp_fusion=False,
        ),
    )
    merge = Launch(
        _decode_reduce_kernel,
        (num_seqs, num_heads),
        (part_out, part_m, part_l, seq_lens, out, out.stride(0), out.stride(1), max_parts),
        dict(
            NUM_HEADS=num_heads,
            D=d,
            BLOCK_D=pow2(d),
            PARTITION=DECODE_PARTITION,
            enable_fp_fusion=False,
        ),
    )
    return out, [partitions, merge]


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor,  # [num_seqs]
    scale: float,
    out: torch.Tensor | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Each sequence's one query token over its context (module docstring). ``max_seq_len``:
    the longest context in ``seq_lens`` where the caller knows it (the grid then holds that
    many keys, not the tables' width)."""
    out, launches = decode_launches(
        q, k_cache, v_cache, block_tables, seq_lens, scale, out, max_seq_len
    )
    if launches:
        LAUNCHES["paged_decode_attention"] += 1
        for launch in launches:
            launch()
    return out
