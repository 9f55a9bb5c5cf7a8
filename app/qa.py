"""Questions about manuals: prompt layout from stored ids, generation on the engine thread,
answer objects, and storage of each turn. No database session stays open while the model
generates: reads happen before submission, the turn is written after the answer is complete
(or cancelled).

The service knows nothing of HTTP: it raises ``app.errors`` and yields plain events
(``app.answer_events``); the API layer turns them into status codes
and server-sent events."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from sqlalchemy import case, select
from sqlalchemy.exc import IntegrityError

from app.answer import Answer, PartRef, PartScore, Timings, Usage
from app.answer_events import AnswerDone, AnswerFailed, Event, IncrementalDecoder, TokenText
from app.db import Database, Manual, ManualPart, ManualPassage, Message
from app.db.models import new_id
from app.engine_runner import Completion, EngineRunner, RequestHandle
from app.errors import NotFound, ServiceError
from app.manual_cache import ManualCache
from app.manual_parts import (
    PART_SCORES_SHOWN,
    choose_part,
    list_parts,
    part_rows,
    rank_parts,
)
from app.parts import part_header
from app.settings import MIN_QUESTION_ROOM, Settings
from app.turn_store import record_ledger, store_turn
from inference import SamplingParams
from prompts import BuiltPrompt, PromptLayoutTooLong, Turn

log = logging.getLogger("docqa.qa")

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class PromptManual:
    """What a prompt needs of a stored manual: its token ids and the tokenizer they came from;
    its text only where that was another tokenizer (the text is then encoded again)."""

    token_ids: list[int]
    tokenizer_fingerprint: str
    content: str = ""
    # a manual stored as parts: the part chosen for the question, and the ranked parts' scores
    part: PartRef | None = None
    part_scores: list[PartScore] = field(default_factory=list)


@dataclass
class Job:
    """One question on its way through the engine."""

    request_id: str
    prompt: BuiltPrompt
    params: SamplingParams
    namespace: bytes
    use_cache: bool
    question: str = ""
    conversation_id: str | None = None
    tenant: str | None = None  # who may cancel it
    warnings: list[str] = field(default_factory=list)
    manual_id: str | None = None  # the manual whose ledger the answer adds to
    speculate: bool = True  # prompt-lookup drafts (the answer is the same without)
    part: PartRef | None = None  # the part of the manual that answers
    part_scores: list[PartScore] = field(default_factory=list)

    @property
    def draft_group(self) -> str | None:
        """The answers this one drafts from and joins (speculation): its manual's, or its
        part's (within the job's namespace, its tenant's)."""
        if self.manual_id is None:
            return None
        return self.manual_id if self.part is None else f"{self.manual_id}:{self.part.index}"


class QAService:
    def __init__(self, settings: Settings, db: Database, runner: EngineRunner):
        self.settings = settings
        self.db = db
        self.runner = runner
        self.cancel_relay = None  # CancelRelay when replicas share a Redis
        self.cache = ManualCache(self)  # warming and pinning manuals' prefixes
        self._tasks: set[asyncio.Task] = set()

    @property
    def num_pending(self) -> int:
        """Answers not yet stored (or given) to their caller."""
        return len(self._tasks)

    # -- tenants and manuals ---------------------------------------------------------------------
    def namespace(self, tenant: str) -> bytes:
        """The cache namespace: the tenant's when auth is on, empty when it is off."""
        return tenant.encode() if self.settings.auth_enabled else b""

    @property
    def tokenizer_fingerprint(self) -> str:
        return self.runner.engine.tokenizer.fingerprint.hex()

    async def get_manual(self, tenant: str, manual_id: str) -> Manual:
        async with self.db.session() as s:
            m = await s.scalar(
                select(Manual).where(Manual.id == manual_id, Manual.tenant == tenant)
            )
        if m is None:
            raise NotFound("manual", manual_id)
        return m

    async def prompt_manual(
        self,
        tenant: str,
        manual_id: str,
        question: str = "",
        context: str = "",
        part: int | None = None,
        previous_part: int | None = None,
    ) -> PromptManual:
        """The manual a question is about, for its prompt: selects of the columns a prompt
        needs, not the whole row through a session (cheaper for the event loop's thread); the
        text is read only for a manual stored under another tokenizer. A manual stored as
        parts gives the part that answers: ``part`` where the request names one, else the one
        full-text search ranks first for the question (with ``context``, the conversation's
        recent questions), staying on ``previous_part`` unless another ranks clearly better."""
        where = (Manual.id == manual_id, Manual.tenant == tenant)
        async with self.db.engine.connect() as conn:
            # one select: a manual that is one part brings its ids along, one stored as parts
            # (whose ids the prompt does not use) does not
            whole_ids = case((Manual.part_count <= 1, Manual.token_ids), else_=None)
            row = (
                await conn.execute(
                    select(
                        Manual.tokenizer_fingerprint, Manual.part_count, Manual.title, whole_ids
                    ).where(*where)
                )
            ).first()
            if row is None:
                raise NotFound("manual", manual_id)
            fingerprint, num_parts, title, ids = row
            num_parts = num_parts or 1
            if part is not None and not 0 <= part < num_parts:
                raise ServiceError(
                    "invalid_request",
                    f"part {part} does not exist: this manual has {num_parts} "
                    f"part{'s' if num_parts > 1 else ''} (0 to {num_parts - 1})",
                    num_parts - 1,
                )
            if num_parts == 1:
                text_ = ""
                if fingerprint != self.tokenizer_fingerprint:
                    text_ = await conn.scalar(select(Manual.content).where(*where))
                return PromptManual(ids, fingerprint, text_)
            ranked = await rank_parts(conn, manual_id, f"{question}\n{context}")
            chosen = part if part is not None else choose_part(ranked, num_parts, previous_part)
            p = (
                await conn.execute(
                    select(ManualPart.title, ManualPart.token_ids, ManualPart.content).where(
                        ManualPart.manual_id == manual_id, ManualPart.idx == chosen
                    )
                )
            ).first()
        if p is None:
            raise NotFound("manual part", f"{manual_id} part {chosen}")
        part_title, ids, content = p
        shown = ranked[:PART_SCORES_SHOWN]
        if all(r.index != chosen for r in shown):
            score = next((r.score for r in ranked if r.index == chosen), 0.0)
            shown = [*shown, PartScore(chosen, part_title, score)]
        text_ = ""
        if fingerprint != self.tokenizer_fingerprint:
            text_ = part_header(title, chosen, num_parts, part_title) + content
        return PromptManual(ids, fingerprint, text_, PartRef(chosen, part_title), shown)

    async def manual_parts(self, manual_ids: Sequence[str]) -> dict[str, list[tuple]]:
        """(index, title, tokens, start, end) of each stored part of these manuals."""
        if not manual_ids:
            return {}
        async with self.db.engine.connect() as conn:
            return await list_parts(conn, manual_ids)

    def manual_prefix(self, manual: Manual | PromptManual) -> tuple[list[int], int]:
        builder = self.runner.builder
        if manual.tokenizer_fingerprint == self.tokenizer_fingerprint:
            return builder.prefix_ids(manual_token_ids=manual.token_ids)
        return builder.prefix_ids(manual.content)  # stored for another tokenizer: re-encode

    async def create_manual(
        self, tenant: str, title: str, text: str, source_type: str
    ) -> tuple[Manual, bool]:
        """(manual, created). The same text again from the same tenant returns the stored one."""
        self.runner.require_ready()
        text = text.strip()
        if not text:
            raise ServiceError("invalid_manual", "the manual has no text")
        title = title.strip()[:512] or "untitled"
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        existing = await self._find_manual(tenant, digest)
        if existing is not None:
            return existing, False
        builder = self.runner.builder
        ids = await asyncio.to_thread(builder.manual_token_ids, text)
        prefix, _ = builder.prefix_ids(manual_token_ids=ids)
        max_len = self.runner.engine.max_model_len
        overhead = len(prefix) - len(ids)
        limit = max_len - MIN_QUESTION_ROOM - overhead
        part_limit = limit
        if self.settings.max_part_tokens is not None:
            part_limit = min(limit, self.settings.max_part_tokens)
        parts: list[ManualPart] = []
        found: list[ManualPassage] = []
        if self.settings.parts and len(ids) > part_limit:
            tok, builder = self.runner.engine.tokenizer, self.runner.builder
            parts, found = await asyncio.to_thread(part_rows, tok, builder, title, text, part_limit)
        elif len(ids) > limit:
            raise ServiceError(
                "manual_too_long",
                f"the manual is {len(ids):,} tokens; with the system instructions ({overhead} "
                f"tokens) and room for a question and an answer ({MIN_QUESTION_ROOM} tokens) it "
                f"must fit the model's context of {max_len:,} tokens, so a manual may have at "
                f"most {limit:,} tokens (this server stores no manual as parts: --parts off)",
                limit,
            )
        manual = Manual(
            id=new_id("man"),
            tenant=tenant,
            title=title,
            source_type=source_type,
            content=text,
            sha256=digest,
            token_ids=ids,
            token_count=len(ids),
            tokenizer_fingerprint=self.tokenizer_fingerprint,
            part_count=max(1, len(parts)),
        )
        for row in (*parts, *found):
            row.manual_id = manual.id
        try:
            async with self.db.transaction() as s:
                s.add(manual)
                await s.flush()  # the manual's row before its parts' (their foreign key)
                s.add_all(parts)
                s.add_all(found)
        except IntegrityError:  # the same upload raced us; return the stored one
            existing = await self._find_manual(tenant, digest)
            if existing is None:
                raise
            return existing, False
        return manual, True

    async def _find_manual(self, tenant: str, digest: str) -> Manual | None:
        async with self.db.session() as s:
            return await s.scalar(
                select(Manual).where(Manual.tenant == tenant, Manual.sha256 == digest)
            )

    # -- prompts ----------------------------------------------------------------------------------
    def params(
        self,
        max_tokens: int | None,
        temperature: float,
        top_p: float,
        seed: int | None,
        ignore_eos: bool = False,
    ) -> SamplingParams:
        """A question's sampling; ``max_tokens`` defaults to the server's default and may not
        exceed its cap (``--max-tokens-cap``)."""
        cap = self.settings.max_tokens_cap
        if max_tokens is not None and max_tokens > cap:
            raise ServiceError(
                "invalid_request",
                f"max_tokens is {max_tokens:,}; this server answers with at most {cap:,} tokens",
                cap,
            )
        return SamplingParams(
            max_tokens=max_tokens or self.settings.default_max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            ignore_eos=ignore_eos,
        )

    def build(
        self,
        manual: Manual | PromptManual,
        question: str,
        history: Sequence[Turn],
        max_tokens: int,
    ) -> BuiltPrompt:
        builder = self.runner.builder
        try:
            return builder.build(
                manual.content,
                question,
                history,
                max_model_len=self.runner.engine.max_model_len,
                max_tokens=max_tokens,
                manual_ids=self.manual_prefix(manual),
            )
        except PromptLayoutTooLong as e:
            raise ServiceError("prompt_too_long", str(e), e.limit) from None

    def history(self, messages: Sequence[Message]) -> list[Turn]:
        """Earlier (question, answer ids) turns; an answer cut short gets its end-of-turn token
        so the next turn opens cleanly."""
        eot = self.runner.builder.end_of_turn_id()
        turns: list[Turn] = []
        pending: str | None = None
        for m in messages:
            if m.role == "user":
                pending = m.content
            elif m.role == "assistant" and pending is not None:
                ids = list(m.token_ids)
                if not ids or ids[-1] != eot:
                    ids.append(eot)
                turns.append(Turn(pending, ids))
                pending = None
        return turns

    # -- running ----------------------------------------------------------------------------------
    async def cancel_local(self, request_id: str, tenant: str) -> dict | None:
        """Cancel an answer running on this replica (its blocks freed at once; a conversation
        turn is stored with finish reason ``cancelled``): the outcome, or None where no answer
        of ``tenant`` with that id runs here."""
        handle = self.runner.find(request_id)
        if handle is None or handle.owner != tenant:
            return None
        handle.cancel()
        done = await asyncio.shield(handle.final)
        return {
            "id": request_id,
            "cancelled": done.finish_reason == "cancelled",
            "finish_reason": done.finish_reason,
            "completion_tokens": len(done.output_token_ids),
        }

    async def cancel(self, request_id: str, tenant: str) -> dict | None:
        """``cancel_local``, else the replica running it, asked over Redis (``CancelRelay``)."""
        done = await self.cancel_local(request_id, tenant)
        if done is None and self.cancel_relay is not None:
            done = await self.cancel_relay.cancel_elsewhere(request_id, tenant)
        return done

    async def submit(self, job: Job) -> tuple[RequestHandle, asyncio.Task]:
        handle = await self.runner.submit(
            job.prompt.token_ids,
            job.params,
            request_id=job.request_id,
            namespace=job.namespace,
            use_cache=job.use_cache,
            owner=job.tenant,
            speculate=job.speculate,
            draft_group=job.draft_group,
        )
        task = asyncio.get_running_loop().create_task(self._complete(job, handle))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return handle, task

    async def _complete(self, job: Job, handle: RequestHandle) -> Answer:
        completion = await handle.final
        answer = self.answer(job, completion)
        if job.conversation_id is not None:
            await store_turn(self.db, self.runner.engine.tokenizer, job, completion, answer)
        elif job.manual_id is not None and answer.usage.completion_tokens:
            try:
                async with self.db.transaction() as s:
                    await record_ledger(s, job, answer)
            except Exception as e:  # the answer stands; only its ledger entry is lost
                log.warning("the ledger of %s was not updated: %s", job.manual_id, e)
                answer.warnings.append(f"this answer is not in the manual's ledger: {e}")
        return answer

    def answer(self, job: Job, c: Completion) -> Answer:
        tok = self.runner.engine.tokenizer
        cached = c.num_cached_tokens
        redis = c.num_tier_cached_tokens
        return Answer(
            id=job.request_id,
            conversation_id=job.conversation_id,
            answer=tok.decode(c.output_token_ids).strip(),
            finish_reason=c.finish_reason,
            usage=Usage(
                prompt_tokens=len(c.prompt_token_ids),
                cached_tokens=cached,
                completion_tokens=len(c.output_token_ids),
                cached_tokens_by_tier={"device": cached - redis, "redis": redis},
                completion_tokens_details={
                    "accepted_prediction_tokens": c.accepted_prediction_tokens,
                    "rejected_prediction_tokens": c.rejected_prediction_tokens,
                },
            ),
            timings=Timings(**c.metrics.to_dict()),
            warnings=list(job.warnings),
            part=job.part,
            part_scores=list(job.part_scores),
        )

    async def text_deltas(self, handle: RequestHandle) -> AsyncIterator[str]:
        """The answer's text as it grows, one non-empty delta per engine step."""
        decoder = IncrementalDecoder(self.runner.engine.tokenizer)
        while True:
            ids = await handle.tokens.get()
            if ids is None:
                return
            delta = decoder.push(ids)
            if delta:
                yield delta

    async def events(self, handle: RequestHandle, task: asyncio.Task) -> AsyncIterator[Event]:
        """The answer as it grows (``TokenText``, one per engine step that adds text), then
        ``AnswerDone`` (or ``AnswerFailed``). A consumer that stops early cancels the request
        (the task stores the partial answer with finish reason ``cancelled``)."""
        try:
            async for delta in self.text_deltas(handle):
                yield TokenText(delta)
            try:
                answer = await asyncio.shield(task)
            except Exception as e:
                log.error("request %s failed: %s", handle.request_id, e)
                yield AnswerFailed(getattr(e, "code", "engine_error"), str(e))
                return
            yield AnswerDone(answer)
        finally:
            if not handle.final.done():
                handle.cancel()
