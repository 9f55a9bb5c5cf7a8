"""Service configuration: environment variables (CONTRACTS.md, "Configuration") plus the
options of ``docqa serve``."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from inference.errors import DocqaError
from inference.model_import import docqa_home

MAX_TOKENS_CAP = 1024  # default upper bound of a request's max_tokens
DEFAULT_MAX_TOKENS = 256
MAX_UPLOAD_BYTES = 10 * 2**20
# a manual must leave this many tokens of the context for a question and an answer
MIN_QUESTION_ROOM = 256


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


@dataclass(frozen=True)
class Settings:
    home: Path
    database_url: str
    redis_url: str | None = None
    api_keys: dict[str, str] = field(default_factory=dict)
    model: str | None = None  # None: the default model, imported on first use
    dtype: str = "auto"
    kv_cache_gib: float | None = None
    pin_budget: float = 0.25  # share of the KV pool pinned manuals may hold
    max_num_batched_tokens: int = 512  # tokens per engine step (decodes + prompt chunks)
    max_tokens_cap: int = MAX_TOKENS_CAP
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_upload_bytes: int = MAX_UPLOAD_BYTES
    max_waiting_requests: int = 256  # beyond this the engine answers 503 with Retry-After
    num_threads: int | None = None

    def __post_init__(self):
        if self.max_tokens_cap < 1:
            raise ConfigError(f"--max-tokens-cap must be at least 1, got {self.max_tokens_cap}")
        if not 0 <= self.pin_budget <= 0.9:
            raise ConfigError(f"--pin-budget must be between 0 and 0.9, got {self.pin_budget}")
        if self.max_num_batched_tokens < 16:
            raise ConfigError("--max-batched-tokens must be at least 16")
        if self.max_upload_bytes < 1:
            raise ConfigError("the upload limit must be positive")

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)

    @classmethod
    def from_env(cls, **overrides) -> Settings:
        home = docqa_home()
        url = os.environ.get("DOCQA_DATABASE_URL") or default_database_url(home)
        values = dict(
            home=home,
            database_url=normalize_database_url(url),
            redis_url=os.environ.get("DOCQA_REDIS_URL") or None,
            api_keys=parse_api_keys(os.environ.get("DOCQA_API_KEYS")),
        )
        values.update({k: v for k, v in overrides.items() if v is not None})
        if "database_url" in overrides and overrides["database_url"]:
            values["database_url"] = normalize_database_url(overrides["database_url"])
        s = cls(**values)
        if s.max_tokens_cap < s.default_max_tokens:
            s = cls(**{**values, "default_max_tokens": s.max_tokens_cap})
        return s
