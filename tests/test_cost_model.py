"""The prefill cost model behind ``ttft_saved_ms`` (inference/metrics.py): fitted from steps,
predicting a prompt in the scheduler's chunks, following the machine's speed as it changes,
capped by a measured cold run; and the engine fitting it at start, so the first cache hit
reports what it saved."""

from __future__ import annotations

import pytest

from inference import LLM, SamplingParams
from inference.metrics import SAVED_COLD_RUN, SAVED_ESTIMATE, SAVED_NONE, PrefillCostModel

A, B, C = 0.002, 1e-4, 2e-8  # a step: 2 ms, plus 0.1 ms a token, plus 20 ns an attended pair


def _step_s(chunks, speed=1.0):
    x = PrefillCostModel.features(chunks)
    return speed * (A + B * x[1] + C * x[2])


def _fed(model: PrefillCostModel, speed=1.0, rounds=1) -> PrefillCostModel:
    for _ in range(rounds):
        for chunks in ([(64, 0)], [(256, 0)], [(512, 0)], [(512, 512)], [(512, 1024)], [(30, 800)]):
            model.observe(chunks, _step_s(chunks, speed))
    return model


def test_a_prompt_is_predicted_in_the_schedulers_chunks():
    m = _fed(PrefillCostModel(chunk_tokens=512))
    assert m.fitted
    chunks = [(512, 0), (512, 512), (512, 1024), (100, 1536)]
    want = sum(_step_s([c]) for c in chunks)
    assert m.predict_s(1636, 0) == pytest.approx(want, rel=0.02)
    assert m.predict_s(36, 1600) == pytest.approx(_step_s([(36, 1600)]), rel=0.05)


def test_nothing_is_predicted_before_two_step_sizes():
    m = PrefillCostModel()
    for _ in range(5):
        m.observe([(128, 0)], 0.02)
    assert not m.fitted and m.predict_s(1000, 0) == 0.0
    assert m.saved(1000, 900) == (0.0, SAVED_ESTIMATE)


def test_the_estimate_follows_the_machines_speed_as_it_changes():
    """Another process starts sharing the CPU: steps take twice as long, and within a few
    steps so do the predictions; it stops, and they come back."""
    m = _fed(PrefillCostModel(), rounds=3)
    base = m.predict_s(2000, 0)
    for chunks in ([(512, 0)], [(512, 512)], [(300, 1024)], [(40, 900)]):
        m.observe(chunks, _step_s(chunks, speed=2.0))
    assert m.predict_s(2000, 0) == pytest.approx(2 * base, rel=0.2)
    for chunks in ([(512, 0)], [(512, 512)], [(300, 1024)], [(40, 900)], [(512, 0)]):
        m.observe(chunks, _step_s(chunks))
    assert m.predict_s(2000, 0) == pytest.approx(base, rel=0.15)


def test_the_saving_is_capped_by_a_cold_run_of_the_same_prompt():
    m = _fed(PrefillCostModel())
    ms, basis = m.saved(2000, 1980, digest=b"p")
    assert basis == SAVED_ESTIMATE and ms > 100
    m.record_cold(b"p", 100.0)
    assert m.saved(2000, 1980, digest=b"p") == (100.0, SAVED_COLD_RUN)
    assert m.saved(2000, 1980, digest=b"other") == (ms, SAVED_ESTIMATE)
    assert m.saved(2000, 0, digest=b"p") == (0.0, SAVED_NONE)


def test_measured_cold_runs_are_kept_for_the_most_recent_prompts():
    m = PrefillCostModel(cold_runs=2)
    for d in (b"a", b"b", b"c"):
        m.record_cold(d, 1.0)
    assert list(m._cold) == [b"b", b"c"]


def test_a_started_engine_reports_a_saving_on_its_first_cache_hit(tiny_model_dir):
    """The engine computes a few prompts cold at start (nothing of them cached, counted or
    left in the pool), so the first warm question already reports what the cache saved."""
    llm = LLM(tiny_model_dir, dtype="float32", kv_cache_gib=0.01, max_num_batched_tokens=64)
    eng = llm.engine
    assert eng.cost_model.fitted
    assert eng.prompt_tokens_computed == 0 and eng.num_steps == 0 and not eng.requests
    assert eng.scheduler.num_prompt_tokens_admitted == 0
    assert eng.kv_manager.pool.num_cached_free == 0  # nothing of the calibration cached
    eng.kv_manager.check_integrity()
    manual = list(range(1000, 1200))
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=[manual + [7, 8, 9]], sampling_params=params)
    cold = outs[0]
    assert cold.num_cached_tokens == 0 and cold.metrics.ttft_saved_basis == SAVED_NONE
    warm = llm.generate(prompt_token_ids=[manual + [10, 11]], sampling_params=params)[0]
    assert warm.num_cached_tokens >= 192
    assert warm.metrics.ttft_saved_ms > 0 and warm.metrics.ttft_saved_basis == SAVED_ESTIMATE


def test_saved_seconds_split_by_tier_never_go_negative():
    """An answer all from Redis splits its saving into 0 on the device and the rest in Redis,
    whatever the float rounding; more Redis tokens than cached ones (blocks loaded past the
    cached prefix) count as all Redis."""
    from app.metrics import ServiceMetrics
    from inference.metrics import RequestMetrics

    sm = ServiceMetrics()
    m = RequestMetrics(1.0, 50.0, 40.0, 10.0, 5.0, 60.0, ttft_saved_ms=0.1 + 0.2)
    sm.observe_request(m, True, True, cached_tokens=3, redis_tokens=3)
    sm.observe_request(m, True, True, cached_tokens=2, redis_tokens=3)
    sm.observe_request(m, True, True, cached_tokens=4, redis_tokens=1)
    device = sm.registry.get_sample_value("docqa:prefill_seconds_saved_total", {"tier": "device"})
    redis = sm.registry.get_sample_value("docqa:prefill_seconds_saved_total", {"tier": "redis"})
    assert device == pytest.approx(0.3e-3 * 0.75) and device >= 0
    assert redis == pytest.approx(0.3e-3 * 2.25)
