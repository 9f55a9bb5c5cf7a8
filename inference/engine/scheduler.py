"""Continuous batching: each step carries running decodes and prompt chunks within a token
budget; admission is limited by free KV blocks; preemption frees the newest request's blocks
and recomputes it later (whatever of its prefix is still cached is reused).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from inference.engine.sequence import Request, RequestStatus
from inference.engine.speculate import DraftPolicy
from inference.errors import DocqaError
from prefix_store import CachedPrefix, KVCacheManager, NoFreeBlocksError


def is_decode(req: Request, n: int, ctx: int) -> bool:
    """A chunk of ``n`` tokens after ``ctx`` computed ones is one new token that follows a
    sampled token (not a chunk of the prompt, nor a preempted request's recompute)."""
    return n == 1 and ctx == req.num_tokens - 1 and ctx >= req.num_prompt_tokens


def _decoding(req: Request) -> bool:
    """The request's next chunk is a decode token."""
    return is_decode(req, req.num_tokens - req.num_computed_tokens, req.num_computed_tokens)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512  # new tokens per step (decodes + prompt chunks)
    max_num_seqs: int = 64  # requests running at once
    # prompt tokens a step may carry while answers are decoding (0: up to the step's budget):
    # a burst of questions is spread over a few steps instead of stalling every answer for
    # one long step, but prompts of a few hundred tokens then queue behind one another
    prefill_tokens_with_decodes: int = 0
    # a request waiting longer than this is admitted in arrival order, ahead of requests that
    # would otherwise go first for their longer cached prefix
    fairness_window_s: float = 2.0
    admission_lookahead: int = 128  # waiting requests considered per step

    def __post_init__(self):
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.prefill_tokens_with_decodes < 0:
            raise ValueError("prefill_tokens_with_decodes must be 0 or more")


class ScheduledChunk(NamedTuple):
    """One request's share of a step: tokens [num_context_tokens, num_context_tokens +
    num_new_tokens) of its prompt and answer, the last ``len(draft)`` of them drafted (a
    verification: its request's next token and the draft after it, every row sampled)."""

    request: Request
    num_new_tokens: int  # tokens computed for this request in this step
    num_context_tokens: int  # tokens already in its KV before this step
    block_ids: list[int]  # the request's KV blocks, enough for every token through this step
    is_decode: bool  # one new token following a sampled one (``is_decode``)
    samples: bool  # the chunk ends at the request's last token: its logits give the next
    draft: tuple[int, ...] = ()  # drafted tokens after the request's last one (speculation)

    @property
    def num_sampled_rows(self) -> int:
        """Logits rows this chunk samples: its last, or a verification's every row."""
        return (1 + len(self.draft)) if self.samples else 0


class SchedulerOutput(NamedTuple):
    """What one step computes, handed to the model runner."""

    chunks: list[ScheduledChunk]  # running requests first (oldest first), then admissions
    preempted: list[Request]  # requests moved back to waiting in this step
    # requests finished with an error in this step: they can no longer fit the pool less its
    # reserved (pinned) blocks (``Request.error`` says so)
    failed: Sequence[Request] = ()

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def num_decode_tokens(self) -> int:
        """Tokens of the step that follow sampled ones: decodes, and verifications' rows."""
        return sum(c.num_new_tokens if c.draft else c.is_decode for c in self.chunks)

    @property
    def sampling(self) -> list[Request]:
        """The requests whose next token this step samples, in chunk order."""
        return [c.request for c in self.chunks if c.samples]

    def sampling_rows(self) -> tuple[list[Request], list[int]]:
        """Each sampled logits row's request and the position of the token it samples, in
        row order (a verification's rows are its request's next positions)."""
        reqs: list[Request] = []
        positions: list[int] = []
        for c in self.chunks:
            if c.samples:
                n = c.num_sampled_rows
                reqs.extend([c.request] * n)
                first = c.request.num_tokens
                positions.extend(range(first, first + n))
        return reqs, positions


def _chunk(req: Request, n: int, ctx: int, blocks, draft: tuple[int, ...] = ()) -> ScheduledChunk:
    ids = [b.block_id for b in blocks]
    if draft:
        return ScheduledChunk(req, n, ctx, ids, False, True, draft)
    return ScheduledChunk(req, n, ctx, ids, is_decode(req, n, ctx), ctx + n == req.num_tokens)


class RequestTooLargeError(DocqaError):
    code = "request_too_large"


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, drafts: DraftPolicy | None = None
    ):
        """``drafts``: prompt-lookup speculation's policy (None: off)."""
        self.config = config
        self.kv = kv
        self.drafts = drafts
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_prompt_tokens_admitted = 0
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        self.num_prefix_hits_tier = 0  # of those, tokens loaded from the second tier
        self.num_prefix_hits_copied = 0  # of those, tokens copied into a fresh block
        self.num_deferred_admissions = 0  # waits for a prefix another request was computing
        # the second tier's look again before a request computes what its lookup, answered
        # long before, did not find (``TierIO.relook``: True while the new lookup runs)
        self.relook: Callable[[Request, int], bool] | None = None

    def add(self, req: Request, reserved_blocks: int = 0) -> None:
        """Queue a request; RequestTooLargeError when its prompt plus its whole answer could
        never fit the pool (less ``reserved_blocks``, e.g. pinned ones), even running alone."""
        too_large = self._too_large(req, reserved_blocks)
        if too_large is not None:
            raise too_large
        self.waiting.append(req)

    def _too_large(self, req: Request, reserved_blocks: int) -> RequestTooLargeError | None:
        """The error of a request whose prompt and whole answer cannot fit the pool less
        ``reserved_blocks`` even alone; None when it fits."""
        total = req.num_prompt_tokens + req.params.max_tokens
        if req.max_model_len:
            total = min(total, req.max_model_len)
        blocks_needed = -(-max(total, req.num_prompt_tokens + 1) // self.kv.block_size)
        available = self.kv.pool.num_blocks - reserved_blocks
        if blocks_needed <= available:
            return None
        return RequestTooLargeError(
            f"prompt of {req.num_prompt_tokens:,} tokens plus max_tokens "
            f"{req.params.max_tokens:,} needs {blocks_needed:,} KV blocks; the pool holds "
            f"{available:,} (of {self.kv.pool.num_blocks:,}, less pinned blocks)"
        )

    def abort(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._free_blocks(req)
        req.status = RequestStatus.FINISHED

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt_newest(self, keep: Request) -> Request | None:
        for victim in reversed(self.running):
            if victim is not keep:
                self._preempt(victim)
                return victim
        return None

    def _preempt(self, req: Request) -> None:
        """Free a running request's blocks and queue it first: it is computed again later
        (from whatever of its prefix is still cached)."""
        self.running.remove(req)
        self._free_blocks(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def schedule(self, reserved_blocks: int = 0) -> SchedulerOutput:
        """The next step's chunks. ``reserved_blocks`` (pinned ones) are blocks no request
        may count on: a request that cannot fit the rest of the pool even alone fails."""
        budget = self.config.max_num_batched_tokens
        # prompt tokens this step may carry: fewer while answers are decoding
        prompt_budget = budget
        cap = self.config.prefill_tokens_with_decodes
        if cap and any(_decoding(r) for r in self.running):
            prompt_budget = cap
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        failed: list[Request] = []
        drafts = self._drafts(budget)
        # 1. running requests, oldest first: decodes and continuing prompt chunks
        for req in list(self.running):
            if budget <= 0:
                break
            if req not in self.running:  # preempted below for an older request
                continue
            prompt = not _decoding(req)  # a prompt chunk, or a preempted request's recompute
            if prompt and prompt_budget <= 0:
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if prompt:
                n = min(n, prompt_budget)
            draft = drafts.get(req, ())[: budget - 1] if not prompt else ()
            n += len(draft)
            while True:
                try:
                    blocks = self.kv.allocate(req.request_id, req.num_computed_tokens + n)
                    break
                except NoFreeBlocksError:
                    victim = self._preempt_newest(keep=req)
                    if victim is None:  # it alone holds blocks and cannot grow
                        n = 0
                        error = self._too_large(req, reserved_blocks)
                        if error is not None:  # pins taken since it was admitted
                            self._fail(req, error)
                            failed.append(req)
                        else:  # blocks held for a moment (a second-tier load)
                            self._preempt(req)
                            preempted.append(req)
                        break
                    preempted.append(victim)
                    for c in chunks:
                        if c.request is victim:
                            budget += c.num_new_tokens
                            if not c.is_decode:
                                prompt_budget += c.num_new_tokens
                    chunks = [c for c in chunks if c.request is not victim]
            if n > 0:
                chunks.append(_chunk(req, n, req.num_computed_tokens, blocks, draft))
                budget -= n
                if prompt:
                    prompt_budget -= n
        # 2. admit waiting requests while budget, sequence slots and blocks last
        self._admit(chunks, min(budget, prompt_budget), reserved_blocks, failed)
        return SchedulerOutput(chunks, preempted, failed)

    def _drafts(self, budget: int) -> dict:
        """The drafts of the step's decoding requests (``DraftPolicy.plan``): none past a
        request's ``max_tokens`` or its context's last position, nor past the step's token
        budget."""
        if self.drafts is None:
            return {}
        decoding = [r for r in self.running if _decoding(r)]
        if not decoding or not self.drafts.outcomes.may_draft(len(decoding)):
            return {}
        cfg, rows = self.drafts.config, len(decoding)
        max_rows = min(cfg.max_step_rows, max(budget, rows))
        drafting = [r for r in decoding if r.speculate]
        if not self.drafts.may_pay(drafting, rows, max_rows):
            return {}
        proposals = {}
        for req in drafting:
            room = min(
                cfg.max_draft_tokens,
                req.params.max_tokens - len(req.output_token_ids) - 1,
                req.max_model_len - req.num_tokens if req.max_model_len else cfg.max_draft_tokens,
            )
            tokens = self.drafts.propose(req, room)
            if tokens:
                proposals[req] = tokens
        if not proposals:
            return {}
        return self.drafts.plan(proposals, rows, max_rows)

    # -- admission --------------------------------------------------------------------------------
    def prompt_hashes(self, req: Request) -> list[bytes]:
        """The chained hashes of the request's full prompt blocks (computed once)."""
        return req.prompt_hashes(self.kv.hasher(req.namespace))

    def _lookup(self, req: Request):
        if not req.use_cache:
            return None
        return self.kv.find_cached_prefix(
            req.all_token_ids, req.namespace, self.prompt_hashes(req), partial=True
        )

    def _inflight_blocks(self) -> set[bytes]:
        """Hashes of prompt blocks that running requests are computing and have not yet
        registered: a waiting request whose next block is among them waits for it instead of
        computing the same prefix in parallel."""
        bs = self.kv.block_size
        out: set[bytes] = set()
        for r in self.running:
            if r.use_cache and r.num_computed_tokens < r.num_prompt_tokens:
                out.update(self.prompt_hashes(r)[r.num_computed_tokens // bs :])
        return out

    def _admission_order(self) -> list[tuple[Request, CachedPrefix | None, bool]]:
        """Preempted requests and those waiting longer than the fairness window first (oldest
        first); then the longest cached prefix first, oldest first among equals. Returns
        (request, its cached prefix, whether that lookup was made)."""
        now = time.perf_counter()
        window = self.config.fairness_window_s
        # a request whose second-tier lookup is still in flight waits for it
        ready = (r for r in self.waiting if r.tier_lookup is None)
        head = list(itertools.islice(ready, self.config.admission_lookahead))
        keyed = []
        for req in head:
            urgent = req.num_preemptions > 0 or now - req.times.arrival > window
            if urgent:
                keyed.append(((0, 0, req.times.arrival), (req, None, False)))
            else:
                cached = self._lookup(req)
                hit = cached.num_cached_tokens if cached else 0
                keyed.append(((1, -hit, req.times.arrival), (req, cached, True)))
        keyed.sort(key=lambda kv: kv[0])
        return [entry for _, entry in keyed]

    def _admit(
        self, chunks: list[ScheduledChunk], budget: int, reserved_blocks: int, failed: list
    ) -> None:
        bs = self.kv.block_size
        inflight: set[bytes] | None = None
        allocated = False  # an allocation may evict blocks an earlier lookup found
        for req, cached, looked in self._admission_order():
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            error = self._too_large(req, reserved_blocks)
            if error is not None:  # pins taken since it was queued
                self.waiting.remove(req)
                self._fail(req, error)
                failed.append(req)
                continue
            if allocated or not looked:
                cached = self._lookup(req)
            num_cached = cached.num_cached_tokens if cached else 0
            if req.use_cache:
                hashes = self.prompt_hashes(req)
                k = num_cached // bs
                if k < len(hashes):
                    if inflight is None:
                        inflight = self._inflight_blocks()
                    if hashes[k] in inflight:
                        self.num_deferred_admissions += 1
                        continue
                    if self.relook is not None and self.relook(req, len(hashes) - k):
                        continue
            taken = self._allocate(req, cached, budget)
            if taken is None:
                break
            cached, n, blocks = taken
            num_cached = cached.num_cached_tokens if cached else 0
            allocated = True
            self.waiting.remove(req)
            if req.num_cached_tokens < 0:  # first admission: count once
                req.num_cached_tokens = num_cached
                self.num_prompt_tokens_admitted += req.num_prompt_tokens
                if req.use_cache:
                    self.num_prefix_queries += req.num_prompt_tokens
                    self.num_prefix_hits += num_cached
                    self.num_prefix_hits_copied += cached.num_copied_tokens if cached else 0
                    if req.tier_loaded and cached is not None:
                        n_tier = bs * sum(1 for h in cached.block_hashes if h in req.tier_loaded)
                        req.num_tier_cached_tokens = n_tier
                        self.num_prefix_hits_tier += n_tier
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            if req.times.first_scheduled is None:
                req.times.first_scheduled = time.perf_counter()
            self.running.append(req)
            chunks.append(_chunk(req, n, num_cached, blocks))
            budget -= n
            if req.use_cache and num_cached < req.num_prompt_tokens:
                if inflight is None:
                    inflight = self._inflight_blocks()
                else:
                    inflight.update(self.prompt_hashes(req)[num_cached // bs :])

    def _allocate(
        self, req: Request, cached: CachedPrefix | None, budget: int
    ) -> tuple[CachedPrefix | None, int, list] | None:
        """Give a request being admitted its blocks for its first chunk; returns the prefix
        taken, the chunk's tokens and the request's blocks, or None when the pool cannot supply
        them. A copy source
        held for its slots is one block less to hand out: in a full pool the copy is given up
        and those tokens are computed instead."""
        while True:
            num_cached = cached.num_cached_tokens if cached else 0
            n = min(req.num_tokens - num_cached, budget)
            try:
                blocks = self.kv.allocate(
                    req.request_id, num_cached + n, cached, req.namespace, req.use_cache
                )
                return cached, n, blocks
            except NoFreeBlocksError:
                if cached is None or cached.copy_source is None:
                    return None
                cached = cached.full_blocks_only()

    def _fail(self, req: Request, error: Exception) -> None:
        req.error = error
        self.finish(req, "error")

    def finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        req.status = RequestStatus.FINISHED
        req.times.finished = time.perf_counter()
        if req in self.running:
            self.running.remove(req)
        self._free_blocks(req)

    def _free_blocks(self, req: Request) -> None:
        """Free the request's blocks; the written part of its last block stays a copy source."""
        self.kv.free(req.request_id, req.all_token_ids, req.num_computed_tokens)
