"""Bad input over real HTTP: each gets a 4xx with the error body of docs/interfaces.md that says
what was wrong and the limit, nothing is stored, and the next good request is served normally."""

from __future__ import annotations

import uuid

import pytest
from test_api import new_manual

pytestmark = pytest.mark.slow


def manual_count(api) -> int:
    return len(api.get("/v1/manuals", params={"limit": 1000}).json()["items"])


def error_of(r, status: int, code: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert err["code"] == code, err
    assert err["message"] and "Traceback" not in err["message"]
    return err


BAD_UPLOADS = [
    ("empty.txt", b"", "text/plain", 400, "invalid_manual", "is empty"),
    ("blank.md", b"  \n\n ", "text/markdown", 400, "invalid_manual", "is empty"),
    ("bin.txt", b"\x00\x01\x02abc", "text/plain", 400, "invalid_manual", "binary"),
    ("latin1.txt", "caf\u00e9 cr\u00e8me".encode("latin-1"), "text/plain", 400, "invalid_manual",
     "not UTF-8"),
    ("doc.docx", b"PK\x03\x04rest", "application/octet-stream", 415, "unsupported_media_type",
     "supported: .txt, .md, .html, .pdf"),
    ("fake.pdf", b"hello, not a pdf", "application/pdf", 400, "invalid_manual", "not a PDF"),
    ("broken.pdf", b"%PDF-1.4\n garbage", "application/pdf", 400, "invalid_manual", "PDF"),
    ("empty.html", b"<html><body><script>x()</script></body></html>", "text/html", 400,
     "invalid_manual", "no text"),
]  # fmt: skip


@pytest.mark.parametrize("name,data,ctype,status,code,words", BAD_UPLOADS)
def test_bad_uploads(api, name, data, ctype, status, code, words):
    before = manual_count(api)
    r = api.post("/v1/manuals", files={"file": (name, data, ctype)})
    err = error_of(r, status, code)
    assert words in err["message"], err
    assert manual_count(api) == before
    # the service keeps serving
    assert api.post(
        "/v1/manuals", json={"title": "ok", "text": f"Fine {uuid.uuid4().hex}."}
    ).status_code in (200, 201)


def test_file_over_the_size_limit(api):
    before = manual_count(api)
    big = b"a" * (10 * 2**20 + 1)
    err = error_of(
        api.post("/v1/manuals", files={"file": ("big.txt", big, "text/plain")}),
        413,
        "file_too_large",
    )
    assert err["limit"] == 10 * 2**20 and "10,485,760" in err["message"]
    huge = b"a" * (12 * 2**20)  # beyond the body limit: refused before it is parsed
    err = error_of(
        api.post("/v1/manuals", files={"file": ("huge.txt", huge, "text/plain")}),
        413,
        "request_too_large",
    )
    assert err["limit"] == 10 * 2**20
    assert manual_count(api) == before


def test_a_manual_longer_than_the_context_is_stored_as_parts_that_fit(api):
    """(``--parts off`` refuses it instead: tests/test_parts_api.py.)"""
    before = manual_count(api)
    text = " ".join(f"word{i}" for i in range(6000))  # ~27,000 tokens, context 8,192
    r = api.post("/v1/manuals", json={"title": "long", "text": text})
    assert r.status_code == 201, r.text
    parts = r.json()["parts"]
    assert r.json()["tokens"] > 8192 and len(parts) >= 4
    assert all(p["tokens"] <= 8192 - 256 for p in parts)
    assert manual_count(api) == before + 1
    assert api.delete(f"/v1/manuals/{r.json()['id']}").status_code == 204


def test_bad_json_bodies(api):
    before = manual_count(api)
    json_ct = {"content-type": "application/json"}
    r = api.post("/v1/manuals", content=b'{"title": "x", "text": ', headers=json_ct)
    error_of(r, 400, "malformed_json")
    error_of(api.post("/v1/manuals", json={"title": "x"}), 400, "invalid_request")
    error_of(api.post("/v1/manuals", json={"title": "", "text": "t"}), 400, "invalid_request")
    err = error_of(api.post("/v1/manuals", json={"title": "x", "text": "t", "txet": 1}), 400,
                   "invalid_request")  # fmt: skip
    assert "txet" in err["message"]
    r = api.post("/v1/manuals", content=b"plain", headers={"content-type": "text/plain"})
    error_of(r, 415, "unsupported_media_type")
    r = api.post("/v1/manuals", files={"notfile": ("a.txt", b"abc", "text/plain")})
    assert "'file'" in error_of(r, 400, "invalid_request")["message"]
    assert manual_count(api) == before


def test_unknown_ids(api):
    error_of(api.get("/v1/manuals/man_nope"), 404, "manual_not_found")
    error_of(api.delete("/v1/manuals/man_nope"), 404, "manual_not_found")
    error_of(api.post("/v1/manuals/man_nope/warm"), 404, "manual_not_found")
    error_of(api.get("/v1/conversations/conv_nope"), 404, "conversation_not_found")
    error_of(api.delete("/v1/conversations/conv_nope"), 404, "conversation_not_found")
    r = api.post("/v1/conversations/conv_nope/messages", json={"content": "hi"})
    error_of(r, 404, "conversation_not_found")
    error_of(api.post("/v1/conversations", json={"manual_id": "man_nope"}), 404,
             "manual_not_found")  # fmt: skip
    error_of(api.post("/v1/ask", json={"manual_id": "man_nope", "question": "q"}), 404,
             "manual_not_found")  # fmt: skip
    error_of(api.get("/v1/nothing-here"), 404, "not_found")


def test_out_of_range_question_parameters(api):
    m = new_manual(api)
    conv = api.post("/v1/conversations", json={"manual_id": m["id"]}).json()
    url = f"/v1/conversations/{conv['id']}/messages"
    err = error_of(api.post(url, json={"content": "q", "max_tokens": 5000}), 400,
                   "invalid_request")  # fmt: skip
    assert "max_tokens" in err["message"] and err["limit"] == 1024
    err = error_of(api.post(url, json={"content": "q", "max_tokens": 0}), 400, "invalid_request")
    assert "max_tokens" in err["message"] and err["limit"] == 1
    err = error_of(api.post(url, json={"content": "q", "temperature": 3}), 400, "invalid_request")
    assert "temperature" in err["message"] and err["limit"] == 2.0
    error_of(api.post(url, json={"content": "q", "cache": "sometimes"}), 400, "invalid_request")
    err = error_of(api.post(url, json={"content": "q", "speculate": "yes"}), 400, "invalid_request")
    assert "speculate" in err["message"], err
    error_of(api.post(url, json={"content": "   "}), 400, "empty_question")
    error_of(api.post(url, json={"content": ""}), 400, "invalid_request")
    error_of(api.post(url, content=b"{nope", headers={"content-type": "application/json"}), 400,
             "malformed_json")  # fmt: skip
    error_of(api.post("/v1/ask", json={"manual_id": m["id"], "question": "q", "max_tokens": 2000}),
             400, "invalid_request")  # fmt: skip
    r = api.post("/v1/chat/completions", json={"messages": [], "max_tokens": 3})
    error_of(r, 400, "invalid_request")
    r = api.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "assistant", "content": "hi"}], "max_tokens": 3},
    )
    assert "last message" in error_of(r, 400, "invalid_request")["message"]
    # nothing was stored, and the conversation answers the next good question
    assert api.get(f"/v1/conversations/{conv['id']}").json()["message_count"] == 0
    r = api.post(url, json={"content": "Which option compresses?", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert api.get(f"/v1/conversations/{conv['id']}").json()["message_count"] == 2


def test_question_that_cannot_fit_the_context(api):
    m = new_manual(api)
    long_q = "0123456789" * 1900  # within the character limit; one token per digit
    err = error_of(
        api.post("/v1/ask", json={"manual_id": m["id"], "question": long_q}),
        400,
        "prompt_too_long",
    )
    assert err["limit"] == 8192 and "8,192" in err["message"]
