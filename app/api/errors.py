"""Error bodies: ``{"error": {"code", "message", "limit"}}`` for every 4xx and 5xx, the message
saying what was wrong and the limit where one applies; no traceback ever reaches the client.
The service's own errors (``app/errors.py``) and the engine's map to status codes here."""

from __future__ import annotations

import logging
import re

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, OperationalError

from app.engine_runner import EngineNotReady, EngineSaturated
from app.errors import NotFound
from app.manual_text import ManualError, ManualTooLarge, UnsupportedManualType
from inference.engine.llm_engine import StepFailure
from inference.errors import DocqaError, PromptTooLongError

log = logging.getLogger("docqa.api")


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        limit: int | float | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.limit = limit
        self.headers = headers or {}


def error_body(code: str, message: str, limit: int | float | None = None) -> dict:
    """``{"error": {"code", "message", "limit"}}``, the limit where one applies: the body of an
    error response and of a stream's error event."""
    body: dict = {"code": code, "message": message}
    if limit is not None:
        body["limit"] = limit
    return {"error": body}


def error_response(
    status: int,
    code: str,
    message: str,
    limit: int | float | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    return Response(error_body(code, message, limit), status_code=status, headers=headers or {})


def _api_error(_req: Request, exc: ApiError) -> Response:
    return error_response(exc.status, exc.code, exc.message, exc.limit, exc.headers)


_LIMIT_RE = re.compile(r"[<>]=? ?(-?[0-9.]+)|length (?:<|>)= (\d+)")


def _validation(_req: Request, exc: ValidationException) -> Response:
    extra = exc.extra if isinstance(exc.extra, list) else []
    parts, limit = [], None
    for item in extra:
        if not isinstance(item, dict):
            continue
        key, msg = item.get("key"), item.get("message", "")
        parts.append(f"{key}: {msg}" if key else msg)
        m = _LIMIT_RE.search(msg)
        if m and limit is None:
            num = m.group(1) or m.group(2)
            limit = float(num) if "." in num else int(num)
    if any(isinstance(i, dict) and i.get("key") == "data" and i.get("message") == "'data'"
           for i in extra):  # fmt: skip
        return error_response(400, "invalid_request", "the request body is empty: send JSON")
    message = "; ".join(parts) or exc.detail or "the request is invalid"
    return error_response(400, "invalid_request", message, limit)


def _http(request: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    headers = dict(exc.headers or {})
    if status == 413:
        limit = request.app.state.settings.max_upload_bytes
        return error_response(
            413,
            "request_too_large",
            f"the request body is larger than the limit of {limit:,} bytes",
            limit,
        )
    if status == 404:
        return error_response(404, "not_found", f"no route for {request.method} {request.url.path}")
    if status == 405:
        return error_response(
            405, "method_not_allowed", f"{request.method} is not allowed on {request.url.path}"
        )
    if status >= 500:
        log.error("HTTP %s on %s: %s", status, request.url.path, exc.detail)
        return error_response(status, "internal_error", "internal error; see the server log")
    detail = exc.detail or "bad request"
    if detail == "Request Entity Too Large":  # the multipart parser's part limit
        limit = request.app.multipart_form_part_limit
        return error_response(
            413, "too_many_parts", f"the multipart body has more than {limit} parts", limit
        )
    if "JSON is malformed" in detail:
        msg = f"the request body is not valid JSON: {detail}"
        return error_response(400, "malformed_json", msg)
    return error_response(status, "bad_request", detail, headers=headers)


def _docqa(_req: Request, exc: DocqaError) -> Response:
    if isinstance(exc, NotFound):
        return error_response(404, exc.code, str(exc))
    if isinstance(exc, EngineNotReady):
        return error_response(503, exc.code, str(exc), headers={"Retry-After": "5"})
    if isinstance(exc, EngineSaturated):
        return error_response(503, exc.code, str(exc), headers={"Retry-After": "1"})
    if isinstance(exc, UnsupportedManualType):
        return error_response(415, exc.code, str(exc))
    if isinstance(exc, ManualTooLarge):
        return error_response(413, exc.code, str(exc), exc.limit)
    if isinstance(exc, ManualError):
        return error_response(400, "invalid_manual", str(exc))
    if isinstance(exc, PromptTooLongError):
        return error_response(400, exc.code, str(exc), exc.limit)
    limit = getattr(exc, "limit", None)
    return error_response(400, exc.code, str(exc), limit)


def _database(_req: Request, exc: Exception) -> Response:
    if isinstance(exc, IntegrityError):
        log.warning("conflict: %s", exc)
        return error_response(409, "conflict", "the change conflicts with stored data; retry")
    log.error("database error: %s", exc)
    return error_response(
        503,
        "database_unavailable",
        "the database is unavailable; retry shortly",
        headers={"Retry-After": "5"},
    )


def _engine_failure(_req: Request, exc: StepFailure) -> Response:
    return error_response(500, exc.code, str(exc))


def _internal(request: Request, exc: Exception) -> Response:
    if isinstance(exc, ConnectionError | TimeoutError):  # refused, reset: the database going
        return _database(request, exc)
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, "internal_error", "internal error; see the server log")


EXCEPTION_HANDLERS = {
    ApiError: _api_error,
    ValidationException: _validation,
    HTTPException: _http,
    DocqaError: _docqa,
    OperationalError: _database,
    InterfaceError: _database,
    DBAPIError: _database,
    StepFailure: _engine_failure,
    Exception: _internal,
}
