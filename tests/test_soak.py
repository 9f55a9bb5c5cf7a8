"""A bounded soak: a few hundred mixed requests sharing prefixes, with cancellations and
preemptions under a deliberately small KV pool, on a tiny random model."""

from __future__ import annotations

import random

import pytest

from inference import LLM, SamplingParams


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 49000) for _ in range(n)]


@pytest.fixture(scope="module")
def soak_llm(tiny_model_dir):
    # ~40 blocks of 16 tokens: a handful of requests at a time
    return LLM(tiny_model_dir, dtype="bfloat16", kv_cache_gib=0.00022, max_num_batched_tokens=96)


def test_soak_with_cancellations_and_preemptions(soak_llm, tiny_model_dir):
    eng = soak_llm.engine
    rng = random.Random(1234)
    manuals = [_ids(rng, rng.randrange(60, 200)) for _ in range(6)]
    specs = []
    for i in range(300):
        prompt = rng.choice(manuals) + _ids(rng, rng.randrange(3, 30))
        specs.append((f"soak-{i}", prompt, rng.randrange(2, 20), rng.random() < 0.12))
    pending = list(specs)
    live: dict[str, object] = {}
    results: dict[str, list[int]] = {}
    cancelled: set[str] = set()
    cancel_at: dict[str, int] = {}
    step = 0
    while pending or live:
        for _ in range(rng.randrange(0, 4)):
            if pending:
                rid, prompt, max_tokens, cancel = pending.pop(0)
                req = eng.add_request(
                    prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=rid
                )
                live[rid] = req
                if cancel:
                    cancel_at[rid] = step + rng.randrange(0, 12)
        for rid, at in list(cancel_at.items()):
            if at <= step and rid in live:
                eng.abort(rid)
                cancelled.add(rid)
                del live[rid]
                del cancel_at[rid]
        for req in eng.step():
            results[req.request_id] = list(req.output_token_ids)
            eng.release(req)
            live.pop(req.request_id, None)
            cancel_at.pop(req.request_id, None)
        step += 1
        assert step < 20000, "the soak did not drain"
    s = eng.scheduler
    print(
        f"steps {step}, preemptions {s.num_preemptions}, cancelled {eng.num_cancelled}, "
        f"deferred {s.num_deferred_admissions}, hits {s.num_prefix_hits}/{s.num_prefix_queries}"
    )
    assert s.num_preemptions > 0 and eng.num_cancelled > 0
    assert len(results) + len(cancelled) == len(specs)
    assert not s.running and not s.waiting and not eng.requests
    eng.kv_manager.check_integrity()
    pool = eng.kv_manager.pool
    assert pool.num_free == pool.num_blocks  # every block is free or cached
    assert all(len(results[rid]) == mt for rid, _, mt, _ in specs if rid in results)
    # greedy answers match the same requests run one at a time (cache bypassed)
    alone = LLM(tiny_model_dir, dtype="bfloat16", kv_cache_gib=0.001)
    checked = 0
    for rid, prompt, max_tokens, _ in specs[::5]:
        if rid not in results:
            continue
        out = alone.generate(
            prompt_token_ids=[prompt],
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            use_cache=False,
        )[0]
        assert out.token_ids == results[rid], rid
        checked += 1
    assert checked >= 40
