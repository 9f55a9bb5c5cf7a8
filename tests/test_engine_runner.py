"""The engine thread behind the async front: timings count from the moment a request is
submitted, not from when the engine thread gets to it; tokens and results reach the event
loop whole and in order."""

import asyncio
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
