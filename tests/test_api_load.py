"""Serving under load over real HTTP: simultaneous first questions, cancellation, pinning."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from svc_helpers import BackgroundStream, Server, computed_total, sse_events
from test_api import SAMPLE, ask

pytestmark = pytest.mark.slow
BS = 16


def test_simultaneous_first_questions_prefill_the_manual_once(sqlite_server):
    with sqlite_server.client() as c:
        text = f"Edition {uuid.uuid4().hex}\n\n{SAMPLE}"
        m = c.post("/v1/manuals", json={"title": "t", "text": text}).json()
        questions = [f"Question {i}: which option compresses the archive?" for i in range(8)]
        before = computed_total(c)

        def one(q):
            with sqlite_server.client() as cc:
                return ask(cc, m["id"], q, max_tokens=2)

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(one, questions))
        delta = computed_total(c) - before
        prefix = c.post(f"/v1/manuals/{m['id']}/warm").json()["prompt_tokens"]
    shared = prefix // BS * BS
    usage = sorted((a["usage"] for a in answers), key=lambda u: u["cached_tokens"])
    assert delta == sum(u["prompt_tokens"] - u["cached_tokens"] for u in usage)
    # one request computed the manual; the seven others found it cached
    assert all(u["cached_tokens"] >= shared for u in usage[1:]), usage
    question_part = max(u["prompt_tokens"] for u in usage) - prefix
    assert delta <= prefix + 8 * (question_part + BS), (delta, prefix, question_part)


def test_cancel_a_running_answer(pg_server):
    with pg_server.client("key-a") as a, pg_server.client("key-b") as b:
        m = a.post(
            "/v1/manuals", json={"title": "t", "text": f"{uuid.uuid4().hex}\n{SAMPLE}"}
        ).json()
        conv = a.post("/v1/conversations", json={"manual_id": m["id"]}).json()
        body = {"content": "Describe tarx.", "max_tokens": 400, "ignore_eos": True, "stream": True}
        running = BackgroundStream(
            pg_server.client("key-a"), f"/v1/conversations/{conv['id']}/messages", body
        )
        assert running.started.wait(120)
        rid = running.request_id
        # another tenant cannot cancel it; an unknown id is a 404
        assert b.post(f"/v1/requests/{rid}/cancel").status_code == 404
        assert a.post("/v1/requests/msg_unknown/cancel").status_code == 404
        r = a.post(f"/v1/requests/{rid}/cancel")
        assert r.status_code == 200, r.text
        assert r.json()["cancelled"] is True and r.json()["completion_tokens"] < 400
        running.join(60)
        assert running.events[-1][0] == "answer"
        final = running.events[-1][1]
        assert final["id"] == rid and final["finish_reason"] == "cancelled"
        engine = a.get("/v1/engine").json()
        assert engine["requests_running"] == 0 and engine["blocks_in_use"] == 0
        assert engine["requests_cancelled_total"] >= 1
        stored = a.get(f"/v1/conversations/{conv['id']}").json()["messages"]
        assert stored[-1]["finish_reason"] == "cancelled"


def test_pinned_manual_survives_eviction(default_model_dir, tmp_path):
    srv = Server(
        tmp_path,
        f"sqlite:///{tmp_path / 'pin.db'}",
        # about 2,800 tokens of KV whatever the machine's default dtype
        args=("--dtype", "float32", "--kv-cache-gib", "0.12", "--pin-budget", "0.5"),
        name="pin",
    ).start()
    try:
        with srv.client() as c:
            pinned = c.post("/v1/manuals", json={"title": "p", "text": "A " + SAMPLE}).json()
            control = c.post("/v1/manuals", json={"title": "c", "text": "B " + SAMPLE}).json()
            r = c.post(f"/v1/manuals/{pinned['id']}/pin")
            assert r.status_code == 200, r.text
            pin = r.json()
            assert pin["pinned"] and pin["pinned_tokens"] >= pinned["tokens"]
            engine = c.get("/v1/engine").json()
            assert engine["pinned_blocks"] == pin["pinned_blocks_total"] > 0
            ask(c, control["id"], "Which option compresses?", max_tokens=1)
            # fill the pool several times over with other manuals
            for i in range(6):
                other = c.post(
                    "/v1/manuals", json={"title": f"o{i}", "text": f"{i} {uuid.uuid4()} {SAMPLE}"}
                ).json()
                ask(c, other["id"], "What is tarx?", max_tokens=1)
            hit = ask(c, pinned["id"], "Which option compresses?", max_tokens=1)
            miss = ask(c, control["id"], "Which option lists?", max_tokens=1)
            assert hit["usage"]["cached_tokens"] >= pin["pinned_tokens"] - BS
            assert miss["usage"]["cached_tokens"] < 100  # evicted (bar shared instructions)
            # over budget: a clear error
            big = c.post("/v1/manuals", json={"title": "big", "text": (SAMPLE + "\n") * 3}).json()
            r = c.post(f"/v1/manuals/{big['id']}/pin")
            assert r.status_code == 400 and r.json()["error"]["code"] == "pin_budget_exceeded"
            assert r.json()["error"]["limit"] == engine["pin_budget_blocks"]
            # unpinned, it can be evicted again
            r = c.post(f"/v1/manuals/{pinned['id']}/unpin")
            assert r.status_code == 200 and r.json()["pinned_blocks_total"] == 0
            assert c.get("/v1/engine").json()["pinned_blocks"] == 0
    finally:
        srv.stop()


def test_metrics_cover_the_scheduler(sqlite_server):
    from svc_helpers import metrics

    with sqlite_server.client() as c:
        start = metrics(c)  # the server is shared: what earlier tests did is left out
        m = c.post("/v1/manuals", json={"title": "t", "text": f"{time.time()} {SAMPLE}"}).json()
        ask(c, m["id"], "Which option compresses?", max_tokens=3)
        before = metrics(c).get("docqa:prefix_cache_copied_tokens_total", 0)
        # the manual's last tokens, past its last full block, and the question's opening
        # template tokens are copied from the block the first question filled
        u = ask(c, m["id"], "Which option lists?", max_tokens=3)["usage"]
        names = metrics(c)
        engine = c.get("/v1/engine").json()
        # a question asked while another answer decodes: its prompt shares that answer's steps
        body = {"manual_id": m["id"], "question": "Describe it.", "max_tokens": 200}
        body |= {"ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/ask", json=body) as r:
            lines = r.iter_lines()
            assert any(line.startswith("event: token") for line in lines)
            ask(c, m["id"], "Which option extracts?", max_tokens=2)
            c.post(f"/v1/requests/{r.headers['x-request-id']}/cancel")
            for _ in lines:
                pass
        later = metrics(c)
    copied = names["docqa:prefix_cache_copied_tokens_total"] - before
    assert 0 < copied < 16 and u["cached_tokens"] % 16 == copied
    total = names["docqa:prefix_cache_copied_tokens_total"]
    assert engine["prefix_cache_copied_tokens_total"] == total
    for n in (
        "docqa:scheduler_step_seconds_count",
        "docqa:batch_size_count",
        "docqa:prefill_tokens_per_step_sum",
        "docqa:decode_tokens_per_step_sum",
        "docqa:num_preemptions_total",
        "docqa:num_requests_cancelled_total",
        "docqa:kv_cache_pinned_blocks",
    ):
        assert n in names, n
    assert names["docqa:scheduler_step_seconds_count"] > 0
    # the engine thread's time for each of those steps: the step and what serving adds
    steps = names["docqa:scheduler_step_seconds_count"]
    assert names["docqa:engine_iteration_seconds_count"] == steps
    assert names["docqa:engine_iteration_seconds_sum"] > names["docqa:scheduler_step_seconds_sum"]
    assert names["docqa:decode_tokens_per_step_sum"] >= 2
    # the step times by kind: each step once, under what its batch carried
    by_kind = "docqa:scheduler_step_seconds_by_kind"
    for part in ("count", "sum"):
        total = sum(
            names[f'{by_kind}_{part}{{kind="{k}"}}'] for k in ("decode", "prefill", "mixed")
        )
        assert total == pytest.approx(names[f"docqa:scheduler_step_seconds_{part}"]), part

    # two questions asked one after the other: their prompts in steps of their own, their
    # answers' later tokens in decode steps
    def steps_of(kind: str, m: dict) -> float:
        name = f'{by_kind}_count{{kind="{kind}"}}'
        return m[name] - start.get(name, 0)

    assert steps_of("prefill", names) >= 2
    assert steps_of("decode", names) >= 2
    assert steps_of("mixed", names) == 0
    assert steps_of("mixed", later) >= 1


def _streamed_answer(srv, path: str, body: dict) -> dict:
    """The answer object of a streamed question (its last event), or the error body."""
    last = None
    with srv.client() as c, c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for event, data in sse_events(r):
            if event in ("answer", "error"):
                last = (event, data)
    return last


def test_a_near_zero_temperature_beside_streamed_answers_leaves_them_whole(sqlite_server):
    """A temperature of 1e-38 (logits divided by it overflow) asked beside four streamed
    answers: the four are answered in full, and so is it (as greedy)."""
    with sqlite_server.client() as c:
        m = c.post("/v1/manuals", json={"title": "t", "text": f"{uuid.uuid4().hex}\n{SAMPLE}"})
        manual_id = m.json()["id"]
    body = {"manual_id": manual_id, "max_tokens": 24, "ignore_eos": True}
    bodies = [{**body, "question": f"Question {i}: what does -k do?"} for i in range(4)]
    bodies.append({**body, "question": "What does -z do?", "temperature": 1e-38, "seed": 1})
    with ThreadPoolExecutor(5) as pool:
        results = list(pool.map(lambda b: _streamed_answer(sqlite_server, "/v1/ask", b), bodies))
    for event, answer in results:
        assert event == "answer", answer
        assert answer["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == 24
