"""Paged attention: the metadata object and the torch reference backend.

KV layout (CONTRACTS.md, "Paged KV layout and kernels"): per layer ``k_cache``/``v_cache`` of
shape ``[num_blocks, block_size, num_kv_heads, head_dim]``; ``slot_mapping[t] = block_id *
block_size + offset`` (-1: do not store); ``block_tables`` int32 ``[num_seqs, max_blocks]``
padded with 0; ``seq_lens`` the context length including this step's new tokens.

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

import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

PREFILL_TILE = 512  # keys per prompt-token work item; a multiple of every supported block size
PREFILL_SLAB = 32  # prompt tokens per work item (times the query heads per KV head: rows)
DECODE_TILE = 128  # keys per decode work item: the granularity at which sequences share keys
DECODE_SLAB = 32  # query rows per decode work item (whole tokens: 32 // group of them)
SHARED_TILE_ITEMS = 4  # items reading one tile that make it worth a call of its own


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
    start = 0
    for i, (sl, ql, dec) in enumerate(
        zip(meta.seq_lens_list, meta.query_lens_list, meta.is_decode_list, strict=True)
    ):
        if dec != decode:
            start += ql
            continue
        table = meta.block_tables[i].tolist()
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
    k_flat, v_flat = k_cache.view(nb, -1), v_cache.view(nb, -1)

    def tiles(cache_flat: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        # [n, kvh, tile, d], a strided view of the gathered blocks
        return cache_flat.index_select(0, block_ids).view(-1, tile, kvh, d).permute(0, 2, 1, 3)

    fused = _FLASH_CPU is not None and q.device.type == "cpu"
    if fused and plan.bias.dtype != q.dtype:  # once per step: every layer shares the plan
        plan.bias = plan.bias.to(q.dtype)
        if plan.rest_bias is not None:
            plan.rest_bias = plan.rest_bias.to(q.dtype)
    if not plan.shared:
        o_t, m_t = _attend_items(
            qg, tiles(k_flat, plan.blocks), tiles(v_flat, plan.blocks), plan.bias, scale, fused
        )
    else:
        o_t = q.new_empty((G, kvh, rows, d), dtype=torch.float32)
        m_t = q.new_empty((G, kvh, rows), dtype=torch.float32)
        for ids, lo, hi in plan.shared:
            n = hi - lo
            keys = tiles(k_flat, ids).expand(n, -1, -1, -1)
            values = tiles(v_flat, ids).expand(n, -1, -1, -1)
            o_t[lo:hi], m_t[lo:hi] = _attend_items(
                qg[lo:hi], keys, values, plan.bias[lo:hi], scale, fused
            )
        if plan.rest is not None and plan.rest.numel():
            o, m = _attend_items(
                qg[plan.rest],
                tiles(k_flat, plan.rest_blocks),
                tiles(v_flat, plan.rest_blocks),
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
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached context plus themselves.

    Query j of a sequence with ``q_len`` new tokens sits at position ``seq_len - q_len + j``
    and attends to positions ``<= seq_len - q_len + j``. KV must already be stored.
    """
    num_tokens, num_heads, d = q.shape
    group = num_heads // k_cache.shape[2]
    bs = k_cache.shape[1]
    if out is None:
        out = torch.empty_like(q)
    for decode in (False, True):
        plan = _tile_plan(meta, bs, group, q.device, decode)
        if plan is not None:
            o = _tile_attention(q, k_cache, v_cache, plan, scale)
            out.index_copy_(0, plan.rows, o.to(out.dtype))
    return out


# -- backends ------------------------------------------------------------------------------------
BACKENDS = ("auto", "torch", "cpu", "triton")


def resolve_backend(name: str | None, device: torch.device) -> str:
    """``auto``: Triton kernels on CUDA; on a CPU the compiled attention kernels (``cpu``) where
    they build, else the torch reference. ``triton`` on a CPU needs ``TRITON_INTERPRET=1`` (tests);
    ``DOCQA_ATTENTION_BACKEND`` sets the default."""
    import os

    from inference import cpu_kernels

    name = (name or os.environ.get("DOCQA_ATTENTION_BACKEND") or "auto").lower()
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "auto":
        if device.type == "cuda":
            return "triton"
        return "cpu" if cpu_kernels.kernels_available() else "torch"
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError("the cpu attention backend runs on the CPU")
        if not cpu_kernels.kernels_available():
            raise ValueError(
                "the cpu attention backend needs its kernel built with a C compiler "
                "(set CC or install gcc), or DOCQA_CPU_KERNELS=0 was set"
            )
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the triton backend needs a CUDA device (or TRITON_INTERPRET=1)")
    return name


class TorchBackend:
    name = "torch"
    # store_kv writes each token's K/V rows into its slot and nothing else, so the model may
    # do that in its own fused pass (cpu_kernels.rotary_store) instead of calling it
    plain_store = True

    def store_kv(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        store_kv_reference(key, value, k_cache, v_cache, meta)

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        return paged_attention_reference(q, k_cache, v_cache, meta, scale)


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
    16 rows to compute over its context where groups of 12 had 27; 0.83-0.85x the time on a
    Zen 5). Else as few groups as ``per`` allows, of even sizes."""
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
    """Attention through the compiled CPU kernels (``inference/csrc/decode_attention.c``), which
    read each token's context in place from the pool in rounds of 64 keys from key 0.

    bf16 on AVX512-BF16 (the default on such CPUs): every token of the step, prompt and decode
    alike, in one call per layer (``cpu_kernels.attention_bf16``), written in place into the
    layer's output. A work unit is one KV head of a group of tokens: up to
    ``cpu_kernels.bf16_unit_rows() // group`` tokens (32 where the tile unit runs it, else 16),
    consecutive tokens of one prompt chunk (full groups, then the rest), or decode tokens whose
    contexts start with the same blocks (``cpu_kernels.decode_groups``). A token's result is
    the same bits as a prompt token or a decode token, alone or in any batch.

    Other dtypes (float32) and shapes: every token of the step, prompt and decode alike,
    through ``cpu_kernels.decode_attention`` where it takes the shape (units of up to
    ``48 // group`` tokens on its register-tiled float32 path, x86 with FMA, else
    ``16 // group``), else the torch path; there too a token's result is the same
    bits as a prompt token or a decode token, alone or in any batch."""

    name = "cpu"

    def __init__(self):
        from inference import cpu_kernels

        self.k = cpu_kernels

    def _decode_tokens(self, meta: AttentionMetadata, bs: int, group: int, max_rows: int):
        """The step's decode tokens in the kernel's group order: (rows of q, sequences,
        context lengths, group starts, keys each group shares) (``cpu_kernels.decode_groups``)."""
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
    not depend on whether prompt chunks share its step."""

    name = "triton"
    plain_store = False  # the store is one of the kernels (store_kv): always called

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


def make_backend(name: str) -> TorchBackend | CPUBackend | TritonBackend:
    if name == "triton":
        return TritonBackend()
    return CPUBackend() if name == "cpu" else TorchBackend()
