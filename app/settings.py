"""Service configuration: environment variables (the README's "Configuration") plus the
options of ``docqa serve``."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from inference.engine.speculate import SPECULATE_MODES
from inference.errors import DocqaError
from inference.model.model_import import docqa_home

MAX_TOKENS_CAP = 1024  # default upper bound of a request's max_tokens
DEFAULT_MAX_TOKENS = 256
MAX_UPLOAD_BYTES = 10 * 2**20
# a manual must leave this many tokens of the context for a question and an answer
MIN_QUESTION_ROOM = 256
MIN_PART_TOKENS = 256  # a part smaller than this holds too little to answer from


class ConfigError(DocqaError):
    code = "bad_configuration"


def parse_api_keys(raw: str | None) -> dict[str, str]:
    """``key1:tenant_a,key2:tenant_b`` -> {key: tenant}; empty or unset means auth off."""
    keys: dict[str, str] = {}
    if not raw or not raw.strip():
        return keys
    for i, item in enumerate(raw.split(","), 1):
        item = item.strip()
        if not item:
            continue
        key, sep, tenant = item.partition(":")
        key, tenant = key.strip(), tenant.strip()
        if not sep or not key or not tenant:
            raise ConfigError(
                f"DOCQA_API_KEYS entry {i} is not 'key:tenant' "
                "(expected key1:tenant_a,key2:tenant_b)"
            )
        if key in keys and keys[key] != tenant:
            raise ConfigError(
                f"DOCQA_API_KEYS lists one key for two tenants ({keys[key]}, {tenant})"
            )
        keys[key] = tenant
    return keys


def normalize_database_url(url: str) -> str:
    """Give the URL an async driver: sqlite -> aiosqlite, postgresql -> asyncpg."""
    url = url.strip()
    for plain, driver in (
        ("sqlite://", "sqlite+aiosqlite://"),
        ("postgresql://", "postgresql+asyncpg://"),
        ("postgres://", "postgresql+asyncpg://"),
    ):
        if url.startswith(plain):
            return driver + url[len(plain) :]
    if url.startswith(("sqlite+aiosqlite://", "postgresql+asyncpg://")):
        return url
    raise ConfigError(
        f"DOCQA_DATABASE_URL {url.split('://')[0]!r} is not supported: use sqlite:///PATH or "
        "postgresql://USER@HOST/DB"
    )


def default_database_url(home: Path) -> str:
    return f"sqlite+aiosqlite:///{home / 'docqa.db'}"


def _env_number(name: str, kind: type, default):
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return kind(raw)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise ConfigError(f"{name} must be {what}, got {raw!r}") from None


def _env_flag(name: str, default: bool) -> bool:
    raw = (os.environ.get(name) or "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "on", "true", "yes"):
        return True
    if raw in ("0", "off", "false", "no"):
        return False
    raise ConfigError(f"{name} must be on or off, got {raw!r}")


@dataclass(frozen=True)
class Settings:
    home: Path
    database_url: str
    redis_url: str | None = None
    api_keys: dict[str, str] = field(default_factory=dict)
    model: str | None = None  # None: the default model, imported on first use
    dtype: str = "auto"
    kv_dtype: str | None = None  # None: the compute dtype; int8 | fp8: an 8-bit KV pool
    kv_cache_gib: float | None = None
    pin_budget: float = 0.25  # share of the KV pool pinned manuals may hold
    max_num_batched_tokens: int = 512  # tokens per engine step (decodes + prompt chunks)
    prefill_tokens_with_decodes: int = 0  # prompt tokens per step while answers decode (0: off)
    max_tokens_cap: int = MAX_TOKENS_CAP
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_upload_bytes: int = MAX_UPLOAD_BYTES
    max_waiting_requests: int = 256  # beyond this the engine answers 503 with Retry-After
    num_threads: int | None = None
    # the Redis tier, and cancels relayed between replicas (used only with redis_url)
    redis_prefix: str = "docqa:"  # key prefix of everything docqa keeps in Redis
    redis_ttl_s: int = 24 * 3600  # lifetime of a KV block in Redis since its last use
    redis_max_gib: float = 2.0  # KV bytes the tier may hold before trimming the oldest
    # on SIGTERM, how long answers in flight may run on before they are cancelled (stored as
    # such) and the process exits; new requests get 503 meanwhile
    shutdown_grace_s: float = 30.0
    # ``--model random:NAME`` (random weights of a known shape) is served only with this on
    benchmark_weights: bool = False
    # CUDA: the batch-invariant products and norms (EngineConfig.batch_invariant)
    batch_invariant: bool = False
    # CUDA: decode steps replayed from captured graphs (EngineConfig.cuda_graphs)
    cuda_graphs: bool = False
    # prompt-lookup speculation: prompt-lookup | off (EngineConfig.speculate)
    speculate: str = "off"
    # manuals longer than the window are stored as parts, each its own cached prefix (off:
    # refused as too long); max_part_tokens also splits manuals that fit (None: only those
    # that do not, into parts as large as the window allows)
    parts: bool = True
    max_part_tokens: int | None = None

    def __post_init__(self):
        if self.speculate not in SPECULATE_MODES:
            raise ValueError(
                f"speculate (DOCQA_SPECULATE) must be one of {', '.join(SPECULATE_MODES)}; "
                f"got {self.speculate!r}"
            )
        if self.max_part_tokens is not None and self.max_part_tokens < MIN_PART_TOKENS:
            raise ConfigError(
                f"--max-part-tokens (DOCQA_MAX_PART_TOKENS) must be at least {MIN_PART_TOKENS}, "
                f"got {self.max_part_tokens}"
            )
        if self.max_tokens_cap < 1:
            raise ConfigError(f"--max-tokens-cap must be at least 1, got {self.max_tokens_cap}")
        if not 0 <= self.pin_budget <= 0.9:
            raise ConfigError(f"--pin-budget must be between 0 and 0.9, got {self.pin_budget}")
        if self.max_num_batched_tokens < 16:
            raise ConfigError("--max-batched-tokens must be at least 16")
        if self.prefill_tokens_with_decodes < 0:
            raise ConfigError(
                "--prefill-tokens-with-decodes must be 0 (no limit) or more, got "
                f"{self.prefill_tokens_with_decodes}"
            )
        if self.max_upload_bytes < 1:
            raise ConfigError("the upload limit must be positive")
        if self.redis_ttl_s < 1:
            raise ConfigError(f"DOCQA_REDIS_TTL_S must be at least 1, got {self.redis_ttl_s}")
        if self.redis_max_gib <= 0:
            raise ConfigError(f"DOCQA_REDIS_MAX_GIB must be positive, got {self.redis_max_gib}")
        self._check_kv_dtype()
        self._check_benchmark_model()
        if not 0 <= self.shutdown_grace_s <= 3600:
            raise ConfigError(
                f"DOCQA_SHUTDOWN_GRACE_S must be between 0 and 3600, got {self.shutdown_grace_s}"
            )

    def _check_benchmark_model(self) -> None:
        random_model = isinstance(self.model, str) and self.model.startswith("random:")
        if random_model and not self.benchmark_weights:
            raise ConfigError(
                f"--model {self.model} draws random weights and answers noise, for benchmarks "
                "only: add --benchmark-weights (DOCQA_BENCHMARK_WEIGHTS=1) to serve it"
            )
        if self.benchmark_weights and not random_model:
            raise ConfigError("--benchmark-weights needs a benchmark model: --model random:NAME")
        if random_model:
            from inference.kv_sizing import KNOWN_CONFIGS

            name = self.model[len("random:") :]
            if name not in KNOWN_CONFIGS:
                raise ConfigError(
                    f"unknown benchmark shape {name!r} in --model {self.model}; known: "
                    f"{', '.join(sorted(KNOWN_CONFIGS))}"
                )

    def _check_kv_dtype(self) -> None:
        if self.kv_dtype is None:
            return
        from inference import kv_quant

        names = ("float32", "bfloat16", "float16", *kv_quant.KV8_NAMES)
        if self.kv_dtype.lower() not in names:
            raise ConfigError(
                f"--kv-dtype (DOCQA_KV_DTYPE) must be one of {', '.join(names)}, "
                f"got {self.kv_dtype!r}"
            )

    def tier_config(self):
        """The engine's second-tier settings, or None without DOCQA_REDIS_URL."""
        from prefix_store import TierConfig

        if not self.redis_url:
            return None
        return TierConfig(
            url=self.redis_url,
            prefix=self.redis_prefix,
            ttl_s=self.redis_ttl_s,
            max_bytes=int(self.redis_max_gib * 2**30),
        )

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)

    @classmethod
    def from_env(cls, **overrides) -> Settings:
        home = docqa_home()
        url = os.environ.get("DOCQA_DATABASE_URL") or default_database_url(home)
        env = os.environ
        values = dict(
            home=home,
            database_url=normalize_database_url(url),
            redis_url=env.get("DOCQA_REDIS_URL") or None,
            kv_dtype=env.get("DOCQA_KV_DTYPE") or None,
            api_keys=parse_api_keys(env.get("DOCQA_API_KEYS")),
            redis_prefix=env.get("DOCQA_REDIS_PREFIX") or "docqa:",
            redis_ttl_s=_env_number("DOCQA_REDIS_TTL_S", int, 24 * 3600),
            redis_max_gib=_env_number("DOCQA_REDIS_MAX_GIB", float, 2.0),
            shutdown_grace_s=_env_number("DOCQA_SHUTDOWN_GRACE_S", float, 30.0),
            benchmark_weights=_env_flag("DOCQA_BENCHMARK_WEIGHTS", False),
            batch_invariant=_env_flag("DOCQA_BATCH_INVARIANT", False),
            cuda_graphs=_env_flag("DOCQA_CUDA_GRAPHS", False),
            speculate=env.get("DOCQA_SPECULATE") or "off",
            parts=_env_flag("DOCQA_PARTS", True),
            max_part_tokens=_env_number("DOCQA_MAX_PART_TOKENS", int, None),
        )
        values.update({k: v for k, v in overrides.items() if v is not None})
        if "database_url" in overrides and overrides["database_url"]:
            values["database_url"] = normalize_database_url(overrides["database_url"])
        s = cls(**values)
        if s.max_tokens_cap < s.default_max_tokens:
            s = cls(**{**values, "default_max_tokens": s.max_tokens_cap})
        return s
