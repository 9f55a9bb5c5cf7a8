"""Service settings from the environment: the Redis tier and replica options, with clear errors
for bad values."""

import pytest

from app.settings import ConfigError, Settings


@pytest.fixture
def env(monkeypatch, tmp_path):
    monkeypatch.setenv("DOCQA_HOME", str(tmp_path))
    for name in (
        "DOCQA_DATABASE_URL",
        "DOCQA_REDIS_URL",
        "DOCQA_REDIS_PREFIX",
        "DOCQA_REDIS_TTL_S",
        "DOCQA_REDIS_MAX_GIB",
        "DOCQA_API_KEYS",
        "DOCQA_KV_DTYPE",
        "DOCQA_BENCHMARK_WEIGHTS",
    ):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_no_redis_means_no_tier(env):
    s = Settings.from_env()
    assert s.redis_url is None and s.tier_config() is None


def test_tier_options_reach_the_engine(env):
    env.setenv("DOCQA_REDIS_URL", "redis://127.0.0.1:6379/0")
    env.setenv("DOCQA_REDIS_PREFIX", "team-a:")
    env.setenv("DOCQA_REDIS_TTL_S", "600")
    env.setenv("DOCQA_REDIS_MAX_GIB", "0.5")
    s = Settings.from_env()
    t = s.tier_config()
    assert (t.url, t.prefix, t.ttl_s, t.max_bytes) == (
        "redis://127.0.0.1:6379/0",
        "team-a:",
        600,
        2**29,
    )


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("DOCQA_REDIS_TTL_S", "soon", "DOCQA_REDIS_TTL_S must be a whole number"),
        ("DOCQA_REDIS_TTL_S", "0", "DOCQA_REDIS_TTL_S must be at least 1"),
        ("DOCQA_REDIS_MAX_GIB", "-1", "DOCQA_REDIS_MAX_GIB must be positive"),
        ("DOCQA_KV_DTYPE", "int4", "must be one of float32, bfloat16, float16, int8, fp8"),
        ("DOCQA_BENCHMARK_WEIGHTS", "on", "--benchmark-weights needs a benchmark model"),
        ("DOCQA_PARTS", "sometimes", "DOCQA_PARTS must be on or off"),
        ("DOCQA_MAX_PART_TOKENS", "many", "DOCQA_MAX_PART_TOKENS must be a whole number"),
        ("DOCQA_MAX_PART_TOKENS", "100", "must be at least 256, got 100"),
    ],
)
def test_bad_values_are_refused_with_the_rule(env, name, value, message):
    env.setenv(name, value)
    with pytest.raises(ConfigError, match=message):
        Settings.from_env()


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("max_num_batched_tokens", 8, "--max-batched-tokens must be at least 16"),
        ("prefill_tokens_with_decodes", -1, "--prefill-tokens-with-decodes must be 0"),
        ("model", "random:llama-3-8b", "answers noise, for benchmarks only"),
    ],
)
def test_bad_options_are_refused_with_the_rule(env, option, value, message):
    with pytest.raises(ConfigError, match=message):
        Settings.from_env(**{option: value})


def test_kv_dtype_and_benchmark_model_settings(env):
    env.setenv("DOCQA_KV_DTYPE", "int8")
    assert Settings.from_env().kv_dtype == "int8"
    env.setenv("DOCQA_BENCHMARK_WEIGHTS", "1")
    s = Settings.from_env(model="random:llama-3-8b")
    assert s.benchmark_weights and s.model == "random:llama-3-8b"
