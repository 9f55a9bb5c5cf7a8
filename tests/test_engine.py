"""Engine behaviour on a tiny random model: prefix reuse, numerics, counters, sizing, errors."""

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inference import LLM, PromptTooLongError, SamplingParams
from inference.engine.scheduler import RequestTooLargeError
from inference.kv_sizing import kv_bytes_per_token
from inference.runner.cpu_runner import zeroed_kv_tensor


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, dtype="bfloat16", kv_cache_gib=0.01, max_num_batched_tokens=96)


def _first_logits(llm, ids, use_cache=True, max_tokens=1):
    eng = llm.engine
    req = eng.add_request(
        ids,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        use_cache=use_cache,
        keep_logits=True,
    )
    while not req.finished:
        eng.step()
    eng.release(req)
    eng.kv_manager.check_integrity()
    return req


def _prompt(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 49000, (n,), generator=g).tolist()


def test_cold_and_warm_last_token_logits_are_bitwise_equal(llm):
    manual = _prompt(1, 300)
    for q_len, seed in [(7, 2), (16, 3), (40, 4)]:  # prefixes ending mid-block and on a block
        ids = manual + _prompt(seed, q_len)
        warm = _first_logits(llm, manual + _prompt(seed + 100, 5))  # puts the manual in cache
        warm = _first_logits(llm, ids)
        cold = _first_logits(llm, ids, use_cache=False)
        # 18 full blocks, then the manual's last 12 tokens copied from the block that the
        # question before filled after them
        assert warm.num_cached_tokens == 300 and cold.num_cached_tokens == 0
        assert torch.equal(warm.logits[0], cold.logits[0])
    # full-prompt hit: every block cached; the last block's first tokens are copied from the
    # earlier request's partial tail into a fresh block and only the last one is computed
    computed = llm.engine.prompt_tokens_computed
    again = _first_logits(llm, ids)
    assert again.num_cached_tokens == len(ids) - 1
    assert llm.engine.prompt_tokens_computed - computed == 1
    assert torch.equal(again.logits[0], cold.logits[0])


def test_decode_logits_equal_alone_and_in_a_batch(llm):
    eng = llm.engine
    prompts = [_prompt(10 + i, 20 + 7 * i) for i in range(4)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    alone = []
    for p in prompts:
        r = _first_logits(llm, p, use_cache=False, max_tokens=6)
        alone.append(r)
    reqs = [eng.add_request(p, params, use_cache=False, keep_logits=True) for p in prompts]
    while any(not r.finished for r in reqs):
        eng.step()
    for a, b in zip(alone, reqs, strict=True):
        assert a.output_token_ids == b.output_token_ids
        for la, lb in zip(a.logits, b.logits, strict=True):
            assert torch.equal(la, lb)
        eng.release(b)


def test_generate_api_reports_cached_tokens_and_computed_counter(llm):
    eng = llm.engine
    manual = _prompt(20, 200)
    sp = SamplingParams(max_tokens=3)
    before = eng.prompt_tokens_computed
    out1 = llm.generate(prompt_token_ids=[manual + [5, 6, 7]], sampling_params=sp)[0]
    assert out1.num_cached_tokens == 0
    assert eng.prompt_tokens_computed - before == 203
    before = eng.prompt_tokens_computed
    out2 = llm.generate(prompt_token_ids=[manual + [8, 9, 10, 11]], sampling_params=sp)[0]
    # 12 full blocks, then the manual's last 8 tokens copied from out1's partial last block
    assert out2.num_cached_tokens == 200
    assert eng.prompt_tokens_computed - before == 204 - 200
    assert out2.finish_reason in ("stop", "length")
    m = out2.metrics
    assert m.ttft_ms > 0 and m.e2e_ms >= m.ttft_ms and m.queue_ms >= 0
    assert isinstance(out2.text, str) and len(out2.token_ids) <= 3
    eng.kv_manager.check_integrity()


def test_bypass_registers_nothing(llm):
    eng = llm.engine
    ids = _prompt(30, 64)
    eng.kv_manager.pool.reset_cache()
    llm.generate(
        prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=1), use_cache=False
    )
    assert eng.kv_manager.find_cached_prefix(ids).num_cached_tokens == 0


def test_kv_allocation_matches_sizing(llm):
    eng = llm.engine
    cfg = eng.model_config
    bpt = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    assert eng.kv_spec.bytes_per_token == bpt
    assert eng.runner.allocated_bytes() == bpt * eng.kv_spec.num_tokens
    assert eng.kv_spec.num_tokens == int(0.01 * 2**30) // (bpt * 16) * 16


def test_bad_prompts_are_rejected(llm):
    eng = llm.engine
    with pytest.raises(PromptTooLongError, match="context is 2,048 tokens"):
        eng.add_request(list(range(2100)), SamplingParams())
    with pytest.raises(PromptTooLongError):
        eng.add_request([], SamplingParams())
    small = LLM(llm.engine.model_dir, dtype="bfloat16", kv_cache_gib=0.0002)
    with pytest.raises(RequestTooLargeError, match="KV blocks"):
        small.engine.add_request(list(range(1000)), SamplingParams())


@pytest.mark.parametrize("speculate", ["off", "prompt-lookup"])
def test_preemption_under_a_tiny_pool_still_completes(tiny_model_dir, speculate):
    """With drafts too (a verification's rows take blocks): every answer is the one its
    prompt gets alone, without drafts."""
    small = LLM(
        tiny_model_dir,
        dtype="bfloat16",
        kv_cache_gib=0.0005,
        max_num_batched_tokens=64,
        speculate=speculate,
    )
    eng = small.engine
    num_blocks = eng.kv_spec.num_blocks
    prompts = [_prompt(40 + i, num_blocks * 16 // 3) for i in range(3)]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    outs = small.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [len(o.token_ids) for o in outs] == [48, 48, 48]
    assert eng.scheduler.num_preemptions > 0
    eng.kv_manager.check_integrity()
    if speculate != "off":
        assert all(o.accepted_prediction_tokens > 0 for o in outs)
    # preempted requests recompute to the same greedy tokens as alone
    for p, o in zip(prompts, outs, strict=True):
        alone = small.generate(
            prompt_token_ids=[p], use_cache=False, sampling_params=params, speculate=False
        )[0]
        assert alone.token_ids == o.token_ids


def test_sampling_with_seed_is_reproducible(llm):
    sp = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    ids = _prompt(50, 30)
    a = llm.generate(prompt_token_ids=[ids], sampling_params=sp)[0]
    b = llm.generate(prompt_token_ids=[ids], sampling_params=sp)[0]
    assert a.token_ids == b.token_ids
    # any 64-bit seed a client may send, negative or past torch's signed range
    for seed in (-1, 2**63, 2**64 - 1):
        sp = SamplingParams(max_tokens=2, temperature=0.9, seed=seed)
        assert len(llm.generate(prompt_token_ids=[ids], sampling_params=sp)[0].token_ids) == 2


def test_sampling_params_validate():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


def test_simultaneous_requests_prefill_a_shared_prefix_once(tiny_model_dir):
    """8 questions about one new manual, arriving together: the manual is computed once and
    the others wait for its blocks instead of computing it in parallel."""
    eng = LLM(tiny_model_dir, dtype="bfloat16", kv_cache_gib=0.01, max_num_batched_tokens=128)
    eng = eng.engine
    manual = _prompt(900, 200)  # 12 full blocks + 8 tokens
    prompts = [manual + _prompt(901 + i, 10) for i in range(8)]
    reqs = [eng.add_request(p, SamplingParams(max_tokens=3, ignore_eos=True)) for p in prompts]
    while any(not r.finished for r in reqs):
        eng.step()
    shared = len(manual)  # its full blocks, then its last 8 tokens copied from the first's block
    assert eng.prompt_tokens_computed == len(prompts[0]) + sum(len(p) - shared for p in prompts[1:])
    assert [r.num_cached_tokens for r in reqs] == [0] + [shared] * 7
    assert eng.scheduler.num_deferred_admissions > 0
    for r in reqs:
        eng.release(r)
    eng.kv_manager.check_integrity()


def test_admission_prefers_the_longest_cached_prefix(tiny_model_dir):
    eng = LLM(tiny_model_dir, dtype="bfloat16", kv_cache_gib=0.01, max_num_batched_tokens=64)
    eng = eng.engine
    manual = _prompt(950, 96)
    warm = eng.add_request(manual + [5], SamplingParams(max_tokens=1))
    while not warm.finished:
        eng.step()
    eng.release(warm)
    cold = eng.add_request(_prompt(951, 100), SamplingParams(max_tokens=1))
    hit = eng.add_request(manual + _prompt(952, 4), SamplingParams(max_tokens=1))
    out = eng.scheduler.schedule()
    first = out.chunks[0].request
    assert first is hit and out.chunks[0].num_context_tokens == 96
    assert any(c.request is cold for c in out.chunks)  # the cold one still gets the rest


def test_prompt_tokens_per_step_are_capped_while_answers_decode(tiny_model_dir):
    """While an answer decodes, a new prompt is computed at most ``prefill_tokens_with_decodes``
    tokens a step and the answer gains a token every step; with nothing decoding, a prompt
    takes the whole step budget."""
    eng = LLM(
        tiny_model_dir,
        dtype="bfloat16",
        kv_cache_gib=0.01,
        max_num_batched_tokens=256,
        prefill_tokens_with_decodes=32,
    ).engine
    alone = eng.add_request(_prompt(960, 150), SamplingParams(max_tokens=1))
    eng.step()
    assert eng.last_step[1:3] == (150, 0) and alone.finished
    eng.release(alone)
    assert eng.step() == [] and eng.last_step is None  # nothing ran: no step to report
    answer = eng.add_request(_prompt(961, 40), SamplingParams(max_tokens=60, ignore_eos=True))
    while not answer.output_token_ids:
        eng.step()
    question = eng.add_request(_prompt(962, 150), SamplingParams(max_tokens=1))
    steps, gained = [], []
    while not question.finished:
        before = len(answer.output_token_ids)
        eng.step()
        steps.append(eng.last_step[1:3])  # (prompt tokens, decode tokens)
        gained.append(len(answer.output_token_ids) - before)
    assert [p for p, _ in steps] == [32, 32, 32, 32, 22]
    # a decode row a step, and a verification's drafted rows where it drafts
    assert all(d >= 1 for _, d in steps) and all(g >= 1 for g in gained), (steps, gained)


def test_random_weights_for_benchmarks(tiny_model_dir):
    a = LLM(tiny_model_dir, dtype="float32", kv_cache_gib=0.002, random_weights_seed=1).engine
    b = LLM(tiny_model_dir, dtype="float32", kv_cache_gib=0.002).engine
    assert a.fingerprint != b.fingerprint
    out = a.add_request(list(range(50, 70)), SamplingParams(max_tokens=3, ignore_eos=True))
    while not out.finished:
        a.step()
    assert len(out.output_token_ids) == 3


def test_a_copy_that_would_not_fit_the_pool_is_computed_instead(tiny_model_dir):
    """The prompt needs every block of the pool, so the block whose slots it could copy must
    be handed out as its fresh block: it is admitted without the copy, not left waiting."""
    eng = LLM(tiny_model_dir, dtype="bfloat16", kv_cache_gib=0.0002).engine
    nb = eng.kv_spec.num_blocks
    prompt = _prompt(960, nb * 16 - 2)
    first = eng.add_request(prompt[: (nb - 1) * 16 + 4], SamplingParams(max_tokens=1))
    while not first.finished:
        eng.step()
    req = eng.add_request(prompt, SamplingParams(max_tokens=1))
    for _ in range(20):
        if req.finished:
            break
        eng.step()
    assert req.finished and req.num_cached_tokens == (nb - 1) * 16
    eng.kv_manager.check_integrity()


def test_auto_dtype_is_measured_once_per_machine(tmp_path, monkeypatch):
    """``auto`` on a CPU follows the first measurement kept beside the kernels: a later process
    reads it instead of measuring again, and where another process wrote its record first (two
    replicas starting together), both follow that one."""
    from inference import device as engine

    path = tmp_path / "kernels" / "auto-dtype.json"
    monkeypatch.setattr(engine, "_dtype_record_path", lambda: path)
    engine.cpu_bf16_matmul_is_faster.cache_clear()
    try:
        first = engine.cpu_bf16_matmul_is_faster()
        if not engine.cpu_has_native_bf16():
            assert first is False and not path.exists()  # nothing to measure
            return
        record = json.loads(path.read_text())
        assert record["bf16_faster"] is first
        assert (record["bf16_over_float32_time"] < 1.0) is first
        # a later process reads the record without measuring, whatever it says
        path.write_text(json.dumps({"bf16_faster": not first}))
        measure = engine._measure_bf16_against_float32

        def not_again() -> float:
            raise AssertionError("measured again although a record is kept")

        monkeypatch.setattr(engine, "_measure_bf16_against_float32", not_again)
        engine.cpu_bf16_matmul_is_faster.cache_clear()
        want = torch.float32 if first else torch.bfloat16
        assert engine.resolve_dtype("auto", torch.device("cpu")) == want

        # a process that measured while another wrote its record first follows that record
        path.unlink()
        theirs = []

        def raced() -> float:
            ratio = measure()
            theirs.append(ratio >= 1.0)  # the other answer than this process's
            path.write_text(json.dumps({"bf16_faster": theirs[0]}))
            return ratio

        monkeypatch.setattr(engine, "_measure_bf16_against_float32", raced)
        engine.cpu_bf16_matmul_is_faster.cache_clear()
        assert engine.cpu_bf16_matmul_is_faster() is theirs[0]
        assert json.loads(path.read_text())["bf16_faster"] is theirs[0]  # not overwritten
        assert not list(path.parent.glob(".auto-dtype-*"))  # no temporary file left
    finally:
        engine.cpu_bf16_matmul_is_faster.cache_clear()


def test_a_requests_token_slices_are_its_joined_tokens():
    """``Request.token_ids`` (a step's chunk, read without joining prompt and answer) gives
    the same tokens as slicing the joined list, on either side of the prompt's end and
    across it."""
    from inference.engine.sequence import Request

    req = Request("r", [5, 6, 7, 8], SamplingParams())
    req.output_token_ids.extend([9, 10, 11])
    joined = req.all_token_ids
    for start in range(len(joined) + 1):
        for end in range(start, len(joined) + 1):
            assert req.token_ids(start, end) == joined[start:end], (start, end)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_copying_a_blocks_first_slots_touches_nothing_else(tiny_model_dir, dtype):
    """``copy_slots`` (a prompt's start that a cached block holds) gives block ``dst`` the
    first ``n`` slots of block ``src`` in every layer's K and V cache, and changes no other
    slot, block or cache."""
    eng = LLM(tiny_model_dir, dtype=dtype, kv_cache_gib=0.002).engine
    gen = torch.Generator().manual_seed(3)
    for kc, vc in eng.runner.kv_caches:
        kc.copy_(torch.randn(kc.shape, generator=gen))
        vc.copy_(torch.randn(vc.shape, generator=gen))
    blocks, size = eng.runner.kv_caches[0][0].shape[:2]
    for src, dst, n in [(1, 4, 5), (blocks - 1, 0, size), (2, 3, 0), (3, 2, 1)]:
        want = [(kc.clone(), vc.clone()) for kc, vc in eng.runner.kv_caches]
        for kc, vc in want:
            kc[dst, :n] = kc[src, :n]
            vc[dst, :n] = vc[src, :n]
        eng.runner.copy_slots(src, dst, n)
        for (kc, vc), (wk, wv) in zip(eng.runner.kv_caches, want, strict=True):
            assert torch.equal(kc, wk) and torch.equal(vc, wv), (src, dst, n)
    with pytest.raises(IndexError):
        eng.runner.copy_slots(0, blocks, 1)


def _resident_bytes() -> int:
    gc.collect()  # an engine of an earlier test freed now would shrink the count
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


linux_only = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="Linux /proc")


@linux_only
def test_a_cpu_kv_tensor_is_zero_and_takes_memory_only_where_written():
    before = _resident_bytes()
    t = zeroed_kv_tensor((2**30 // (16 * 3 * 64 * 2), 16, 3, 64), torch.bfloat16)
    assert t.nbytes > 2**30 - 2**14 and t.is_contiguous()
    assert _resident_bytes() - before < 2**26  # not the gibibyte
    assert not t[::97].any()
    t[5] = 1.0
    assert _resident_bytes() - before < 2**26
    assert t[5].all() and not t[4].any() and not t[6].any()


# a process whose pool is still being mapped when it exits: an atexit hook registered before
# the runner's (so run after it) says whether the mapping thread was still alive then
_EXIT_WHILE_MAPPING = """
import atexit, threading
atexit.register(lambda: print("alive" if any(
    t.name == "docqa-kv-prefault" and t.is_alive() for t in threading.enumerate()) else "stopped"))
import torch
from inference.runner.cpu_runner import prefault_pool, zeroed_kv_tensor
thread = prefault_pool([zeroed_kv_tensor((4 << 30,), torch.uint8)])  # 4 GiB: seconds to map
print("mapping" if thread.is_alive() else "done")
"""


@linux_only
def test_a_process_that_exits_while_its_pool_is_mapped_stops_the_mapping_first():
    """The mapping thread is stopped and joined at exit, before the interpreter finalizes (a
    daemon thread dropping the pool's tensors while it finalizes aborts the process)."""
    run = subprocess.run(
        [sys.executable, "-c", _EXIT_WHILE_MAPPING],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["mapping", "stopped"], run.stdout


@linux_only
def test_the_cpu_pool_is_mapped_in_the_background_and_keeps_what_the_engine_wrote(
    tiny_model_dir,
):
    """The engine starts before its pool is mapped; a request runs while the pages are mapped,
    and afterwards the pool is resident, the request's blocks hold its K/V and no other block
    was written."""
    before = _resident_bytes()
    eng = LLM(tiny_model_dir, dtype="bfloat16", kv_cache_gib=0.5).engine
    pool = sum(k.nbytes + v.nbytes for k, v in eng.runner.kv_caches)
    req = eng.add_request(list(range(50, 90)), SamplingParams(max_tokens=2, ignore_eos=True))
    eng.step()  # the prompt
    blocks = eng.kv_manager.block_ids(req.request_id)
    while not req.finished:
        eng.step()
    assert len(req.output_token_ids) == 2
    eng.runner.prefault.join(timeout=120)
    assert not eng.runner.prefault.is_alive()
    assert _resident_bytes() - before > 0.9 * pool
    for k, v in eng.runner.kv_caches:
        assert k.view(k.shape[0], -1).any(dim=1).nonzero().flatten().tolist() == sorted(blocks)
        assert all(v[b].any() for b in blocks)


def test_pins_taken_under_a_running_request_neither_stall_nor_spin_it(tiny_model_dir):
    """A request admitted when the pool could hold it, then left short by pins taken while it
    runs: once it cannot grow it finishes with an error that says so, in a bounded number of
    steps, each of which ran something; the pins keep their blocks."""
    eng = LLM(tiny_model_dir, dtype="bfloat16", kv_cache_gib=0.0005, pin_budget=1.0).engine
    nb = eng.kv_spec.num_blocks
    third = nb // 3
    manual = _prompt(990, third * 16)
    warm = eng.add_request(manual + [5], SamplingParams(max_tokens=1))
    while not warm.finished:
        eng.step()
    eng.release(warm)
    # its prompt and answer fit the pool with nothing pinned
    req = eng.add_request(
        _prompt(991, third * 16), SamplingParams(max_tokens=(nb - third - 4) * 16, ignore_eos=True)
    )
    while not req.output_token_ids:
        eng.step()
    assert eng.pin("manual", manual) == third * 16
    for _ in range(nb * 16):
        finished = eng.step()
        if req.finished:
            break
        assert eng.last_step is not None  # every step ran something
    assert req.finished and req in finished and req.finish_reason == "error"
    assert isinstance(req.error, RequestTooLargeError) and "pinned" in str(req.error)
    assert eng.kv_manager.find_cached_prefix(manual + [0]).num_cached_tokens == third * 16
    eng.kv_manager.check_integrity()
    assert eng.unpin("manual")
