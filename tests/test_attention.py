"""The CPU paged-attention backends against dense float64 attention, and their invariances:
``torch`` (the reference: fixed-shape tiles through torch's fused attention) and ``cpu`` (the
compiled kernels of inference/kernels/cpu/csrc: in bf16 on AVX512-BF16 every token through
``attention_bf16``; otherwise prompt tokens through the reference's tiles and decode tokens
through ``decode_attention``).

Random caches with shuffled block tables, several sequences in one step (prompt chunks and
decode tokens together, some sharing cached blocks as questions about one manual do), lengths
that cross block and tile boundaries, GQA ratios 1 and 3, block sizes 8, 16 and 32. The seed
is printed on failure.
"""

import os
import random
import subprocess
from pathlib import Path

import pytest
import torch

import inference.attention.reference as att
from inference.attention.backends import CPUBackend
from inference.attention.metadata import AttentionMetadata
from inference.attention.reference import paged_attention_reference
from inference.kernels.cpu import attention as cpu_attention
from inference.kernels.cpu import build as cpu_build
from inference.kernels.cpu import linear as cpu_linear

SEED = int(os.environ.get("DOCQA_TEST_SEED", random.randrange(2**31)))
BACKENDS = ["torch", "cpu"]


def _attention(backend: str, q, k_cache, v_cache, meta, scale):
    if backend == "torch":
        return paged_attention_reference(q, k_cache, v_cache, meta, scale)
    assert cpu_attention.kernels_available(), "the CPU kernels did not build (is gcc installed?)"
    return CPUBackend().attention(q, k_cache, v_cache, meta, scale)


def _as_close_as_the_reference(q, k_cache, v_cache, meta, scale, ref):
    """The kernel's bf16 result against the torch reference's, both measured from dense float64
    attention. Both round their result to bf16, so the worst element's error is mostly where
    that one value fell between two bf16 neighbours: it gets a loose bound (2x). The mean error
    over every element is what the arithmetic decides, and it is steady from seed to seed
    (0.96x the reference's over 78 seeds and shapes): it gets the tight bound (1.1x)."""
    errs = {
        b: (_attention(b, q, k_cache, v_cache, meta, scale).double() - ref).abs() for b in BACKENDS
    }
    mean = {b: e.mean().item() for b, e in errs.items()}
    worst = {b: e.max().item() for b, e in errs.items()}
    assert mean["cpu"] <= 1.1 * mean["torch"], f"mean error {mean} (seed {SEED})"
    assert worst["cpu"] <= 2 * worst["torch"] + 1e-6, f"max error {worst} (seed {SEED})"


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
@pytest.mark.parametrize("path", ["fused", "unfused", "cpu"])
@pytest.mark.parametrize("d", [32, 64])
def test_matches_dense_float64(bs, heads, kvh, path, d, monkeypatch):
    if path == "unfused":
        monkeypatch.setattr(att, "_FLASH_CPU", None)
    rng = random.Random(SEED + bs + heads + d)
    k_cache, v_cache, tables, meta = _step(rng, bs, kvh, d, torch.float32, SPECS)
    n = sum(s[1] for s in SPECS)
    q = torch.randn(n, heads, d, generator=torch.Generator().manual_seed(SEED))
    out = _attention("cpu" if path == "cpu" else "torch", q, k_cache, v_cache, meta, d**-0.5)
    ref = _dense(q, k_cache, v_cache, tables, SPECS, d**-0.5)
    err = (out.double() - ref).abs().max().item()
    assert err < 2e-5, f"max error {err} (seed {SEED})"


def _bf16_kernel():
    if not cpu_attention.bf16_kernel_supports(torch.bfloat16, torch.bfloat16, 9, 3, 64):
        pytest.skip("this CPU has no AVX512-BF16 (the bf16 kernel is not built for it)")


def test_bf16_products_take_the_tile_unit_where_the_cpu_has_one():
    """On a CPU with AMX-BF16 the bf16 attention kernel and linear layers run on the tile
    unit (so the bf16 kernel tests here check that path, and ``auto`` picks bf16); on one with
    AVX512-BF16 alone, the linear layers run in linear.c's bf16 kernel; elsewhere they keep
    oneDNN's path."""
    if os.environ.get("DOCQA_CPU_KERNELS", "1") == "0":
        pytest.skip("CPU kernels turned off")
    from inference.kernels.cpu.linear_layer import CPULinear

    flags = cpu_build.cpu_flags()
    bf16 = "avx512_bf16" in flags and "avx512bw" in flags
    amx = "amx_bf16" in flags and bf16
    assert cpu_attention.decode_attention_library().amx is amx
    assert cpu_linear.linear_bf16_amx_available() is amx
    assert bool(cpu_linear.linear_bf16_panel()) is bf16
    lin = CPULinear(torch.zeros(48, 64, dtype=torch.bfloat16))
    assert (lin._tiles is not None) is amx
    assert (lin._bf16_panels is not None) is (bf16 and not amx)
    if amx and cpu_linear.linear_f32_panel():
        # the tile unit runs these products 7-8x faster than linear.c's float32 panels:
        # ``auto`` must weigh the kernel the model runs, not linear.c's bf16 panels
        from inference.device import resolve_dtype

        assert resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16


@pytest.mark.parametrize("bs", [8, 16, 64, 128])
@pytest.mark.parametrize("heads,kvh", [(4, 4), (9, 3), (32, 1)])
@pytest.mark.parametrize("d", [64, 128])
def test_bf16_kernel_is_about_as_close_as_the_reference(bs, heads, kvh, d):
    """Prompt and decode tokens through ``attention_bf16`` (bf16 products, float32 sums, the
    softmax weights rounded to bf16 as the reference's bf16 product does): as close to dense
    float64 attention as the torch reference, both rounding their result to bf16."""
    _bf16_kernel()
    rng = random.Random(SEED + bs + heads + d)
    k_cache, v_cache, tables, meta = _step(rng, bs, kvh, d, torch.bfloat16, SPECS)
    n = sum(s[1] for s in SPECS)
    q = torch.randn(n, heads, d, generator=torch.Generator().manual_seed(SEED)).bfloat16()
    ref = _dense(q, k_cache, v_cache, tables, SPECS, d**-0.5)
    _as_close_as_the_reference(q, k_cache, v_cache, meta, d**-0.5, ref)


def test_bf16_kernel_exponential_is_accurate():
    """The bf16 kernels' softmax exponential within 3e-7 of exp in float64 over the range its
    scores take (a score minus the running maximum, clamped at -87), exactly 1 at 0, and the
    tail of an array that is not a multiple of the vector width computed too."""
    _bf16_kernel()
    inf = float("inf")
    x = torch.cat([torch.linspace(-87, 0, 100_003), torch.tensor([-1e-30, -0.5, -200.0, -inf])])
    out = torch.full_like(x, float("nan"))
    lib = cpu_attention.decode_attention_library()
    assert lib.docqa_attention_bf16_exp(x.data_ptr(), out.data_ptr(), x.numel()) == 0
    ref = x.double().clamp(min=-87).exp()
    rel = ((out.double() - ref) / ref).abs()
    assert rel.max().item() < 3e-7, f"worst at x = {x[rel.argmax()].item()}"
    assert out[x == 0].eq(1).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_gives_a_prompt_token_the_bits_of_a_decode_token(dtype):
    """One path for every token: each token of a prompt chunk has the same bits as the same
    query at the same position computed as a decode token, alone (bf16: the bf16 kernel's
    units of consecutive tokens; float32: on x86 with FMA the register-tiled units of 16
    consecutive tokens walking the last one's context, each masked at its own, else units of 5
    sharing the whole rounds of the first one's context)."""
    if dtype == torch.bfloat16:
        _bf16_kernel()
    rng = random.Random(SEED)
    bs, heads, d = 16, 9, 64
    sl, ql = 1100, 70
    k_cache, v_cache, tables, meta = _step(rng, bs, 3, d, dtype, [(sl, ql, False, False)])
    q = torch.randn(ql, heads, d, generator=torch.Generator().manual_seed(SEED)).to(dtype)
    chunk = _attention("cpu", q, k_cache, v_cache, meta, 0.125)
    for j in range(ql):
        spec = [(sl - ql + j + 1, 1, True, False)]
        one = _run(q, k_cache, v_cache, tables, spec, bs, [j], "cpu")
        assert torch.equal(one[0], chunk[j]), f"token {j} (seed {SEED})"


def test_bf16_softmax_of_four_rows_has_the_bits_of_one_row(tmp_path):
    """The bf16 decode path takes its rows' online-softmax steps four at a time
    (``bf_softmax_row4``), their maxima and sums reduced together: every row must get the
    bits the one-row step gives it (the prompt path's and the tile unit's), or a token's
    result would depend on the rows beside it."""
    _bf16_kernel()
    csrc = cpu_build.CSRC
    exe = tmp_path / "softmax_rows"
    flags = [f for f in cpu_build.CFLAGS if f not in ("-shared", "-fPIC")]
    here = Path(__file__).parent / "csrc" / "softmax_rows.c"
    subprocess.run(
        [cpu_build.compiler(), *flags, f"-I{csrc}", "-o", str(exe), str(here), "-lm"],
        check=True,
        capture_output=True,
    )
    out = subprocess.run([str(exe), str(SEED), "20000"], check=True, capture_output=True)
    differ, _, seen = out.stdout.decode().split()
    assert (int(differ), int(seen)) == (0, 50000), f"seed {SEED}"


def test_bf16_kernel_groups_do_not_change_outputs():
    """Decode tokens about one manual in groups of up to ``bf16_unit_rows()`` query rows (96
    on the tile unit, else 48) whose shared keys are read once, and prompt tokens in full units
    of consecutive tokens, then the rest: the same bits as every token in a group of its
    own."""
    _bf16_kernel()
    rng = random.Random(SEED)
    bs, d = 16, 64
    per = cpu_attention.bf16_unit_rows() // 3
    assert per == (32 if cpu_attention.decode_attention_library().amx else 16)
    specs = [(1090, 1, True, False)] + [(1000 + 13 * i, 1, True, True) for i in range(per + 2)]
    specs += [(1130, 40, False, True), (40, 1, True, False), (2 * per + 5, 2 * per, False, False)]
    k_cache, v_cache, tables, meta = _step(rng, bs, 3, d, torch.bfloat16, specs)
    n = sum(s[1] for s in specs)
    q = torch.randn(n, 9, d, generator=torch.Generator().manual_seed(SEED)).bfloat16()
    backend = CPUBackend()
    rows, bt, ctx, starts, shared = backend.plan(meta, "cpu", bs, 3, bf16=True)
    sizes = (starts[1:] - starts[:-1]).tolist()
    assert max(sizes) == per and sum(sizes) == n
    # the 40-token chunk in full units and the rest; the 2 * per-token one in two full units
    assert sizes.count(per) >= 2 + 40 // per and 40 % per in sizes
    assert max(shared.tolist()) >= 960
    grouped = cpu_attention.attention_bf16(
        q, rows, k_cache, v_cache, bt, ctx, 0.125, starts, shared, torch.empty_like(q)
    )
    alone = cpu_attention.attention_bf16(
        q,
        rows,
        k_cache,
        v_cache,
        bt,
        ctx,
        0.125,
        torch.arange(n + 1, dtype=torch.int32),
        torch.zeros(n, dtype=torch.int32),
        torch.empty_like(q),
    )
    assert torch.equal(grouped, alone), f"seed {SEED}"
    ref = _dense(q, k_cache, v_cache, tables, specs, 0.125)
    assert (grouped.double() - ref).abs().max().item() < 2e-2  # rounded to bf16


def test_decode_groups_part_at_the_manual_not_at_the_system_instructions():
    """Every prompt starts with the same system instructions (shared blocks of their own) and
    goes on to one of four manuals: the groups never mix manuals, each shares its manual's
    keys, and each holds at most ``max_rows // group`` tokens."""
    rng = random.Random(SEED)
    system = [1, 2]
    manuals = [[100 * (m + 1) + i for i in range(62)] for m in range(4)]
    tables, ctx, manual_of = [], [], []
    for t in range(22):
        m = rng.randrange(4)
        tables.append(system + manuals[m] + [5000 + 10 * t + i for i in range(3)])
        ctx.append(1060 + rng.randrange(40))
        manual_of.append(m)
    for max_rows in (16, 32):
        order, starts, shared = cpu_attention.decode_groups(tables, ctx, 16, 3, max_rows)
        assert sorted(order) == list(range(22))
        for a, b, keys in zip(starts, starts[1:], shared, strict=False):
            members = order[a:b]
            assert 1 <= len(members) <= max_rows // 3
            assert len({manual_of[t] for t in members}) == 1, members
            assert keys == (1024 if len(members) > 1 else 0)


def test_bf16_kernel_rejects_groups_outside_its_limits():
    _bf16_kernel()
    rng = random.Random(SEED)
    k_cache, v_cache, tables, meta = _step(rng, 16, 3, 64, torch.bfloat16, [(300, 1, True, False)])
    q = torch.randn(1, 9, 64).bfloat16()
    args = (
        q,
        torch.zeros(1, dtype=torch.int64),
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
    )
    start = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="outside its limits"):  # 100 keys: not a round's end
        cpu_attention.attention_bf16(
            *args, 0.125, start, torch.tensor([100], dtype=torch.int32), torch.empty_like(q)
        )


@pytest.mark.parametrize("d", [64, 128])
def test_decode_kernel_in_bf16_is_as_close_as_the_reference(d):
    """bf16 inputs, float32 arithmetic: the kernel's decode rows are as close to dense float64
    attention as the torch reference's (both round the result to bf16)."""
    rng = random.Random(SEED + d)
    specs = [(1090, 1, True, False), (1101, 1, True, True), (37, 1, True, False)]
    k_cache, v_cache, tables, meta = _step(rng, 16, 3, d, torch.bfloat16, specs)
    q = torch.randn(3, 9, d, generator=torch.Generator().manual_seed(SEED)).bfloat16()
    ref = _dense(q, k_cache, v_cache, tables, specs, d**-0.5)
    _as_close_as_the_reference(q, k_cache, v_cache, meta, d**-0.5, ref)


def _run(q, k_cache, v_cache, tables, specs, bs, rows, backend="torch"):
    meta = AttentionMetadata.build(
        tables, [s[0] for s in specs], [s[1] for s in specs], bs, "cpu", [s[2] for s in specs]
    )
    return _attention(backend, q[rows], k_cache, v_cache, meta, 0.125)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_sequence_alone_equals_in_the_batch(dtype, backend):
    """Bitwise: a sequence's outputs do not depend on which other sequences share the step."""
    rng = random.Random(SEED)
    bs, kvh, heads, d = 16, 3, 9, 64
    k_cache, v_cache, tables, meta = _step(rng, bs, kvh, d, dtype, SPECS)
    n = sum(s[1] for s in SPECS)
    q = torch.randn(n, heads, d, generator=torch.Generator().manual_seed(SEED)).to(dtype)
    batch = _attention(backend, q, k_cache, v_cache, meta, 0.125)
    start = 0
    for i, spec in enumerate(SPECS):
        rows = list(range(start, start + spec[1]))
        alone = _run(q, k_cache, v_cache, [tables[i]], [spec], bs, rows, backend)
        assert torch.equal(alone, batch[rows]), f"sequence {i} (seed {SEED})"
        start += spec[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_kernel_does_not_depend_on_the_thread_count(dtype):
    """Bitwise: work units are whole (token, KV head) pairs, so threads only decide where a
    unit runs, never how its sums are ordered (float32: the register-tiled path on x86 with
    FMA)."""
    rng = random.Random(SEED)
    specs = [(1090, 1, True, False), (1101, 1, True, True), (700, 1, True, True)] * 3
    specs += [(n, 1, True, False) for n in (63, 64, 65, 511, 512, 513)]
    k_cache, v_cache, _, meta = _step(rng, 16, 3, 64, dtype, specs)
    q = torch.randn(len(specs), 9, 64, generator=torch.Generator().manual_seed(SEED)).to(dtype)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(_attention("cpu", q, k_cache, v_cache, meta, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(o, outs[0]) for o in outs[1:]), f"seed {SEED}"


def test_cpu_backend_takes_the_reference_path_outside_the_kernel_limits():
    """float16 (not a kernel dtype): the cpu backend gives the reference's bits."""
    rng = random.Random(SEED)
    k_cache, v_cache, _, meta = _step(rng, 16, 3, 64, torch.float16, SPECS)
    n = sum(s[1] for s in SPECS)
    q = torch.randn(n, 9, 64, generator=torch.Generator().manual_seed(SEED)).half()
    ref = paged_attention_reference(q, k_cache, v_cache, meta, 0.125)
    assert torch.equal(_attention("cpu", q, k_cache, v_cache, meta, 0.125), ref)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prompt_chunking_does_not_change_outputs(dtype, backend):
    """Bitwise: a prompt's tokens give the same outputs computed in one chunk or in several
    (each chunk over the context the earlier ones left), cuts at and around tile ends too."""
    rng = random.Random(SEED)
    bs, kvh, heads, d = 16, 3, 9, 64
    sl = 1200
    k_cache, v_cache, tables, _ = _step(rng, bs, kvh, d, dtype, [(sl, sl, False, False)])
    q = torch.randn(sl, heads, d, generator=torch.Generator().manual_seed(SEED)).to(dtype)
    whole = _run(
        q, k_cache, v_cache, tables, [(sl, sl, False, False)], bs, list(range(sl)), backend
    )
    cuts = sorted(set(rng.sample(range(1, sl), 5) + [511, 512, 513, sl]))
    lo = 0
    for hi in cuts:
        spec = [(hi, hi - lo, False, False)]
        part = _run(q, k_cache, v_cache, tables, spec, bs, list(range(lo, hi)), backend)
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


def test_decode_kernel_groups_share_reads_without_changing_outputs():
    """Tokens about one manual go through the kernel as groups whose shared keys are read once
    for all of them (at most 16 query rows per group, the shared part a multiple of 64 keys);
    the outputs are the same bits as with every token in a group of its own."""
    rng = random.Random(SEED)
    bs, d = 16, 64
    specs = [(1090, 1, True, False)] + [(1000 + 13 * i, 1, True, True) for i in range(7)]
    specs += [(40, 1, True, False)]
    k_cache, v_cache, tables, meta = _step(rng, bs, 3, d, torch.bfloat16, specs)
    # two of the tokens share only the manual's first 20 blocks (another conversation's turns
    # follow): their group must not read the first token's blocks past those
    nb = k_cache.shape[0]
    extra = torch.randn(140, bs, 3, d, generator=torch.Generator().manual_seed(SEED))
    k_cache = torch.cat([k_cache, extra.bfloat16()])
    v_cache = torch.cat([v_cache, extra.flip(0).bfloat16()])
    for i, t in enumerate((6, 7)):
        tables[t] = tables[t][:20] + list(range(nb + 70 * i, nb + 70 * i + len(tables[t]) - 20))
    meta = AttentionMetadata.build(
        tables, [s[0] for s in specs], [1] * len(specs), bs, "cpu", [True] * len(specs)
    )
    ctx = [s[0] for s in specs]
    order, starts, shared = cpu_attention.decode_groups(tables, ctx, bs, 3)
    assert sorted(order) == list(range(len(specs)))
    groups = [order[a:b] for a, b in zip(starts, starts[1:], strict=False)]
    assert max(len(g) for g in groups) <= 5  # 16 rows // 3 rows per token
    assert all(k % cpu_attention.ROUND == 0 for k in shared) and max(shared) >= 960
    by_token = {t: (g, k) for g, k in zip(groups, shared, strict=True) for t in g}
    assert sorted(by_token[6][0]) == [6, 7] and 256 <= by_token[6][1] <= 320
    assert by_token[8] == ([8], 0)  # the short sequence shares nothing
    assert all(k >= 960 for g, k in by_token.values() if len(g) > 1 and max(g) < 6)
    q = torch.randn(len(specs), 9, d, generator=torch.Generator().manual_seed(SEED)).bfloat16()
    rows = torch.tensor(order)
    bt = torch.stack([meta.block_tables[o] for o in order]).contiguous()
    lens = torch.tensor([ctx[o] for o in order], dtype=torch.int32)
    args = (q, rows, k_cache, v_cache, bt, lens, 0.125)
    grouped = cpu_attention.decode_attention(
        *args, torch.tensor(starts, dtype=torch.int32), torch.tensor(shared, dtype=torch.int32)
    )
    assert torch.equal(grouped, cpu_attention.decode_attention(*args)), f"seed {SEED}"
    ref = _dense(q, k_cache, v_cache, tables, specs, 0.125)[order]
    assert (grouped.double() - ref).abs().max().item() < 1e-4


def test_tiled_float32_kernel_masks_each_row_at_its_own_context():
    """On the register-tiled float32 path a prompt chunk's tokens walk the chunk's last
    context together, 16 tokens (48 query rows) to a unit, each row masked at its own context:
    every token gets the bits it gets alone, at chunk starts on and off the 64-key rounds, and
    stays as close to float64 attention as the reference path."""
    if not cpu_attention.decode_attention_tiled(torch.float32, torch.float32, 64):
        pytest.skip("no register-tiled float32 path on this CPU (x86 with FMA)")
    rng = random.Random(SEED)
    bs, d = 16, 64
    for first, n in ((0, 70), (1000, 51), (63, 40), (130, 5)):
        specs = [(first + n, n, False, False)]
        k_cache, v_cache, tables, _ = _step(rng, bs, 3, d, torch.float32, specs)
        q = torch.randn(n, 9, d, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
        rows = torch.arange(n)
        bt = torch.tensor([tables[0]] * n, dtype=torch.int32)
        ctx = torch.arange(first + 1, first + n + 1, dtype=torch.int32)
        starts = list(range(0, n, 16)) + [n]
        shared = [int(ctx[b - 1]) for b in starts[1:]]  # every key of the unit's last token
        args = (q, rows, k_cache, v_cache, bt, ctx, 0.125)
        grouped = cpu_attention.decode_attention(
            *args, torch.tensor(starts, dtype=torch.int32), torch.tensor(shared, dtype=torch.int32)
        )
        assert torch.equal(grouped, cpu_attention.decode_attention(*args)), f"{first} (seed {SEED})"
        ref = _dense(q, k_cache, v_cache, tables, specs, 0.125)
        assert (grouped.double() - ref).abs().max().item() < 1e-5
        # a unit's shared keys off the rounds must cover every context of the unit
        short = torch.tensor([shared[0] - 1] + shared[1:], dtype=torch.int32)
        if short[0] % cpu_attention.ROUND:
            with pytest.raises(ValueError, match="outside its limits"):
                cpu_attention.decode_attention(
                    *args, torch.tensor(starts, dtype=torch.int32), short
                )


def test_cpu_backend_reads_strided_queries_in_place():
    """The model hands attention q as a view of its fused q/k projection (rows strided by the
    query and key heads together): the kernel reads it in place, with the bits of a dense q."""
    rng = random.Random(SEED)
    k_cache, v_cache, _, meta = _step(rng, 16, 3, 64, torch.bfloat16, SPECS)
    n = sum(s[1] for s in SPECS)
    qk = torch.randn(n, 12, 64, generator=torch.Generator().manual_seed(SEED)).bfloat16()
    q = qk[:, :9]
    assert not q.is_contiguous()
    strided = _attention("cpu", q, k_cache, v_cache, meta, 0.125)
    assert torch.equal(strided, _attention("cpu", q.contiguous(), k_cache, v_cache, meta, 0.125))
    ref = paged_attention_reference(q.contiguous(), k_cache, v_cache, meta, 0.125)
    assert (strided.float() - ref.float()).abs().max().item() < 2e-2  # both rounded to bf16
