"""Server-sent events: the service's answer events as the native SSE stream."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import msgspec
from litestar.response import Stream

from app.answer_events import AnswerDone, AnswerFailed, Event, TokenText
from app.api.errors import error_body


def sse(event: str | None, data) -> bytes:
    """One server-sent event: ``event:`` (when named), then ``data:`` with JSON (or bytes)."""
    payload = data if isinstance(data, bytes) else msgspec.json.encode(data)
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + payload + b"\n\n"


async def native_sse(events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
    """``event: token`` with ``{"text"}`` deltas, then ``event: answer`` with the whole answer
    object (``event: error`` with the error body when the engine failed the request). Closing
    this stream (a client gone) closes ``events`` at once, which cancels the request."""
    async with contextlib.aclosing(events):
        async for ev in events:
            if isinstance(ev, TokenText):
                yield sse("token", {"text": ev.text})
            elif isinstance(ev, AnswerDone):
                yield sse("answer", ev.answer)
            elif isinstance(ev, AnswerFailed):
                yield sse("error", error_body(ev.code, ev.message))


class _FixedMediaStream(Stream):
    """A stream whose own media type wins over the one its handler declares for JSON answers
    (Litestar lets the handler's type win over the response's)."""

    def __init__(self, content, media_type: str, **kwargs):
        self._fixed_media_type = media_type
        super().__init__(content, media_type=media_type, **kwargs)

    def to_asgi_response(self, *args, **kwargs):
        kwargs["media_type"] = self._fixed_media_type
        return super().to_asgi_response(*args, **kwargs)


class EventStream(_FixedMediaStream):
    """A ``text/event-stream`` response."""

    def __init__(self, content, request_id: str | None = None, **kwargs):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        if request_id:
            headers["X-Request-Id"] = request_id  # for POST /v1/requests/{id}/cancel
        super().__init__(content, "text/event-stream", headers=headers, **kwargs)
