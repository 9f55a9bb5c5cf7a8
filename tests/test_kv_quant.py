"""8-bit KV caches (int8, fp8 e4m3; inference/kv_quant.py): the store kernel against torch's
quantization, the attention kernel over an 8-bit pool against the same kernel over a bf16 pool
holding the dequantized values (bitwise), the real model's cold and warm answers and its batch
invariance with an 8-bit pool, the pool's size, and blocks of one KV dtype never served to an
engine of another through Redis."""

import os
import random
import time

import pytest
import torch
from svc_helpers import REDIS_URL, RUN_REDIS_PREFIX, delete_prefix, redis_client
from test_attention import SPECS, _attention, _bf16_kernel, _step
from test_real_model import MANUAL, QUESTIONS, _first

from inference import LLM, EngineConfig, LLMEngine, SamplingParams, kv_quant
from inference.kernels.cpu import elementwise
from prefix_store import TierConfig
from prompts import PromptBuilder

SEED = int(os.environ.get("DOCQA_TEST_SEED", random.randrange(2**31)))
FORMATS = [kv_quant.INT8, kv_quant.FP8]


def _scales(kvh: int, d: int, dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random per-channel scales for values of magnitude about 1 (powers of two)."""
    amax = torch.rand(kvh, d, generator=g) * 3 + 0.5
    scale = kv_quant.pow2_scales(amax, dtype)
    return scale, 1.0 / scale


def _kv8_pair(k16: torch.Tensor, v16: torch.Tensor, dtype, g: torch.Generator):
    """An 8-bit pool quantized from bf16 caches, and the bf16 pool of its dequantized values."""
    kvh, d = k16.shape[2], k16.shape[3]
    caches8, caches16 = [], []
    for c in (k16, v16):
        scale, inv = _scales(kvh, d, dtype, g)
        q = kv_quant.quantize(c, inv, dtype).contiguous()
        kv_quant.attach(q, scale, inv)
        caches8.append(q)
        caches16.append(kv_quant.dequantize(q, scale, torch.bfloat16).contiguous())
    return caches8, caches16


@pytest.mark.parametrize("dtype", FORMATS, ids=["int8", "fp8"])
def test_dequantized_values_are_exact_in_bf16(dtype):
    """Power-of-two scales: an 8-bit value times its scale is a bf16 value, so the kernels'
    bf16 staging loses nothing (kv_quant's docstring)."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    if dtype == kv_quant.FP8:
        codes = codes[~codes.float().isnan()]
    for e in (-12, -3, 0, 4):
        scale = torch.full((1, 1), 2.0**e)
        v = codes.view(-1, 1, 1).float() * scale
        assert torch.equal(
            kv_quant.dequantize(codes.view(-1, 1, 1), scale, torch.bfloat16).float(), v
        )


@pytest.mark.parametrize("dtype", FORMATS, ids=["int8", "fp8"])
def test_store_kernel_has_torchs_quantized_bits(dtype):
    """``rotary_store`` into an 8-bit cache: the bits of the bf16 store followed by
    ``kv_quant.quantize`` (round to nearest even, saturation at the format's largest value,
    fp8 subnormals), for values from far below to far above the scales' range."""
    g = torch.Generator().manual_seed(SEED)
    heads, kvh, d, n, bs, blocks = 9, 3, 64, 37, 16, 6
    qkv = torch.randn(n, (heads + 2 * kvh) * d, generator=g)
    qkv *= torch.exp2(torch.randint(-14, 9, qkv.shape, generator=g).float())  # 2^-14 .. 2^8
    qkv = qkv.bfloat16()
    cos, sin = (torch.randn(4096, d, generator=g).bfloat16() for _ in range(2))
    pos = torch.randint(0, 4000, (n,), generator=g)
    slots = torch.randperm(blocks * bs, generator=g)[:n]
    slots[5] = -1  # not stored
    k16 = torch.zeros(blocks, bs, kvh, d, dtype=torch.bfloat16)
    v16 = torch.zeros_like(k16)
    a = qkv.clone()
    elementwise.rotary_store(a, heads, kvh, pos, cos, sin, slots, k16, v16)
    k8 = torch.zeros(blocks, bs, kvh, d, dtype=dtype)
    v8 = torch.zeros_like(k8)
    (ks, ki), (vs, vi) = _scales(kvh, d, dtype, g), _scales(kvh, d, dtype, g)
    kv_quant.attach(k8, ks, ki)
    kv_quant.attach(v8, vs, vi)
    b = qkv.clone()
    elementwise.rotary_store(b, heads, kvh, pos, cos, sin, slots, k8, v8)
    assert torch.equal(a, b)  # the rotated queries and keys
    for c16, c8, inv in ((k16, k8, ki), (v16, v8, vi)):
        want = kv_quant.raw(kv_quant.quantize(c16, inv, dtype))
        assert torch.equal(kv_quant.raw(c8), want), f"seed {SEED}"


@pytest.mark.parametrize("dtype", FORMATS, ids=["int8", "fp8"])
@pytest.mark.parametrize("bs", [8, 16, 32])
@pytest.mark.parametrize("heads,kvh,d", [(9, 3, 64), (8, 2, 128)])
def test_attention_over_8_bit_caches_has_the_bits_of_the_dequantized_bf16_pool(
    dtype, bs, heads, kvh, d
):
    """The bf16 kernel over an 8-bit pool dequantizes each round of keys into bf16 and walks it
    as it walks a bf16 pool: the same bits as over a bf16 pool holding those values (prompt
    chunks and decode tokens, shared blocks, every block size); the torch reference too."""
    _bf16_kernel()
    rng = random.Random(SEED + bs + d)
    k16, v16, _tables, meta = _step(rng, bs, kvh, d, torch.bfloat16, SPECS)
    g = torch.Generator().manual_seed(SEED)
    (k8, v8), (kd, vd) = _kv8_pair(k16, v16, dtype, g)
    n = sum(s[1] for s in SPECS)
    q = torch.randn(n, heads, d, generator=g).bfloat16()
    for backend in ("cpu", "torch"):
        over8 = _attention(backend, q, k8, v8, meta, d**-0.5)
        over16 = _attention(backend, q, kd, vd, meta, d**-0.5)
        assert torch.equal(over8, over16), f"{backend} (seed {SEED})"


@pytest.mark.parametrize("dtype", FORMATS, ids=["int8", "fp8"])
@pytest.mark.parametrize("bs", [8, 16])
def test_float32_attention_over_8_bit_caches_has_the_bits_of_the_dequantized_pool(dtype, bs):
    """The float32 register-tiled kernel over an 8-bit pool (each round's rows dequantized to
    float32, exactly) gives the bits it gives over a float32 pool holding those values."""
    from inference.kernels.cpu import attention as cpu_attention

    if not cpu_attention.decode_attention_tiled(torch.float32, dtype, 64):
        pytest.skip("no AVX2 with F16C: the torch reference reads 8-bit pools here")
    rng = random.Random(SEED + bs)
    k32, v32, _tables, meta = _step(rng, bs, 3, 64, torch.float32, SPECS)
    g = torch.Generator().manual_seed(SEED)
    (k8, v8), _ = _kv8_pair(k32.bfloat16(), v32.bfloat16(), dtype, g)
    kd = kv_quant.dequantize(k8, kv_quant.scales_of(k8)[0], torch.float32).contiguous()
    vd = kv_quant.dequantize(v8, kv_quant.scales_of(v8)[0], torch.float32).contiguous()
    n = sum(s[1] for s in SPECS)
    q = torch.randn(n, 9, 64, generator=g)
    over8 = _attention("cpu", q, k8, v8, meta, 0.125)
    assert torch.equal(over8, _attention("cpu", q, kd, vd, meta, 0.125)), f"seed {SEED}"
    ref = _attention("torch", q, k8, v8, meta, 0.125)
    assert ((over8 - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.parametrize("dtype", FORMATS, ids=["int8", "fp8"])
def test_float32_store_kernel_has_torchs_quantized_bits(dtype):
    g = torch.Generator().manual_seed(SEED)
    heads, kvh, d, n = 9, 3, 64, 21
    qkv = torch.randn(n, (heads + 2 * kvh) * d, generator=g) * 3
    cos, sin = (torch.randn(4096, d, generator=g) for _ in range(2))
    pos = torch.randint(0, 4000, (n,), generator=g)
    slots = torch.randperm(6 * 16, generator=g)[:n]
    k32, v32 = torch.zeros(6, 16, kvh, d), torch.zeros(6, 16, kvh, d)
    a = qkv.clone()
    elementwise.rotary_store(a, heads, kvh, pos, cos, sin, slots, k32, v32)
    k8, v8 = torch.zeros(6, 16, kvh, d, dtype=dtype), torch.zeros(6, 16, kvh, d, dtype=dtype)
    (ks, ki), (vs, vi) = _scales(kvh, d, dtype, g), _scales(kvh, d, dtype, g)
    kv_quant.attach(k8, ks, ki)
    kv_quant.attach(v8, vs, vi)
    b = qkv.clone()
    elementwise.rotary_store(b, heads, kvh, pos, cos, sin, slots, k8, v8)
    assert torch.equal(a, b)
    for c32, c8, inv in ((k32, k8, ki), (v32, v8, vi)):
        assert torch.equal(kv_quant.raw(c8), kv_quant.raw(kv_quant.quantize(c32, inv, dtype)))


def test_float32_model_over_an_8_bit_pool_runs_compiled_and_agrees(default_model_dir):
    """float32 compute with int8 KV: the compiled layer loop runs (the float32 kernels read
    the 8-bit pool), its logits equal the Python loop's, and greedy tokens agree cold and
    warm."""
    from inference.kernels.cpu.forward import layers_compile_here

    llm = LLM(default_model_dir, dtype="float32", kv_dtype="int8", kv_cache_gib=0.1)
    model = llm.engine.runner.model
    if not layers_compile_here(torch.float32, kv_quant.INT8, model.cfg, 16):
        pytest.skip("this CPU has no compiled float32 kernel for a part of the layers")
    assert model.layer_loop(llm.engine.runner.kv_caches) is not None
    builder = PromptBuilder(llm.tokenizer)
    ids = builder.build(MANUAL, QUESTIONS[0]).token_ids
    _assert_compiled_layers_give_the_python_loops_logits(llm, ids)
    _first(llm, ids, use_cache=True)
    warm = _first(llm, ids, use_cache=True, max_tokens=8)
    cold = _first(llm, ids, use_cache=False, max_tokens=8)
    assert warm.num_cached_tokens > 0 and warm.output_token_ids == cold.output_token_ids
    llm.engine.close()


# -- the real model ------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["int8", "fp8"])
def kv8_llm(request, default_model_dir):
    return LLM(default_model_dir, dtype="bfloat16", kv_dtype=request.param, kv_cache_gib=0.25)


def test_8_bit_pool_holds_twice_the_tokens_at_half_the_bytes(kv8_llm, default_model_dir):
    eng = kv8_llm.engine
    assert eng.kv_spec.bytes_per_token == 2 * 30 * 3 * 64 * 1  # 11.25 KiB: half of bf16's
    assert eng.runner.allocated_bytes() == eng.kv_spec.total_bytes
    for k, v in eng.runner.kv_caches:
        assert k.element_size() == v.element_size() == 1
    bf16 = LLMEngine(EngineConfig(model_dir=default_model_dir, dtype="bfloat16", kv_cache_gib=0.25))
    try:
        assert eng.kv_spec.bytes_per_token * 2 == bf16.kv_spec.bytes_per_token
        assert eng.kv_spec.num_tokens >= 1.95 * bf16.kv_spec.num_tokens
        assert eng.fingerprint != bf16.fingerprint
    finally:
        bf16.close()


def test_8_bit_cold_and_warm_are_bitwise_equal(kv8_llm):
    """A cache hit never changes the answer with an 8-bit pool either: a token's stored bytes
    depend on its own K/V and the engine's fixed scales alone."""
    builder = PromptBuilder(kv8_llm.tokenizer)
    prefix, _ = builder.prefix_ids(MANUAL)
    _first(kv8_llm, builder.build(MANUAL, "Warm-up question?").token_ids, use_cache=True)
    for q in QUESTIONS[:3]:
        ids = builder.build(MANUAL, q, manual_ids=(prefix, 0)).token_ids
        warm = _first(kv8_llm, ids, use_cache=True, max_tokens=10)
        cold = _first(kv8_llm, ids, use_cache=False, max_tokens=10)
        assert warm.num_cached_tokens >= len(prefix)
        assert torch.equal(warm.logits[0], cold.logits[0]), q
        assert warm.output_token_ids == cold.output_token_ids, q
    kv8_llm.engine.kv_manager.check_integrity()


def test_8_bit_decode_logits_equal_alone_and_in_a_batch(kv8_llm):
    from inference.kernels.cpu.forward import layers_compile_here

    eng = kv8_llm.engine
    kv_dtype = eng.runner.kv_dtype
    compiled = layers_compile_here(torch.bfloat16, kv_dtype, eng.model_config, 16)
    # the compiled loop wherever this CPU has its kernels (else the Python loop: tested too)
    assert (eng.runner.model.layer_loop(eng.runner.kv_caches) is not None) == compiled
    builder = PromptBuilder(kv8_llm.tokenizer)
    prompts = [builder.build(MANUAL, q).token_ids for q in QUESTIONS[:3]]
    _first(kv8_llm, prompts[0], use_cache=True)
    alone = [_first(kv8_llm, ids, use_cache=True, max_tokens=6) for ids in prompts]
    params = SamplingParams(max_tokens=6)
    reqs = [eng.add_request(ids, params, use_cache=True, keep_logits=True) for ids in prompts]
    while any(not r.finished for r in reqs):
        eng.step()
    for a, b in zip(alone, reqs, strict=True):
        assert a.output_token_ids == b.output_token_ids
        for la, lb in zip(a.logits, b.logits, strict=True):
            assert torch.equal(la, lb)
        eng.release(b)


def test_compiled_layers_and_python_layers_agree_over_an_8_bit_pool(kv8_llm):
    """The compiled layer loop and the model's Python loop (the fused store and the bf16
    kernel called one by one) give the same logits over an 8-bit pool."""
    ids = PromptBuilder(kv8_llm.tokenizer).build(MANUAL, QUESTIONS[0]).token_ids
    _assert_compiled_layers_give_the_python_loops_logits(kv8_llm, ids)


def _assert_compiled_layers_give_the_python_loops_logits(llm, ids) -> None:
    model = llm.engine.runner.model
    logits = {}
    for compiled in (True, False):
        model.compiled_layers = compiled
        try:
            logits[compiled] = _first(llm, ids, use_cache=False).logits[0]
        finally:
            model.compiled_layers = True
    assert torch.equal(logits[True], logits[False])


# -- Redis: one tier, two KV dtypes ----------------------------------------------------------------


@pytest.fixture
def prefix():
    p = f"{RUN_REDIS_PREFIX}kv8-{time.monotonic_ns()}:"
    yield p
    delete_prefix(redis_client(), p)


def _tier_engine(model_dir, prefix: str, kv_dtype: str | None) -> LLMEngine:
    tier = TierConfig(url=REDIS_URL, prefix=prefix, retry_s=0.2)
    return LLMEngine(
        EngineConfig(
            model_dir=model_dir, dtype="bfloat16", kv_dtype=kv_dtype, kv_cache_gib=0.1, kv_tier=tier
        )
    )


def _ask(engine: LLMEngine, ids: list[int]):
    req = engine.add_request(ids, SamplingParams(max_tokens=4), use_cache=True)
    while not req.finished:
        engine.step()
    engine.release(req)
    return req


def test_blocks_of_one_kv_dtype_are_never_served_to_an_engine_of_another(default_model_dir, prefix):
    """Engines of bf16, int8 and fp8 KV on one Redis: each dtype's blocks reach only engines of
    that dtype (the fingerprint that starts every block hash includes the KV dtype and the
    8-bit scales); a second int8 engine does load the first one's blocks."""
    writers = {kv: _tier_engine(default_model_dir, prefix, kv) for kv in (None, "int8", "fp8")}
    reader = _tier_engine(default_model_dir, prefix, "int8")
    try:
        builder = PromptBuilder(reader.tokenizer)
        first = builder.build(MANUAL, QUESTIONS[0]).token_ids
        second = builder.build(MANUAL, QUESTIONS[1])
        _ask(writers[None], first)
        _ask(writers["fp8"], first)
        for w in (writers[None], writers["fp8"]):
            assert w.tier.flush().result(30)
            assert w.tier.blocks_written >= second.prefix_len // 16
        miss = _ask(reader, second.token_ids)
        assert miss.num_tier_cached_tokens == 0  # bf16 and fp8 blocks are not its own
        _ask(writers["int8"], first)
        assert writers["int8"].tier.flush().result(30)
        other = _tier_engine(default_model_dir, prefix, "int8")
        try:
            hit = _ask(other, second.token_ids)
            assert hit.num_tier_cached_tokens >= 0.9 * second.prefix_len
            cold = other.add_request(
                second.token_ids, SamplingParams(max_tokens=4), use_cache=False
            )
            while not cold.finished:
                other.step()
            assert hit.output_token_ids == cold.output_token_ids
        finally:
            other.close()
    finally:
        for e in (*writers.values(), reader):
            e.close()


# -- the service ---------------------------------------------------------------------------------


def test_service_reports_an_8_bit_pool(default_model_dir, sqlite_server, tmp_path):
    """``docqa serve --kv-dtype int8`` beside the bf16 test server, both with 0.25 GiB of KV:
    ``/v1/engine`` reports the KV dtype, half the bytes per token and twice the tokens, the
    start-up log says so the way vLLM does, and answers stream as usual."""
    from svc_helpers import Server

    srv = Server(tmp_path, f"sqlite:///{tmp_path / 'kv8.db'}", args=("--kv-dtype", "int8"))
    srv.start()
    try:
        with srv.client() as c, sqlite_server.client() as base:
            e, b = c.get("/v1/engine").json(), base.get("/v1/engine").json()
            # the default dtype is this CPU's (bfloat16 where its products are faster)
            elem = {"bfloat16": 2, "float32": 4}[b["dtype"]]
            assert (e["kv_dtype"], b["kv_dtype"]) == ("int8", b["dtype"])
            assert e["weights"] == b["weights"] == "files"
            assert e["kv_bytes_per_token"] == 11520 and b["kv_bytes_per_token"] == 11520 * elem
            assert e["kv_capacity_tokens"] >= 0.975 * elem * b["kv_capacity_tokens"]
            man = c.post("/v1/manuals", json={"title": "t", "text": MANUAL})
            assert man.status_code == 201, man.text
            for _ in range(2):
                r = c.post("/v1/ask", json={"manual_id": man.json()["id"],
                                            "question": QUESTIONS[0], "max_tokens": 8})  # fmt: skip
                assert r.status_code == 200, r.text
            assert r.json()["usage"]["cached_tokens"] > 0
        log = srv.log_tail(200_000)
        assert "KV cache: 11.25 KiB per token" in log
        assert "KV cache int8: scales" in log
    finally:
        srv.stop()


def test_a_bad_kv_dtype_stops_the_service_with_one_line(tmp_path):
    from test_cli import _assert_one_line_error, docqa

    _assert_one_line_error(docqa("serve", "--kv-dtype", "int4"), "--kv-dtype")
