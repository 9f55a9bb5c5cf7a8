"""A manual's prompt prefixes held in the cache on request: ``warm`` computes them (every part's,
for a manual stored as parts) and waits until Redis holds them where there is a Redis tier;
``pin`` keeps their blocks out of eviction, within the pin budget; ``unpin`` lets them go."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import TYPE_CHECKING

from sqlalchemy import select

from app.db import Manual, ManualPart
from app.parts import part_header
from inference import SamplingParams
from prompts import BuiltPrompt

if TYPE_CHECKING:
    from app.qa import QAService


class ManualCache:
    def __init__(self, qa: QAService):
        self.qa = qa

    @staticmethod
    def pin_key(tenant: str, manual_id: str) -> str:
        """The engine's pin keys of a manual start with this; part ``i``'s adds ``\\x00i``."""
        return f"{tenant}\x00{manual_id}\x00"

    async def prefixes(self, manual: Manual) -> list[list[int]]:
        """The prompt prefix of every part of a manual (one for a manual that is one part)."""
        qa = self.qa
        if (manual.part_count or 1) == 1:
            return [qa.manual_prefix(manual)[0]]
        async with qa.db.engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(
                        ManualPart.idx, ManualPart.title, ManualPart.token_ids, ManualPart.content
                    )
                    .where(ManualPart.manual_id == manual.id)
                    .order_by(ManualPart.idx)
                )
            ).all()
        builder = qa.runner.builder
        out = []
        for idx, title, ids, content in rows:
            if manual.tokenizer_fingerprint == qa.tokenizer_fingerprint:
                out.append(builder.prefix_ids(manual_token_ids=ids)[0])
            else:  # stored for another tokenizer: its text again, header line first
                header = part_header(manual.title, idx, manual.part_count, title)
                out.append(builder.prefix_ids(header + content)[0])
        return out

    async def warm(self, tenant: str, manual: Manual) -> dict:
        """Prefill the manual's prefixes into the cache, one after the other, and wait until
        Redis holds them where there is a Redis tier."""
        from app.qa import Job

        qa = self.qa
        ns = qa.namespace(tenant)
        t0 = time.perf_counter()
        out = {
            "manual_id": manual.id,
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "computed_tokens": 0,
            "redis": "disabled",
            "redis_cached_tokens": 0,
            "parts": manual.part_count or 1,
        }
        for prefix in await self.prefixes(manual):
            job = Job(
                request_id=f"warm_{uuid.uuid4().hex}",
                prompt=BuiltPrompt(prefix, len(prefix), 0, 0),
                params=SamplingParams(max_tokens=1),
                namespace=ns,
                use_cache=True,
            )
            handle, task = await qa.submit(job)
            c = await handle.final
            await task
            probe = prefix + [0]
            out["cached_tokens"] += await qa.runner.call(
                lambda e, probe=probe: (
                    e.kv_manager.find_cached_prefix(probe, ns, partial=True).num_cached_tokens
                )
            )
            out["redis"], redis_tokens = await self._warm_tier(prefix, ns)
            out["prompt_tokens"] += len(prefix)
            out["computed_tokens"] += len(prefix) - c.num_cached_tokens
            out["redis_cached_tokens"] += redis_tokens
        out["elapsed_ms"] = round((time.perf_counter() - t0) * 1000, 3)
        return out

    async def _warm_tier(self, prefix: list[int], ns: bytes) -> tuple[str, int]:
        """Wait until Redis holds the prefix's full blocks (writing again those it lacks, e.g.
        written while Redis was down or trimmed since). Returns (tier status, tokens held)."""
        runner = self.qa.runner
        engine = runner.engine
        tier = engine.tier
        if tier is None:
            return "disabled", 0
        hashes = engine.kv_manager.hasher(ns).chain(prefix)
        bs = engine.kv_manager.block_size
        for attempt in range(2):
            if not tier.up:
                break
            await asyncio.wait_for(asyncio.wrap_future(tier.flush()), timeout=120)
            present = await asyncio.to_thread(tier.count_present, hashes)
            if present == len(hashes) or attempt:
                return tier.status, present * bs
            await runner.call(lambda e: e.write_prefix_to_tier(prefix, ns))
        return tier.status, 0

    async def pin(self, tenant: str, manual: Manual) -> dict:
        """Warm the manual if needed, then hold its prefixes' blocks out of eviction."""
        qa = self.qa
        await self.warm(tenant, manual)
        prefixes = await self.prefixes(manual)
        ns, key = qa.namespace(tenant), self.pin_key(tenant, manual.id)

        def pin_all(e):
            return sum(e.pin(f"{key}{i}", p, ns) for i, p in enumerate(prefixes))

        tokens = await qa.runner.call(pin_all)
        c = qa.runner.counters()
        return {
            "manual_id": manual.id,
            "pinned": tokens > 0,
            "pinned_tokens": tokens,
            "pinned_blocks_total": c["pinned_blocks"],
            "pin_budget_blocks": c["pin_budget_blocks"],
        }

    async def unpin(self, tenant: str, manual_id: str) -> bool:
        runner = self.qa.runner
        if not runner.ready:
            return False
        key = self.pin_key(tenant, manual_id)
        return await runner.call(lambda e: e.unpin_prefix(key) > 0)
