"""The engine thread behind the async front: timings count from the moment a request is
submitted, not from when the engine thread gets to it; tokens and results reach the event
loop whole and in order."""

import asyncio
import contextlib
import time

from app.engine_runner import EngineRunner
from inference import SamplingParams


def _ready_runner(model_dir) -> EngineRunner:
    runner = EngineRunner(model_dir, dtype="bfloat16", kv_cache_gib=0.01)
    runner.start()
    for _ in range(600):
        if runner.state != "loading":
            break
        time.sleep(0.05)
    assert runner.ready, runner.error
    return runner


async def _drain(handle) -> list[int]:
    got = []
    while (ids := await handle.tokens.get()) is not None:
        got += ids
    return got


def test_queue_time_counts_the_wait_for_the_engine_thread(tiny_model_dir):
    runner = _ready_runner(tiny_model_dir)
    try:

        async def ask():
            # the engine thread is busy for 0.3 s (as it is during a long step) when the
            # request arrives: it waits that long before the engine can take it
            runner._post(lambda: time.sleep(0.3))
            handle = await runner.submit(
                list(range(100, 140)), SamplingParams(max_tokens=2), request_id="r1"
            )
            return await handle.final

        done = asyncio.run(ask())
        m = done.metrics
        assert m.queue_ms >= 250, m
        assert m.ttft_ms >= m.queue_ms and m.e2e_ms >= m.ttft_ms
    finally:
        runner.stop()


def test_streams_arrive_whole_and_in_order_with_their_results(tiny_model_dir):
    """Every token reaches its stream, before the end of the stream and the request's
    result, for requests that finish in different steps and for one cancelled while others
    run; afterwards every block is free or cached."""
    runner = _ready_runner(tiny_model_dir)
    try:

        async def ask():
            handles = [
                await runner.submit(
                    list(range(100 + i, 140 + 3 * i)),
                    SamplingParams(max_tokens=3 + 5 * i, ignore_eos=True),
                    request_id=f"r{i}",
                )
                for i in range(4)
            ]
            long = await runner.submit(
                list(range(300, 350)),
                SamplingParams(max_tokens=500, ignore_eos=True),
                request_id="long",
            )
            first = await long.tokens.get()  # it is running: stop it mid-answer
            long.cancel()
            rest = await _drain(long)
            streams = [await _drain(h) for h in handles]
            return (
                [(s, await h.final) for s, h in zip(streams, handles, strict=True)],
                (first + rest, await long.final),
            )

        done, (streamed, cancelled) = asyncio.run(asyncio.wait_for(ask(), 120))
        for i, (stream, result) in enumerate(done):
            assert result.finish_reason == "length"
            assert stream == result.output_token_ids and len(stream) == 3 + 5 * i
        assert cancelled.finish_reason == "cancelled"
        assert streamed == cancelled.output_token_ids and 1 <= len(streamed) < 500
        runner.engine.kv_manager.check_integrity()
        assert runner.engine.kv_manager.pool.num_free == runner.engine.kv_manager.pool.num_blocks
    finally:
        runner.stop()


def test_a_requests_failure_stays_that_requests(tiny_model_dir, monkeypatch):
    """An exception while one request's token is taken fails that request alone, with the
    engine's error code; its blocks are freed, the others finish, the engine keeps serving."""
    from inference.engine.llm_engine import LLMEngine, StepFailure

    append = LLMEngine._append_token

    def faulty(self, req, tok, logits, row, now):
        if req.request_id == "boom" and len(req.output_token_ids) == 2:
            raise RuntimeError("injected fault")
        return append(self, req, tok, logits, row, now)

    monkeypatch.setattr(LLMEngine, "_append_token", faulty)
    runner = _ready_runner(tiny_model_dir)
    try:

        async def ask():
            params = SamplingParams(max_tokens=6, ignore_eos=True)
            ids = ["a", "boom", "b"]
            handles = [
                await runner.submit(list(range(100 + 7 * i, 130 + 7 * i)), params, request_id=r)
                for i, r in enumerate(ids)
            ]
            return await asyncio.gather(*(h.final for h in handles), return_exceptions=True)

        a, boom, b = asyncio.run(asyncio.wait_for(ask(), 120))
        assert isinstance(boom, StepFailure) and boom.code == "engine_error"
        assert "injected fault" in str(boom)
        assert [len(r.output_token_ids) for r in (a, b)] == [6, 6]
        kv = runner.engine.kv_manager
        kv.check_integrity()
        assert kv.pool.num_free == kv.pool.num_blocks
        after = asyncio.run(_one(runner, "after"))
        assert len(after.output_token_ids) == 2 and runner.ready
    finally:
        runner.stop()


async def _one(runner, rid):
    handle = await runner.submit(list(range(50, 70)), SamplingParams(max_tokens=2), request_id=rid)
    return await asyncio.wait_for(handle.final, 60)


def test_a_cancelled_call_leaves_the_engine_serving(tiny_model_dir):
    """A caller cancelled before the engine thread runs its command: the command is dropped,
    and the thread serves on."""
    import threading

    runner = _ready_runner(tiny_model_dir)
    try:

        async def cancel_a_call():
            gate = threading.Event()
            runner._post(gate.wait)  # the thread is busy while the call is made and cancelled
            ran = []
            call = asyncio.ensure_future(runner.call(lambda e: ran.append(1)))
            await asyncio.sleep(0.05)
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await call
            gate.set()
            return ran

        assert asyncio.run(cancel_a_call()) == []
        done = asyncio.run(_one(runner, "after-cancel"))
        assert len(done.output_token_ids) == 2
        assert runner.ready and runner._thread.is_alive()
    finally:
        runner.stop()


def test_a_thread_that_stopped_is_reported_and_fails_its_callers(tiny_model_dir, monkeypatch):
    """Should the engine thread itself stop, the runner says so instead of "ready", and
    callers get an error instead of waiting forever."""
    from app.engine_runner import EngineNotReady

    runner = _ready_runner(tiny_model_dir)
    try:

        def broken_publish(finished):
            raise SystemError("the loop broke")

        monkeypatch.setattr(runner, "_publish", broken_publish)

        async def ask():
            handle = await runner.submit(
                list(range(50, 70)), SamplingParams(max_tokens=2), request_id="x"
            )
            return await asyncio.wait_for(handle.final, 60)

        try:
            asyncio.run(ask())
            raise AssertionError("the request should have failed")
        except EngineNotReady as e:
            assert "stopped" in str(e)
        assert not runner.ready and runner.state == "failed"
        try:
            runner.require_ready()
            raise AssertionError("require_ready should refuse")
        except EngineNotReady:
            pass
    finally:
        runner.stop()


def test_a_step_that_runs_nothing_waits_instead_of_spinning(tiny_model_dir, monkeypatch):
    """While every request waits (a scheduler with nothing to run), the engine thread
    sleeps between tries rather than calling step() as fast as it can."""
    runner = _ready_runner(tiny_model_dir)
    try:
        engine = runner.engine
        calls = []

        def idle_step():
            calls.append(time.perf_counter())
            engine.last_step = None
            return []

        async def wait_a_second():
            monkeypatch.setattr(engine, "step", idle_step)
            await runner.submit(list(range(50, 70)), SamplingParams(max_tokens=2), request_id="w")
            await asyncio.sleep(1.0)
            monkeypatch.undo()

        asyncio.run(wait_a_second())
        assert 1 <= len(calls) <= 100, len(calls)  # a spinning loop makes tens of thousands
    finally:
        runner.stop()
