"""Continuous batching: each step carries running decodes and prompt chunks within a token
budget; admission is limited by free KV blocks; preemption frees the newest request's blocks
and recomputes it later (whatever of its prefix is still cached is reused).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from inference.errors import DocqaError
from inference.sequence import Request, RequestStatus
from prefix_store import KVCacheManager, NoFreeBlocksError


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512  # new tokens per step (decodes + prompt chunks)
    max_num_seqs: int = 64  # requests running at once

    def __post_init__(self):
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")


class ScheduledChunk(NamedTuple):
    request: Request
    num_new_tokens: int  # tokens computed for this request in this step
    num_context_tokens: int  # tokens already in its KV before this step


class SchedulerOutput(NamedTuple):
    chunks: list[ScheduledChunk]
    preempted: list[Request]  # requests moved back to waiting in this step


class RequestTooLargeError(DocqaError):
    code = "request_too_large"


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_prompt_tokens_admitted = 0
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0

    def add(self, req: Request) -> None:
        blocks_needed = -(-(req.num_prompt_tokens + 1) // self.kv.block_size)
        if blocks_needed > self.kv.pool.num_blocks:
            raise RequestTooLargeError(
                f"prompt of {req.num_prompt_tokens:,} tokens needs {blocks_needed:,} KV blocks; "
                f"the pool holds {self.kv.pool.num_blocks:,}"
            )
        self.waiting.append(req)

    def abort(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.request_id)
        req.status = RequestStatus.FINISHED

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt_newest(self, keep: Request) -> Request | None:
        for victim in reversed(self.running):
            if victim is not keep:
                self.running.remove(victim)
                self.kv.free(victim.request_id)
                victim.status = RequestStatus.WAITING
                victim.num_computed_tokens = 0
                victim.num_preemptions += 1
                self.num_preemptions += 1
                self.waiting.appendleft(victim)
                return victim
        return None

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        # 1. running requests, oldest first: decodes and continuing prompt chunks
        for req in list(self.running):
            if budget <= 0:
                break
            if req not in self.running:  # preempted below for an older request
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while True:
                try:
                    self.kv.allocate(req.request_id, req.num_computed_tokens + n)
                    break
                except NoFreeBlocksError:
                    victim = self._preempt_newest(keep=req)
                    if victim is None:
                        n = 0
                        break
                    preempted.append(victim)
                    chunks = [c for c in chunks if c.request is not victim]
            if n > 0:
                chunks.append(ScheduledChunk(req, n, req.num_computed_tokens))
                budget -= n
        # 2. admit waiting requests while budget, sequence slots and blocks last
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            cached = None
            if req.use_cache:
                cached = self.kv.find_cached_prefix(req.all_token_ids, req.namespace)
            num_cached = cached.num_cached_tokens if cached else 0
            n = min(req.num_tokens - num_cached, budget)
            try:
                self.kv.allocate(
                    req.request_id, num_cached + n, cached, req.namespace, req.use_cache
                )
            except NoFreeBlocksError:
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:  # first admission: count once
                req.num_cached_tokens = num_cached
                self.num_prompt_tokens_admitted += req.num_prompt_tokens
                if req.use_cache:
                    self.num_prefix_queries += req.num_prompt_tokens
                    self.num_prefix_hits += num_cached
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            if req.times.first_scheduled is None:
                req.times.first_scheduled = time.perf_counter()
            self.running.append(req)
            chunks.append(ScheduledChunk(req, n, num_cached))
            budget -= n
        return SchedulerOutput(chunks, preempted)

    def finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        req.status = RequestStatus.FINISHED
        req.times.finished = time.perf_counter()
        if req in self.running:
            self.running.remove(req)
        self.kv.free(req.request_id)
