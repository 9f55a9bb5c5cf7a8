"""A manual longer than the model's window over the API, on SQLite (FTS5) and Postgres
(tsvector, GIN): stored as parts that each fit, each question answered from the part full-text
search ranks first, that part's prefix cached; a follow-up stays on its part; a request may
name the part; --parts off refuses such a manual and --max-part-tokens splits one that fits."""

import pydoc
import typing
import uuid

import pytest
from svc_helpers import Server

from app.settings import MIN_QUESTION_ROOM

# a real manual of over 20,000 tokens: Python's documentation of the typing module, as pydoc
# renders it
TYPING = pydoc.render_doc(typing, renderer=pydoc.plaintext)


def _upload(api, text: str, title: str = "typing") -> dict:
    r = api.post("/v1/manuals", json={"title": title, "text": text})
    assert r.status_code == 201, r.text
    return r.json()


def _ask(api, manual_id: str, question: str, **kw) -> dict:
    body = {"manual_id": manual_id, "question": question, "max_tokens": 4, **kw}
    r = api.post("/v1/ask", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _holding(manual: dict, text: str, passage: str) -> list[int]:
    at = text.index(passage)
    return [p["index"] for p in manual["parts"] if p["start_char"] <= at < p["end_char"]]


def test_a_long_manual_is_answered_from_the_part_holding_the_answer(api):
    text = f"Revision {uuid.uuid4().hex}\n\n{TYPING}"
    m = _upload(api, text)
    window = api.get("/v1/engine").json()["max_model_len"]
    assert m["tokens"] >= 20_000
    parts = m["parts"]
    assert len(parts) >= 3 and [p["index"] for p in parts] == list(range(len(parts)))
    assert all(p["tokens"] <= window - MIN_QUESTION_ROOM for p in parts)
    assert parts[0]["start_char"] == 0 and parts[-1]["end_char"] >= len(text.strip()) - 1
    assert all(p["title"] for p in parts)
    assert api.get(f"/v1/manuals/{m['id']}").json()["parts"] == parts

    holder = _holding(m, text, "    get_type_hints(obj")
    question = "What does get_type_hints return?"
    ranked = api.get(f"/v1/manuals/{m['id']}/parts", params={"question": question}).json()
    assert ranked["chosen"] in holder and ranked["parts"][0]["index"] == ranked["chosen"]

    first = _ask(api, m["id"], question)
    chosen = first["part"]["index"]
    assert chosen in holder and first["part"]["title"] == parts[chosen]["title"]
    assert first["part_scores"][0]["index"] == chosen
    scores = [s["score"] for s in first["part_scores"]]
    assert scores == sorted(scores, reverse=True) and len(scores) >= 2

    # a second question answered from the same part reads its prefix from the cache
    second = _ask(api, m["id"], "Which arguments does get_type_hints take?")
    assert second["part"]["index"] == chosen
    assert second["usage"]["cached_tokens"] >= parts[chosen]["tokens"] - 16

    # a request may name the part; one that does not exist is a 400 naming the range
    other = (chosen + 1) % len(parts)
    assert _ask(api, m["id"], question, part=other)["part"]["index"] == other
    r = api.post("/v1/ask", json={"manual_id": m["id"], "question": question, "part": 99})
    assert r.status_code == 400 and f"0 to {len(parts) - 1}" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "invalid_request"
    # in a conversation, no turn is stored for it
    bad = api.post("/v1/conversations", json={"manual_id": m["id"]}).json()["id"]
    r = api.post(f"/v1/conversations/{bad}/messages", json={"content": question, "part": -1})
    assert r.status_code == 400 and "part" in r.json()["error"]["message"]
    r = api.post(f"/v1/conversations/{bad}/messages", json={"content": question, "part": 99})
    assert r.status_code == 400 and "this manual has" in r.json()["error"]["message"]
    assert api.get(f"/v1/conversations/{bad}").json()["messages"] == []

    # in a conversation, a follow-up that ranks no part clearly better stays on the part
    conv = api.post("/v1/conversations", json={"manual_id": m["id"]}).json()["id"]
    turns = []
    for q in (question, "Can you say that again more briefly?"):
        r = api.post(f"/v1/conversations/{conv}/messages", json={"content": q, "max_tokens": 4})
        assert r.status_code == 200, r.text
        turns.append(r.json())
    assert [t["part"]["index"] for t in turns] == [chosen, chosen]
    stored = api.get(f"/v1/conversations/{conv}").json()["messages"]
    assert [x["part"] for x in stored if x["role"] == "assistant"] == [chosen, chosen]

    # an OpenAI-style completion about the manual says the part as well
    r = api.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": question}],
            "manual_id": m["id"],
            "max_tokens": 2,
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["part"]["index"] == chosen and r.json()["part_scores"]

    # deleting the manual removes its parts with it
    assert api.delete(f"/v1/manuals/{m['id']}").status_code == 204
    assert api.get(f"/v1/manuals/{m['id']}/parts", params={"question": "x"}).status_code == 404


def _chosen_holds(api, head: str, tail: str, question: str, passage: str) -> None:
    """TYPING between ``head`` and ``tail`` as one manual: the part chosen for ``question``
    holds ``passage`` (which is not in the first part)."""
    text = f"Revision {uuid.uuid4().hex}\n\n{head}{TYPING}{tail}"
    m = _upload(api, text)
    holder = _holding(m, text, passage)
    assert 0 not in holder
    ranked = api.get(f"/v1/manuals/{m['id']}/parts", params={"question": question}).json()
    assert ranked["chosen"] in holder, ranked
    assert api.delete(f"/v1/manuals/{m['id']}").status_code == 204


def test_a_placeholder_of_a_definition_is_a_word_to_search(api):
    """``--slow <kilobaud>``: Postgres's text parser reads ``<kilobaud>`` as a markup tag and
    indexes nothing of it unless told otherwise (migrations/versions/0004)."""
    tail = "\n\nOPTIONS\n       --slow <kilobaud>\n\t      Sends at most this many bits.\n"
    _chosen_holds(api, "", tail, "Which one is in kilobaud?", "--slow <kilobaud>")


def test_a_summary_entry_counts_for_the_definition_it_sums_up(api):
    """An option summary's one-line entry holds the question's words; the definition it sums
    up, far away in another part, holds none of them: the definition's part answers."""
    head = (
        "OPTION SUMMARY\n"
        "       --verbose, -v\t\tincrease verbosity\n"
        "       --bwlimit=RATE\t\tlimit socket I/O bandwidth\n"
        "       --quiet, -q\t\tsuppress non-error messages\n\n"
    )
    tail = (
        "\n\nOPTIONS\n       --bwlimit=RATE\n"
        "\t      This option sets the maximum transfer rate for the data sent over the\n"
        "\t      socket, in units per second.\n\n"
        "\t      If it is given twice, the last rate counts.\n"
    )
    question = "How do I limit the bandwidth?"
    _chosen_holds(api, head, tail, question, "       --bwlimit=RATE\n")


def test_an_english_stop_word_of_a_definition_is_a_word_to_search(api):
    """Postgres's english configuration drops "only" and "once" when it indexes; the
    question decides which words count, on both databases alike (migrations/versions/0005)."""
    tail = "\n\nOPTIONS\n       --solo\n\t      Runs only once.\n"
    _chosen_holds(api, "", tail, "Only once?", "--solo")


def test_a_manual_that_fits_is_one_part_and_its_prompt_is_unchanged(api, tokenizer):
    from prompts import PromptBuilder

    text = f"Revision {uuid.uuid4().hex}\n\n{TYPING[:3000]}"
    m = _upload(api, text, "short")
    assert [(p["index"], p["tokens"]) for p in m["parts"]] == [(0, m["tokens"])]
    # its prefix is the whole-manual prefix, no part header line in it
    prefix, _ = PromptBuilder(tokenizer).prefix_ids(text)
    assert api.post(f"/v1/manuals/{m['id']}/warm").json()["prompt_tokens"] == len(prefix)
    a = _ask(api, m["id"], "What is typing?")
    assert a["part"] is None and a["part_scores"] == []
    r = api.post("/v1/ask", json={"manual_id": m["id"], "question": "x", "part": 1})
    assert r.status_code == 400 and "this manual has 1 part" in r.json()["error"]["message"]


def test_one_unbroken_line_is_stored_as_parts(api):
    line = " ".join(f"w{i * 7919 % 1_000_003}" for i in range(17_000))
    m = _upload(api, line, "one line")
    assert m["tokens"] >= 50_000 and len(m["parts"]) >= 7


@pytest.fixture(scope="module")
def parts_servers(default_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("parts-servers")
    off = Server(d, f"sqlite:///{d / 'off.db'}", args=("--parts", "off"), name="parts-off")
    small = Server(
        d, f"sqlite:///{d / 'small.db'}", args=("--max-part-tokens", "300"), name="small-parts"
    )
    off.start()
    small.start()
    yield off, small
    off.stop()
    small.stop()


def test_parts_off_refuses_a_long_manual_and_max_part_tokens_splits_a_short_one(parts_servers):
    off, small = parts_servers
    with off.client() as c:
        r = c.post("/v1/manuals", json={"title": "typing", "text": TYPING})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "manual_too_long" and "--parts off" in err["message"]
        assert c.get("/v1/manuals").json()["items"] == []  # nothing stored
    with small.client() as c:
        text = TYPING[:6000]
        m = c.post("/v1/manuals", json={"title": "typing", "text": text}).json()
        assert len(m["parts"]) >= 3 and all(p["tokens"] <= 300 for p in m["parts"])
        a = c.post(
            "/v1/ask", json={"manual_id": m["id"], "question": "What is Any?", "max_tokens": 2}
        ).json()
        assert a["part"] is not None
        # warming and pinning take every part
        w = c.post(f"/v1/manuals/{m['id']}/warm").json()
        assert w["parts"] == len(m["parts"])
        assert w["prompt_tokens"] > sum(p["tokens"] for p in m["parts"])  # + instructions each
        assert w["cached_tokens"] >= w["prompt_tokens"] - 16 * len(m["parts"])
        pin = c.post(f"/v1/manuals/{m['id']}/pin").json()
        assert pin["pinned"] and pin["pinned_tokens"] >= w["cached_tokens"] - 16 * len(m["parts"])
        assert pin["pinned_blocks_total"] >= pin["pinned_tokens"] // 16
        out = c.post(f"/v1/manuals/{m['id']}/unpin").json()
        assert out["pinned_blocks_total"] == 0
