"""The service's own workload, read from its stored conversations: each answered turn's prompt
and answer lengths in tokens (``docqa workload export``, read by ``docqa kv-budget
--workload``)."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import TextIO

from sqlalchemy import select

from app.db.models import Message
from app.db.session import Database
from inference.errors import DocqaError


def parse_since(since: str | None) -> datetime | None:
    """``--since`` as an aware datetime (UTC where it names no zone), or None."""
    if since is None:
        return None
    try:
        t = datetime.fromisoformat(since)
    except ValueError:
        raise DocqaError(f"--since must be an ISO date or date and time, got {since!r}") from None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


async def _export(url: str, out: TextIO, since: datetime | None) -> int:
    db = Database(url)
    n = 0
    try:
        async with db.session() as s:
            q = select(Message.usage, Message.created_at).where(Message.role == "assistant")
            if since is not None:
                q = q.where(Message.created_at >= since)
            result = await s.stream(q.order_by(Message.created_at))
            async for usage, _created in result:
                if not usage:
                    continue
                prompt, output = usage.get("prompt_tokens"), usage.get("completion_tokens")
                if not prompt or not output:  # stopped before its first token
                    continue
                out.write(json.dumps({"prompt_tokens": prompt, "output_tokens": output}) + "\n")
                n += 1
    finally:
        await db.close()
    return n


def export_workload(url: str, out: TextIO, since: datetime | None = None) -> int:
    """Write one JSON line per answered turn created at or after ``since``; returns how many."""
    return asyncio.run(_export(url, out, since))
