"""Triton kernels for the paged KV cache (the layout in inference/attention/metadata.py).

- ``store_kv``: scatter new K/V rows into the paged cache (slot -1 skipped).
- ``paged_decode_attention``: one query token per sequence, split along the context in
  partitions of ``DECODE_PARTITION`` keys, then a reduction pass over the partitions in order.
  The partition size is fixed, so a sequence's reduction never depends on the batch.
- ``paged_prefill_attention``: causal attention of each sequence's new tokens over its cached
  prefix plus themselves (varlen, ``cu_seqlens_q``), in the structure of Triton's
  fused-attention tutorial: tiles of 128 query rows (a KV head's query heads packed into them)
  against tiles of 64 keys from absolute position 0, ``exp2`` with log2(e) folded into the
  scale, the key tiles every row sees whole without a mask and the diagonal ones masked;
  configurations pinned per head dim and dtype (``PREFILL_CONFIGS``).

Every dot product takes at least 16 rows, columns and depth (what the GPU compiler accepts for
16-bit inputs): query groups are padded to 16 rows, keys are read a whole KV block (16 or more
tokens) at a time. fp32 inputs use ``input_precision="ieee"`` (a GPU otherwise uses tf32).
Softmax statistics are kept in fp32.

8-bit caches (``inference/kv_quant.py``: int8, or fp8 e4m3 read natively by the GPU) carry
their layer's scales [num_kv_heads, head_dim]: ``store_kv`` quantizes each element with its
channel's reciprocal scale (int8: nearest even, clamped to +-127; fp8: clamped to +-448, the
conversion's nearest even), and the attention kernels read a block's keys and values times
their scales, in the queries' dtype (exact: the scales are powers of two), before the same
products as a 16-bit cache.

On a machine without a GPU these kernels run under Triton's interpreter: set
``TRITON_INTERPRET=1`` before this module is imported.
"""

from __future__ import annotations

from collections import Counter

import torch
import triton
import triton.language as tl

from inference import kv_quant

DECODE_PARTITION = 512  # keys per decode split; fixed for batch invariance
_MIN_DOT = 16
LAUNCHES: Counter[str] = Counter()  # kernel launches per entry point (tests, benchmarks)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    nb, bs, kvh, d = k_cache.shape
    if kv_quant.is_kv8(k_cache.dtype):
        for c in (k_cache, v_cache):
            sc, inv = kv_quant.scales_of(c)
            if sc.shape != (kvh, d) or not sc.is_contiguous() or not inv.is_contiguous():
                raise ValueError(f"an 8-bit cache's scales must be [{kvh}, {d}], contiguous")
    if bs < _MIN_DOT or bs & (bs - 1):
        raise ValueError(f"block_size must be a power of two >= {_MIN_DOT}, got {bs}")
    return nb, bs, kvh, d


def _check_int(t: torch.Tensor, name: str, dim: int) -> None:
    if t.dtype not in (torch.int32, torch.int64) or t.dim() != dim:
        raise ValueError(f"{name} must be a {dim}-d int32/int64 tensor, got {t.dtype} {t.dim()}-d")


def _check_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None,
    rows: str,
) -> tuple[int, int, int, torch.Tensor]:
    """Shapes, strides and dtypes shared by both attention entry points; returns
    (block_size, num_kv_heads, head_dim, out)."""
    _, bs, kvh, d = _check_cache(k_cache, v_cache)
    if q.dim() != 3 or q.shape[2] != d or q.shape[1] % kvh:
        raise ValueError(
            f"q must be [{rows}, num_heads, {d}] with num_heads a multiple of {kvh}, "
            f"got {tuple(q.shape)}"
        )
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in head_dim")
    if q.dtype != k_cache.dtype and not kv_quant.is_kv8(k_cache.dtype):
        raise ValueError(f"q is {q.dtype} but the cache is {k_cache.dtype}")
    _check_int(block_tables, "block_tables", 2)
    _check_int(seq_lens, "seq_lens", 1)
    if block_tables.shape[0] != seq_lens.numel():
        raise ValueError("block_tables needs one row per sequence")
    if block_tables.stride(-1) != 1:
        raise ValueError("block_tables must be contiguous in its last dimension")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)}, contiguous in head_dim")
    return bs, kvh, d, out


def _scales(k_cache: torch.Tensor, v_cache: torch.Tensor, inverse: bool = False):
    """The kernels' KV8 code (0: a 16/32-bit cache) and the K and V scales (reciprocals with
    ``inverse``); for a 16/32-bit cache the caches themselves stand in (never read)."""
    code = kv_quant.FORMAT_CODE.get(k_cache.dtype, 0)
    if not code:
        return 0, k_cache, v_cache
    i = 1 if inverse else 0
    return code, kv_quant.scales_of(k_cache)[i], kv_quant.scales_of(v_cache)[i]


@triton.jit
def _e4m3_bits(v):
    """float32 v (|v| <= 448) as fp8 e4m3 bits, nearest even, subnormals kept: the bit steps
    of torch's conversion (csrc/elementwise.c has the same), written out so that every
    backend of Triton, its interpreter included, gives the same bits."""
    u = v.to(tl.uint32, bitcast=True)
    sign = u & 0x80000000
    u = u ^ sign
    odd = (u >> 20) & 1
    normal = (u - (120 << 23) + 0x7FFFF + odd) >> 20
    magic = 141 << 23  # 2^14: adding it rounds a subnormal's bits into place
    f = u.to(tl.float32, bitcast=True) + 16384.0
    sub = f.to(tl.uint32, bitcast=True) - magic
    bits = tl.where(u < (121 << 23), sub, normal) | (sign >> 24)
    return (bits & 0xFF).to(tl.uint8)


@triton.jit
def _quantize(x, inv, KV8: tl.constexpr):
    """float32 x times its reciprocal scales, as the cache's 8 bits (module docstring): int8
    values, or fp8 e4m3 bits (stored through a uint8 view of the cache)."""
    v = x * inv
    if KV8 == 1:  # int8: round half to even by the float32 magic number, then clamp
        v = (v + 12582912.0) - 12582912.0
        return tl.minimum(tl.maximum(v, -127.0), 127.0).to(tl.int8)
    return _e4m3_bits(tl.minimum(tl.maximum(v, -448.0), 448.0))


@triton.jit
def _head_scales(k_scale_ptr, v_scale_ptr, kvh, d, d_mask, D: tl.constexpr,
                 BLOCK_D: tl.constexpr, KV8: tl.constexpr):  # fmt: skip
    """KV head kvh's K and V scales [BLOCK_D] (an 8-bit cache's; zeros, never read, else)."""
    if KV8 != 0:
        k_sc = tl.load(k_scale_ptr + kvh * D + d, mask=d_mask, other=0.0)
        v_sc = tl.load(v_scale_ptr + kvh * D + d, mask=d_mask, other=0.0)
    else:
        k_sc = tl.zeros([BLOCK_D], dtype=tl.float32)
        v_sc = k_sc
    return k_sc, v_sc


@triton.jit
def _dequantize(x, scale, KV8: tl.constexpr, out_ty: tl.constexpr):
    """An 8-bit block [keys, D] times its channels' scales [D], in out_ty."""
    if KV8 == 0:
        return x
    return (x.to(tl.float32) * scale[None, :]).to(out_ty)


# -- store_kv ------------------------------------------------------------------------------------
@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_inv_ptr,  # 8-bit caches: [KVH, D] reciprocal scales
    v_inv_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    KVH: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV8: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    slots = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int64) + slot
    mask = (h < KVH) & (d < D) & (slots >= 0)
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    dst = slot * (KVH * D) + h * D + d
    if KV8 != 0:
        hd = (h < KVH) & (d < D)
        k_inv = tl.load(k_inv_ptr + h * D + d, mask=hd, other=1.0)
        v_inv = tl.load(v_inv_ptr + h * D + d, mask=hd, other=1.0)
        tl.store(k_cache_ptr + dst, _quantize(k.to(tl.float32), k_inv, KV8), mask=mask)
        tl.store(v_cache_ptr + dst, _quantize(v.to(tl.float32), v_inv, KV8), mask=mask)
    else:
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens], -1 = skip
) -> None:
    nb, bs, kvh, d = _check_cache(k_cache, v_cache)
    if key.shape != value.shape or key.dim() != 3 or key.shape[1:] != (kvh, d):
        raise ValueError(
            f"key and value must be [num_tokens, {kvh}, {d}], got {tuple(key.shape)} and "
            f"{tuple(value.shape)}"
        )
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value must be contiguous in head_dim")
    _check_int(slot_mapping, "slot_mapping", 1)
    if slot_mapping.numel() != key.shape[0]:
        raise ValueError("slot_mapping needs one slot per token")
    n = key.shape[0]
    if n == 0:
        return
    LAUNCHES["store_kv"] += 1
    kv8, k_inv, v_inv = _scales(k_cache, v_cache, inverse=True)
    _store_kv_kernel[(n,)](
        key,
        value,
        kv_quant.raw(k_cache) if kv8 == 2 else k_cache,  # fp8: its bits (_e4m3_bits)
        kv_quant.raw(v_cache) if kv8 == 2 else v_cache,
        slot_mapping,
        k_inv,
        v_inv,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        KVH=kvh,
        D=d,
        BLOCK_H=_pow2(kvh),
        BLOCK_D=_pow2(d),
        KV8=kv8,
    )


@triton.jit
def _attend_block(q, k, v, visible, m_i, l_i, acc, scale, IEEE: tl.constexpr):
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


# -- decode --------------------------------------------------------------------------------------
@triton.jit
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
    k_sc, v_sc = _head_scales(k_scale_ptr, v_scale_ptr, kvh, d, d_mask, D, BLOCK_D, KV8)
    start = part * PARTITION
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    offs = tl.arange(0, BS)
    for j in range(0, PARTITION // BS):
        pos0 = start + j * BS
        if pos0 < seq_len:
            blk = tl.load(block_tables_ptr + s * stride_bt + pos0 // BS).to(tl.int64)
            row = (blk * BS + offs) * (KVH * D) + kvh * D
            kv_mask = d_mask[None, :]
            k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            k = _dequantize(k, k_sc, KV8, q.dtype)
            v = _dequantize(v, v_sc, KV8, q.dtype)
            visible = (pos0 + offs)[None, :] < seq_len
            m_i, l_i, acc = _attend_block(q, k, v, visible, m_i, l_i, acc, scale, IEEE)
    base = (s * (KVH * GROUP) + heads) * max_parts + part
    tl.store(part_m_ptr + base, m_i, mask=g_mask)
    tl.store(part_l_ptr + base, l_i, mask=g_mask)
    tl.store(
        part_out_ptr + base[:, None] * D + d[None, :],
        acc,
        mask=g_mask[:, None] & d_mask[None, :],
    )


@triton.jit
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
    res = (acc / l).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + s * stride_os + h * stride_oh + d, res, mask=d_mask)


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor,  # [num_seqs]
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    bs, kvh, d, out = _check_attention(q, k_cache, v_cache, block_tables, seq_lens, out, "num_seqs")
    num_seqs, num_heads, _ = q.shape
    if seq_lens.numel() != num_seqs:
        raise ValueError("seq_lens needs one entry per query row")
    if num_seqs == 0:
        return out
    max_len = max(1, block_tables.shape[1] * bs)
    max_parts = -(-max_len // DECODE_PARTITION)
    part_out = torch.empty(num_seqs, num_heads, max_parts, d, dtype=torch.float32, device=q.device)
    part_m = torch.empty(num_seqs, num_heads, max_parts, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    group = num_heads // kvh
    LAUNCHES["paged_decode_attention"] += 1
    kv8, k_scale, v_scale = _scales(k_cache, v_cache)
    _decode_partition_kernel[(num_seqs, kvh, max_parts)](
        q,
        k_cache,
        v_cache,
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
        KVH=kvh,
        GROUP=group,
        D=d,
        BS=bs,
        BLOCK_G=max(_MIN_DOT, _pow2(group)),
        BLOCK_D=max(_MIN_DOT, _pow2(d)),
        PARTITION=DECODE_PARTITION,
        IEEE=q.dtype == torch.float32,
        KV8=kv8,
    )
    _decode_reduce_kernel[(num_seqs, num_heads)](
        part_out,
        part_m,
        part_l,
        seq_lens,
        out,
        out.stride(0),
        out.stride(1),
        max_parts,
        NUM_HEADS=num_heads,
        D=d,
        BLOCK_D=_pow2(d),
        PARTITION=DECODE_PARTITION,
    )
    return out


# -- prefill -------------------------------------------------------------------------------------
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
    key = (max(64, _pow2(head_dim)), width)
    if key not in PREFILL_CONFIGS:
        raise ValueError(f"no prefill configuration for head_dim {head_dim} ({dtype})")
    return PREFILL_CONFIGS[key]


@triton.jit
def _prefill_tile(
    q, k_cache_ptr, v_cache_ptr, table_row_ptr, kvh, n0, seq_len, k_sc, v_sc, q_pos, m_i, l_i,
    acc, qk_scale, d, d_mask,
    KVH: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, IEEE: tl.constexpr, KV8: tl.constexpr,
):  # fmt: skip
    """Keys [n0, n0 + BLOCK_N) of one sequence into the rows' running (max, sum, values), in
    log2 units; MASKED: the causal mask and the context's end applied (the diagonal tiles)."""
    keys = n0 + tl.arange(0, BLOCK_N)
    in_ctx = keys < seq_len
    blk = tl.load(table_row_ptr + keys // BS, mask=in_ctx, other=0).to(tl.int64)
    row = (blk * BS + keys % BS) * (KVH * D) + kvh * D
    kv_mask = in_ctx[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    k = _dequantize(k, k_sc, KV8, q.dtype)
    v = _dequantize(v, v_sc, KV8, q.dtype)
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


@triton.jit
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
    KVH: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
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
        k_sc, v_sc = _head_scales(k_scale_ptr, v_scale_ptr, kvh, d, d_mask, D, BLOCK_D, KV8)
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
                q_pos, m_i, l_i, acc, qk_scale, d, d_mask,
                KVH, D, BS, BLOCK_N, False, IEEE, KV8,
            )  # fmt: skip
        for j in range(whole, last // BLOCK_N + 1):
            m_i, l_i, acc = _prefill_tile(
                q, k_cache_ptr, v_cache_ptr, table_row, kvh, j * BLOCK_N, seq_len, k_sc, v_sc,
                q_pos, m_i, l_i, acc, qk_scale, d, d_mask,
                KVH, D, BS, BLOCK_N, True, IEEE, KV8,
            )  # fmt: skip
        res = acc / l_i[:, None]
        tl.store(
            out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            res.to(out_ptr.dtype.element_ty),
            mask=r_mask[:, None] & d_mask[None, :],
        )


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1]
    seq_lens: torch.Tensor,  # [num_seqs]
    scale: float,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix plus themselves
    (varlen), in tiles of query rows and keys (``_prefill_kernel``)."""
    bs, kvh, d, out = _check_attention(
        q, k_cache, v_cache, block_tables, seq_lens, out, "num_tokens"
    )
    _check_int(cu_seqlens_q, "cu_seqlens_q", 1)
    num_seqs = seq_lens.numel()
    if cu_seqlens_q.numel() != num_seqs + 1:
        raise ValueError("cu_seqlens_q needs num_seqs + 1 entries")
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    num_heads = q.shape[1]
    group = num_heads // kvh
    block_m, block_n, warps, stages = prefill_config(d, q.dtype)
    block_m = max(block_m, _pow2(group))  # a tile holds whole tokens
    grid = (num_seqs, kvh, -(-max_query_len * group // block_m))
    LAUNCHES["paged_prefill_attention"] += 1
    kv8, k_scale, v_scale = _scales(k_cache, v_cache)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        seq_lens,
        k_scale,
        v_scale,
        out,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        KVH=kvh,
        GROUP=group,
        D=d,
        BS=bs,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(_MIN_DOT, _pow2(d)),
        IEEE=q.dtype == torch.float32,
        KV8=kv8,
        num_warps=warps,
        num_stages=stages,
    )
    return out
