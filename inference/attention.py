"""Paged attention: the metadata object and the torch reference backend.

KV layout (CONTRACTS.md, "Paged KV layout and kernels"): per layer ``k_cache``/``v_cache`` of
shape ``[num_blocks, block_size, num_kv_heads, head_dim]``; ``slot_mapping[t] = block_id *
block_size + offset`` (-1: do not store); ``block_tables`` int32 ``[num_seqs, max_blocks]``
padded with 0; ``seq_lens`` the context length including this step's new tokens.

Batch invariance: a query's output must not depend on how many queries or sequences are
computed with it, nor on how its prompt was chunked. The reference path therefore
- computes prefill queries in slabs of ``PREFILL_QUERY_SLAB`` rows, padded, so every score and
  value product of a prefill has the same shape whatever the chunk length;
- reduces over keys in tiles of ``KEY_TILE`` keys, in order from key 0, with an online softmax;
  tiles wholly after a query contribute exact zeros, so they can be skipped;
- handles one sequence per call, so batching sequences changes nothing.
Decode tokens (one new token after a sampled one) take a shorter path of their own: one
product over the whole context. It is invariant to batching by the same per-sequence rule,
but its rounding differs from a prompt chunk's, so a prompt chunk of one token still takes the
prefill path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

PREFILL_QUERY_SLAB = 64  # queries per prefill score product (padded)
KEY_TILE = 512  # keys per reduction step; a multiple of every supported block size


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one engine step; passed explicitly to every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, flat slot per new token, -1 = skip
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32, context incl. this step's tokens
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32, offsets of each sequence's new tokens
    # host copies, so the CPU path never syncs on device tensors
    seq_lens_list: list[int]
    query_lens_list: list[int]
    num_blocks_list: list[int]
    is_decode_list: list[bool]  # True: the sequence's one new token is a decode token
    # per-step index work shared by all layers (decode gather rows per sequence)
    scratch: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @classmethod
    def build(
        cls,
        block_tables: list[list[int]],
        seq_lens: list[int],
        query_lens: list[int],
        block_size: int,
        device: torch.device | str = "cpu",
        is_decode: list[bool] | None = None,
    ) -> AttentionMetadata:
        """Metadata for sequences whose last ``query_lens[i]`` of ``seq_lens[i]`` tokens are new.

        ``is_decode[i]`` marks a decode token (default: none; every chunk is a prompt chunk).
        """
        slots: list[int] = []
        for table, sl, ql in zip(block_tables, seq_lens, query_lens, strict=True):
            for pos in range(sl - ql, sl):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        max_blocks = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        cu = [0]
        for ql in query_lens:
            cu.append(cu[-1] + ql)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(
                len(block_tables), max_blocks
            ),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            seq_lens_list=list(seq_lens),
            query_lens_list=list(query_lens),
            num_blocks_list=[-(-sl // block_size) for sl in seq_lens],
            is_decode_list=list(is_decode) if is_decode is not None else [False] * len(seq_lens),
        )


def store_kv_reference(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Scatter new K/V rows into the paged cache; slots of -1 are skipped."""
    nb, bs, kvh, d = k_cache.shape
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_cache.view(nb * bs, kvh, d).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(nb * bs, kvh, d).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _gather_kv(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[kvh, len(block_ids) * block_size, d]: one sequence's cache positions, in order.

    Whole blocks are gathered as flat rows, several times faster on CPU than indexing the
    4-d cache."""
    nb, bs, kvh, d = cache.shape
    rows = cache.view(nb, bs * kvh * d).index_select(0, block_ids)
    return rows.view(-1, kvh, d).permute(1, 0, 2)


def _head_major_rows(block_ids: torch.Tensor, block_size: int, kvh: int) -> torch.Tensor:
    """Flat cache rows (``slot * kvh + head``) of a sequence's keys, ordered [head, position]:
    gathering them yields ``[kvh, positions, d]`` contiguous, ready for the products."""
    slots = (
        block_ids.view(-1, 1) * block_size + torch.arange(block_size, device=block_ids.device)
    ).view(1, -1)
    return (slots * kvh + torch.arange(kvh, device=block_ids.device).view(-1, 1)).view(-1)


def _decode_one(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: torch.Tensor,
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    """q: [H, d] of one decode token at position seq_len - 1 -> [H, d] float32. ``rows`` from
    ``_head_major_rows``."""
    num_heads, d = q.shape
    kvh = k_cache.shape[2]
    keys = k_cache.view(-1, d).index_select(0, rows).view(kvh, -1, d)  # [kvh, nblk * bs, d]
    values = v_cache.view(-1, d).index_select(0, rows).view(kvh, -1, d)
    qg = q.view(kvh, num_heads // kvh, d)
    s = torch.matmul(qg, keys.transpose(1, 2)).float() * scale  # [kvh, g, nblk * bs]
    s[..., seq_len:] = float("-inf")
    p = torch.softmax(s, dim=-1)
    o = torch.matmul(p.to(values.dtype), values)  # [kvh, g, d]
    return o.reshape(num_heads, d)


def _attend_queries(
    q: torch.Tensor,  # [kvh, M, d] queries grouped by KV head (M = group * num_queries)
    q_pos: torch.Tensor,  # [M] absolute positions
    keys: torch.Tensor,  # [kvh, n_tiles * KEY_TILE, d]
    values: torch.Tensor,  # [kvh, n_tiles * KEY_TILE, d]
    scale: float,
) -> torch.Tensor:  # [kvh, M, d] float32
    n_tiles = keys.shape[1] // KEY_TILE
    m = l = acc = None
    for t in range(n_tiles):
        lo = t * KEY_TILE
        k_t = keys[:, lo : lo + KEY_TILE]
        s = torch.matmul(q, k_t.transpose(1, 2)).float() * scale  # [kvh, M, T]
        key_pos = torch.arange(lo, lo + KEY_TILE, device=q.device)
        s.masked_fill_(key_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        s_max = s.amax(dim=-1)
        if m is None:  # tile 0 holds key 0, which every query sees
            m_new = s_max
            p = torch.exp(s - m_new[..., None])
            l = p.sum(dim=-1)
            acc = torch.matmul(p.to(values.dtype), values[:, lo : lo + KEY_TILE]).float()
        else:
            m_new = torch.maximum(m, s_max)
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new[..., None])
            l = l * alpha + p.sum(dim=-1)
            pv = torch.matmul(p.to(values.dtype), values[:, lo : lo + KEY_TILE]).float()
            acc = acc * alpha[..., None] + pv
        m = m_new
    return acc / l[..., None]


def paged_attention_reference(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached context plus themselves.

    Query j of a sequence with ``q_len`` new tokens sits at position ``seq_len - q_len + j``
    and attends to positions ``<= seq_len - q_len + j``. KV must already be stored.
    """
    num_tokens, num_heads, d = q.shape
    kvh = k_cache.shape[2]
    group = num_heads // kvh
    if out is None:
        out = torch.empty_like(q)
    bs = k_cache.shape[1]
    start = 0
    for i, (sl, ql, nblk, decode) in enumerate(
        zip(
            meta.seq_lens_list,
            meta.query_lens_list,
            meta.num_blocks_list,
            meta.is_decode_list,
            strict=True,
        )
    ):
        block_ids = meta.block_tables[i, :nblk].to(torch.int64)
        if decode:
            rows = meta.scratch.get(i)
            if rows is None:
                rows = meta.scratch[i] = _head_major_rows(block_ids, bs, kvh)
            out[start] = _decode_one(q[start], k_cache, v_cache, rows, sl, scale)
            start += 1
            continue
        first_pos = sl - ql
        slab = PREFILL_QUERY_SLAB
        all_len = -(-sl // KEY_TILE) * KEY_TILE
        # pad with block 0 (finite; fully masked) up to a whole number of key tiles
        pad = all_len // bs - nblk
        if pad:
            block_ids = torch.cat([block_ids, block_ids.new_zeros(pad)])
        all_keys = _gather_kv(k_cache, block_ids)
        all_values = _gather_kv(v_cache, block_ids)
        for s0 in range(0, ql, slab):
            n = min(slab, ql - s0)
            last_pos = first_pos + s0 + n - 1
            key_len = -(-(last_pos + 1) // KEY_TILE) * KEY_TILE
            keys, values = all_keys[:, :key_len], all_values[:, :key_len]
            pos = torch.arange(first_pos + s0, first_pos + s0 + slab, device=q.device)
            qs = q.new_zeros(slab, num_heads, d)  # padded to a full slab: shapes never change
            qs[:n] = q[start + s0 : start + s0 + n]
            if n < slab:
                pos[n:] = last_pos
            # [slab, kvh, group, d] -> [kvh, group * slab, d]; row = g * slab + j
            qg = qs.view(slab, kvh, group, d).permute(1, 2, 0, 3).reshape(kvh, group * slab, d)
            o = _attend_queries(qg, pos.repeat(group), keys, values, scale)
            o = o.view(kvh, group, slab, d).permute(2, 0, 1, 3).reshape(slab, num_heads, d)
            out[start + s0 : start + s0 + n] = o[:n].to(out.dtype)
        start += ql
    return out
