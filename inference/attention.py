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


# Fused per-tile attention on CPU (blocked, vectorized; returns the tile's output and the
# log-sum-exp of each row, which is all a merge across tiles needs).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


DECODE_TILE = 128  # keys per decode product: the granularity at which sequences share keys
DECODE_SLAB = 32  # query rows per decode product (padded): fixed, so rows never interact


@dataclass(slots=True)
class _DecodePlan:
    """How a step's decode tokens are grouped, built once per step and used by every layer.

    Every decode sequence's context is cut into tiles of ``DECODE_TILE`` keys from key 0.
    Tiles with the same blocks (the same cached prefix, e.g. one manual asked about by many
    users) form one group, and each group is computed once for all its sequences: the shared
    keys are read once and the queries of up to ``slab_seqs`` sequences share one product."""

    q_index: torch.Tensor  # [G, S] query row of each slot (padding slots repeat a real row)
    blocks: torch.Tensor  # [G * blocks per tile] block ids of each group's tile
    bias: torch.Tensor  # [G, 1, S * group, tile] 0 where a row may see the key, -inf past it
    seq_rows: torch.Tensor  # [D] query row of each decode sequence
    slot_g: torch.Tensor  # [D, max tiles] group of (sequence, tile) (0 where absent)
    slot_s: torch.Tensor  # [D, max tiles] slot within that group
    absent: torch.Tensor  # [D, max tiles, 1, 1] True past a sequence's last tile
    last_tile: torch.Tensor  # [D] index of each sequence's last tile
    slab_seqs: int


def _decode_plan(meta: AttentionMetadata, block_size: int, group: int, device) -> _DecodePlan:
    key = ("decode", block_size, group)
    plan = meta.scratch.get(key)
    if plan is not None:
        return plan
    per_tile = max(1, DECODE_TILE // block_size)
    tile = per_tile * block_size
    slab_seqs = max(1, DECODE_SLAB // group)
    groups: dict[tuple, list[int]] = {}  # (tile index, blocks) -> decode sequence numbers
    seq_rows, seq_lens, seq_tiles = [], [], []
    start = 0
    for i, (sl, ql, dec) in enumerate(
        zip(meta.seq_lens_list, meta.query_lens_list, meta.is_decode_list, strict=True)
    ):
        if dec:
            n = len(seq_rows)
            seq_rows.append(start)
            seq_lens.append(sl)
            table = meta.block_tables[i].tolist()
            n_tiles = -(-sl // tile)
            seq_tiles.append(n_tiles)
            nblk = -(-sl // block_size)
            for t in range(n_tiles):
                ids = tuple(table[t * per_tile : min((t + 1) * per_tile, nblk)])
                groups.setdefault((t, ids), []).append(n)
        start += ql
    q_index, blocks, tile_start, slot_len = [], [], [], []
    max_tiles = max(seq_tiles)
    placement: list[tuple[int, int, int, int]] = []  # (sequence, tile, group, slot)
    for (t, ids), members in groups.items():
        for c in range(0, len(members), slab_seqs):
            chunk = members[c : c + slab_seqs]
            g = len(q_index)
            pad = slab_seqs - len(chunk)
            q_index.append([seq_rows[m] for m in chunk] + [seq_rows[chunk[0]]] * pad)
            blocks.extend(list(ids) + [0] * (per_tile - len(ids)))
            tile_start.append(t * tile)
            slot_len.append([seq_lens[m] for m in chunk] + [2**30] * pad)
            for k, m in enumerate(chunk):
                placement.append((m, t, g, k))
    slot_g = torch.zeros((len(seq_rows), max_tiles), dtype=torch.int64)
    slot_s = torch.zeros_like(slot_g)
    absent = torch.ones((len(seq_rows), max_tiles, 1, 1), dtype=torch.bool)
    for m, t, g, k in placement:
        slot_g[m, t], slot_s[m, t], absent[m, t] = g, k, False
    lens_rows = torch.tensor(slot_len, dtype=torch.int64).repeat_interleave(group, dim=1)
    key_pos = torch.tensor(tile_start).view(-1, 1, 1) + torch.arange(tile).view(1, 1, -1)
    bias = torch.zeros(key_pos.shape[0], lens_rows.shape[1], tile)
    bias.masked_fill_(key_pos >= lens_rows.view(len(q_index), -1, 1), float("-inf"))
    plan = _DecodePlan(
        q_index=torch.tensor(q_index, dtype=torch.int64, device=device),
        blocks=torch.tensor(blocks, dtype=torch.int64, device=device),
        bias=bias.view(len(q_index), 1, -1, tile).to(device),
        seq_rows=torch.tensor(seq_rows, dtype=torch.int64, device=device),
        slot_g=slot_g.to(device),
        slot_s=slot_s.to(device),
        absent=absent.to(device),
        last_tile=torch.tensor([n - 1 for n in seq_tiles], dtype=torch.int64, device=device),
        slab_seqs=slab_seqs,
    )
    meta.scratch[key] = plan
    return plan


def _decode_attention(
    q: torch.Tensor,  # [num_tokens, H, d]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: _DecodePlan,
    scale: float,
) -> torch.Tensor:  # [D, H, d] float32, in plan.seq_rows order
    """Decode attention of all decode sequences of a step, tile groups at once.

    Per group: scores of ``[S * group, d] x [d, tile]`` per KV head in one batched product
    of fixed shape, the tile's own max, exp-sum and weighted values; then each sequence merges
    its tiles in order 0, 1, ... (a running sum, exact for absent tiles), so a sequence's result
    does not depend on which other sequences share the step or its groups.
    """
    num_tokens, num_heads, d = q.shape
    nb, bs, kvh, _ = k_cache.shape
    group = num_heads // kvh
    G, S = plan.q_index.shape  # noqa: N806
    rows = S * group
    tile = plan.blocks.numel() // G * bs
    qg = q[plan.q_index].view(G, S, kvh, group, d).permute(0, 2, 1, 3, 4)
    qg = qg.reshape(G, kvh, rows, d)
    keys = k_cache.view(nb, -1).index_select(0, plan.blocks).view(G, tile, kvh, d)
    values = v_cache.view(nb, -1).index_select(0, plan.blocks).view(G, tile, kvh, d)
    values = values.permute(0, 2, 1, 3).contiguous()  # [G, kvh, tile, d]
    if _FLASH_CPU is not None and q.device.type == "cpu":
        # fused per group tile: normalized output and each row's log-sum-exp
        keys = keys.permute(0, 2, 1, 3).contiguous()  # [G, kvh, tile, d]
        if plan.bias.dtype != q.dtype:  # once per step: every layer shares the plan
            plan.bias = plan.bias.to(q.dtype)
        o_t, m_t = _FLASH_CPU(qg, keys, values, 0.0, False, attn_mask=plan.bias, scale=scale)
        o_t = o_t.float()
        l_t = torch.ones_like(m_t)
    else:
        keys = keys.permute(0, 2, 3, 1).contiguous()  # [G, kvh, d, tile]
        s = torch.matmul(qg, keys).float().mul_(scale).add_(plan.bias.float())
        m_t = s.amax(dim=-1)  # [G, kvh, rows]
        p = torch.exp(s - m_t[..., None])
        l_t = p.sum(dim=-1)
        o_t = torch.matmul(p.to(values.dtype), values).float()  # [G, kvh, rows, d]

    gi, si = plan.slot_g, plan.slot_s
    m_all = m_t.view(G, kvh, S, group)[gi, :, si]  # [D, tiles, kvh, group]
    m_all.masked_fill_(plan.absent, float("-inf"))
    l_all = l_t.view(G, kvh, S, group)[gi, :, si]
    o_all = o_t.view(G, kvh, S, group, d)[gi, :, si]  # [D, tiles, kvh, group, d]
    m = m_all.amax(dim=1, keepdim=True)
    w = torch.exp(m_all - m)  # absent tiles: 0
    last = plan.last_tile.view(-1, 1, 1, 1)
    l_sum = torch.cumsum(w * l_all, dim=1).gather(1, last.expand(-1, 1, kvh, group))
    idx = last.view(-1, 1, 1, 1, 1).expand(-1, 1, kvh, group, d)
    o_sum = torch.cumsum(w[..., None] * o_all, dim=1).gather(1, idx)
    return (o_sum[:, 0] / l_sum[:, 0, ..., None]).reshape(-1, num_heads, d)


def _slab_positions(first: int, n: int, group: int, device) -> torch.Tensor:
    """[group * PREFILL_QUERY_SLAB] positions of a slab's query rows (row = g * slab + j); the
    padding rows repeat the last real position."""
    pos = torch.arange(first, first + PREFILL_QUERY_SLAB, device=device)
    pos[n:] = first + n - 1
    return pos.repeat(group)


def _attend_queries(
    q: torch.Tensor,  # [kvh, M, d] queries grouped by KV head (M = group * slab)
    keys: torch.Tensor,  # [kvh, n_tiles * KEY_TILE, d]
    values: torch.Tensor,  # [kvh, n_tiles * KEY_TILE, d]
    scale: float,
    first_pos: int,  # position of the slab's first query
    n: int,  # real queries in the slab
    scratch: dict,  # per-step cache: positions and masks are the same for every layer
    group: int,
) -> torch.Tensor:  # [kvh, M, d] float32
    """Each key tile is attended on its own (fixed shapes: a slab of queries against
    ``KEY_TILE`` keys), then tiles merge in order by their rows' log-sum-exp."""
    key = ("slab", first_pos, n, group)
    q_pos = scratch.get(key)
    if q_pos is None:
        q_pos = scratch[key] = _slab_positions(first_pos, n, group, q.device)
    if _FLASH_CPU is None or q.device.type != "cpu":
        return _attend_queries_unfused(q, q_pos, keys, values, scale, first_pos)
    n_tiles = keys.shape[1] // KEY_TILE
    lse = acc = None
    for t in range(n_tiles):
        lo = t * KEY_TILE
        k_t = keys[None, :, lo : lo + KEY_TILE]
        v_t = values[None, :, lo : lo + KEY_TILE]
        mask = dead = None
        if lo + KEY_TILE - 1 > first_pos:  # some key lies after some query
            mkey = ("mask", first_pos, n, group, lo, q.dtype)
            if mkey not in scratch:
                key_pos = torch.arange(lo, lo + KEY_TILE, device=q.device)
                m = torch.zeros(q.shape[1], KEY_TILE, dtype=q.dtype, device=q.device)
                m.masked_fill_(key_pos[None, :] > q_pos[:, None], float("-inf"))
                scratch[mkey] = (m, (q_pos < lo)[None, :])
            mask, dead = scratch[mkey]
        o_t, lse_t = _FLASH_CPU(q[None], k_t, v_t, 0.0, False, attn_mask=mask, scale=scale)
        o_t, lse_t = o_t[0].float(), lse_t[0]
        if acc is None:  # tile 0 holds key 0, which every query sees
            acc, lse = o_t, lse_t
            continue
        if dead is not None:  # rows that see no key of this tile take no part in it
            lse_t = lse_t.masked_fill(dead, float("-inf"))
        new = torch.logaddexp(lse, lse_t)
        acc = acc * torch.exp(lse - new)[..., None] + o_t * torch.exp(lse_t - new)[..., None]
        lse = new
    return acc


def _attend_queries_unfused(
    q: torch.Tensor,  # [kvh, M, d] queries grouped by KV head (M = group * num_queries)
    q_pos: torch.Tensor,  # [M] absolute positions
    keys: torch.Tensor,  # [kvh, n_tiles * KEY_TILE, d]
    values: torch.Tensor,  # [kvh, n_tiles * KEY_TILE, d]
    scale: float,
    first_pos: int = 0,  # the smallest of q_pos: tiles wholly before it need no mask
) -> torch.Tensor:  # [kvh, M, d] float32
    n_tiles = keys.shape[1] // KEY_TILE
    m = l = acc = None
    for t in range(n_tiles):
        lo = t * KEY_TILE
        k_t = keys[:, lo : lo + KEY_TILE]
        s = torch.matmul(q, k_t.transpose(1, 2)).float().mul_(scale)  # [kvh, M, T]
        if lo + KEY_TILE - 1 > first_pos:  # some key lies after some query
            key_pos = torch.arange(lo, lo + KEY_TILE, device=q.device)
            s.masked_fill_(key_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        s_max = s.amax(dim=-1)
        if m is None:  # tile 0 holds key 0, which every query sees
            m_new = s_max
            p = s.sub_(m_new[..., None]).exp_()
            l = p.sum(dim=-1)
            acc = torch.matmul(p.to(values.dtype), values[:, lo : lo + KEY_TILE]).float()
        else:
            m_new = torch.maximum(m, s_max)
            alpha = torch.exp(m - m_new)
            p = s.sub_(m_new[..., None]).exp_()
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
    any_decode = False
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
        if decode:
            any_decode = True
            start += 1
            continue
        first_pos = sl - ql
        slab = PREFILL_QUERY_SLAB
        block_ids = meta.scratch.get(("prefill blocks", i))
        if block_ids is None:
            # pad with block 0 (finite; fully masked) up to a whole number of key tiles
            pad = -(-sl // KEY_TILE) * KEY_TILE // bs - nblk
            block_ids = meta.block_tables[i, :nblk].to(torch.int64)
            if pad:
                block_ids = torch.cat([block_ids, block_ids.new_zeros(pad)])
            meta.scratch[("prefill blocks", i)] = block_ids
        all_keys = _gather_kv(k_cache, block_ids)
        all_values = _gather_kv(v_cache, block_ids)
        for s0 in range(0, ql, slab):
            n = min(slab, ql - s0)
            last_pos = first_pos + s0 + n - 1
            key_len = -(-(last_pos + 1) // KEY_TILE) * KEY_TILE
            keys, values = all_keys[:, :key_len], all_values[:, :key_len]
            qs = q.new_zeros(slab, num_heads, d)  # padded to a full slab: shapes never change
            qs[:n] = q[start + s0 : start + s0 + n]
            # [slab, kvh, group, d] -> [kvh, group * slab, d]; row = g * slab + j
            qg = qs.view(slab, kvh, group, d).permute(1, 2, 0, 3).reshape(kvh, group * slab, d)
            o = _attend_queries(qg, keys, values, scale, first_pos + s0, n, meta.scratch, group)
            o = o.view(kvh, group, slab, d).permute(2, 0, 1, 3).reshape(slab, num_heads, d)
            out[start + s0 : start + s0 + n] = o[:n].to(out.dtype)
        start += ql
    if any_decode:
        plan = _decode_plan(meta, bs, group, q.device)
        o = _decode_attention(q, k_cache, v_cache, plan, scale)
        out.index_copy_(0, plan.seq_rows, o.to(out.dtype))
    return out


# -- backends ------------------------------------------------------------------------------------
BACKENDS = ("auto", "torch", "triton")


def resolve_backend(name: str | None, device: torch.device) -> str:
    """``auto``: Triton kernels on CUDA, the torch reference on CPU. ``triton`` on a CPU needs
    ``TRITON_INTERPRET=1`` (tests); ``DOCQA_ATTENTION_BACKEND`` sets the default."""
    import os

    name = (name or os.environ.get("DOCQA_ATTENTION_BACKEND") or "auto").lower()
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the triton backend needs a CUDA device (or TRITON_INTERPRET=1)")
    return name


class TorchBackend:
    name = "torch"

    def store_kv(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        store_kv_reference(key, value, k_cache, v_cache, meta.slot_mapping)

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        return paged_attention_reference(q, k_cache, v_cache, meta, scale)


class TritonBackend:
    """The Triton kernels: decode tokens through ``paged_decode_attention``, prompt chunks
    through ``paged_prefill_attention``, each on its own rows, so a decode token's result does
    not depend on whether prompt chunks share its step."""

    name = "triton"

    def __init__(self):
        from inference import triton_attention

        self.k = triton_attention

    def store_kv(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        self.k.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)

    def _split(self, meta: AttentionMetadata, device):
        plan = meta.scratch.get("triton")
        if plan is not None:
            return plan
        dec_rows, dec_seqs, pre_rows, pre_seqs, cu, max_q = [], [], [], [], [0], 0
        start = 0
        for i, (ql, dec) in enumerate(zip(meta.query_lens_list, meta.is_decode_list, strict=True)):
            if dec:
                dec_rows.append(start)
                dec_seqs.append(i)
            else:
                pre_rows.extend(range(start, start + ql))
                pre_seqs.append(i)
                cu.append(cu[-1] + ql)
                max_q = max(max_q, ql)
            start += ql

        def t(x):
            return torch.tensor(x, dtype=torch.int64, device=device)

        bt, sl = meta.block_tables, meta.seq_lens
        plan = {
            "dec_rows": t(dec_rows),
            "dec_tables": bt[t(dec_seqs)].contiguous() if dec_seqs else None,
            "dec_lens": sl[t(dec_seqs)].contiguous() if dec_seqs else None,
            "pre_rows": t(pre_rows),
            "pre_tables": bt[t(pre_seqs)].contiguous() if pre_seqs else None,
            "pre_lens": sl[t(pre_seqs)].contiguous() if pre_seqs else None,
            "cu": torch.tensor(cu, dtype=torch.int32, device=device),
            "max_q": max_q,
        }
        meta.scratch["triton"] = plan
        return plan

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        p = self._split(meta, q.device)
        out = torch.empty_like(q)
        if p["dec_tables"] is not None:
            o = self.k.paged_decode_attention(
                q.index_select(0, p["dec_rows"]),
                k_cache,
                v_cache,
                p["dec_tables"],
                p["dec_lens"],
                scale,
            )
            out.index_copy_(0, p["dec_rows"], o)
        if p["pre_tables"] is not None:
            o = self.k.paged_prefill_attention(
                q.index_select(0, p["pre_rows"]),
                k_cache,
                v_cache,
                p["pre_tables"],
                p["cu"],
                p["pre_lens"],
                scale,
                max_query_len=p["max_q"],
            )
            out.index_copy_(0, p["pre_rows"], o)
        return out


def make_backend(name: str) -> TorchBackend | TritonBackend:
    return TritonBackend() if name == "triton" else TorchBackend()
