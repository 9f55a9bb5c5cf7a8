"""What the generated OpenAPI schema cannot say by itself: the server's ``max_tokens`` cap, that
request bodies take no fields beyond their own, and links from the operations that create ids
to the operations that take them (so a client, or a stateful fuzzer, can follow an upload to
its questions and a question to its cancellation)."""

from __future__ import annotations

import msgspec
from litestar.openapi.spec import Link, OpenAPI, OpenAPIType

from app.api import schemas

MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens")

_MANUAL = {"manual_id": "$response.body#/id"}
_CONVERSATION = {"conversation_id": "$response.body#/id"}
_ANSWER = {"request_id": "$response.body#/id"}
_MANUAL_CONVERSATION = {
    "manual_id": "$response.body#/manual_id",
    "conversation_id": "$response.body#/id",
}
_MANUAL_ANSWER = {"manual_id": "$request.path.manual_id", "request_id": "$response.body#/id"}

# (path, method, status) -> {link name: (operation id, parameters, request body)}
LINKS: dict[tuple[str, str, str], dict[str, tuple[str, dict | None, dict | None]]] = {
    ("/v1/manuals", "post", "201"): {
        "GetManual": ("getManual", _MANUAL, None),
        "WarmManual": ("warmManual", _MANUAL, None),
        "PinManual": ("pinManual", _MANUAL, None),
        "UnpinManual": ("unpinManual", _MANUAL, None),
        "DeleteManual": ("deleteManual", _MANUAL, None),
        "StartConversation": ("createConversation", None, _MANUAL),
        "Ask": ("ask", None, {**_MANUAL, "question": "What does this manual cover?"}),
        "AskAboutManual": ("askAboutManual", _MANUAL, {"question": "What does this manual cover?"}),
        "StartManualConversation": ("createManualConversation", _MANUAL, None),
        "ManualChatCompletion": ("createManualChatCompletion", _MANUAL, None),
    },
    ("/v1/manuals/{manual_id}/conversations", "post", "201"): {
        "AskInManualConversation": ("askInManualConversation", _MANUAL_CONVERSATION, None),
    },
    ("/v1/manuals/{manual_id}/ask", "post", "200"): {
        "CancelAnswer": ("cancelManualRequest", _MANUAL_ANSWER, None),
    },
    ("/v1/manuals/{manual_id}/conversations/{conversation_id}/messages", "post", "200"): {
        "CancelAnswer": ("cancelManualRequest", _MANUAL_ANSWER, None),
    },
    ("/v1/conversations", "post", "201"): {
        "GetConversation": ("getConversation", _CONVERSATION, None),
        "AskInConversation": ("askInConversation", _CONVERSATION, None),
        "DeleteConversation": ("deleteConversation", _CONVERSATION, None),
    },
    ("/v1/conversations/{conversation_id}/messages", "post", "200"): {
        "CancelAnswer": ("cancelRequest", _ANSWER, None),
    },
    ("/v1/ask", "post", "200"): {
        "CancelAnswer": ("cancelRequest", _ANSWER, None),
    },
}


def declare_max_tokens_cap(openapi: OpenAPI, cap: int) -> None:
    """The server's ``max_tokens`` cap as the maximum (and in the description) of every such
    integer field of the request bodies."""
    for schema in (openapi.components.schemas or {}).values():
        for name, prop in (schema.properties or {}).items():
            if name not in MAX_TOKENS_FIELDS:
                continue
            prop.description = f"answer length in tokens, at most {cap}"
            for option in [prop, *(getattr(prop, "one_of", None) or [])]:
                if getattr(option, "type", None) == OpenAPIType.INTEGER:
                    option.maximum = cap


def add_links(openapi: OpenAPI) -> None:
    """The links of ``LINKS`` on their operations' responses."""
    for (path, method, status), links in LINKS.items():
        operation = getattr(openapi.paths[path], method)
        response = operation.responses[status]
        response.links = {
            name: Link(operation_id=op, parameters=params, request_body=body)
            for name, (op, params, body) in links.items()
        }


def declare_closed_bodies(openapi: OpenAPI) -> None:
    """``additionalProperties: false`` on the bodies that refuse unknown fields."""
    closed = {
        name
        for name, obj in vars(schemas).items()
        if isinstance(obj, type)
        and issubclass(obj, msgspec.Struct)
        and obj.__struct_config__.forbid_unknown_fields
    }
    for name, schema in (openapi.components.schemas or {}).items():
        if name in closed:
            schema.additional_properties = False


def finish_openapi(openapi: OpenAPI, max_tokens_cap: int) -> None:
    declare_max_tokens_cap(openapi, max_tokens_cap)
    declare_closed_bodies(openapi)
    add_links(openapi)
