"""Hostile uploads and bodies over real HTTP: each gets a 4xx with its limit, or a clean,
bounded result; nothing half-stored; the service keeps serving."""

from __future__ import annotations

import uuid

import pytest
from svc_helpers import make_pdf_bomb
from test_api_errors import error_of, manual_count

from app.manual_text import MAX_PDF_CONTENT_BYTES, MAX_PDF_PAGES

pytestmark = pytest.mark.slow


def _still_serving(c) -> None:
    assert c.get("/health").status_code == 200
    r = c.post("/v1/manuals", json={"title": "ok", "text": f"Fine {uuid.uuid4().hex}."})
    assert r.status_code == 201, r.text


def test_a_pdf_that_expands_far_beyond_its_size_is_refused(sqlite_server):
    with sqlite_server.client() as c:
        before = manual_count(c)
        bomb = make_pdf_bomb(200_000)  # 40 lines of content a kilobyte: megabytes of text
        assert len(bomb) < 64 * 1024
        r = c.post("/v1/manuals", files={"file": ("bomb.pdf", bomb, "application/pdf")})
        err = error_of(r, 413, "manual_too_large")
        assert err["limit"] == MAX_PDF_CONTENT_BYTES and "decompress" in err["message"]
        many = make_pdf_bomb(1, pages=MAX_PDF_PAGES + 1)
        r = c.post("/v1/manuals", files={"file": ("many.pdf", many, "application/pdf")})
        err = error_of(r, 413, "manual_too_large")
        assert err["limit"] == MAX_PDF_PAGES and f"{MAX_PDF_PAGES + 1:,} pages" in err["message"]
        assert manual_count(c) == before
        _still_serving(c)


def test_html_with_scripts_and_huge_attributes_keeps_its_text_only(sqlite_server):
    marker = uuid.uuid4().hex
    html = (
        "<html><head><script>var secret = 'SCRIPT-TEXT';</script><style>p{color:red}</style>"
        f"</head><body><p title='{'A' * 2_000_000}' data-x='{'B' * 1_000_000}'>"
        f"Press START to run ({marker}).</p></body></html>"
    )
    with sqlite_server.client() as c:
        r = c.post("/v1/manuals", files={"file": ("page.html", html.encode(), "text/html")})
        assert r.status_code == 201, r.text
        text = c.get(f"/v1/manuals/{r.json()['id']}").json()["text"]
        assert marker in text and "SCRIPT-TEXT" not in text and "AAAA" not in text
        assert len(text) < 200
        _still_serving(c)


def test_a_file_name_with_path_parts_names_nothing_but_the_manual(sqlite_server):
    with sqlite_server.client() as c:
        for name in ("../../etc/passwd.txt", "..\\..\\boot.ini.txt", "/abs/path/notes.md"):
            body = f"Manual {uuid.uuid4().hex}.".encode()
            r = c.post("/v1/manuals", files={"file": (name, body, "text/plain")})
            assert r.status_code == 201, r.text
            title = r.json()["title"]
            assert "/" not in title and ".." not in title, title


def test_many_parts_deep_json_and_empty_bodies_get_their_limits(sqlite_server):
    with sqlite_server.client() as c:
        before = manual_count(c)
        parts = "".join(
            f'--B\r\nContent-Disposition: form-data; name="f{i}"\r\n\r\nx\r\n' for i in range(5000)
        )
        body = (
            parts + '--B\r\nContent-Disposition: form-data; name="file"; filename="a.txt"\r\n'
            "Content-Type: text/plain\r\n\r\nhello manual\r\n--B--\r\n"
        )
        r = c.post(
            "/v1/manuals",
            content=body.encode(),
            headers={"content-type": "multipart/form-data; boundary=B"},
        )
        assert error_of(r, 413, "too_many_parts")["limit"] == 16
        nested = "[" * 20_000 + "]" * 20_000
        for path, doc in (
            ("/v1/ask", f'{{"manual_id": "man_x", "question": "q", "x": {nested}}}'),
            ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": {nested}}}]}}'),
            ("/v1/manuals", f'{{"title": "t", "text": {nested}}}'),
        ):
            r = c.post(path, content=doc, headers={"content-type": "application/json"})
            assert r.status_code == 400, (path, r.text)
        r = c.post("/v1/ask", content=nested, headers={"content-type": "application/json"})
        assert error_of(r, 400, "malformed_json")["limit"] == 1000
        r = c.post("/v1/ask", content=b"", headers={"content-type": "application/json"})
        assert "empty" in error_of(r, 400, "invalid_request")["message"]
        assert manual_count(c) == before
        _still_serving(c)
