"""What an answer leaves in the database: its turn in a conversation (question and answer
stored together) and its manual's ledger (``Manual.answers`` and the sums beside it)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import msgspec
from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError

from app.answer import Answer
from app.db import Conversation, Database, Manual, Message
from app.engine_runner import Completion

if TYPE_CHECKING:
    from app.qa import Job

log = logging.getLogger("docqa.qa")


async def record_ledger(s, job: Job, answer: Answer) -> None:
    """Add an answer to its manual's ledger (``Manual.answers`` and the rest), in the
    session's transaction: one UPDATE of sums, so replicas sharing the database never lose
    an answer to another's."""
    u, t = answer.usage, answer.timings
    await s.execute(
        update(Manual)
        .where(Manual.id == job.manual_id, Manual.tenant == job.tenant)
        .values(
            answers=Manual.answers + 1,
            answered_prompt_tokens=Manual.answered_prompt_tokens + u.prompt_tokens,
            cached_tokens=Manual.cached_tokens + u.cached_tokens,
            cached_tokens_redis=Manual.cached_tokens_redis + u.cached_tokens_by_tier["redis"],
            ttft_saved_ms=Manual.ttft_saved_ms + t.ttft_saved_ms,
        )
    )


async def store_turn(db: Database, tokenizer, job: Job, c: Completion, answer: Answer) -> None:
    """Store a conversation turn (the question and its answer, at the conversation's next two
    seqs) and add the answer to its manual's ledger, in one transaction; retried where a
    concurrent turn took the seq; a warning on the answer where the conversation was deleted
    meanwhile."""
    q_ids = tokenizer.encode(job.question.strip())
    for attempt in range(5):
        try:
            async with db.transaction() as s:
                last = await s.scalar(
                    select(func.max(Message.seq)).where(
                        Message.conversation_id == job.conversation_id
                    )
                )
                seq = (last if last is not None else -1) + 1
                s.add(
                    Message(
                        conversation_id=job.conversation_id,
                        seq=seq,
                        role="user",
                        content=job.question,
                        token_ids=q_ids,
                    )
                )
                s.add(
                    Message(
                        id=job.request_id,
                        conversation_id=job.conversation_id,
                        seq=seq + 1,
                        role="assistant",
                        content=answer.answer,
                        token_ids=c.output_token_ids,
                        finish_reason=answer.finish_reason,
                        usage=msgspec.to_builtins(answer.usage),
                        timings=msgspec.to_builtins(answer.timings),
                        warnings=list(answer.warnings),
                        part=job.part.index if job.part is not None else None,
                    )
                )
                if job.manual_id is not None and answer.usage.completion_tokens:
                    await record_ledger(s, job, answer)
            return
        except IntegrityError as e:
            # a concurrent turn took this seq, or the conversation was deleted meanwhile
            async with db.session() as s:
                alive = await s.get(Conversation, job.conversation_id)
            if alive is None:
                log.info("conversation %s was deleted; answer not stored", job.conversation_id)
                answer.warnings.append("the conversation was deleted; this answer is not stored")
                return
            log.debug("retrying turn storage (%s): %s", attempt, e)
            await asyncio.sleep(0.01 * (attempt + 1))
    raise RuntimeError(f"could not store a turn of {job.conversation_id}")
