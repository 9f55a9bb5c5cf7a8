"""The engine behind an async interface: one thread owns the ``LLMEngine`` and steps it; the
event loop submits requests and receives tokens through thread-safe hand-offs, so it never
blocks on model work. Concurrent HTTP requests queue in the engine's scheduler and share its
batches.

A step's new tokens go to the event loop as soon as the step ends (holding them back until
the next model call starts made no step shorter: bench/RESULTS.md, "Service measurements").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inference import EngineConfig, LLMEngine, SamplingParams
from inference.engine.llm_engine import StepFailure
from inference.engine.sequence import Request
from inference.errors import DocqaError
from inference.llm import benchmark_seed, resolve_model
from inference.metrics import RequestMetrics
from inference.model.config import read_config_json
from inference.runner import prebuild_kernels
from prefix_store import TierConfig
from prompts import PromptBuilder

log = logging.getLogger("docqa.runner")


class EngineNotReady(DocqaError):
    code = "not_ready"


class EngineSaturated(DocqaError):
    code = "engine_saturated"


@dataclass(frozen=True)
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str  # stop | length | cancelled
    num_cached_tokens: int
    metrics: RequestMetrics
    num_tier_cached_tokens: int = 0  # of num_cached_tokens, those loaded from Redis
    # speculation: drafted tokens that became the answer's, and those verified and discarded
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class RequestHandle:
    """The caller's side of one engine request: new token ids arrive on ``tokens`` (a list per
    step, ``None`` at the end); ``final`` resolves to the ``Completion``."""

    def __init__(
        self,
        runner: EngineRunner,
        request_id: str,
        loop: asyncio.AbstractEventLoop,
        owner: str | None = None,
    ):
        self.runner = runner
        self.request_id = request_id
        self.owner = owner  # the tenant that may cancel it
        self.loop = loop
        self.tokens: asyncio.Queue[list[int] | None] = asyncio.Queue()
        self.final: asyncio.Future[Completion] = loop.create_future()
        # engine-thread bookkeeping
        self._sent = 0
        self._last_token_at: float | None = None

    def cancel(self) -> None:
        """Stop generating and free the request's blocks; ``final`` resolves with finish
        reason ``cancelled`` and the tokens produced so far."""
        if not self.final.done():
            self.runner._post(lambda: self.runner._abort(self.request_id))

    # called on the event loop
    def _push(self, ids: list[int]) -> None:
        self.tokens.put_nowait(ids)

    def _finish(self, result: Completion | BaseException) -> None:
        self.tokens.put_nowait(None)
        if self.final.done():
            return
        if isinstance(result, BaseException):
            self.final.set_exception(result)
        else:
            self.final.set_result(result)


def _push_all(batch: list[tuple[RequestHandle, list[int]]]) -> None:
    """On the event loop: one step's new tokens to each of its requests."""
    for handle, ids in batch:
        handle._push(ids)


class EngineRunner:
    """Loads the model in its own thread (``state``: loading -> ready | failed), then runs the
    step loop there until ``stop``."""

    # how long the engine thread sleeps when a step ran nothing (every request waiting for
    # blocks) before it tries again, unless a command wakes it
    IDLE_WAIT_S = 0.05

    def __init__(
        self,
        model: str | Path | None = None,
        dtype: str = "auto",
        kv_cache_gib: float | None = None,
        kv_dtype: str | None = None,
        batch_invariant: bool = False,
        cuda_graphs: bool = False,
        num_threads: int | None = None,
        max_waiting: int = 256,
        pin_budget: float = 0.25,
        max_num_batched_tokens: int = 512,
        prefill_tokens_with_decodes: int = 0,
        observer: Any = None,  # ServiceMetrics, or None
        kv_tier: TierConfig | None = None,
        speculate: str = "off",
    ):
        self._model = model
        self._engine_kwargs = dict(
            dtype=dtype,
            kv_cache_gib=kv_cache_gib,
            kv_dtype=kv_dtype,
            batch_invariant=batch_invariant,
            cuda_graphs=cuda_graphs,
            num_threads=num_threads,
            pin_budget=pin_budget,
            max_num_batched_tokens=max_num_batched_tokens,
            prefill_tokens_with_decodes=prefill_tokens_with_decodes,
            kv_tier=kv_tier,
            speculate=speculate,
        )
        self.max_waiting = max_waiting
        self.observer = observer
        self.state = "loading"
        self.error: str | None = None
        self.engine: LLMEngine | None = None
        self.builder: PromptBuilder | None = None
        self.model_name: str | None = None
        self.model_family: str | None = None  # config.json's model_type
        self.model_quantization: str | None = None  # the GGUF's file type, or the dtype
        self.random_weights = False  # a benchmark model (``random:NAME``): answers are noise
        self.started_at = time.time()
        self._cv = threading.Condition()
        # commands for the engine thread, each with the future its caller awaits (if any)
        self._cmds: list[tuple[Callable[[], None], concurrent.futures.Future | None]] = []
        self._stopping = False
        self._closed = False  # the thread runs no more commands
        self._active: dict[str, tuple[Request, RequestHandle]] = {}
        self._thread = threading.Thread(target=self._main, name="docqa-engine", daemon=True)

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def ready(self) -> bool:
        return self.state == "ready" and self._thread.is_alive()

    def _main(self) -> None:
        try:
            t0 = time.perf_counter()
            prebuild_kernels()  # a first start compiles beside the model's import
            model_dir = resolve_model(self._model)
            kwargs = {**benchmark_seed(self._model), **self._engine_kwargs}
            engine = LLMEngine(EngineConfig(model_dir=model_dir, **kwargs))
            self.random_weights = "random_weights_seed" in kwargs
            self.builder = PromptBuilder(engine.tokenizer)
            self.model_name = model_dir.name
            _, raw = read_config_json(model_dir)
            self.model_family = str(raw.get("model_type", "llama"))
            self.model_quantization = str(raw.get("gguf_quantization") or raw.get("torch_dtype"))
            self.engine = engine
            self.state = "ready"
            log.info("engine ready in %.1f s", time.perf_counter() - t0)
        except BaseException as e:  # report, never crash the server
            self.state = "failed"
            self.error = str(e) or type(e).__name__
            log.exception("engine failed to start")
            return
        try:
            self._loop()
        except BaseException as e:  # the loop itself broke: never leave callers waiting
            self.state = "failed"
            self.error = f"the engine thread stopped: {e}"
            log.exception("the engine thread stopped")
            self._fail_all(EngineNotReady(self.error))
            self._drop_commands(EngineNotReady(self.error))

    def _loop(self) -> None:
        engine = self.engine
        assert engine is not None
        while True:
            with self._cv:
                while not self._cmds and not self._stopping and not engine.has_unfinished():
                    self._cv.wait()
                if self._stopping:
                    break
                cmds, self._cmds = self._cmds, []
            t0 = time.perf_counter()
            for cmd, _ in cmds:
                try:
                    cmd()
                except Exception:  # a command's failure is its caller's, never the thread's
                    log.exception("an engine command failed")
            if not engine.has_unfinished():
                continue
            try:
                finished = engine.step()
            except Exception as e:
                log.exception("engine step failed; aborting the requests in flight")
                self._fail_all(StepFailure(f"the engine failed: {e}"))
                continue
            ran = engine.last_step
            self._publish(finished)
            if ran is None and not finished and not engine.waiting_on_tier:
                self._idle()  # (a step waiting on the second tier waited on its lookups)
            elif self.observer is not None and ran is not None:
                self.observer.observe_step(*ran, time.perf_counter() - t0)
        self._fail_all(EngineNotReady("the server is shutting down"))
        self._drop_commands(EngineNotReady("the server is shutting down"))
        engine.close()

    def _idle(self) -> None:
        """A step ran nothing: wait a little for blocks or a lookup, or for a command."""
        with self._cv:
            if not self._cmds and not self._stopping:
                self._cv.wait(self.IDLE_WAIT_S)

    # -- engine thread ---------------------------------------------------------------------------
    def _post(self, cmd: Callable[[], None], fut: concurrent.futures.Future | None = None) -> None:
        with self._cv:
            closed = self._closed
            if not closed:
                self._cmds.append((cmd, fut))
                self._cv.notify()
        if closed and fut is not None and fut.set_running_or_notify_cancel():
            fut.set_exception(EngineNotReady(self.error or "the server is shutting down"))

    def _drop_commands(self, exc: BaseException) -> None:
        """The thread will run no more commands: their callers get ``exc``."""
        with self._cv:
            self._closed = True
            cmds, self._cmds = self._cmds, []
        for _, fut in cmds:
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_exception(exc)

    def _publish(self, finished: list[Request]) -> None:
        """Hands each request's new tokens to its caller: one call into each event loop per
        step for all its requests (a wake-up of the loop, and a write to its self-pipe, per
        step rather than per request)."""
        now = time.perf_counter()
        obs = self.observer
        pushes: dict[asyncio.AbstractEventLoop, list[tuple[RequestHandle, list[int]]]] = {}
        for req, handle in list(self._active.values()):
            n = len(req.output_token_ids)
            if n > handle._sent:
                new = req.output_token_ids[handle._sent : n]
                if obs is not None and handle._last_token_at is not None:
                    gap = (now - handle._last_token_at) / len(new)
                    for _ in new:
                        obs.observe_inter_token(gap)
                handle._last_token_at = now
                handle._sent = n
                pushes.setdefault(handle.loop, []).append((handle, new))
        for loop, batch in pushes.items():
            loop.call_soon_threadsafe(_push_all, batch)
        for req in finished:
            self._complete(req, req.finish_reason or "stop", req.error)

    def _complete(self, req: Request, reason: str, error: Exception | None = None) -> None:
        """Hand a finished request's completion (or ``error``) to its caller."""
        engine = self.engine
        entry = self._active.pop(req.request_id, None)
        if req.times.finished is None:
            req.times.finished = time.perf_counter()
        metrics = engine.request_metrics(req)
        engine.release(req)
        if entry is None:
            return
        handle = entry[1]
        if self.observer is not None:
            try:
                self.observer.observe_request(
                    metrics,
                    started=req.times.first_scheduled is not None,
                    got_first_token=req.times.first_token is not None,
                    cached_tokens=max(req.num_cached_tokens, 0),
                    redis_tokens=req.num_tier_cached_tokens,
                )
            except Exception:  # a metric that fails must not stop the engine: logged, skipped
                log.exception("could not record the metrics of %s", req.request_id)
        if error is not None:
            handle.loop.call_soon_threadsafe(handle._finish, error)
            return
        result = Completion(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=list(req.output_token_ids),
            finish_reason=reason,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            metrics=metrics,
            num_tier_cached_tokens=req.num_tier_cached_tokens,
            accepted_prediction_tokens=req.num_accepted_tokens,
            rejected_prediction_tokens=req.num_rejected_tokens,
        )
        handle.loop.call_soon_threadsafe(handle._finish, result)

    def _abort(self, request_id: str) -> None:
        entry = self._active.get(request_id)
        if entry is None:
            return
        req = entry[0]
        self.engine.abort(request_id)
        # tokens produced since the last publish still reach the caller
        if len(req.output_token_ids) > entry[1]._sent:
            entry[1].loop.call_soon_threadsafe(
                entry[1]._push, req.output_token_ids[entry[1]._sent :]
            )
            entry[1]._sent = len(req.output_token_ids)
        self._complete(req, "cancelled")

    def _fail_all(self, exc: BaseException) -> None:
        for rid, (_req, handle) in list(self._active.items()):
            self._active.pop(rid, None)
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("aborting %s failed", rid)
            handle.loop.call_soon_threadsafe(handle._finish, exc)

    # -- event loop side -------------------------------------------------------------------------
    def require_ready(self) -> LLMEngine:
        if self.state == "failed":
            raise EngineNotReady(f"the engine is not running: {self.error}")
        if self.state == "ready" and not self._thread.is_alive():
            raise EngineNotReady("the engine thread has stopped")
        if self.state != "ready" or self.engine is None:
            raise EngineNotReady("the model is still loading; retry shortly")
        return self.engine

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        engine = self.require_ready()
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def cmd():
            if not fut.set_running_or_notify_cancel():  # the caller went away: nothing to do
                return
            try:
                fut.set_result(fn(engine))
            except BaseException as e:
                fut.set_exception(e)

        self._post(cmd, fut)
        return await asyncio.wrap_future(fut)

    async def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str,
        namespace: bytes = b"",
        use_cache: bool = True,
        owner: str | None = None,
        speculate: bool = True,
        draft_group: str | None = None,
    ) -> RequestHandle:
        """Queue a request; errors about the prompt (too long, too large for the pool) are
        raised here, before anything runs. Its timings count from this call: the engine thread
        takes it between two steps."""
        arrival = time.perf_counter()
        engine = self.require_ready()
        if len(engine.scheduler.waiting) >= self.max_waiting:
            raise EngineSaturated(
                f"{len(engine.scheduler.waiting)} requests are waiting for the engine "
                f"(limit {self.max_waiting}); retry shortly"
            )
        handle = RequestHandle(self, request_id, asyncio.get_running_loop(), owner)

        def add(e: LLMEngine):
            req = e.add_request(
                prompt_token_ids,
                params,
                request_id=request_id,
                namespace=namespace,
                use_cache=use_cache,
                arrival=arrival,
                speculate=speculate,
                draft_group=draft_group,
            )
            self._active[request_id] = (req, handle)

        await self.call(add)
        return handle

    @property
    def num_active(self) -> int:
        """Requests in the engine with a caller waiting for them."""
        return len(self._active)

    def cancel_all(self) -> None:
        """Cancel every request in the engine (their callers get finish reason
        ``cancelled``)."""
        for rid in list(self._active):
            self._post(lambda rid=rid: self._abort(rid))

    def find(self, request_id: str) -> RequestHandle | None:
        """The handle of a request still in the engine (read from the event loop: the dict is
        only replaced entry by entry, so a lookup is safe)."""
        entry = self._active.get(request_id)
        return entry[1] if entry is not None else None

    # -- reporting -----------------------------------------------------------------------------
    def counters(self) -> dict[str, float]:
        """Engine counters for /metrics and /v1/engine (read without stopping the engine)."""
        e = self.engine
        if e is None:
            return {}
        s = e.scheduler
        kv = e.kv_manager
        tier = {f"tier_{k}": v for k, v in e.tier.counters().items()} if e.tier else {}
        return {
            **tier,
            "prompt_tokens": s.num_prompt_tokens_admitted,
            "prefix_cache_queries": s.num_prefix_queries,
            "prefix_cache_hits": s.num_prefix_hits,
            "prefix_cache_hits_device": s.num_prefix_hits - s.num_prefix_hits_tier,
            "prefix_cache_hits_redis": s.num_prefix_hits_tier,
            "prefix_cache_hits_copied": s.num_prefix_hits_copied,
            "prompt_tokens_computed": e.prompt_tokens_computed,
            "generation_tokens": e.generation_tokens,
            "spec_draft_tokens": e.draft_tokens,
            "spec_accepted_tokens": e.accepted_draft_tokens,
            "num_preemptions": s.num_preemptions,
            "kv_cache_usage_perc": kv.usage(),
            "kv_cache_cached_blocks": kv.pool.num_cached_free,
            "num_blocks": kv.pool.num_blocks,
            "block_size": e.kv_spec.block_size,
            "num_free_blocks": kv.pool.num_free,
            "num_requests_running": len(s.running),
            "num_requests_waiting": len(s.waiting),
            "num_steps": e.num_steps,
            "num_cancelled": e.num_cancelled,
            "num_deferred_admissions": s.num_deferred_admissions,
            "pinned_blocks": e.pins.num_pinned_blocks,
            "pin_budget_blocks": e.pins.budget_blocks,
        }
