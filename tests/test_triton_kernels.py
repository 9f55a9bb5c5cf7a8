"""The Triton kernels under TRITON_INTERPRET=1 against a float64 torch reference.

Random shapes with GQA ratios 1, 3 and 8, block sizes 16 and 32, lengths that are not
multiples of the block size, shuffled block tables, outputs poisoned before each run and fresh
inputs each time. Kept small: the interpreter runs each program in numpy.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined

import pytest  # noqa: E402
import torch  # noqa: E402

from inference.kernels.triton import common, decode_attention, kv_store, prefill_attention  # noqa: E402

POISON = float("nan")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
CASES = [  # (num_heads, num_kv_heads, head_dim, block_size)
    (4, 4, 32, 16),  # GQA ratio 1
    (6, 2, 32, 32),  # ratio 3
    (8, 1, 16, 16),  # ratio 8
]


def fresh_generator() -> tuple[torch.Generator, int]:
    seed = int.from_bytes(os.urandom(4), "little")
    return torch.Generator().manual_seed(seed), seed


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def make_cache(gen, num_blocks, bs, kvh, d, dtype):
    k = torch.randn(num_blocks, bs, kvh, d, generator=gen).to(dtype)
    v = torch.randn(num_blocks, bs, kvh, d, generator=gen).to(dtype)
    return k, v


def shuffled_tables(gen, lens, bs, num_blocks):
    """Each sequence gets distinct blocks in random order, padded with 0."""
    need = [-(-n // bs) for n in lens]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(need)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor(perm[:n])
        perm = perm[n:]
    return table


def ref_attention(q, k_cache, v_cache, table, seq_lens, q_lens, scale):
    """float64: queries of each sequence are its last q_len positions, causal."""
    _, bs, kvh, d = k_cache.shape
    heads = q.shape[1]
    group = heads // kvh
    out = torch.empty(q.shape, dtype=torch.float64)
    row = 0
    for i, (sl, ql) in enumerate(zip(seq_lens, q_lens, strict=True)):
        blocks = table[i, : -(-sl // bs)].long()
        keys = k_cache[blocks].reshape(-1, kvh, d)[:sl].double()
        vals = v_cache[blocks].reshape(-1, kvh, d)[:sl].double()
        for j in range(ql):
            pos = sl - ql + j
            for h in range(heads):
                kh = h // group
                s = keys[: pos + 1, kh] @ q[row + j, h].double() * scale
                p = torch.softmax(s, 0)
                out[row + j, h] = p @ vals[: pos + 1, kh]
        row += ql
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kvh,d,bs", CASES)
def test_store_kv(dtype, heads, kvh, d, bs):
    gen, seed = fresh_generator()
    nb = 6
    k_cache, v_cache = make_cache(gen, nb, bs, kvh, d, dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    n = 11
    key = torch.randn(n, kvh, d, generator=gen).to(dtype)
    value = torch.randn(n, kvh, d, generator=gen).to(dtype)
    slots = torch.randperm(nb * bs, generator=gen)[:n]
    slots[3] = -1
    slots[7] = -1
    kv_store.store_kv(key, value, k_cache, v_cache, slots)
    keep = slots >= 0
    k_ref.view(-1, kvh, d)[slots[keep]] = key[keep]
    v_ref.view(-1, kvh, d)[slots[keep]] = value[keep]
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref), f"seed {seed}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kvh,d,bs", CASES)
def test_paged_decode_attention(dtype, heads, kvh, d, bs, monkeypatch):
    monkeypatch.setattr(
        decode_attention, "DECODE_PARTITION", 2 * bs
    )  # several partitions, small inputs
    gen, seed = fresh_generator()
    lens = [int(x) for x in torch.randint(1, 5 * bs, (3,), generator=gen)]
    lens[0] = 3 * bs + 5  # spans partitions, not a multiple of the block size
    nb = sum(-(-n // bs) for n in lens) + 3
    k_cache, v_cache = make_cache(gen, nb, bs, kvh, d, dtype)
    table = shuffled_tables(gen, lens, bs, nb)
    q = torch.randn(len(lens), heads, d, generator=gen).to(dtype)
    out = torch.full_like(q, POISON)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    decode_attention.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, d**-0.5, out=out)
    assert not torch.isnan(out).any(), "a poisoned output element was not written"
    ref = ref_attention(q, k_cache, v_cache, table, lens, [1] * len(lens), d**-0.5)
    assert rel_err(out, ref) < TOL[dtype], f"seed {seed}: {rel_err(out, ref):.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kvh,d,bs", CASES)
def test_paged_prefill_attention(dtype, heads, kvh, d, bs):
    gen, seed = fresh_generator()
    # (cached prefix, new tokens): cold, over a cached prefix, one token, longer than a block
    shapes = [(0, 19), (2 * bs + 3, 7), (bs - 1, 1), (5, bs + 9)]
    check_prefill(gen, seed, shapes, heads, kvh, d, bs, dtype, TOL[dtype])


def check_prefill(gen, seed, shapes, heads, kvh, d, bs, dtype, tol):
    """Prefill of sequences of (cached prefix, new tokens) in one call against float64, every
    poisoned output element overwritten."""
    lens = [c + n for c, n in shapes]
    q_lens = [n for _, n in shapes]
    nb = sum(-(-n // bs) for n in lens) + 2
    k_cache, v_cache = make_cache(gen, nb, bs, kvh, d, dtype)
    table = shuffled_tables(gen, lens, bs, nb)
    q = torch.randn(sum(q_lens), heads, d, generator=gen).to(dtype)
    out = torch.full_like(q, POISON)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    prefill_attention.paged_prefill_attention(
        q, k_cache, v_cache, table, cu, seq_lens, d**-0.5, out=out
    )
    assert not torch.isnan(out).any(), "a poisoned output element was not written"
    ref = ref_attention(q, k_cache, v_cache, table, lens, q_lens, d**-0.5)
    assert rel_err(out, ref) < tol, f"seed {seed}: {rel_err(out, ref):.2e}"


KV8 = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def kv8_cache(gen, num_blocks, bs, kvh, d, dtype):
    """8-bit caches of random values with random power-of-two scales per channel, and the
    same values dequantized in float64 (what the kernels must attend over)."""
    from inference import kv_quant

    caches, dense = [], []
    for _ in range(2):
        x = torch.randn(num_blocks, bs, kvh, d, generator=gen) * 2
        scale = kv_quant.pow2_scales(torch.rand(kvh, d, generator=gen) * 4 + 0.5, dtype)
        c = kv_quant.quantize(x, 1.0 / scale, dtype).contiguous()
        kv_quant.attach(c, scale, (1.0 / scale).contiguous())
        caches.append(c)
        dense.append(c.double() * scale.double())
    return caches, dense


@pytest.mark.parametrize("kv", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_into_8_bit_caches_has_torchs_bits(kv, dtype):
    from inference import kv_quant

    gen, seed = fresh_generator()
    heads, kvh, d, bs = CASES[1]
    nb = 5
    (k_cache, v_cache), _ = kv8_cache(gen, nb, bs, kvh, d, KV8[kv])
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    n = 13
    # magnitudes from far below to far above the scales' range, and halves (ties)
    key = (torch.randn(n, kvh, d, generator=gen) * torch.exp2(torch.randint(-12, 10, (n, kvh, d),
           generator=gen).float())).to(dtype)  # fmt: skip
    key[0] = 0.5
    value = torch.randn(n, kvh, d, generator=gen).to(dtype) * 40
    slots = torch.randperm(nb * bs, generator=gen)[:n]
    slots[4] = -1
    kv_store.store_kv(key, value, k_cache, v_cache, slots)
    keep = slots >= 0
    for ref, cache, x in ((k_ref, k_cache, key), (v_ref, v_cache, value)):
        inv = kv_quant.scales_of(cache)[1]
        q = kv_quant.quantize(x[keep].float(), inv, cache.dtype)
        kv_quant.raw(ref).view(-1, kvh, d)[slots[keep]] = kv_quant.raw(q)
        same = kv_quant.raw(cache) == kv_quant.raw(ref)
        assert same.all(), f"seed {seed}: {(~same).sum().item()} elements differ"


@pytest.mark.parametrize("kv", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_over_8_bit_caches(kv, dtype, monkeypatch):
    """Decode and prefill over 8-bit caches against float64 attention over their dequantized
    values (the scales are powers of two: reading them in the queries' dtype is exact)."""
    monkeypatch.setattr(decode_attention, "DECODE_PARTITION", 32)
    gen, seed = fresh_generator()
    heads, kvh, d, bs = CASES[1]
    shapes = [(0, 19), (2 * bs + 3, 7), (bs - 1, 1)]
    lens = [c + n for c, n in shapes]
    nb = sum(-(-n // bs) for n in lens) + 2
    (k_cache, v_cache), (k64, v64) = kv8_cache(gen, nb, bs, kvh, d, KV8[kv])
    table = shuffled_tables(gen, lens, bs, nb)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q_lens = [n for _, n in shapes]
    q = torch.randn(sum(q_lens), heads, d, generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = prefill_attention.paged_prefill_attention(
        q, k_cache, v_cache, table, cu, seq_lens, d**-0.5
    )
    ref = ref_attention(q, k64, v64, table, lens, q_lens, d**-0.5)
    assert rel_err(out, ref) < TOL[dtype], f"prefill, seed {seed}: {rel_err(out, ref):.2e}"
    qd = torch.randn(len(lens), heads, d, generator=gen).to(dtype)
    out = decode_attention.paged_decode_attention(qd, k_cache, v_cache, table, seq_lens, d**-0.5)
    ref = ref_attention(qd, k64, v64, table, lens, [1] * len(lens), d**-0.5)
    assert rel_err(out, ref) < TOL[dtype], f"decode, seed {seed}: {rel_err(out, ref):.2e}"


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("bs", [16, 64])
def test_tiled_prefill_at_odd_lengths(group, bs):
    """The tiled prefill kernel (query heads packed into tiles of rows, keys in tiles from
    position 0, whole tiles unmasked): odd lengths 37, 101 and 517, a cached prefix that ends
    mid-block, several sequences in one call, every poisoned output element overwritten; fp32
    within 1e-5 of float64."""
    gen, seed = fresh_generator()
    kvh, d = 2, 32
    heads = kvh * group
    # (cached prefix, new tokens)
    shapes = [(0, 37), (bs + 5, 101), (3, 517), (2 * bs - 1, 1)]
    check_prefill(gen, seed, shapes, heads, kvh, d, bs, torch.float32, 1e-5)


@pytest.mark.parametrize("group", [1, 3])
def test_tiled_prefill_does_not_depend_on_chunking(group):
    """A prompt's tokens computed in one call, or in chunks over the cached start (any split,
    the same positions): each token's result is its online softmax over the same key tiles,
    whatever rows share its tile. Under the interpreter a tile's products are numpy's, whose
    BLAS rounds a row differently by its place in the block (about one unit in the last
    place), so here the chunks agree within 1e-6; on a GPU bench/gpu.py checks them bitwise."""
    gen, seed = fresh_generator()
    kvh, d, bs = 2, 32, 16
    heads = kvh * group
    n = 150
    nb = -(-n // bs) + 1
    k_cache, v_cache = make_cache(gen, nb, bs, kvh, d, torch.float32)
    table = torch.arange(-(-n // bs), dtype=torch.int32)[None, :]
    q = torch.randn(n, heads, d, generator=gen)

    def run(start: int, end: int) -> torch.Tensor:
        cu = torch.tensor([0, end - start], dtype=torch.int32)
        sl = torch.tensor([end], dtype=torch.int32)
        return prefill_attention.paged_prefill_attention(
            q[start:end], k_cache, v_cache, table, cu, sl, 0.17
        )

    whole = run(0, n)
    for cuts in ([0, 70, 150], [0, 1, 33, 97, 150], [0, 149, 150]):
        parts = torch.cat([run(a, b) for a, b in zip(cuts, cuts[1:], strict=False)])
        assert rel_err(parts, whole.double()) < 1e-6, f"chunks {cuts} (seed {seed})"


def test_wrappers_check_their_inputs():
    k = torch.zeros(4, 16, 2, 32)
    q = torch.zeros(2, 4, 32)
    table = torch.zeros(2, 2, dtype=torch.int32)
    lens = torch.tensor([3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_size"):
        small = torch.zeros(4, 8, 2, 32)
        decode_attention.paged_decode_attention(q, small, small.clone(), table, lens, 1.0)
    with pytest.raises(ValueError, match="num_heads a multiple"):
        decode_attention.paged_decode_attention(
            torch.zeros(2, 3, 32), k, k.clone(), table, lens, 1.0
        )
    with pytest.raises(ValueError, match="q is"):
        decode_attention.paged_decode_attention(q.half(), k, k.clone(), table, lens, 1.0)
    with pytest.raises(ValueError, match="int32/int64"):
        decode_attention.paged_decode_attention(q, k, k.clone(), table.float(), lens, 1.0)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        prefill_attention.paged_prefill_attention(q, k, k.clone(), table, lens, lens, 1.0)
    with pytest.raises(ValueError, match="slot per token"):
        kv_store.store_kv(torch.zeros(3, 2, 32), torch.zeros(3, 2, 32), k, k.clone(), lens)


@pytest.mark.parametrize("kv_dtype", [None, "int8", "fp8"])
def test_engine_with_the_triton_backend_matches_the_torch_backend(tiny_model_dir, kv_dtype):
    """The same answers and logits through the Triton kernels as through the torch reference,
    over a KV pool of the compute dtype or an 8-bit one (its scales calibrated by each engine
    from the same model: the same scales)."""
    from inference import LLM, SamplingParams

    prompts = [list(range(100, 137)), list(range(300, 309))]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    outs = {}
    before = dict(common.LAUNCHES)
    for backend in ("torch", "triton"):
        llm = LLM(
            tiny_model_dir,
            dtype="float32",
            kv_dtype=kv_dtype,
            kv_cache_gib=0.002,
            attention_backend=backend,
        )
        assert llm.engine.runner.attention_backend == backend
        eng = llm.engine
        reqs = [eng.add_request(p, params, keep_logits=True) for p in prompts]
        while any(not r.finished for r in reqs):
            eng.step()
        outs[backend] = reqs
    # the kernels really ran: one store and attention launch per layer and step
    layers = llm.engine.model_config.num_layers
    ran = {k: common.LAUNCHES[k] - before.get(k, 0) for k in common.LAUNCHES}
    assert ran["store_kv"] >= 4 * layers
    assert ran["paged_prefill_attention"] >= layers
    assert ran["paged_decode_attention"] >= 3 * layers
    for a, b in zip(outs["torch"], outs["triton"], strict=True):
        assert a.output_token_ids == b.output_token_ids
        for la, lb in zip(a.logits, b.logits, strict=True):
            torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-4)


def test_small_heads_are_padded_to_what_the_gpu_compiler_accepts():
    """tl.dot needs M, N, K >= 16 for 16-bit inputs on a GPU: a head_dim of 8 and a single
    query head per KV head are padded to 16 inside the kernels, and block sizes under 16 are
    refused, rather than relying on the interpreter accepting smaller dots."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    heads, kvh, d, bs = 2, 2, 8, 16
    lens = [21, 5]
    k_cache, v_cache = make_cache(gen, 6, bs, kvh, d, torch.float16)
    table = shuffled_tables(gen, lens, bs, 6)
    q = torch.randn(2, heads, d, generator=gen).half()
    out = torch.full_like(q, POISON)
    sl = torch.tensor(lens, dtype=torch.int32)
    decode_attention.paged_decode_attention(q, k_cache, v_cache, table, sl, d**-0.5, out=out)
    ref = ref_attention(q, k_cache, v_cache, table, lens, [1, 1], d**-0.5)
    assert rel_err(out, ref) < TOL[torch.float16]
    with pytest.raises(ValueError, match="block_size must be a power of two >= 16"):
        small = torch.zeros(6, 8, kvh, d).half()
        decode_attention.paged_decode_attention(q, small, small.clone(), table, sl, 1.0)


def test_gpu_bench_dry_run_starts(tmp_path):
    """bench/gpu.py end to end with tiny shapes under the interpreter, so it is known to start."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "gpu.json"
    r = subprocess.run(
        [sys.executable, "bench/gpu.py", "--dry-run", "--out", str(out)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "paged_decode_attention" in r.stdout and out.is_file()


def test_the_cuda_ops_table_matches_the_cpu_one(tiny_model_dir):
    """The GPU's ops table (torch's products and norms around the Triton kernels), run here on
    the CPU under the interpreter, gives the CPU table's logits within float32 rounding, for a
    prompt and the decode step after it."""
    from inference.attention.metadata import AttentionMetadata
    from inference.model.llama import LlamaModel
    from inference.runner.cpu_runner import cpu_ops
    from inference.runner.cuda_runner import cuda_ops

    cpu = torch.device("cpu")
    outs = []
    tables = (
        cuda_ops(cpu, "triton"),
        cuda_ops(cpu, "triton", batch_invariant=True),
        cpu_ops(torch.float32, torch.float32, "torch", 64),
    )
    assert tables[1].mode == "batch-invariant" and tables[1].name != tables[0].name
    for ops in tables:
        model = LlamaModel.from_pretrained(tiny_model_dir, torch.float32, ops)
        cfg = model.cfg
        shape = (4, 16, cfg.num_kv_heads, cfg.head_dim)
        kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
        ids = list(range(200, 237))
        meta = AttentionMetadata.build([[3, 0, 2]], [37], [37], 16)
        first = model.forward(torch.tensor(ids), torch.arange(37), meta, kv, torch.tensor([36]))
        meta = AttentionMetadata.build([[3, 0, 2]], [38], [1], 16, is_decode=[True])
        nxt = torch.tensor([int(first.argmax())])
        second = model.forward(nxt, torch.tensor([37]), meta, kv, torch.tensor([0]))
        outs.append(torch.cat([first, second]))
    assert rel_err(outs[0], outs[2]) < 1e-5
    assert rel_err(outs[1], outs[2]) < 1e-5


def test_decode_work_follows_the_context_not_the_tables_width(monkeypatch):
    """A decode step over block tables much wider than its contexts (a captured graph's full
    width): the partitions past each context store nothing and the merge reads none of them;
    eagerly, the grid holds the step's longest context only."""
    monkeypatch.setattr(decode_attention, "DECODE_PARTITION", 32)
    gen, seed = fresh_generator()
    heads, kvh, d, bs = CASES[0]
    lens = [21, 40]
    nb = 8
    k_cache, v_cache = make_cache(gen, nb, bs, kvh, d, torch.float32)
    table = torch.zeros(2, 64, dtype=torch.int32)  # 1,024 slots a row
    table[:, :3] = shuffled_tables(gen, lens, bs, nb)[:, :3]
    sl = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(2, heads, d, generator=gen)
    out, (part, merge) = decode_attention.decode_launches(q, k_cache, v_cache, table, sl, 0.2)
    assert part.grid == (2, kvh, 32)  # the tables' width: 1,024 keys in partitions of 32
    part_out, part_m, part_l = part.args[7:10]
    for t in (part_out, part_m, part_l):
        t.fill_(POISON)
    part()
    merge()
    for s, n in enumerate(lens):
        used = -(-n // 32)
        assert not torch.isnan(part_m[s, :, :used]).any()
        assert torch.isnan(part_m[s, :, used:]).all(), "a partition past the context was stored"
        assert torch.isnan(part_out[s, :, used:]).all()
    ref = ref_attention(q, k_cache, v_cache, table, lens, [1, 1], 0.2)
    assert rel_err(out, ref) < 1e-5, f"seed {seed}"
    _, (eager, _) = decode_attention.decode_launches(
        q, k_cache, v_cache, table, sl, 0.2, max_seq_len=max(lens)
    )
    assert eager.grid == (2, kvh, 2)


def test_a_padding_rows_decode_attention_is_zero():
    """A context of 0 (a captured graph's padding row) attends nothing: zeros, never 0 / 0."""
    heads, kvh, d, bs = CASES[0]
    k_cache, v_cache = make_cache(torch.Generator().manual_seed(0), 4, bs, kvh, d, torch.float32)
    q = torch.randn(2, heads, d)
    out = decode_attention.paged_decode_attention(
        q, k_cache, v_cache, torch.zeros(2, 4, dtype=torch.int32),
        torch.tensor([0, 5], dtype=torch.int32), 0.2,
    )  # fmt: skip
    assert torch.equal(out[0], torch.zeros_like(out[0])) and not torch.isnan(out).any()
