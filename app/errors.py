"""Errors of the service layer: what a request got wrong, in words a caller can show, with the
limit where one applies. They know nothing of HTTP; the API layer maps them to status codes
(``app/api/errors.py``): ``NotFound`` to 404, other ``ServiceError``s to 400."""

from __future__ import annotations

from inference.errors import DocqaError


class ServiceError(DocqaError):
    """A request the service refuses (``code``, a one-line message, the limit if any)."""

    def __init__(self, code: str, message: str, limit: int | float | None = None):
        super().__init__(message)
        self.code = code
        self.limit = limit


class NotFound(ServiceError):
    """No ``kind`` (manual, conversation, request) with this id for this tenant."""

    def __init__(self, kind: str, id_: str, message: str | None = None):
        super().__init__(f"{kind}_not_found", message or f"no {kind} with id {id_!r}")
