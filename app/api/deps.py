"""Authentication (API key -> tenant) and the dependencies every /v1 handler receives."""

from __future__ import annotations

import hmac

from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.handlers.base import BaseRouteHandler

from app.api.errors import ApiError
from app.engine_runner import EngineNotReady
from app.qa import DEFAULT_TENANT, QAService


def auth_guard(connection: ASGIConnection, _handler: BaseRouteHandler) -> None:
    """With DOCQA_API_KEYS set, every /v1 request needs ``Authorization: Bearer <key>``; the
    tenant (and so the cache namespace) comes from the key, never from the client's body."""
    settings = connection.app.state.settings
    if not settings.auth_enabled:
        connection.state.tenant = DEFAULT_TENANT
        return
    header = connection.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(
            401,
            "unauthorized",
            "an API key is required: send 'Authorization: Bearer <key>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    token = token.strip()
    tenant = None
    for key, t in settings.api_keys.items():
        if hmac.compare_digest(key.encode(), token.encode()):
            tenant = t
    if tenant is None:
        raise ApiError(
            401, "unauthorized", "the API key is not valid", headers={"WWW-Authenticate": "Bearer"}
        )
    connection.state.tenant = tenant


def not_draining(connection: ASGIConnection, _handler: BaseRouteHandler) -> None:
    """While the server drains for shutdown (app/shutdown.py), new requests get 503."""
    if connection.app.state.get("draining"):
        raise EngineNotReady("the server is shutting down; retry on another replica or later")


def provide_tenant(request: ASGIConnection) -> str:
    return request.state.tenant


def provide_qa(state: State) -> QAService:
    return state.qa
