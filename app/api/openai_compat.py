"""OpenAI-compatible ``GET /v1/models`` and ``POST /v1/chat/completions``, and the same per
manual under ``/v1/manuals/{manual_id}`` (an OpenAI client's ``base_url`` for one manual).

With ``manual_id`` (an extra body field, or the path's) the stored manual is laid out as the
system prefix exactly as the native endpoints do, earlier user/assistant messages become the
conversation, and the last user message is the question.
``usage.prompt_tokens_details.cached_tokens`` is always present; ``timings`` sits beside
``usage``.
"""

import time
import uuid

import msgspec
from litestar import Controller, Response, get, post

from app.answer_events import AnswerDone, AnswerFailed, TokenText
from app.api.errors import error_body
from app.api.schemas import ChatCompletionCreate, ChatMessage, ManualId, ModelCard, ModelList
from app.api.streaming import EventStream, sse
from app.errors import NotFound, ServiceError
from app.qa import Job, QAService
from prompts import BuiltPrompt, Turn

_FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}


def _text(m: ChatMessage) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    parts = []
    for p in m.content:
        if p.type != "text":
            raise ServiceError(
                "unsupported_content",
                f"content parts of type {p.type!r} are not supported; send text",
            )
        parts.append(p.text or "")
    return "".join(parts)


class OpenAIController(Controller):
    path = "/"
    tags = ["openai"]

    @get("/models", summary="Models served (OpenAI shape)", operation_id="listModels")
    async def models(self, qa: QAService) -> ModelList:
        return _models(qa)

    @post(
        "/chat/completions",
        status_code=200,
        summary="Chat completion (OpenAI shape)",
        operation_id="createChatCompletion",
    )
    async def chat(self, qa: QAService, tenant: str, data: ChatCompletionCreate) -> Response:
        return await chat_completion(qa, tenant, data)


class ManualOpenAIController(Controller):
    """The OpenAI API with one manual as the system prefix, its id in the path: an OpenAI
    client's ``base_url`` of ``…/v1/manuals/{manual_id}`` asks about that manual, and a load
    balancer hashing on the path sends every such call to the replica holding its cache."""

    path = "/manuals/{manual_id:str}"
    tags = ["openai"]

    @get("/models", summary="Models served (OpenAI shape)", operation_id="listManualModels")
    async def models(self, qa: QAService, tenant: str, manual_id: ManualId) -> ModelList:
        await qa.get_manual(tenant, manual_id)
        return _models(qa)

    @post(
        "/chat/completions",
        status_code=200,
        summary="Chat completion about a manual (OpenAI shape)",
        operation_id="createManualChatCompletion",
    )
    async def chat(
        self, qa: QAService, tenant: str, manual_id: ManualId, data: ChatCompletionCreate
    ) -> Response:
        if data.manual_id and data.manual_id != manual_id:
            raise ServiceError(
                "invalid_request",
                f"manual_id {data.manual_id!r} in the body differs from {manual_id!r} in the path",
            )
        return await chat_completion(qa, tenant, msgspec.structs.replace(data, manual_id=manual_id))


def _models(qa: QAService) -> ModelList:
    r = qa.runner
    engine = r.require_ready()
    card = ModelCard(
        id=r.model_name,
        created=int(r.started_at),
        family=r.model_family,
        quantization=r.model_quantization,
        max_model_len=engine.max_model_len,
    )
    return ModelList(data=[card])


async def chat_completion(qa: QAService, tenant: str, data: ChatCompletionCreate) -> Response:
    """A chat completion (OpenAI's shape): with ``manual_id`` the stored manual is the system
    prefix, laid out as the native endpoints lay it out."""
    runner = qa.runner
    runner.require_ready()
    if data.model and data.model != runner.model_name:
        raise NotFound(
            "model",
            data.model,
            f"model {data.model!r} is not served here; this server serves "
            f"{runner.model_name!r} (GET /v1/models)",
        )
    max_tokens = data.max_completion_tokens or data.max_tokens
    params = qa.params(max_tokens, data.temperature, data.top_p, data.seed, data.ignore_eos)
    msgs = [(("system" if m.role == "developer" else m.role), _text(m)) for m in data.messages]
    if msgs[-1][0] != "user" or not msgs[-1][1].strip():
        raise ServiceError("invalid_request", "the last message must be a non-empty user message")
    warnings: list[str] = []
    if data.manual_id:
        asked = [t for r, t in msgs[:-1] if r == "user"][-2:]
        manual = await qa.prompt_manual(
            tenant, data.manual_id, msgs[-1][1], "\n".join(asked), data.part
        )
        if any(r == "system" for r, _ in msgs):
            warnings.append(
                "system messages are ignored with manual_id: the manual's system prefix is used"
            )
        turns, pending = [], None
        eot = runner.builder.end_of_turn_id()
        tok = runner.engine.tokenizer
        for role, text in msgs[:-1]:
            if role == "user":
                pending = text
            elif role == "assistant" and pending is not None:
                turns.append(Turn(pending, tok.encode(text.strip()) + [eot]))
                pending = None
        built = qa.build(manual, msgs[-1][1], turns, params.max_tokens)
        warnings += built.warnings
    else:
        ids = runner.builder.chat_ids(msgs)
        limit = runner.engine.max_model_len
        if len(ids) + params.max_tokens > limit:
            raise ServiceError(
                "prompt_too_long",
                f"the messages are {len(ids):,} tokens plus max_tokens "
                f"{params.max_tokens:,}; "
                f"this model's context is {limit:,} tokens",
                limit,
            )
        built = BuiltPrompt(ids, 0, 0, 0)
    job = Job(
        request_id=f"chatcmpl-{uuid.uuid4().hex}",
        prompt=built,
        params=params,
        namespace=qa.namespace(tenant),
        use_cache=data.cache != "bypass",
        speculate=data.speculate,
        question=msgs[-1][1],
        tenant=tenant,
        warnings=warnings,
        manual_id=data.manual_id or None,
        part=manual.part if data.manual_id else None,
        part_scores=list(manual.part_scores) if data.manual_id else [],
    )
    handle, task = await qa.submit(job)
    created = int(time.time())
    model = runner.model_name
    if not data.stream:
        a = await task
        body = {
            "id": job.request_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": a.answer},
                    "finish_reason": _FINISH.get(a.finish_reason, "stop"),
                }
            ],
            "usage": _usage(a),
            "timings": msgspec.to_builtins(a.timings),
            "warnings": a.warnings,
        }
        if a.part is not None:  # a manual stored as parts: the part that answered
            body["part"] = msgspec.to_builtins(a.part)
            body["part_scores"] = msgspec.to_builtins(a.part_scores)
        return Response(body)
    include_usage = bool(data.stream_options and data.stream_options.include_usage)

    async def chunks():
        head = {
            "id": job.request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
        }

        def chunk(delta, finish=None, **extra):
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            return sse(None, {**head, "choices": [choice], **extra})

        events = qa.events(handle, task)
        try:
            yield chunk({"role": "assistant", "content": ""})
            async for ev in events:
                if isinstance(ev, TokenText):
                    yield chunk({"content": ev.text})
                elif isinstance(ev, AnswerFailed):
                    yield sse(None, error_body(ev.code, ev.message))
                    return
                elif isinstance(ev, AnswerDone):
                    a = ev.answer
                    timings = msgspec.to_builtins(a.timings)
                    extra = {"timings": timings}
                    if a.part is not None:
                        extra["part"] = msgspec.to_builtins(a.part)
                    yield chunk({}, _FINISH.get(a.finish_reason, "stop"), **extra)
                    if include_usage:
                        usage = {"usage": _usage(a), "timings": timings}
                        yield sse(None, {**head, "choices": [], **usage})
            yield b"data: [DONE]\n\n"
        finally:  # a client gone: the request is cancelled
            await events.aclose()
            if not handle.final.done():
                handle.cancel()

    return EventStream(chunks(), request_id=job.request_id)


def _usage(a) -> dict:
    u = a.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "completion_tokens_details": dict(u.completion_tokens_details),
        "cached_tokens_by_tier": u.cached_tokens_by_tier,
    }
