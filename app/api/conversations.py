"""/v1/conversations and /v1/ask: questions about a manual, answered with the answer object
(``app/answer.py``) as JSON, or as server-sent events with ``stream: true``; and the same under
/v1/manuals/{manual_id}/ (``ManualQuestionController``), where a load balancer reads the manual
from the path."""

from typing import Annotated

from litestar import Controller, Response, delete, get, post
from sqlalchemy import delete as sa_delete
from sqlalchemy import func, select

from app.answer import Answer
from app.api.schemas import (
    AskCreate,
    CancelOut,
    ConversationCreate,
    ConversationDetail,
    ConversationId,
    ConversationList,
    ConversationOut,
    ManualAskCreate,
    ManualId,
    MessageCreate,
    MessageOut,
    PageLimit,
    PageOffset,
    RequestId,
    path_id,
)
from app.api.streaming import EventStream, native_sse
from app.db import Conversation, Message
from app.db.models import new_id
from app.errors import NotFound, ServiceError
from app.qa import Job, QAService


def _message_out(m: Message) -> MessageOut:
    return MessageOut(
        id=m.id,
        role=m.role,
        content=m.content,
        created_at=m.created_at,
        finish_reason=m.finish_reason,
        usage=m.usage,
        timings=m.timings,
        warnings=list(m.warnings or []),
        part=m.part,
    )


def _owned(conversation_id: str, tenant: str) -> tuple:
    """The conditions that select a conversation of this tenant only."""
    return (Conversation.id == conversation_id, Conversation.tenant == tenant)


async def _messages(s, conversation_id: ConversationId) -> list[Message]:
    rows = await s.scalars(
        select(Message).where(Message.conversation_id == conversation_id).order_by(Message.seq)
    )
    return list(rows)


def _question(text: str) -> str:
    if not text.strip():
        raise ServiceError("empty_question", "the question is empty")
    return text


def _job(
    qa: QAService, tenant: str, data, manual, manual_id, question, history, conversation_id
) -> Job:
    """A question's job: its sampling (``data``'s answer options), its prompt after ``history``
    (earlier turns), the tenant's cache namespace, the manual whose ledger it adds to."""
    qa.runner.require_ready()
    params = qa.params(data.max_tokens, data.temperature, data.top_p, data.seed, data.ignore_eos)
    built = qa.build(manual, question, history, params.max_tokens)
    return Job(
        request_id=new_id("msg"),
        prompt=built,
        params=params,
        namespace=qa.namespace(tenant),
        use_cache=data.cache != "bypass",
        speculate=data.speculate,
        question=question,
        conversation_id=conversation_id,
        tenant=tenant,
        warnings=list(built.warnings),
        manual_id=manual_id,
        part=manual.part,
        part_scores=list(manual.part_scores),
    )


async def _respond(qa: QAService, job: Job, stream: bool):
    handle, task = await qa.submit(job)
    if stream:
        return EventStream(native_sse(qa.events(handle, task)), request_id=job.request_id)
    return await task


async def _new_conversation(qa: QAService, tenant: str, manual_id: str) -> ConversationOut:
    await qa.get_manual(tenant, manual_id)
    conv = Conversation(id=new_id("conv"), tenant=tenant, manual_id=manual_id)
    async with qa.db.transaction() as s:
        s.add(conv)
    return ConversationOut(id=conv.id, manual_id=conv.manual_id, created_at=conv.created_at)


async def _turn(
    qa: QAService,
    tenant: str,
    conversation_id: str,
    data: MessageCreate,
    manual_id: str | None = None,
) -> Answer | Response:
    """The next turn of a conversation (of ``manual_id``, where the path names one: a
    conversation of another manual is not found there)."""
    question = _question(data.content)
    async with qa.db.session() as s:
        conv = await s.scalar(select(Conversation).where(*_owned(conversation_id, tenant)))
        if conv is None or (manual_id is not None and conv.manual_id != manual_id):
            raise NotFound("conversation", conversation_id)
        msgs = await _messages(s, conv.id)
    # the part of a manual stored as parts: ranked with the recent questions, and the previous
    # turn's part kept unless another ranks clearly better
    asked = [m.content for m in msgs if m.role == "user"][-2:]
    previous = next((m.part for m in reversed(msgs) if m.role == "assistant"), None)
    manual = await qa.prompt_manual(
        tenant, conv.manual_id, question, "\n".join(asked), data.part, previous
    )
    job = _job(qa, tenant, data, manual, conv.manual_id, question, qa.history(msgs), conv.id)
    return await _respond(qa, job, data.stream)


async def _ask(qa: QAService, tenant: str, manual_id: str, data, question: str):
    question = _question(question)
    manual = await qa.prompt_manual(tenant, manual_id, question, part=data.part)
    job = _job(qa, tenant, data, manual, manual_id, question, (), None)
    return await _respond(qa, job, data.stream)


async def _cancel(qa: QAService, tenant: str, request_id: str) -> CancelOut:
    done = await qa.cancel(request_id, tenant)
    if done is None:
        raise NotFound("request", request_id)
    return CancelOut(**done)


class ConversationController(Controller):
    path = "/conversations"
    tags = ["conversations"]

    @post("/", summary="Start a conversation about a manual", operation_id="createConversation")
    async def create(self, qa: QAService, tenant: str, data: ConversationCreate) -> ConversationOut:
        return await _new_conversation(qa, tenant, data.manual_id)

    @get("/", summary="List conversations", operation_id="listConversations")
    async def list_conversations(
        self,
        qa: QAService,
        tenant: str,
        manual_id: Annotated[str | None, path_id("manual")] = None,
        limit: PageLimit = 100,
        offset: PageOffset = 0,
    ) -> ConversationList:
        counts = (
            select(Message.conversation_id, func.count().label("n"))
            .group_by(Message.conversation_id)
            .subquery()
        )
        q = (
            select(Conversation, func.coalesce(counts.c.n, 0))
            .outerjoin(counts, counts.c.conversation_id == Conversation.id)
            .where(Conversation.tenant == tenant)
        )
        if manual_id:
            q = q.where(Conversation.manual_id == manual_id)
        q = q.order_by(Conversation.created_at, Conversation.id).limit(limit).offset(offset)
        async with qa.db.session() as s:
            rows = (await s.execute(q)).all()
        return ConversationList(
            items=[
                ConversationOut(
                    id=c.id, manual_id=c.manual_id, created_at=c.created_at, message_count=n
                )
                for c, n in rows
            ]
        )

    @get(
        "/{conversation_id:str}",
        summary="A conversation with its messages",
        operation_id="getConversation",
    )
    async def get_conversation(
        self, qa: QAService, tenant: str, conversation_id: ConversationId
    ) -> ConversationDetail:
        async with qa.db.session() as s:
            conv = await s.scalar(select(Conversation).where(*_owned(conversation_id, tenant)))
            if conv is None:
                raise NotFound("conversation", conversation_id)
            msgs = await _messages(s, conv.id)
        return ConversationDetail(
            id=conv.id,
            manual_id=conv.manual_id,
            created_at=conv.created_at,
            message_count=len(msgs),
            messages=[_message_out(m) for m in msgs],
        )

    @delete(
        "/{conversation_id:str}", summary="Delete a conversation", operation_id="deleteConversation"
    )
    async def delete_conversation(
        self, qa: QAService, tenant: str, conversation_id: ConversationId
    ) -> None:
        async with qa.db.transaction() as s:
            res = await s.execute(sa_delete(Conversation).where(*_owned(conversation_id, tenant)))
            if res.rowcount == 0:
                raise NotFound("conversation", conversation_id)

    @post(
        "/{conversation_id:str}/messages",
        status_code=200,
        operation_id="askInConversation",
        summary="Ask the next question in a conversation",
        description=(
            "Returns the answer object; with `stream: true`, SSE `token` events and a final "
            "`answer` event carrying the answer object."
        ),
    )
    async def ask(
        self, qa: QAService, tenant: str, conversation_id: ConversationId, data: MessageCreate
    ) -> Answer | Response:
        return await _turn(qa, tenant, conversation_id, data)


class AskController(Controller):
    path = "/ask"
    tags = ["questions"]

    @post(
        "/",
        status_code=200,
        operation_id="ask",
        summary="One question about a manual, without a conversation",
    )
    async def ask(self, qa: QAService, tenant: str, data: AskCreate) -> Answer | Response:
        return await _ask(qa, tenant, data.manual_id, data, data.question)


class RequestController(Controller):
    path = "/requests"
    tags = ["questions"]

    @post(
        "/{request_id:str}/cancel",
        status_code=200,
        summary="Cancel a running answer",
        operation_id="cancelRequest",
    )
    async def cancel(self, qa: QAService, tenant: str, request_id: RequestId) -> CancelOut:
        """Stops the request (the answer object's ``id``) and frees its KV blocks at once; a
        conversation turn is stored with finish reason ``cancelled``. An answer running on
        another replica (behind a load balancer) is cancelled there, found through Redis."""
        return await _cancel(qa, tenant, request_id)


class ManualQuestionController(Controller):
    """The question routes with the manual's id in the path: a load balancer hashing on it
    (the README's "Scaling out") sends every question about a manual, one-shot or in a
    conversation, and its cancellation, to the replica holding that manual's cache. The same
    answers as the routes without it."""

    path = "/manuals/{manual_id:str}"
    tags = ["questions"]

    @post(
        "/ask",
        status_code=200,
        operation_id="askAboutManual",
        summary="One question about this manual, without a conversation",
    )
    async def ask(
        self, qa: QAService, tenant: str, manual_id: ManualId, data: ManualAskCreate
    ) -> Answer | Response:
        return await _ask(qa, tenant, manual_id, data, data.question)

    @post(
        "/conversations",
        operation_id="createManualConversation",
        summary="Start a conversation about this manual",
    )
    async def create_conversation(
        self, qa: QAService, tenant: str, manual_id: ManualId
    ) -> ConversationOut:
        return await _new_conversation(qa, tenant, manual_id)

    @post(
        "/conversations/{conversation_id:str}/messages",
        status_code=200,
        operation_id="askInManualConversation",
        summary="Ask the next question in a conversation about this manual",
    )
    async def turn(
        self,
        qa: QAService,
        tenant: str,
        manual_id: ManualId,
        conversation_id: ConversationId,
        data: MessageCreate,
    ) -> Answer | Response:
        return await _turn(qa, tenant, conversation_id, data, manual_id)

    @post(
        "/requests/{request_id:str}/cancel",
        status_code=200,
        summary="Cancel a running answer about this manual",
        operation_id="cancelManualRequest",
    )
    async def cancel(
        self, qa: QAService, tenant: str, manual_id: ManualId, request_id: RequestId
    ) -> CancelOut:
        return await _cancel(qa, tenant, request_id)
