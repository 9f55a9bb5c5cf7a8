"""The engine thread behind the async front: timings count from the moment a request is
submitted, not from when the engine thread gets to it."""

import asyncio
import time

from app.engine_runner import EngineRunner
from inference import SamplingParams


def test_queue_time_counts_the_wait_for_the_engine_thread(tiny_model_dir):
    runner = EngineRunner(tiny_model_dir, dtype="bfloat16", kv_cache_gib=0.01)
    runner.start()
    try:
        for _ in range(600):
            if runner.state != "loading":
                break
            time.sleep(0.05)
        assert runner.ready, runner.error

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
