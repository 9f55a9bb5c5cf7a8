"""The torch reference of paged attention (any device, any dtype), over the layout of
``inference/attention/metadata.py``.

Batch invariance: a query's output must not depend on how many queries or sequences are
computed with it, nor on how its prompt was chunked. The reference path therefore works in
fixed shapes, the same for every step:
- a query token at position ``p`` attends its context in tiles of ``tile`` keys from key 0
  (tiles ``0 .. p // tile``); the last tile is masked past ``p``;
- every (query token, key tile) pair is one slot of a *work item*: a product of a fixed number
  of query rows against one tile's keys. Tokens whose tile holds the same blocks (one
  sequence's consecutive prompt tokens, or many sequences asking about one cached manual) share
  an item, so shared keys are read once; padding slots repeat a real row;
- all items of a step go through one fused attention call per layer, which returns each row's
  output and log-sum-exp; each token then merges its own tiles in order 0, 1, ... .
A row's result depends only on its query, its position and its tiles' keys: never on which
other tokens share its items or its step. Prompt tokens and decode tokens (one new token after
a sampled one) form two families with their own shapes: prompt tokens in items of
``PREFILL_SLAB`` tokens over ``PREFILL_TILE`` keys, decode tokens in items of ``DECODE_SLAB``
query rows over ``DECODE_TILE`` keys. A prompt chunk of one token still belongs to the prompt
family, so chunking never changes which family a token is computed in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference import kv_quant
from inference.attention.metadata import AttentionMetadata

PREFILL_TILE = 512  # keys per prompt-token work item; a multiple of every supported block size
PREFILL_SLAB = 32  # prompt tokens per work item (times the query heads per KV head: rows)
DECODE_TILE = 128  # keys per decode work item: the granularity at which sequences share keys
DECODE_SLAB = 32  # query rows per decode work item (whole tokens: 32 // group of them)
SHARED_TILE_ITEMS = 4  # items reading one tile that make it worth a call of its own


def store_kv_reference(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """Scatter new K/V rows into the paged cache; slots of -1 are skipped (which rows those
    are is worked out once per step, for every layer)."""
    rows = meta.scratch.get("store-rows", False)
    if rows is False:
        keep = meta.slot_mapping >= 0
        rows = None if bool(keep.all()) else keep.nonzero().flatten()
        meta.scratch["store-rows"] = rows
    slots = meta.slot_mapping
    if rows is not None:
        key, value, slots = key[rows], value[rows], slots[rows]
    nb, bs, kvh, d = k_cache.shape
    if kv_quant.is_kv8(k_cache.dtype):  # quantized with the layer's scales (kv_quant)
        key = kv_quant.quantize(key, kv_quant.scales_of(k_cache)[1], k_cache.dtype)
        value = kv_quant.quantize(value, kv_quant.scales_of(v_cache)[1], v_cache.dtype)
        k_cache, v_cache = kv_quant.raw(k_cache), kv_quant.raw(v_cache)
        key, value = kv_quant.raw(key), kv_quant.raw(value)
    k_cache.view(nb * bs, kvh, d).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(nb * bs, kvh, d).index_copy_(0, slots, value.to(v_cache.dtype))


# Fused per-tile attention on CPU (blocked, vectorized; returns the tile's output and the
# log-sum-exp of each row, which is all a merge across tiles needs).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass(slots=True)
class _TilePlan:
    """How one family of a step's query tokens is cut into work items, built once per step and
    used by every layer.

    ``G`` items of ``S`` token slots each, ``D`` tokens, each token in up to ``max tiles``
    items (one per tile of its context)."""

    q_index: torch.Tensor  # [G, S] query row of each slot (padding slots repeat a real row)
    blocks: torch.Tensor  # [G * blocks per tile] block ids of each item's tile
    bias: torch.Tensor  # [G, 1, S * group, tile] 0 where a row may see the key, -inf past it
    rows: torch.Tensor  # [D] query row of each token
    slot_g: torch.Tensor  # [D, max tiles] item of (token, tile) (0 where absent)
    slot_s: torch.Tensor  # [D, max tiles] slot within that item
    absent: torch.Tensor  # [D, max tiles, 1, 1] True past a token's last tile
    last_tile: torch.Tensor  # [D] index of each token's last tile
    # how the items are computed (the results do not depend on it: every item has the same
    # shape): tiles that many items read (a long prompt chunk) are gathered once and read by
    # all their items in one call; the other items go through one call with their tiles
    # gathered item by item
    shared: list[tuple[torch.Tensor, int, int]]  # (tile's block ids, first item, end item)
    rest: torch.Tensor | None  # [items] not in ``shared``; None when every item is
    rest_blocks: torch.Tensor | None  # block ids of the ``rest`` items' tiles
    rest_bias: torch.Tensor | None  # ``bias`` of the ``rest`` items
    merge_by_tile: bool  # prompt tokens merge tile by tile, decode tokens all tiles at once


def _tile_plan(
    meta: AttentionMetadata,
    block_size: int,
    group: int,
    device,
    decode: bool,
) -> _TilePlan | None:
    """The work items of the step's decode tokens (``decode``) or prompt tokens; None when
    the step has none."""
    key = ("tiles", decode, block_size, group)
    if key in meta.scratch:
        return meta.scratch[key]
    tile_keys = DECODE_TILE if decode else PREFILL_TILE
    per_tile = max(1, tile_keys // block_size)
    tile = per_tile * block_size
    slab = max(1, DECODE_SLAB // group) if decode else PREFILL_SLAB
    groups: dict[tuple, list[int]] = {}  # (tile index, blocks) -> token numbers
    rows, pos, tiles_of = [], [], []
    host_tables = meta.host_block_tables()
    start = 0
    for i, (sl, ql, dec) in enumerate(
        zip(meta.seq_lens_list, meta.query_lens_list, meta.is_decode_list, strict=True)
    ):
        if dec != decode or sl == 0:  # another family, or a padding row (attends nothing)
            start += ql
            continue
        table = host_tables[i].tolist()
        nblk = -(-sl // block_size)
        tile_ids = [
            tuple(table[t * per_tile : min((t + 1) * per_tile, nblk)])
            for t in range(-(-sl // tile))
        ]
        for j in range(ql):
            p = sl - ql + j
            n = len(rows)
            rows.append(start + j)
            pos.append(p)
            tiles_of.append(p // tile + 1)
            for t in range(p // tile + 1):
                groups.setdefault((t, tile_ids[t]), []).append(n)
        start += ql
    if not rows:
        meta.scratch[key] = None
        return None
    q_index, blocks, tile_start, slot_pos = [], [], [], []
    placement: list[tuple[int, int, int, int]] = []  # (token, tile, item, slot)
    shared_tiles: list[tuple[list[int], int, int]] = []
    rest: list[int] = []
    for (t, ids), members in groups.items():
        first = len(q_index)
        n_items = -(-len(members) // slab)
        if n_items >= SHARED_TILE_ITEMS:
            shared_tiles.append((list(ids) + [0] * (per_tile - len(ids)), first, first + n_items))
        else:
            rest.extend(range(first, first + n_items))
        for c in range(0, len(members), slab):
            chunk = members[c : c + slab]
            g = len(q_index)
            pad = slab - len(chunk)
            q_index.append([rows[m] for m in chunk] + [rows[chunk[0]]] * pad)
            blocks.extend(list(ids) + [0] * (per_tile - len(ids)))
            tile_start.append(t * tile)
            slot_pos.append([pos[m] for m in chunk] + [pos[chunk[0]]] * pad)
            for s, m in enumerate(chunk):
                placement.append((m, t, g, s))
    max_tiles = max(tiles_of)
    slot_g = torch.zeros((len(rows), max_tiles), dtype=torch.int64)
    slot_s = torch.zeros_like(slot_g)
    absent = torch.ones((len(rows), max_tiles, 1, 1), dtype=torch.bool)
    if placement:
        m_i, t_i, g_i, s_i = (torch.tensor(x) for x in zip(*placement, strict=True))
        slot_g[m_i, t_i] = g_i
        slot_s[m_i, t_i] = s_i
        absent[m_i, t_i] = False
    pos_rows = torch.tensor(slot_pos, dtype=torch.int64).repeat_interleave(group, dim=1)
    key_pos = torch.tensor(tile_start).view(-1, 1, 1) + torch.arange(tile).view(1, 1, -1)
    bias = torch.zeros(len(q_index), pos_rows.shape[1], tile)
    bias.masked_fill_(key_pos > pos_rows.view(len(q_index), -1, 1), float("-inf"))
    plan = _TilePlan(
        q_index=torch.tensor(q_index, dtype=torch.int64, device=device),
        blocks=torch.tensor(blocks, dtype=torch.int64, device=device),
        bias=bias.view(len(q_index), 1, -1, tile).to(device),
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        slot_g=slot_g.to(device),
        slot_s=slot_s.to(device),
        absent=absent.to(device),
        last_tile=torch.tensor([n - 1 for n in tiles_of], dtype=torch.int64, device=device),
        shared=[
            (torch.tensor(ids, dtype=torch.int64, device=device), lo, hi)
            for ids, lo, hi in shared_tiles
        ],
        merge_by_tile=not decode,
        rest=None,
        rest_blocks=None,
        rest_bias=None,
    )
    if len(rest) < len(q_index):  # the per-layer indexing of the rest, done once per step
        plan.rest = torch.tensor(rest, dtype=torch.int64, device=device)
        plan.rest_blocks = plan.blocks.view(len(q_index), per_tile)[plan.rest].reshape(-1)
        plan.rest_bias = plan.bias[plan.rest]
    meta.scratch[key] = plan
    return plan


def _attend_items(
    qg: torch.Tensor,  # [n, kvh, rows, d]
    keys: torch.Tensor,  # [n, kvh, tile, d]
    values: torch.Tensor,  # [n, kvh, tile, d]
    bias: torch.Tensor,  # [n, 1, rows, tile]
    scale: float,
    fused: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each item's normalized output [n, kvh, rows, d] and log-sum-exp [n, kvh, rows], both
    float32."""
    if fused:
        o, lse = _FLASH_CPU(qg, keys, values, 0.0, False, attn_mask=bias, scale=scale)
        return o.float(), lse
    s = torch.matmul(qg, keys.transpose(2, 3)).float().mul_(scale).add_(bias.float())
    s_max = s.amax(dim=-1)
    p = torch.exp(s - s_max[..., None])
    l_sum = p.sum(dim=-1)
    o = torch.matmul(p.to(values.dtype), values).float() / l_sum[..., None]
    return o, s_max + torch.log(l_sum)


def _tile_attention(
    q: torch.Tensor,  # [num_tokens, H, d]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: _TilePlan,
    scale: float,
    flash: bool,
) -> torch.Tensor:  # [D, H, d] float32, in plan.rows order
    """Attention of one family of tokens: all work items in one product of fixed shape per
    item (scores of ``[S * group, d] x [d, tile]`` per KV head), each row's tile output and
    log-sum-exp; then each token merges its tiles in order 0, 1, ... (a running sum, exact
    for absent tiles), so a token's result does not depend on which other tokens share the
    step or its items."""
    num_tokens, num_heads, d = q.shape
    nb, bs, kvh, _ = k_cache.shape
    group = num_heads // kvh
    G, S = plan.q_index.shape  # noqa: N806
    rows = S * group
    tile = plan.blocks.numel() // G * bs
    qg = q[plan.q_index].view(G, S, kvh, group, d).permute(0, 2, 1, 3, 4)
    qg = qg.reshape(G, kvh, rows, d)
    k_flat, v_flat = kv_quant.raw(k_cache).view(nb, -1), kv_quant.raw(v_cache).view(nb, -1)
    kv8 = kv_quant.is_kv8(k_cache.dtype)
    k_scale = kv_quant.scales_of(k_cache)[0] if kv8 else None
    v_scale = kv_quant.scales_of(v_cache)[0] if kv8 else None

    def tiles(cache_flat: torch.Tensor, block_ids: torch.Tensor, kv_scale) -> torch.Tensor:
        # [n, kvh, tile, d], a strided view of the gathered blocks (8-bit caches: read with
        # their scales, in q's dtype)
        t = cache_flat.index_select(0, block_ids).view(-1, tile, kvh, d)
        if kv8:
            t = kv_quant.dequantize(t.view(k_cache.dtype), kv_scale, q.dtype)
        return t.permute(0, 2, 1, 3)

    fused = flash and _FLASH_CPU is not None
    if fused and plan.bias.dtype != q.dtype:  # once per step: every layer shares the plan
        plan.bias = plan.bias.to(q.dtype)
        if plan.rest_bias is not None:
            plan.rest_bias = plan.rest_bias.to(q.dtype)
    if not plan.shared:
        o_t, m_t = _attend_items(
            qg,
            tiles(k_flat, plan.blocks, k_scale),
            tiles(v_flat, plan.blocks, v_scale),
            plan.bias,
            scale,
            fused,
        )
    else:
        o_t = q.new_empty((G, kvh, rows, d), dtype=torch.float32)
        m_t = q.new_empty((G, kvh, rows), dtype=torch.float32)
        for ids, lo, hi in plan.shared:
            n = hi - lo
            keys = tiles(k_flat, ids, k_scale).expand(n, -1, -1, -1)
            values = tiles(v_flat, ids, v_scale).expand(n, -1, -1, -1)
            o_t[lo:hi], m_t[lo:hi] = _attend_items(
                qg[lo:hi], keys, values, plan.bias[lo:hi], scale, fused
            )
        if plan.rest is not None and plan.rest.numel():
            o, m = _attend_items(
                qg[plan.rest],
                tiles(k_flat, plan.rest_blocks, k_scale),
                tiles(v_flat, plan.rest_blocks, v_scale),
                plan.rest_bias,
                scale,
                fused,
            )
            o_t.index_copy_(0, plan.rest, o)
            m_t.index_copy_(0, plan.rest, m)

    gi, si = plan.slot_g, plan.slot_s
    m_all = m_t.view(G, kvh, S, group)[gi, :, si]  # [D, tiles, kvh, group]
    m_all.masked_fill_(plan.absent, float("-inf"))
    m = m_all.amax(dim=1, keepdim=True)
    w = torch.exp(m_all - m)  # absent tiles: 0
    o_rows = o_t.view(G, kvh, S, group, d)
    last = plan.last_tile.view(-1, 1, 1, 1)
    l_sum = torch.cumsum(w, dim=1).gather(1, last.expand(-1, 1, kvh, group))[:, 0]
    if plan.merge_by_tile:
        # tile by tile (few tiles, many tokens): the same sums in the same order, without
        # holding every tile's rows at once
        acc = w[:, 0, ..., None] * o_rows[gi[:, 0], :, si[:, 0]]
        for t in range(1, gi.shape[1]):
            acc = acc + w[:, t, ..., None] * o_rows[gi[:, t], :, si[:, t]]
    else:
        o_all = o_rows[gi, :, si]  # [D, tiles, kvh, group, d]
        idx = last.view(-1, 1, 1, 1, 1).expand(-1, 1, kvh, group, d)
        acc = torch.cumsum(w[..., None] * o_all, dim=1).gather(1, idx)[:, 0]
    return (acc / l_sum[..., None]).reshape(-1, num_heads, d)


def paged_attention_reference(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    flash: bool = True,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached context plus themselves.

    Query j of a sequence with ``q_len`` new tokens sits at position ``seq_len - q_len + j``
    and attends to positions ``<= seq_len - q_len + j``. KV must already be stored.
    ``flash``: each work item through torch's fused CPU attention where this torch has it (CPU
    tensors); False computes it with plain products and a softmax (any device).
    """
    num_tokens, num_heads, d = q.shape
    group = num_heads // k_cache.shape[2]
    bs = k_cache.shape[1]
    if out is None:
        out = torch.empty_like(q)
    if 0 in meta.seq_lens_list:  # padding rows (runner/inputs.py) attend nothing: zeros
        out.zero_()
    for decode in (False, True):
        plan = _tile_plan(meta, bs, group, q.device, decode)
        if plan is not None:
            o = _tile_attention(q, k_cache, v_cache, plan, scale, flash)
            out.index_copy_(0, plan.rows, o.to(out.dtype))
    return out
