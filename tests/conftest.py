"""Shared fixtures: the real default model (imported once into $DOCQA_HOME) and tiny random
Llama checkpoints written in Hugging Face layout."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from inference.model.model_import import import_default_model

    return import_default_model()


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    from inference.model.tokenizer import TextTokenizer

    return TextTokenizer(default_model_dir)


def write_tiny_model(
    path: Path,
    tokenizer_dir: Path,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    hidden: int = 64,
    layers: int = 2,
    seed: int = 0,
    qkv_bias: bool = False,
    intermediate: int | None = None,
    vocab: int = 49152,
) -> Path:
    """A random Llama checkpoint with the default model's tokenizer (its vocab, 49152, unless
    ``vocab`` is smaller: then ids at or past it are not the model's)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or hidden * 2 + 8,
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attention_bias=qkv_bias,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg).eval()
    path.mkdir(parents=True, exist_ok=True)
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(sd, str(path / "model.safetensors"))
    d = cfg.to_dict()
    d["torch_dtype"] = "float32"
    (path / "config.json").write_text(json.dumps(d))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (path / f).write_bytes((tokenizer_dir / f).read_bytes())
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "m", default_model_dir)


@pytest.fixture(scope="session", autouse=True)
def _clean_redis_keys():
    """Remove every key this run wrote to the machine's Redis (its own key prefix)."""
    yield
    from svc_helpers import RUN_REDIS_PREFIX, delete_prefix, redis_client

    with contextlib.suppress(RuntimeError):
        delete_prefix(redis_client(), RUN_REDIS_PREFIX)


# -- the service over real HTTP ------------------------------------------------------------------
API_KEYS = "key-a:tenant_a,key-b:tenant_b"


@pytest.fixture(scope="session")
def pg_url():
    """A Postgres database of this test run only (dropped at the end)."""
    from svc_helpers import create_pg_database, drop_pg_database

    url = create_pg_database()
    yield url
    drop_pg_database(url)


@pytest.fixture(scope="session")
def sqlite_server(default_model_dir, tmp_path_factory):
    """``docqa serve`` on a SQLite file, auth off (the embedded default)."""
    from svc_helpers import Server

    d = tmp_path_factory.mktemp("sqlite-server")
    srv = Server(d, f"sqlite:///{d / 'docqa.db'}", name="sqlite").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def pg_server(default_model_dir, pg_url, tmp_path_factory):
    """``docqa serve`` on the real Postgres, with API keys for two tenants and prompt-lookup
    speculation on (the SQLite one runs the default, off)."""
    from svc_helpers import Server

    d = tmp_path_factory.mktemp("pg-server")
    srv = Server(d, pg_url, api_keys=API_KEYS, name="postgres")
    srv.extra_env["DOCQA_SPECULATE"] = "prompt-lookup"
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(params=["sqlite", "postgres"])
def api(request):
    """An HTTP client of a running server, on each database (tenant_a's key on Postgres)."""
    if request.param == "sqlite":
        srv = request.getfixturevalue("sqlite_server")
        client = srv.client()
    else:
        srv = request.getfixturevalue("pg_server")
        client = srv.client("key-a")
    client.server = srv
    with client:
        yield client
