"""The REST service over real HTTP, on SQLite and on the real Postgres: manuals, questions,
conversations, streaming, cache accounting (confirmed by the engine's own counter)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from svc_helpers import computed_total, metrics, sse_events

pytestmark = pytest.mark.slow

SAMPLE = (Path(__file__).resolve().parent.parent / "app" / "samples" / "tarx-manual.md").read_text()
BS = 16
# the system instructions before the manual are the same for every manual, so a new manual's
# first question may find those few blocks cached (never a block of the manual itself)
SHARED = 48
# ... and then a few of the manual's first tokens, copied from another manual's block that
# begins the same way ("Revision " and the first characters its random tag shares)
FIRST_HIT = SHARED + BS - 1


def new_manual(api, title: str = "tarx") -> dict:
    """Upload the sample manual made unique, so nothing of it is cached yet."""
    text = f"Revision {uuid.uuid4().hex}\n\n{SAMPLE}"
    r = api.post("/v1/manuals", json={"title": title, "text": text})
    assert r.status_code == 201, r.text
    return r.json()


def ask(api, manual_id: str, question: str, **kw) -> dict:
    r = api.post(
        "/v1/ask", json={"manual_id": manual_id, "question": question, "max_tokens": 8, **kw}
    )
    assert r.status_code == 200, r.text
    return r.json()


def prefix_tokens(api, manual_id: str) -> int:
    """Tokens of system instructions + manual, as the warm endpoint reports them."""
    r = api.post(f"/v1/manuals/{manual_id}/warm")
    assert r.status_code == 200, r.text
    return r.json()["prompt_tokens"]


def test_upload_list_read_delete_and_dedup(api):
    m = new_manual(api)
    assert m["id"].startswith("man_") and m["tokens"] > 500 and len(m["sha256"]) == 64
    assert m["created_at"].endswith("Z") or "+00:00" in m["created_at"]
    got = api.get(f"/v1/manuals/{m['id']}").json()
    assert got["text"].startswith("Revision ") and got["tokens"] == m["tokens"]
    # the same text again: the stored manual, 200
    r = api.post("/v1/manuals", json={"title": "again", "text": got["text"]})
    assert r.status_code == 200 and r.json()["id"] == m["id"]
    ids = [x["id"] for x in api.get("/v1/manuals").json()["items"]]
    assert ids.count(m["id"]) == 1
    # multipart upload of a markdown file
    data = f"# Unique {uuid.uuid4().hex}\n\nUse -k to keep files.\n".encode()
    r = api.post("/v1/manuals", files={"file": ("guide.md", data, "text/markdown")})
    assert r.status_code == 201, r.text
    assert r.json()["title"] == "guide" and r.json()["source_type"] == "md"
    mid = r.json()["id"]
    conv = api.post("/v1/conversations", json={"manual_id": mid}).json()
    assert api.delete(f"/v1/manuals/{mid}").status_code == 204
    assert api.get(f"/v1/manuals/{mid}").status_code == 404
    assert api.get(f"/v1/conversations/{conv['id']}").status_code == 404  # cascaded


def test_html_and_pdf_uploads(api):
    from svc_helpers import make_pdf

    tag = uuid.uuid4().hex
    html = (
        f"<html><head><title>x</title><style>p {{color: red}}</style></head><body>"
        f"<h1>Pump {tag}</h1><p>Press <b>START</b> to prime the pump.</p>"
        "<script>var x = 1;</script></body></html>"
    ).encode()
    r = api.post("/v1/manuals", files={"file": ("pump.html", html, "text/html")})
    assert r.status_code == 201, r.text
    text = api.get(f"/v1/manuals/{r.json()['id']}").json()["text"]
    assert "Press **START** to prime the pump." in text and "<" not in text
    assert "color" not in text and "var x" not in text
    pdf = make_pdf([f"Valve {tag}", "Turn the red valve clockwise to close it."])
    r = api.post("/v1/manuals", files={"file": ("valve.pdf", pdf, "application/pdf")})
    assert r.status_code == 201, r.text
    text = api.get(f"/v1/manuals/{r.json()['id']}").json()["text"]
    assert "Turn the red valve clockwise to close it." in text and tag in text


def test_second_question_hits_the_cache(api):
    m = new_manual(api)
    q1 = "How do I extract an archive without overwriting existing files?"
    before = computed_total(api)
    a1 = ask(api, m["id"], q1)
    mid_count = computed_total(api)
    assert a1["usage"]["cached_tokens"] <= FIRST_HIT
    assert mid_count - before == a1["usage"]["prompt_tokens"] - a1["usage"]["cached_tokens"]
    a2 = ask(api, m["id"], "Which option compresses the archive?")
    after = computed_total(api)
    u = a2["usage"]
    pre_question = prefix_tokens(api, m["id"])
    assert u["cached_tokens"] >= 0.95 * pre_question, (u, pre_question)
    assert u["cached_tokens_by_tier"] == {"device": u["cached_tokens"], "redis": 0}
    assert after - mid_count == u["prompt_tokens"] - u["cached_tokens"]
    assert a2["timings"]["ttft_ms"] > 0 and a2["finish_reason"] in ("stop", "length")
    for k in ("queue_ms", "prefill_ms", "decode_ms", "tpot_ms", "e2e_ms", "ttft_saved_ms"):
        assert k in a2["timings"]


def test_a_manual_stored_under_another_tokenizer_is_encoded_again(sqlite_server):
    """A question reads a manual's stored token ids; where they came from another tokenizer
    (the served model was changed), the manual's text is encoded again: the same prompt and
    the same answer as from ids of this tokenizer."""
    import sqlite3

    with sqlite_server.client() as c:
        m = new_manual(c)
        before = ask(c, m["id"], "Which option lists an archive?")
        path = sqlite_server.database_url.removeprefix("sqlite:///")
        with sqlite3.connect(path) as db:  # ids no prompt could be built from
            db.execute(
                "UPDATE manuals SET tokenizer_fingerprint = 'another', token_ids = x'' "
                "WHERE id = ?",
                (m["id"],),
            )
        db.close()
        after = ask(c, m["id"], "Which option lists an archive?")
        chat = c.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Which option lists an archive?"}],
                "manual_id": m["id"],
                "max_tokens": 8,
            },
        )
    assert after["usage"]["prompt_tokens"] == before["usage"]["prompt_tokens"]
    assert after["answer"] == before["answer"]
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == before["usage"]["prompt_tokens"]


def test_bypass_computes_cold_and_gives_the_same_answer(api):
    m = new_manual(api)
    q = "What exit status means a fatal error?"
    ask(api, m["id"], "Which option lists an archive?")  # caches the manual
    warm = ask(api, m["id"], q)
    assert warm["usage"]["cached_tokens"] > 0
    before = computed_total(api)
    cold = ask(api, m["id"], q, cache="bypass")
    assert cold["usage"]["cached_tokens"] == 0
    assert computed_total(api) - before == cold["usage"]["prompt_tokens"]
    assert cold["answer"] == warm["answer"]  # a cache hit never changes the output


def test_conversation_turns_hit_the_whole_history(api):
    m = new_manual(api)
    conv = api.post("/v1/conversations", json={"manual_id": m["id"]}).json()
    url = f"/v1/conversations/{conv['id']}/messages"
    t1 = api.post(url, json={"content": "What does -k do?", "max_tokens": 12}).json()
    t2 = api.post(url, json={"content": "And what does -z do?", "max_tokens": 12}).json()
    before = computed_total(api)
    t3 = api.post(url, json={"content": "Which exit status is fatal?", "max_tokens": 12}).json()
    assert t1["conversation_id"] == conv["id"] and t1["id"].startswith("msg_")
    # turn 2's prompt and all but its last sampled token are in the cache, in full blocks
    covered = (t2["usage"]["prompt_tokens"] + t2["usage"]["completion_tokens"] - 1) // BS * BS
    assert t3["usage"]["cached_tokens"] >= covered - BS + 1, (t2["usage"], t3["usage"])
    assert t3["usage"]["cached_tokens"] >= t2["usage"]["prompt_tokens"] - BS
    u3 = t3["usage"]
    assert computed_total(api) - before == u3["prompt_tokens"] - u3["cached_tokens"]
    # a new conversation on the same manual hits the manual too
    conv2 = api.post("/v1/conversations", json={"manual_id": m["id"]}).json()
    url2 = f"/v1/conversations/{conv2['id']}/messages"
    r = api.post(url2, json={"content": "What is -C?", "max_tokens": 4}).json()
    assert r["usage"]["cached_tokens"] >= 0.95 * prefix_tokens(api, m["id"])
    detail = api.get(f"/v1/conversations/{conv['id']}").json()
    roles = [x["role"] for x in detail["messages"]]
    assert roles == ["user", "assistant"] * 3 and detail["message_count"] == 6
    last = detail["messages"][-1]
    assert last["id"] == t3["id"] and last["content"] == t3["answer"]
    assert last["usage"]["cached_tokens"] == t3["usage"]["cached_tokens"]
    assert last["timings"]["ttft_ms"] == t3["timings"]["ttft_ms"]
    listed = {c["id"]: c for c in api.get("/v1/conversations").json()["items"]}
    assert listed[conv["id"]]["message_count"] == 6
    assert api.delete(f"/v1/conversations/{conv['id']}").status_code == 204
    assert api.get(f"/v1/conversations/{conv['id']}").status_code == 404


def test_drafted_tokens_are_reported_in_every_shape_and_never_change_an_answer(api):
    """REST answers, stored turns and OpenAI-compatible responses carry
    ``completion_tokens_details``; on the server with speculation on (Postgres) an answer that
    quotes the manual takes drafted tokens, and the same question with ``"speculate": false``
    gives the same answer; on the default server (SQLite) nothing is drafted."""
    on = api.server.extra_env.get("DOCQA_SPECULATE") == "prompt-lookup"
    m = new_manual(api)
    q = "Show the EXAMPLES section of the manual."
    spec = ask(api, m["id"], q, max_tokens=48)
    plain = ask(api, m["id"], q, max_tokens=48, speculate=False)
    d, p = spec["usage"]["completion_tokens_details"], plain["usage"]["completion_tokens_details"]
    assert spec["answer"] == plain["answer"]
    assert p == {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
    if not on:
        assert d == p
        return
    assert d["accepted_prediction_tokens"] > 0, d
    assert d["accepted_prediction_tokens"] < spec["usage"]["completion_tokens"]
    # a stored turn keeps them
    conv = api.post("/v1/conversations", json={"manual_id": m["id"]}).json()
    turn = api.post(f"/v1/conversations/{conv['id']}/messages",
                    json={"content": q, "max_tokens": 48}).json()  # fmt: skip
    assert turn["answer"] == spec["answer"]
    stored = api.get(f"/v1/conversations/{conv['id']}").json()["messages"][-1]
    assert (
        stored["usage"]["completion_tokens_details"] == turn["usage"]["completion_tokens_details"]
    )
    # the OpenAI shape, streamed or not
    body = {"messages": [{"role": "user", "content": q}], "max_tokens": 48, "temperature": 0,
            "manual_id": m["id"]}  # fmt: skip
    chat = api.post("/v1/chat/completions", json=body).json()
    details = chat["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0, details
    off = api.post("/v1/chat/completions", json={**body, "speculate": False}).json()
    assert off["choices"][0]["message"]["content"] == chat["choices"][0]["message"]["content"]
    assert off["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 0
    metrics = api.get("/metrics").text
    drafted = [ln for ln in metrics.splitlines() if ln.startswith("docqa:spec_decode_num_draft")]
    assert drafted and float(drafted[0].split()[-1]) > 0, drafted


def test_streaming_answer(api):
    m = new_manual(api)
    conv = api.post("/v1/conversations", json={"manual_id": m["id"]}).json()
    body = {"content": "Which option compresses the archive?", "max_tokens": 10, "stream": True}
    events = []
    with api.stream("POST", f"/v1/conversations/{conv['id']}/messages", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events += sse_events(r)
    kinds = [e for e, _ in events]
    assert kinds[-1] == "answer" and set(kinds[:-1]) == {"token"}
    final = events[-1][1]
    streamed = "".join(d["text"] for e, d in events if e == "token")
    assert streamed.strip() == final["answer"]
    assert final["usage"]["completion_tokens"] == 10 or final["finish_reason"] == "stop"
    assert final["conversation_id"] == conv["id"]
    stored = api.get(f"/v1/conversations/{conv['id']}").json()["messages"]
    assert stored[-1]["content"] == final["answer"]


def test_warm_then_first_question_hits(api):
    m = new_manual(api)
    r = api.post(f"/v1/manuals/{m['id']}/warm")
    assert r.status_code == 200
    w = r.json()
    # nothing of the new manual was cached before but what FIRST_HIT allows
    assert w["prompt_tokens"] - FIRST_HIT <= w["computed_tokens"] <= w["prompt_tokens"]
    assert w["elapsed_ms"] > 0
    # every token: the full blocks, and the manual's last tokens in the partial block the warm
    # request left (a question copies those slots)
    assert w["cached_tokens"] == w["prompt_tokens"]
    before = computed_total(api)
    a = ask(api, m["id"], "Which option compresses the archive?")
    assert a["usage"]["cached_tokens"] == w["cached_tokens"]
    assert computed_total(api) - before == a["usage"]["prompt_tokens"] - w["prompt_tokens"]


def test_openai_client(api):
    import openai

    srv = api.server
    key = api.headers.get("authorization", "Bearer none").split(" ", 1)[1]
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)
    models = client.models.list()
    model = models.data[0].id
    m = new_manual(api)
    extra = {"manual_id": m["id"]}
    msgs = [{"role": "user", "content": "Which option compresses the archive?"}]
    r1 = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=6, temperature=0, extra_body=extra
    )
    assert r1.choices[0].message.role == "assistant" and r1.choices[0].message.content
    assert r1.usage.prompt_tokens_details.cached_tokens <= FIRST_HIT
    assert r1.choices[0].finish_reason in ("stop", "length")
    r2 = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=6, temperature=0, extra_body=extra
    )
    assert r2.choices[0].message.content == r1.choices[0].message.content
    assert r2.usage.prompt_tokens_details.cached_tokens >= 0.95 * prefix_tokens(api, m["id"])
    # streamed, with usage in the last chunk
    stream = client.chat.completions.create(
        model=model,
        messages=msgs,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert text.strip() == r1.choices[0].message.content
    assert usage is not None and usage.prompt_tokens_details.cached_tokens > 0
    assert usage.completion_tokens == r1.usage.completion_tokens
    # a plain chat, no manual; an unknown model is a 404
    r3 = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=3
    )
    assert r3.usage.prompt_tokens_details.cached_tokens >= 0
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=msgs, max_tokens=3)
    assert "is not served here" in str(e.value)


def test_engine_info_metrics_and_schema(api):
    e = api.get("/v1/engine").json()
    assert e["model"] == "SmolLM2-135M-Instruct"
    assert e["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * {"bfloat16": 2, "float32": 4}[e["kv_dtype"]]
    assert e["kv_capacity_tokens"] == e["kv_capacity_blocks"] * e["block_size"]
    assert (e["max_batched_tokens"], e["prefill_tokens_with_decodes"]) == (512, 0)  # defaults
    assert e["attention_backend"] == "cpu"  # the compiled CPU kernels (gcc is here)
    # 134.5 M linear weights: in float32 the GGUF's Q4_1 layers and Q8_0 output stay in their
    # blocks (0.75 and 1.125 bytes a weight); bf16 kernels hold 2 bytes a weight
    held = e["linear_weight_bytes"]
    if e["dtype"] == "float32":
        assert set(held) == {"q4_1", "q8_0"} and sum(held.values()) < 120e6, held
    else:
        assert set(held) == {"bfloat16"} and 265e6 < held["bfloat16"] < 275e6, held
    assert e["blocks_in_use"] + e["blocks_free"] == e["kv_capacity_blocks"]
    assert abs(e["max_concurrency"] - e["kv_capacity_tokens"] / e["max_model_len"]) < 0.01
    names = metrics(api)
    for n in (
        "docqa:time_to_first_token_seconds_count",
        "docqa:inter_token_latency_seconds_count",
        "docqa:request_queue_time_seconds_count",
        "docqa:e2e_request_latency_seconds_count",
        "docqa:prompt_tokens_total",
        "docqa:prefix_cache_queries_total",
        'docqa:prefix_cache_hits_total{tier="device"}',
        'docqa:prefix_cache_hits_total{tier="redis"}',
        "docqa:prompt_tokens_computed_total",
        "docqa:generation_tokens_total",
        "docqa:kv_cache_usage_perc",
        "docqa:kv_cache_cached_blocks",
        "docqa:num_requests_running",
        "docqa:num_requests_waiting",
        "docqa:num_preemptions_total",
    ):
        assert n in names, n
    schema = api.get("/schema/openapi.json").json()
    paths = schema["paths"]
    for p in (
        "/v1/manuals",
        "/v1/manuals/{manual_id}",
        "/v1/manuals/{manual_id}/warm",
        "/v1/conversations",
        "/v1/conversations/{conversation_id}",
        "/v1/conversations/{conversation_id}/messages",
        "/v1/ask",
        "/v1/models",
        "/v1/chat/completions",
        "/v1/engine",
        "/health",
        "/ready",
        "/metrics",
    ):
        assert p in paths, p
    assert "multipart/form-data" in paths["/v1/manuals"]["post"]["requestBody"]["content"]
    text = json.dumps(schema)
    assert '"maximum": 1024' in text  # the max_tokens cap is declared
