"""docqa scaled out as operators run it: three ``docqa serve`` replicas behind HAProxy
(deploy/haproxy/haproxy.cfg, hashing on the manual) over the real Postgres and a three-master
Redis Cluster on loopback ports. A manual's questions reach one replica whichever route asks
them; a manual warmed on one replica is answered on another from Redis; tenants stay apart; a
cancel reaches the replica running the answer; under load each manual is computed about once
and the replicas share the work; a replica killed mid-run costs only what was in flight on it;
a Redis master killed costs only recomputation; a Redis that stops mid-run only degrades
caching."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from pathlib import Path

import httpx
import pytest
from conftest import API_KEYS
from svc_helpers import BackgroundStream, RedisServer, Server, metrics, sse_events

from bench import scale_out
from bench.scale_out import Stack, manual_text

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(pg_url, default_model_dir, tmp_path_factory):
    s = scale_out.start_stack(tmp_path_factory.mktemp("scale-out"), pg_url, api_keys=API_KEYS)
    yield s
    s.stop()


def _upload(c: httpx.Client, name: str, text: str | None = None) -> dict:
    text = text or f"Edition {uuid.uuid4().hex}\n" + manual_text(name, 6)
    r = c.post("/v1/manuals", json={"title": name, "text": text})
    assert r.status_code in (200, 201), r.text
    return r.json()


def _client(url: str, key: str = "key-a") -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=300)


def _ask(c: httpx.Client, manual_id: str, q: str, **kw) -> httpx.Response:
    body = {"question": q, "max_tokens": 8, **kw}
    r = c.post(f"/v1/manuals/{manual_id}/ask", json=body)
    assert r.status_code == 200, r.text
    return r


def test_a_manuals_questions_reach_one_replica_by_every_route(stack: Stack):
    with _client(stack.lb.url) as c:
        m = _upload(c, "R-1")
        mid = m["id"]
        first = _ask(c, mid, "How do I reset it?")
        home = first.headers["x-docqa-replica"]
        assert home in stack.ids
        seen = {home}
        u = _ask(c, mid, "What does error E9 mean?").json()["usage"]
        assert u["cached_tokens_by_tier"]["device"] >= m["tokens"], u  # the manual, on device
        conv = c.post(f"/v1/manuals/{mid}/conversations")
        assert conv.status_code == 201, conv.text
        seen.add(conv.headers["x-docqa-replica"])
        path = f"/v1/manuals/{mid}/conversations/{conv.json()['id']}/messages"
        for q in ("Eco?", "And Boost?"):
            r = c.post(path, json={"content": q, "max_tokens": 8})
            assert r.status_code == 200, r.text
            seen.add(r.headers["x-docqa-replica"])
        # a conversation of another manual is not found under this one
        other = _upload(c, "R-1b")
        cid = conv.json()["id"]
        wrong = f"/v1/manuals/{other['id']}/conversations/{cid}/messages"
        r = c.post(wrong, json={"content": "Eco?"})
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "conversation_not_found" and cid in r.text
        stored = c.get(f"/v1/conversations/{cid}").json()["messages"]
        assert [m["role"] for m in stored] == ["user", "assistant"] * 2  # nothing added
        # streamed, on the manual's route
        with c.stream(
            "POST", f"/v1/manuals/{mid}/ask", json={"question": "Eco?", "stream": True}
        ) as s:
            assert s.headers["content-type"].startswith("text/event-stream")
            seen.add(s.headers["x-docqa-replica"])
            events = [name for name, _ in sse_events(s)]
        assert events[-1] == "answer" and "token" in events
        # OpenAI-compatible, with the manual's base URL
        r = c.post(
            f"/v1/manuals/{mid}/chat/completions",
            json={"messages": [{"role": "user", "content": "Boost?"}], "max_tokens": 8},
        )
        assert r.status_code == 200, r.text
        seen.add(r.headers["x-docqa-replica"])
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= m["tokens"]
        assert c.get(f"/v1/manuals/{mid}/models").json()["data"][0]["id"]
        # the routes without the manual in their path, keyed by the header
        r = c.post(
            "/v1/ask",
            json={"manual_id": mid, "question": "Holiday?", "max_tokens": 8},
            headers={"X-Docqa-Manual": mid},
        )
        assert r.status_code == 200, r.text
        seen.add(r.headers["x-docqa-replica"])
        assert seen == {home}, seen
        # a body naming another manual than the path is refused, and nothing is answered
        answered = c.get(f"/v1/manuals/{mid}").json()["ledger"]["answers"]
        assert answered > 0
        r = c.post(
            f"/v1/manuals/{mid}/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}], "manual_id": other["id"]},
        )
        assert r.status_code == 400
        msg = r.json()["error"]["message"]
        assert other["id"] in msg and mid in msg and "differs" in msg
        for manual in (mid, other["id"]):
            ledger = c.get(f"/v1/manuals/{manual}").json()["ledger"]
            assert ledger["answers"] == (answered if manual == mid else 0), ledger


def test_warmed_on_one_replica_answered_on_another_from_redis(stack: Stack):
    a, b = stack.servers[0], stack.servers[1]
    with _client(a.url) as ca, _client(b.url) as cb:
        m = _upload(ca, "R-2")
        w = ca.post(f"/v1/manuals/{m['id']}/warm").json()
        assert w["redis"] == "ok"
        assert w["redis_cached_tokens"] == w["prompt_tokens"] // 16 * 16 > 0
        before = metrics(cb)
        r = _ask(cb, m["id"], "What does error E9 mean?")
        assert r.headers["x-docqa-replica"] == stack.ids[1]
        u = r.json()["usage"]
        assert u["cached_tokens"] >= 0.95 * w["prompt_tokens"], u
        # the system instructions may already be on B's device from earlier answers
        assert u["cached_tokens_by_tier"]["redis"] >= u["cached_tokens"] - 64, u
        after = metrics(cb)
        hits = 'docqa:prefix_cache_hits_total{tier="redis"}'
        assert after[hits] - before.get(hits, 0) == u["cached_tokens_by_tier"]["redis"]
        # identical to a cold computation on B
        cold = _ask(cb, m["id"], "What does error E9 mean?", cache="bypass").json()
        assert cold["usage"]["cached_tokens"] == 0
        assert cold["answer"] == r.json()["answer"]


def test_tenants_stay_apart_in_redis(stack: Stack):
    a, b = stack.servers[0], stack.servers[2]
    with _client(a.url) as ca, _client(b.url) as ca_on_b, _client(b.url, "key-b") as cb:
        text = f"Edition {uuid.uuid4().hex}\n" + manual_text("R-3", 6)
        m = _upload(ca, "R-3", text)
        w = ca.post(f"/v1/manuals/{m['id']}/warm").json()
        assert w["redis_cached_tokens"] > 0
        other = _upload(cb, "R-3", text)  # the same text, uploaded by the other tenant
        assert cb.post(f"/v1/manuals/{m['id']}/ask", json={"question": "E2?"}).status_code == 404
        r = _ask(cb, other["id"], "What does error E2 mean?").json()
        assert r["usage"]["cached_tokens_by_tier"]["redis"] == 0, r["usage"]
        # positive control: the first tenant's own question on that replica hits Redis
        own = _ask(ca_on_b, m["id"], "What does error E2 mean?").json()["usage"]
        assert own["cached_tokens"] >= 0.95 * w["prompt_tokens"], own
        assert own["cached_tokens_by_tier"]["redis"] >= own["cached_tokens"] - 64, own


def test_a_cancel_reaches_the_replica_running_the_answer(stack: Stack):
    a, b = stack.servers[0], stack.servers[1]
    with _client(a.url) as ca, _client(b.url) as cb, _client(b.url, "key-b") as other_tenant:
        m = _upload(ca, "R-4")
        # long enough to outlast a relay that finds nobody (1.5 s) at any decode speed
        body = {"question": "Describe it.", "max_tokens": 1024, "ignore_eos": True, "stream": True}
        running = BackgroundStream(_client(a.url), f"/v1/manuals/{m['id']}/ask", body)
        assert running.started.wait(120)
        rid = running.request_id
        # another tenant's cancel is not found anywhere
        assert other_tenant.post(f"/v1/requests/{rid}/cancel").status_code == 404
        # the cancel reaches B, which relays it to A
        r = cb.post(f"/v1/manuals/{m['id']}/requests/{rid}/cancel")
        assert r.status_code == 200, r.text
        assert r.headers["x-docqa-replica"] == stack.ids[1]
        assert r.json()["cancelled"] is True and r.json()["completion_tokens"] < 1024
        assert cb.post("/v1/requests/msg_unknown/cancel").status_code == 404  # an unknown id
        running.join(60)
        final = running.events[-1]
        assert final[0] == "answer"
        assert final[1]["id"] == rid and final[1]["finish_reason"] == "cancelled"
        assert ca.get("/v1/engine").json()["requests_running"] == 0


def _stored_message_ids(pg_url: str, ids: list[str]) -> set[str]:
    import asyncpg

    async def q() -> set[str]:
        conn = await asyncpg.connect(pg_url.replace("+asyncpg", ""), timeout=10)
        try:
            rows = await conn.fetch("select id from messages where id = any($1::text[])", ids)
        finally:
            await conn.close()
        return {r["id"] for r in rows}

    return asyncio.run(q())


def test_load_then_a_replica_killed_mid_run(stack: Stack, pg_url):
    """12 manuals, 16 clients, 6 questions each (the benchmark's load): each manual computed
    about once cluster-wide, the replicas sharing the answers; then a replica killed with
    SIGKILL under the same load."""
    manuals = scale_out.upload_manuals(stack.lb.url, 12, key="key-a")
    results = scale_out.Load(stack.lb.url, manuals, clients=16, questions=6, key="key-a").run()
    row = scale_out.summarize(results, manuals)
    print(row)
    assert row["failed"] == 0, [r.error for r in results if r.status != 200][:3]
    # bounds a broken affinity or claim would cross (round robin without claims computed 1.52
    # prefills a manual; one replica taking every manual serves 3x the mean), not the
    # benchmark's goals (1.1 and 1.3x): on two cores shared by three engines the split varies
    # from run to run (seen here: 0.92-1.18 prefills, 1.06-1.53x busiest; bench/RESULTS.md)
    assert row["prefills_per_manual"] <= 1.3, row
    assert len(row["answers_per_replica"]) == 3 and row["busiest_over_mean"] <= 2.0, row
    assert row["device_hit_share"] > 0.5, row

    fresh = scale_out.upload_manuals(stack.lb.url, 12, key="key-a")
    run = scale_out.run_with_kill(stack, fresh, clients=16, questions=6, after=24, key="key-a")
    kill = scale_out.kill_summary(run)
    failed = [r for r in run.results if r.status != 200]
    print(kill)
    # what failed was in flight on the killed replica, and failed as it died (the balancer's
    # 502, or the connection closed under the response as the replica's was), never a hang;
    # nothing sent after the kill failed (a connection refused is retried on another replica)
    late = [
        (round(r.start - run.at, 3), round(r.end - run.at, 3), r.status, r.kind, r.error[:200])
        for r in failed
        if r.start >= run.at
    ]
    why = (kill, late, _lb_errors(stack))
    assert kill["failed_in_window"] == kill["failed_after_window"] == 0, why
    for r in failed:
        assert r.status == 502 or r.error.startswith("RemoteProtocolError"), r
        assert r.start < run.at and r.end - run.at < scale_out.DETECTION_S, r
    assert kill["answers"] >= 16 * 6 - len(failed)
    # its manuals moved, none computed again: a replica that already held one (bounded loads
    # spread busy manuals) answered from its pool, one that did not read it from Redis
    assert kill["moved_answers"] > 0 and kill["moved_answers_cold"] == 0, kill
    if kill["moved_first_on_replica"]:
        assert kill["moved_first_redis_tokens"] > 0, kill
    # every turn acknowledged to a client is in Postgres
    acked = [r.answer_id for r in run.results if r.status == 200 and r.kind == "turn"]
    assert acked and _stored_message_ids(pg_url, acked) == set(acked)


def _lb_errors(stack: Stack) -> list[str]:
    """The balancer's log lines of requests that did not succeed (health checks left out)."""
    log = Path(stack.lb.log_dir) / f"haproxy-{stack.lb.port}.log"
    lines = log.read_text().splitlines() if log.is_file() else []
    return [ln for ln in lines if "GET /ready" not in ln and not re.search(r" 20[01] \d+ ", ln)]


def test_a_redis_master_killed_answers_continue(stack: Stack):
    """Last in this module: it leaves the cluster without a third of its slots."""
    alive = [s for s in stack.servers if s.proc.poll() is None]
    a, b = alive[0], alive[1]
    with _client(a.url) as ca, _client(b.url) as cb:
        m = _upload(ca, "R-6")
        assert ca.post(f"/v1/manuals/{m['id']}/warm").json()["redis_cached_tokens"] > 0
        stack.redis.kill(stack.redis.ports[0])
        # B finds the chain up to the first block that was on the lost master, computes the
        # rest, and answers as a cold run would
        r = _ask(cb, m["id"], "What does error E2 mean?").json()
        cold = _ask(cb, m["id"], "What does error E2 mean?", cache="bypass").json()
        assert r["answer"] == cold["answer"]
        assert r["usage"]["cached_tokens"] < m["tokens"], r["usage"]
        # new manuals keep being answered, through the balancer too
        with _client(stack.lb.url) as c:
            n = _upload(c, "R-7")
            for q in ("Eco?", "Boost?"):
                assert _ask(c, n["id"], q).json()["finish_reason"] in ("stop", "length")
        for s in alive:
            assert httpx.get(s.url + "/ready", timeout=10).status_code == 200


def test_redis_stopping_mid_run_degrades_and_recovers(default_model_dir, tmp_path):
    server = RedisServer(tmp_path).start()
    srv = Server(tmp_path, f"sqlite:///{tmp_path / 'r.db'}", name="redis-stops")
    srv.extra_env = {"DOCQA_REDIS_URL": server.url}
    srv.start()
    try:
        with srv.client() as c:
            assert c.get("/ready").json()["tiers"]["redis"] == "ok"
            m1 = _upload(c, "S-1")
            assert c.post(f"/v1/manuals/{m1['id']}/warm").json()["redis_cached_tokens"] > 0
            server.stop()
            # every request keeps succeeding, on the local pool only
            m2 = _upload(c, "S-2")
            for q in ("Eco?", "Boost?", "Reset?"):
                assert _ask(c, m2["id"], q).json()["finish_reason"] in ("stop", "length")
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
            m3 = _upload(c, "S-3")
            w = c.post(f"/v1/manuals/{m3['id']}/warm").json()
            assert w["redis"] == "ok" and w["redis_cached_tokens"] > 0
            assert metrics(c)["docqa:redis_tier_up"] == 1
        assert "redis tier degraded" in srv.log_tail(50000)
    finally:
        srv.stop()
        server.stop()
