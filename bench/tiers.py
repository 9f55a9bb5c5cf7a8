"""TTFT for a question about a manual that is (a) in the local KV pool, (b) only in Redis,
(c) nowhere, at several manual lengths, measured side by side in one run.

    .venv/bin/python bench/tiers.py [--lengths 1000 2000 4000 8000] [--repeats 3]
                                    [--redis redis://127.0.0.1:6379/0]

Two engines share one Redis (a key prefix of this run, removed at the end). For each length and
repeat, with a manual never seen before: engine A answers a first question (c: computed cold;
its blocks are written through to Redis), then a second question (a: a device-pool hit); engine
B, whose pool never held the manual, answers the same second question (b: loaded from Redis).
Prints a markdown table and writes JSON under bench/results/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import uuid
from pathlib import Path

import redis
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ttft import manual_text  # noqa: E402

from inference import (  # noqa: E402
    EngineConfig,
    LLMEngine,
    SamplingParams,  # noqa: E402
)
from inference.llm import resolve_model  # noqa: E402
from prefix_store import TierConfig  # noqa: E402
from prompts import PromptBuilder  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def ask(engine: LLMEngine, ids: list[int]):
    req = engine.add_request(ids, SamplingParams(max_tokens=1, ignore_eos=True))
    while not req.finished:
        engine.step()
    engine.release(req)
    return engine.request_metrics(req), req


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1000, 2000, 4000, 8000])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--out", default=None, help="JSON path (default bench/results/tiers-DATE.json)")
    args = p.parse_args()

    prefix = f"docqa-bench-{uuid.uuid4().hex[:8]}:"
    tier = TierConfig(url=args.redis, prefix=prefix)
    model = resolve_model(None)
    a = LLMEngine(EngineConfig(model_dir=model, kv_cache_gib=args.kv_cache_gib, kv_tier=tier))
    b = LLMEngine(EngineConfig(model_dir=model, kv_cache_gib=args.kv_cache_gib, kv_tier=tier))
    if a.tier.status != "ok":
        print(f"Redis at {args.redis} does not answer: {a.tier.reason}", file=sys.stderr)
        return 2
    builder = PromptBuilder(a.tokenizer)
    rows = []
    try:
        # warm-up: first calls pay one-time costs (kernels, allocator)
        warm_text = manual_text(a.tokenizer, 300)
        for e in (a, b):
            ask(e, builder.build(warm_text, "Warm-up?").token_ids)
        for n in args.lengths:
            base = manual_text(a.tokenizer, n)
            local, remote, cold, moved = [], [], [], []
            cached = {}
            for r in range(args.repeats):
                text = f"Revision {uuid.uuid4().hex[:8]}.\n" + base  # a manual never seen before
                prefix_ids = builder.prefix_ids(text)
                q1 = builder.build(text, "What is this manual about?", manual_ids=prefix_ids)
                q2 = builder.build(text, f"What does section {r + 2} say?", manual_ids=prefix_ids)
                m_cold, _ = ask(a, q1.token_ids)
                assert a.tier.flush().result(300)
                m_local, req_local = ask(a, q2.token_ids)
                read0 = b.tier.bytes_read
                m_remote, req_remote = ask(b, q2.token_ids)
                moved.append(b.tier.bytes_read - read0)
                cold.append(m_cold.ttft_ms)
                local.append(m_local.ttft_ms)
                remote.append(m_remote.ttft_ms)
                cached = {
                    "prompt_tokens": len(q2.token_ids),
                    "local_cached": req_local.num_cached_tokens,
                    "redis_cached": req_remote.num_tier_cached_tokens,
                }
            row = {
                "manual_tokens": n,
                **cached,
                "local_ttft_ms": statistics.median(local),
                "redis_ttft_ms": statistics.median(remote),
                "cold_ttft_ms": statistics.median(cold),
                "redis_mb_read": statistics.median(moved) / 1e6,
            }
            row["redis_over_cold"] = row["redis_ttft_ms"] / row["cold_ttft_ms"]
            row["local_over_cold"] = row["local_ttft_ms"] / row["cold_ttft_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        a.close()
        b.close()
        client = redis.Redis.from_url(args.redis)
        for key in client.scan_iter(match=prefix + "*", count=1000):
            client.delete(key)

    print()
    print(
        "| manual tokens | (a) local pool ms | (b) Redis only ms | (c) nowhere ms "
        "| (b)/(c) | (a)/(c) | MB read from Redis |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['manual_tokens']:,} | {r['local_ttft_ms']:.0f} | {r['redis_ttft_ms']:.0f} | "
            f"{r['cold_ttft_ms']:.0f} | {r['redis_over_cold']:.3f} | {r['local_over_cold']:.3f} "
            f"| {r['redis_mb_read']:.1f} |"
        )
    out = Path(args.out) if args.out else RESULTS / f"tiers-{dt.date.today()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "machine": platform.processor() or platform.machine(),
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "dtype": str(a.dtype),
                "repeats": args.repeats,
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
