"""Tenants, API keys, restarts, client disconnects and migrations, against real servers."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import uuid

import pytest
from svc_helpers import ROOT, Server, computed_total, create_pg_database, drop_pg_database
from test_api import SAMPLE, ask, prefix_tokens

pytestmark = pytest.mark.slow


def test_tenants_share_nothing(pg_server):
    text = f"Shared text {uuid.uuid4().hex}\n\n{SAMPLE}"
    with pg_server.client("key-a") as a, pg_server.client("key-b") as b:
        ma = a.post("/v1/manuals", json={"title": "t", "text": text}).json()
        mb_resp = b.post("/v1/manuals", json={"title": "t", "text": text})
        assert mb_resp.status_code == 201  # the same text is a new manual for tenant b
        mb = mb_resp.json()
        assert mb["id"] != ma["id"] and mb["sha256"] == ma["sha256"]
        q = "Which option compresses the archive?"
        ask(a, ma["id"], "How do I list an archive?")  # tenant a caches the manual
        hit = ask(a, ma["id"], q)
        assert hit["usage"]["cached_tokens"] >= 0.95 * prefix_tokens(a, ma["id"])  # control
        before = computed_total(b)
        miss = ask(b, mb["id"], q)
        assert miss["usage"]["cached_tokens"] == 0, miss["usage"]
        assert computed_total(b) - before == miss["usage"]["prompt_tokens"]
        assert hit["answer"] == miss["answer"]
        # neither tenant can see the other's manuals or conversations
        conv_a = a.post("/v1/conversations", json={"manual_id": ma["id"]}).json()
        assert b.get(f"/v1/manuals/{ma['id']}").status_code == 404
        assert b.delete(f"/v1/manuals/{ma['id']}").status_code == 404
        assert b.post(f"/v1/manuals/{ma['id']}/warm").status_code == 404
        assert b.post("/v1/conversations", json={"manual_id": ma["id"]}).status_code == 404
        assert b.get(f"/v1/conversations/{conv_a['id']}").status_code == 404
        r = b.post(f"/v1/conversations/{conv_a['id']}/messages", json={"content": "hi"})
        assert r.status_code == 404
        r = b.post("/v1/ask", json={"manual_id": ma["id"], "question": "hi"})
        assert r.status_code == 404
        r = b.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "manual_id": ma["id"]},
        )
        assert r.status_code == 404
        ids_b = {m["id"] for m in b.get("/v1/manuals").json()["items"]}
        assert ma["id"] not in ids_b and mb["id"] in ids_b
        convs_b = {c["id"] for c in b.get("/v1/conversations").json()["items"]}
        assert conv_a["id"] not in convs_b
        assert a.get(f"/v1/manuals/{ma['id']}").status_code == 200


def test_a_tenant_cannot_tell_by_timing_whether_another_holds_a_prefix(pg_server):
    """Tenant b's first question about a manual tenant a has cached takes as long as the same
    question computed cold (cache bypassed); within one tenant, the positive control, a cached
    question takes a fraction of its cold time. Another tenant's id is refused as an unknown one
    is, word for word."""
    import statistics

    ratios_b, ratios_a = [], []
    with pg_server.client("key-a") as a, pg_server.client("key-b") as b:
        for i in range(3):
            text = f"Timing {uuid.uuid4().hex}\n\n{SAMPLE}"
            ma = a.post("/v1/manuals", json={"title": "t", "text": text}).json()
            mb = b.post("/v1/manuals", json={"title": "t", "text": text}).json()
            ask(a, ma["id"], "How do I list an archive?")  # tenant a caches the manual
            q = f"Question {i}: which option compresses the archive?"
            warm_a = ask(a, ma["id"], q)
            cold_a = ask(a, ma["id"], q, cache="bypass")
            first_b = ask(b, mb["id"], q)
            cold_b = ask(b, mb["id"], q, cache="bypass")
            # b's own earlier questions may have cached the system instructions, never a's
            # manual
            assert first_b["usage"]["cached_tokens"] < 0.2 * prefix_tokens(b, mb["id"])
            ratios_a.append(warm_a["timings"]["ttft_ms"] / cold_a["timings"]["ttft_ms"])
            ratios_b.append(first_b["timings"]["ttft_ms"] / cold_b["timings"]["ttft_ms"])
        mine, theirs = b.get(f"/v1/manuals/{ma['id']}"), b.get("/v1/manuals/man_nobody")
    assert statistics.median(ratios_a) < 0.5, ratios_a  # the control sees the cache
    assert 0.6 < statistics.median(ratios_b) < 1.7, ratios_b  # b sees no difference
    assert mine.status_code == theirs.status_code == 404
    assert mine.json()["error"]["message"].replace(ma["id"], "X") == theirs.json()["error"][
        "message"
    ].replace("man_nobody", "X")


def test_api_keys(pg_server):
    with pg_server.client() as anon, pg_server.client("wrong") as bad:
        for c in (anon, bad):
            r = c.get("/v1/manuals")
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
            assert r.headers["www-authenticate"] == "Bearer"
            assert c.post("/v1/ask", json={"manual_id": "x", "question": "q"}).status_code == 401
        assert "Authorization" in anon.get("/v1/manuals").json()["error"]["message"]
        for path in ("/health", "/ready", "/metrics"):
            assert anon.get(path).status_code == 200, path


def test_manuals_and_conversations_survive_a_restart(default_model_dir, tmp_path):
    """A freshly started server reports what the cache saved from its first cache hit (the
    cost model is fitted at start); every answer adds to its manual's ledger, which a restart
    keeps."""
    srv = Server(tmp_path, f"sqlite:///{tmp_path / 'docqa.db'}", name="restart").start()
    try:
        with srv.client() as c:
            m = c.post("/v1/manuals", json={"title": "t", "text": SAMPLE}).json()
            assert m["ledger"]["answers"] == 0
            body = {"manual_id": m["id"], "max_tokens": 4}
            cold = c.post("/v1/ask", json={**body, "question": "Which option lists?"}).json()
            warm = c.post("/v1/ask", json={**body, "question": "And which extracts?"}).json()
            assert cold["usage"]["cached_tokens"] == 0
            assert cold["timings"]["ttft_saved_basis"] == "none"
            assert warm["usage"]["cached_tokens"] > 0
            assert warm["timings"]["ttft_saved_ms"] > 0, warm["timings"]
            assert warm["timings"]["ttft_saved_basis"] == "estimate"
            conv = c.post("/v1/conversations", json={"manual_id": m["id"]}).json()
            url = f"/v1/conversations/{conv['id']}/messages"
            t1 = c.post(url, json={"content": "What does -k do?", "max_tokens": 6}).json()
            answers = [cold, warm, t1]
            ledger = c.get(f"/v1/manuals/{m['id']}").json()["ledger"]
            assert ledger["answers"] == 3
            assert ledger["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in answers)
            assert ledger["cached_tokens"] == sum(a["usage"]["cached_tokens"] for a in answers)
            assert ledger["cached_tokens_by_tier"] == {
                "device": ledger["cached_tokens"],
                "redis": 0,
            }
            saved = sum(a["timings"]["ttft_saved_ms"] for a in answers)
            assert abs(ledger["ttft_saved_ms"] - saved) < 0.2, (ledger, saved)
            metrics = c.get("/metrics").text
            device = 'docqa:prefill_seconds_saved_total{tier="device"}'
            line = next(x for x in metrics.splitlines() if x.startswith(device))
            assert abs(float(line.split()[-1]) * 1000 - saved) < 1.0, line
    finally:
        srv.stop()
    srv.start()
    try:
        with srv.client() as c:
            items = c.get("/v1/manuals").json()["items"]
            assert [x["id"] for x in items] == [m["id"]]
            assert items[0]["ledger"] == ledger  # the ledger is the database's
            detail = c.get(f"/v1/conversations/{conv['id']}").json()
            assert [x["content"] for x in detail["messages"]] == ["What does -k do?", t1["answer"]]
            t2 = c.post(url, json={"content": "And -z?", "max_tokens": 4}).json()
            # the cache is empty after a restart: the whole history is computed again
            assert (
                t2["usage"]["prompt_tokens"]
                > t1["usage"]["prompt_tokens"] + t1["usage"]["completion_tokens"]
            )
            assert c.get(f"/v1/conversations/{conv['id']}").json()["message_count"] == 4
            assert c.get(f"/v1/manuals/{m['id']}").json()["ledger"]["answers"] == 4
    finally:
        srv.stop()


def _raw_stream_then_close(srv: Server, path: str, body: dict, events_before_close: int) -> str:
    """POST over a plain socket, read a few SSE events, then close the connection."""
    payload = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=120)
    s.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    buf = b""
    while buf.count(b"event: token") < events_before_close:
        chunk = s.recv(4096)
        assert chunk, buf
        buf += chunk
    s.close()
    return buf.decode(errors="replace")


def test_client_disconnect_cancels_and_stores_the_partial_answer(sqlite_server):
    with sqlite_server.client() as c:
        m = c.post(
            "/v1/manuals", json={"title": "t", "text": f"{uuid.uuid4().hex}\n{SAMPLE}"}
        ).json()
        conv = c.post("/v1/conversations", json={"manual_id": m["id"]}).json()
        body = {
            "content": "Explain every option of tarx in detail, with an example for each.",
            "max_tokens": 400,
            "stream": True,
        }
        head = _raw_stream_then_close(
            sqlite_server, f"/v1/conversations/{conv['id']}/messages", body, 3
        )
        assert "200 OK" in head.splitlines()[0]
        deadline = time.monotonic() + 60
        msgs = []
        while time.monotonic() < deadline:
            msgs = c.get(f"/v1/conversations/{conv['id']}").json()["messages"]
            if len(msgs) == 2:
                break
            time.sleep(0.2)
        assert [x["role"] for x in msgs] == ["user", "assistant"]
        answer = msgs[1]
        assert answer["finish_reason"] == "cancelled", answer
        assert 3 <= answer["usage"]["completion_tokens"] < 400
        # the blocks are free again: nothing is running and no block is held
        engine = c.get("/v1/engine").json()
        assert engine["requests_running"] == 0 and engine["requests_waiting"] == 0
        assert engine["blocks_in_use"] == 0
        # the conversation continues from the partial answer
        r = c.post(
            f"/v1/conversations/{conv['id']}/messages", json={"content": "Thanks.", "max_tokens": 3}
        )
        assert r.status_code == 200


def test_concurrent_migrations_on_postgres(tmp_path):
    """Two replicas starting at once: the advisory lock makes one wait; both succeed."""
    url = create_pg_database()
    try:
        env = {"DOCQA_DATABASE_URL": url, "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "app.cli", "db", "upgrade"],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            for _ in range(3)
        ]
        outs = [p.communicate(timeout=120)[0].decode() for p in procs]
        assert all(p.returncode == 0 for p in procs), outs
        from app.db.migrate import head_revision

        assert all(f"database at revision {head_revision()}" in o for o in outs), outs
    finally:
        drop_pg_database(url)


def test_database_errors_are_clear(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "app.cli", "db", "upgrade"],
        cwd=ROOT,
        env={"DOCQA_DATABASE_URL": "mysql://x@y/z", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "not supported" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "app.cli", "db", "upgrade"],
        cwd=ROOT,
        env={
            "DOCQA_DATABASE_URL": "postgresql://postgres@127.0.0.1:1/none",
            "PATH": "/usr/bin:/bin",
            "HOME": str(tmp_path),
        },
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "cannot reach the database" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_ready_reports_the_redis_tier(default_model_dir, tmp_path):
    """Redis configured but absent: /ready stays 200 and says the tier is degraded; with the
    machine's Redis it is ok."""
    from svc_helpers import free_port

    dead = f"redis://127.0.0.1:{free_port()}/0"
    srv = Server(tmp_path, f"sqlite:///{tmp_path / 'a.db'}", name="redis-down")
    srv.extra_env = {"DOCQA_REDIS_URL": dead}
    srv.start()
    try:
        with srv.client() as c:
            r = c.get("/ready")
            assert r.status_code == 200 and r.json()["tiers"]["redis"] == "degraded"
            m = c.post("/v1/manuals", json={"title": "t", "text": "Press START."}).json()
            assert ask(c, m["id"], "What do I press?", max_tokens=2)["usage"]["prompt_tokens"]
    finally:
        srv.stop()
    srv.extra_env = {"DOCQA_REDIS_URL": "redis://127.0.0.1:6379/0"}
    srv.start()
    try:
        with srv.client() as c:
            assert c.get("/ready").json()["tiers"]["redis"] == "ok"
    finally:
        srv.stop()


def test_database_gone_gives_503_and_the_server_keeps_answering(default_model_dir, tmp_path):
    url = create_pg_database()
    srv = Server(tmp_path, url, name="db-gone").start()
    try:
        with srv.client() as c:
            assert c.get("/v1/manuals").status_code == 200
            drop_pg_database(url)  # terminates the server's connections too
            r = c.get("/v1/manuals")
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "database_unavailable"
            assert r.headers["retry-after"]
            assert c.get("/health").status_code == 200
            assert c.get("/v1/engine").status_code == 200
    finally:
        srv.stop()
        drop_pg_database(url)
