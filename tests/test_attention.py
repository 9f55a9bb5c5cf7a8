"""The torch paged-attention backend against dense float64 attention, and its invariances.

Random caches with shuffled block tables, several sequences in one step (prompt chunks and
decode tokens together, some sharing cached blocks as questions about one manual do), lengths
that cross block and tile boundaries, GQA ratios 1 and 3, block sizes 8, 16 and 32. The seed
is printed on failure.
"""

import os
import random

import pytest
import torch

import inference.attention as att
from inference.attention import AttentionMetadata, paged_attention_reference

SEED = int(os.environ.get("DOCQA_TEST_SEED", random.randrange(2**31)))


def _step(rng: random.Random, bs: int, kvh: int, d: int, dtype, specs):
    """A pool holding every sequence's context; ``specs``: (context length, new tokens,
    decode?, shares the first sequence's leading blocks?)."""
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    need = sum(-(-sl // bs) for sl, *_ in specs) + 4
    num_blocks = need + 8
    k_cache = torch.randn(num_blocks, bs, kvh, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, kvh, d, generator=g).to(dtype)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables, shared_table = [], None
    for sl, _ql, _dec, shares in specs:
        n = -(-sl // bs)
        if shares and shared_table is not None:
            k = min(n - 1, len(shared_table) - 1)  # full blocks of the shared prefix
            table = shared_table[:k] + [free.pop() for _ in range(n - k)]
        else:
            table = [free.pop() for _ in range(n)]
        if shared_table is None:
            shared_table = table
        tables.append(table)
    meta = AttentionMetadata.build(
        tables, [s[0] for s in specs], [s[1] for s in specs], bs, "cpu", [s[2] for s in specs]
    )
    return k_cache, v_cache, tables, meta


def _dense(q, k_cache, v_cache, tables, specs, scale):
    """float64 causal attention of each sequence's new tokens over its context."""
    heads, d = q.shape[1], q.shape[2]
    kvh = k_cache.shape[2]
    group = heads // kvh
    out = torch.empty(q.shape, dtype=torch.float64)
    row = 0
    for table, (sl, ql, *_rest) in zip(tables, specs, strict=True):
        keys = k_cache[table].reshape(-1, kvh, d)[:sl].double()
        values = v_cache[table].reshape(-1, kvh, d)[:sl].double()
        keys = keys.repeat_interleave(group, dim=1)  # [sl, heads, d]
        values = values.repeat_interleave(group, dim=1)
        for j in range(ql):
            p = sl - ql + j
            s = torch.einsum("hd,khd->hk", q[row + j].double(), keys[: p + 1]) * scale
            out[row + j] = torch.einsum("hk,khd->hd", s.softmax(-1), values[: p + 1])
        row += ql
    return out


SPECS = [
    # (context incl. new tokens, new tokens, decode, shares the first sequence's blocks)
    (1100, 45, False, False),  # a question after a cached manual
    (1090, 1, True, True),  # a decode token about the same manual
    (1101, 1, True, True),
    (600, 600, False, False),  # a whole prompt chunk from position 0
    (37, 1, True, False),  # a short sequence
    (1150, 1, False, True),  # a prompt chunk of one token
]


@pytest.mark.parametrize("bs", [8, 16, 32])
@pytest.mark.parametrize("heads,kvh", [(4, 4), (9, 3)])
@pytest.mark.parametrize("fused", [True, False])
def test_matches_dense_float64(bs, heads, kvh, fused, monkeypatch):
    if not fused:
        monkeypatch.setattr(att, "_FLASH_CPU", None)
    rng = random.Random(SEED + bs + heads)
    d = 32
    k_cache, v_cache, tables, meta = _step(rng, bs, kvh, d, torch.float32, SPECS)
    n = sum(s[1] for s in SPECS)
    q = torch.randn(n, heads, d, generator=torch.Generator().manual_seed(SEED))
    out = torch.full_like(q, float("nan"))
    paged_attention_reference(q, k_cache, v_cache, meta, d**-0.5, out=out)
    ref = _dense(q, k_cache, v_cache, tables, SPECS, d**-0.5)
    err = (out.double() - ref).abs().max().item()
    assert err < 2e-5, f"max error {err} (seed {SEED})"


def _run(q, k_cache, v_cache, tables, specs, bs, rows):
    meta = AttentionMetadata.build(
        tables, [s[0] for s in specs], [s[1] for s in specs], bs, "cpu", [s[2] for s in specs]
    )
    out = paged_attention_reference(q[rows], k_cache, v_cache, meta, 0.125)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_sequence_alone_equals_in_the_batch(dtype):
    """Bitwise: a sequence's outputs do not depend on which other sequences share the step."""
    rng = random.Random(SEED)
    bs, kvh, heads, d = 16, 3, 9, 64
    k_cache, v_cache, tables, meta = _step(rng, bs, kvh, d, dtype, SPECS)
    n = sum(s[1] for s in SPECS)
    q = torch.randn(n, heads, d, generator=torch.Generator().manual_seed(SEED)).to(dtype)
    batch = paged_attention_reference(q, k_cache, v_cache, meta, 0.125)
    start = 0
    for i, spec in enumerate(SPECS):
        rows = list(range(start, start + spec[1]))
        alone = _run(q, k_cache, v_cache, [tables[i]], [spec], bs, rows)
        assert torch.equal(alone, batch[rows]), f"sequence {i} (seed {SEED})"
        start += spec[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prompt_chunking_does_not_change_outputs(dtype):
    """Bitwise: a prompt's tokens give the same outputs computed in one chunk or in several
    (each chunk over the context the earlier ones left)."""
    rng = random.Random(SEED)
    bs, kvh, heads, d = 16, 3, 9, 64
    sl = 1200
    k_cache, v_cache, tables, _ = _step(rng, bs, kvh, d, dtype, [(sl, sl, False, False)])
    q = torch.randn(sl, heads, d, generator=torch.Generator().manual_seed(SEED)).to(dtype)
    whole = _run(q, k_cache, v_cache, tables, [(sl, sl, False, False)], bs, list(range(sl)))
    cuts = sorted(rng.sample(range(1, sl), 5)) + [sl]
    lo = 0
    for hi in cuts:
        part = _run(
            q, k_cache, v_cache, tables, [(hi, hi - lo, False, False)], bs, list(range(lo, hi))
        )
        assert torch.equal(part, whole[lo:hi]), f"chunk {lo}:{hi} (seed {SEED})"
        lo = hi


def test_how_items_are_grouped_into_calls_does_not_change_outputs(monkeypatch):
    """Tiles read by many items go through calls of their own; the outputs are the same bits
    as when every item goes through one call."""
    rng = random.Random(SEED)
    bs, kvh, heads, d = 16, 3, 9, 64
    specs = [(1500, 500, False, False), (1200, 40, False, True), (1201, 1, True, True)]
    k_cache, v_cache, tables, _ = _step(rng, bs, kvh, d, torch.float32, specs)
    n = sum(s[1] for s in specs)
    q = torch.randn(n, heads, d, generator=torch.Generator().manual_seed(SEED))
    rows = list(range(n))
    outs = []
    for threshold in (1, 2**30):
        monkeypatch.setattr(att, "SHARED_TILE_ITEMS", threshold)
        outs.append(_run(q, k_cache, v_cache, tables, specs, bs, rows))
    assert torch.equal(outs[0], outs[1]), f"seed {SEED}"
