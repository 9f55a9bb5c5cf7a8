"""Several ``docqa serve`` replicas sharing the real Postgres and the machine's Redis (a key prefix
of this run): a manual warmed on one replica is answered on another from Redis, questions are
routed to the replica holding the prefix, a replica that died is skipped and deregistered,
tenants stay apart in Redis, and a Redis that stops mid-run only degrades caching."""

import json
import time

import httpx
import pytest
from conftest import API_KEYS
from svc_helpers import (
    REDIS_URL,
    RUN_REDIS_PREFIX,
    RedisServer,
    Server,
    metrics,
    redis_client,
)

pytestmark = pytest.mark.slow

LOCAL = {"X-Docqa-Route": "local"}


def manual_text(name: str) -> str:
    return (
        f"The {name} heat pump has three modes. Eco keeps the water at 45 degrees. Boost heats "
        f"to 60 degrees once and returns to Eco. Holiday keeps the tank above 10 degrees. To "
        f"reset the {name}, hold MODE and OK for five seconds. Error E2 means low refrigerant "
        f"pressure: call service. Error E9 means the inlet sensor is open. Clean the air filter "
        f"every three months. "
    ) * 6


def _start(tmp_path, name: str, db_url: str, redis_url: str = REDIS_URL) -> Server:
    srv = Server(tmp_path, db_url, api_keys=API_KEYS, name=name)
    srv.extra_env = {"DOCQA_REDIS_URL": redis_url}
    return srv.start()


@pytest.fixture(scope="module")
def replicas(pg_url, default_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("replicas")
    a = _start(d, "replica-a", pg_url)
    b = _start(d, "replica-b", pg_url)
    for s in (a, b):
        with s.client() as c:
            s.replica_id = c.get("/ready").json()["replica"]["id"]
    yield a, b
    a.stop()
    b.stop()


def _upload(c: httpx.Client, text: str) -> dict:
    r = c.post("/v1/manuals", json={"title": "pump", "text": text})
    assert r.status_code in (200, 201), r.text
    return r.json()


def _ask(c: httpx.Client, manual_id: str, q: str, headers=None, **kw) -> httpx.Response:
    body = {"manual_id": manual_id, "question": q, "max_tokens": 12, **kw}
    r = c.post("/v1/ask", json=body, headers=headers or {})
    assert r.status_code == 200, r.text
    return r


def _wait_published(srv: Server, timeout: float = 10.0) -> None:
    """The registry publishes block hashes every 0.5 s."""
    time.sleep(1.2)


def test_warmed_on_a_answered_on_b_from_redis(replicas):
    a, b = replicas
    text = manual_text("HX-1")
    with a.client("key-a") as ca, b.client("key-a") as cb:
        m = _upload(ca, text)
        w = ca.post(f"/v1/manuals/{m['id']}/warm").json()
        assert w["redis"] == "ok"
        assert w["redis_cached_tokens"] == w["prompt_tokens"] // 16 * 16 > 0
        before = metrics(cb)
        r = _ask(cb, m["id"], "What does error E9 mean?", LOCAL)
        assert r.headers["x-docqa-replica"] == b.replica_id
        u = r.json()["usage"]
        pre_question = w["prompt_tokens"]
        assert u["cached_tokens_by_tier"]["redis"] >= 0.95 * pre_question, u
        assert u["cached_tokens"] == u["cached_tokens_by_tier"]["redis"]
        after = metrics(cb)
        hits = 'docqa:prefix_cache_hits_total{tier="redis"}'
        assert after[hits] - before.get(hits, 0) == u["cached_tokens_by_tier"]["redis"]
        moved = 'docqa:redis_tier_bytes_total{direction="read"}'
        assert (
            after[moved] - before.get(moved, 0) >= u["cached_tokens_by_tier"]["redis"] * 22 * 1024
        )
        # identical to a cold computation on B
        cold = _ask(cb, m["id"], "What does error E9 mean?", LOCAL, cache="bypass").json()
        assert cold["usage"]["cached_tokens"] == 0
        assert cold["answer"] == r.json()["answer"]


def test_questions_are_routed_to_the_replica_holding_the_prefix(replicas):
    a, b = replicas
    text = manual_text("HX-2")
    with a.client("key-a") as ca, b.client("key-a") as cb:
        m = _upload(ca, text)
        w = ca.post(f"/v1/manuals/{m['id']}/warm").json()
        _wait_published(a)
        r = _ask(cb, m["id"], "How do I reset it?")
        assert r.headers["x-docqa-replica"] == a.replica_id  # forwarded to A
        u = r.json()["usage"]
        assert u["cached_tokens_by_tier"]["device"] >= 0.95 * w["prompt_tokens"], u
        # streamed answers are relayed event by event, and the final one is A's
        with cb.stream(
            "POST", "/v1/ask", json={"manual_id": m["id"], "question": "Eco?", "stream": True}
        ) as s:
            assert s.headers["content-type"].startswith("text/event-stream")
            assert s.headers["x-docqa-replica"] == a.replica_id
            events = [line for line in s.iter_lines() if line.startswith("event:")]
        assert events[-1] == "event: answer" and "event: token" in events
        # OpenAI-compatible requests are routed the same way
        r = cb.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Boost?"}], "manual_id": m["id"]},
        )
        assert r.status_code == 200 and r.headers["x-docqa-replica"] == a.replica_id
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_tenants_stay_apart_in_redis(replicas):
    a, b = replicas
    text = manual_text("HX-3")
    with a.client("key-a") as ca, b.client("key-a") as ca_on_b, b.client("key-b") as cb:
        m = _upload(ca, text)
        w = ca.post(f"/v1/manuals/{m['id']}/warm").json()
        assert w["redis_cached_tokens"] > 0
        other = _upload(cb, text)  # the same text, uploaded by the other tenant
        r = _ask(cb, other["id"], "What does error E2 mean?", LOCAL).json()
        assert r["usage"]["cached_tokens"] == 0, r["usage"]
        assert r["usage"]["cached_tokens_by_tier"] == {"device": 0, "redis": 0}
        # positive control: the first tenant's own question on B hits Redis
        own = _ask(ca_on_b, m["id"], "What does error E2 mean?", LOCAL).json()["usage"]
        assert own["cached_tokens"] >= 0.95 * w["prompt_tokens"], own
        # the system instructions may already be on B's device from this tenant's earlier turns
        assert own["cached_tokens_by_tier"]["redis"] >= own["cached_tokens"] - 64, own


def test_a_replica_that_died_is_skipped_and_deregistered(replicas, pg_url, tmp_path):
    _, b = replicas
    c_srv = _start(tmp_path, "replica-c", pg_url)
    with c_srv.client() as c:
        c_id = c.get("/ready").json()["replica"]["id"]
    text = manual_text("HX-4")
    try:
        with c_srv.client("key-a") as cc:
            m = _upload(cc, text)
            w = cc.post(f"/v1/manuals/{m['id']}/warm").json()
        _wait_published(c_srv)
    finally:
        c_srv.proc.kill()  # no clean deregistration
        c_srv.proc.wait()
    registry = redis_client()
    assert registry.hexists(f"{RUN_REDIS_PREFIX}replicas", c_id)
    with b.client("key-a") as cb:
        r = _ask(cb, m["id"], "Which mode keeps the tank above 10 degrees?")
        assert r.headers["x-docqa-replica"] == b.replica_id
        u = r.json()["usage"]
        assert u["cached_tokens"] >= 0.95 * w["prompt_tokens"], u
        assert u["cached_tokens_by_tier"]["redis"] >= u["cached_tokens"] - 64, u
    assert not registry.hexists(f"{RUN_REDIS_PREFIX}replicas", c_id)
    assert "did not answer" in b.log_tail(20000)


def test_registry_lists_live_replicas_with_their_blocks(replicas):
    a, b = replicas
    with a.client("key-a") as ca:
        m = _upload(ca, manual_text("HX-5"))
        w = ca.post(f"/v1/manuals/{m['id']}/warm").json()
    _wait_published(a)
    r = redis_client()
    entries = {
        k.decode(): json.loads(v) for k, v in r.hgetall(f"{RUN_REDIS_PREFIX}replicas").items()
    }
    assert entries[a.replica_id]["url"] == a.url and entries[b.replica_id]["url"] == b.url
    assert r.scard(f"{RUN_REDIS_PREFIX}replica:{a.replica_id}:blocks") >= w["prompt_tokens"] // 16


def test_redis_stopping_mid_run_degrades_and_recovers(default_model_dir, tmp_path):
    server = RedisServer(tmp_path).start()
    srv = Server(tmp_path, f"sqlite:///{tmp_path / 'r.db'}", name="redis-stops")
    srv.extra_env = {"DOCQA_REDIS_URL": server.url}
    srv.start()
    try:
        with srv.client() as c:
            assert c.get("/ready").json()["tiers"]["redis"] == "ok"
            m1 = _upload(c, manual_text("R-1"))
            assert c.post(f"/v1/manuals/{m1['id']}/warm").json()["redis_cached_tokens"] > 0
            server.stop()
            # every request keeps succeeding, on the local pool only
            m2 = _upload(c, manual_text("R-2"))
            for q in ("Eco?", "Boost?", "Reset?"):
                r = _ask(c, m2["id"], q).json()
                assert r["finish_reason"] in ("stop", "length")
            hit = _ask(c, m1["id"], "Holiday?").json()
            assert hit["usage"]["cached_tokens_by_tier"]["device"] > 0
            ready = c.get("/ready")
            assert ready.status_code == 200 and ready.json()["tiers"]["redis"] == "degraded"
            assert metrics(c)["docqa:redis_tier_up"] == 0
            server.start()
            deadline = time.monotonic() + 15
            while c.get("/ready").json()["tiers"]["redis"] != "ok":
                assert time.monotonic() < deadline, "the tier did not come back"
                time.sleep(0.2)
            m3 = _upload(c, manual_text("R-3"))
            w = c.post(f"/v1/manuals/{m3['id']}/warm").json()
            assert w["redis"] == "ok" and w["redis_cached_tokens"] > 0
            assert metrics(c)["docqa:redis_tier_up"] == 1
        assert "redis tier degraded" in srv.log_tail(50000)
    finally:
        srv.stop()
        server.stop()
