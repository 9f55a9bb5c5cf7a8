"""Paged prefill attention: causal attention of each sequence's new tokens over its cached
prefix plus themselves (varlen, ``cu_seqlens_q``), in the structure of Triton's
fused-attention tutorial: tiles of 128 query rows (a KV head's query heads packed into them)
against tiles of 64 keys from absolute position 0, ``exp2`` with log2(e) folded into the
scale, the key tiles every row sees whole without a mask and the diagonal ones masked;
configurations pinned per head dim and dtype (``PREFILL_CONFIGS``).

Every dot product takes at least 16 rows, columns and depth (what the GPU compiler accepts for
16-bit inputs). fp32 inputs use ``input_precision="ieee"`` (a GPU otherwise uses tf32).
Softmax statistics are kept in fp32. The kernel is compiled with fp fusion off
(``common.py``): a masked tile and an unmasked one then round a key's score the same way, so
a row's bits do not depend on where its query tile starts.
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
    check_int,
    dequantize,
    head_scales,
    kv8_args,
    pow2,
)

# Tile configurations, pinned per (head dim, dtype) so that a run never picks another: query
# rows per program (a KV head's query heads packed into its rows), keys per tile, warps,
# pipeline stages. 16-bit: the structure and sizes of Triton's fused-attention tutorial; fp32
# (checks, not speed): smaller tiles that fit a multiprocessor's shared memory.
PREFILL_CONFIGS: dict[tuple[int, str], tuple[int, int, int, int]] = {
    (64, "16"): (128, 64, 4, 3),
    (128, "16"): (128, 64, 8, 3),
    (64, "32"): (64, 32, 4, 2),
    (128, "32"): (64, 32, 4, 2),
}
PREFILL_KEY_TILE = 64  # keys per tile, from absolute position 0 (16-bit configurations)
_LOG2E = 1.4426950408889634


def prefill_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    width = "32" if dtype == torch.float32 else "16"
    key = (max(64, pow2(head_dim)), width)
    if key not in PREFILL_CONFIGS:
        raise ValueError(f"no prefill configuration for head_dim {head_dim} ({dtype})")
    return PREFILL_CONFIGS[key]


@triton.jit
def _prefill_tile(
    q, k_cache_ptr, v_cache_ptr, table_row_ptr, kvh, n0, seq_len, k_sc, v_sc, q_pos, m_i, l_i,
    acc, qk_scale, d, d_mask, bs_shift,
    KVH: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, IEEE: tl.constexpr, KV8: tl.constexpr,
):  # fmt: skip
    """Keys [n0, n0 + BLOCK_N) of one sequence into the rows' running (max, sum, values), in
    log2 units; MASKED: the causal mask and the context's end applied (the diagonal tiles).
    A key's slot: its block (the table's entry ``key >> bs_shift``) times the block size, plus
    its offset in the block."""
    keys = n0 + tl.arange(0, BLOCK_N)
    in_ctx = keys < seq_len
    blk = tl.load(table_row_ptr + (keys >> bs_shift), mask=in_ctx, other=0).to(tl.int64)
    row = ((blk << bs_shift) + (keys & ((1 << bs_shift) - 1))) * (KVH * D) + kvh * D
    kv_mask = in_ctx[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    k = dequantize(k, k_sc, KV8, q.dtype)
    v = dequantize(v, v_sc, KV8, q.dtype)
    if IEEE:  # noqa: SIM108 - constexpr branch
        sc = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        sc = tl.dot(q, tl.trans(k))
    sc = sc.to(tl.float32) * qk_scale
    if MASKED:
        sc = tl.where(keys[None, :] <= q_pos[:, None], sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(sc - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:  # noqa: SIM108
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit(do_not_specialize=["stride_bt", "bs_shift"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    cu_q_ptr,
    seq_lens_ptr,
    k_scale_ptr,  # 8-bit caches: [KVH, D] scales
    v_scale_ptr,
    out_ptr,
    qk_scale,  # the softmax scale times log2(e): scores in log2 units, exp2
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    bs_shift,  # log2 of the block size: a runtime value, so one binary serves every size
    KVH: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
    KV8: tl.constexpr,
):
    """One tile of BLOCK_M query rows of one sequence and KV head: row r is token r // GROUP
    of the sequence's new tokens, query head kvh * GROUP + r % GROUP (GQA: the group's heads
    share every key and value the tile reads). Keys go in tiles of BLOCK_N from absolute
    position 0: first the tiles every row sees whole (no mask), then the rest up to the tile's
    last query (masked). A row's result is its online softmax over tiles 0, 1, ... up to its
    own position, a tile past it changing nothing (its weights are exactly 0 and its rescale
    exactly 1): it does not depend on which rows share the tile, so neither on how the prompt
    was chunked nor on how much of it came from the cache."""
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    mt = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + s)
    q_len = tl.load(cu_q_ptr + s + 1) - q_start
    if mt * BLOCK_M < q_len * GROUP:
        seq_len = tl.load(seq_lens_ptr + s)
        r = mt * BLOCK_M + tl.arange(0, BLOCK_M)
        tok = r // GROUP
        head = kvh * GROUP + r % GROUP
        r_mask = tok < q_len
        d = tl.arange(0, BLOCK_D)
        d_mask = d < D
        q_pos = seq_len - q_len + tok
        q = tl.load(
            q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=r_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        k_sc, v_sc = head_scales(k_scale_ptr, v_scale_ptr, kvh, d, d_mask, D, BLOCK_D, KV8)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        table_row = block_tables_ptr + s * stride_bt
        first = seq_len - q_len + mt * BLOCK_M // GROUP  # the tile's first query position
        last = seq_len - q_len + tl.minimum(((mt + 1) * BLOCK_M - 1) // GROUP, q_len - 1)
        whole = (first + 1) // BLOCK_N  # tiles every row sees whole
        for j in range(0, whole):
            m_i, l_i, acc = _prefill_tile(
                q, k_cache_ptr, v_cache_ptr, table_row, kvh, j * BLOCK_N, seq_len, k_sc, v_sc,
                q_pos, m_i, l_i, acc, qk_scale, d, d_mask, bs_shift,
                KVH, D, BLOCK_N, False, IEEE, KV8,
            )  # fmt: skip
        for j in range(whole, last // BLOCK_N + 1):
            m_i, l_i, acc = _prefill_tile(
                q, k_cache_ptr, v_cache_ptr, table_row, kvh, j * BLOCK_N, seq_len, k_sc, v_sc,
                q_pos, m_i, l_i, acc, qk_scale, d, d_mask, bs_shift,
                KVH, D, BLOCK_N, True, IEEE, KV8,
            )  # fmt: skip
        res = acc / l_i[:, None]
        tl.store(
            out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            res.to(out_ptr.dtype.element_ty),
            mask=r_mask[:, None] & d_mask[None, :],
        )


def prefill_launch(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1]
    seq_lens: torch.Tensor,  # [num_seqs]
    scale: float,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
) -> tuple[torch.Tensor, Launch | None]:
    """The output and the launch of ``paged_prefill_attention`` (None: nothing to compute)."""
    bs, kvh, d, out = check_attention(
        q, k_cache, v_cache, block_tables, seq_lens, out, "num_tokens"
    )
    check_int(cu_seqlens_q, "cu_seqlens_q", 1)
    num_seqs = seq_lens.numel()
    if cu_seqlens_q.numel() != num_seqs + 1:
        raise ValueError("cu_seqlens_q needs num_seqs + 1 entries")
    if num_seqs == 0 or q.shape[0] == 0:
        return out, None
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    num_heads = q.shape[1]
    group = num_heads // kvh
    block_m, block_n, warps, stages = prefill_config(d, q.dtype)
    block_m = max(block_m, pow2(group))  # a tile holds whole tokens
    grid = (num_seqs, kvh, -(-max_query_len * group // block_m))
    kv8, kc, vc, k_scale, v_scale = kv8_args(k_cache, v_cache)
    args = (q, kc, vc, block_tables, cu_seqlens_q, seq_lens, k_scale, v_scale, out,
            scale * _LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            block_tables.stride(0), bs.bit_length() - 1)  # fmt: skip
    kwargs = dict(
        KVH=kvh,
        GROUP=group,
        D=d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(MIN_DOT, pow2(d)),
        IEEE=q.dtype == torch.float32,
        KV8=kv8,
        num_warps=warps,
        num_stages=stages,
        enable_fp_fusion=False,
    )
    return out, Launch(_prefill_kernel, grid, args, kwargs)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix plus themselves
    (varlen), in tiles of query rows and keys (module docstring). ``max_query_len``: the
    longest ``cu_seqlens_q`` span where the caller knows it (else read from the tensor)."""
    out, launch = prefill_launch(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, out, max_query_len
    )
    if launch is not None:
        LAUNCHES["paged_prefill_attention"] += 1
        launch()
    return out
