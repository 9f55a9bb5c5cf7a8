"""The least time bench/load.py's engine steps could take at this CPU's matrix product rate, and
what that leaves of the serving goals.

    .venv/bin/python bench/floor.py FILE [--model DIR] [--dtype auto|float32|bfloat16]
        [--rate GFLOPS]

FILE is a bench/load.py result taken on this machine (the server's machine), or, with
``--rate``, on a machine whose product rate is known (GFLOP/s). Each level's
average step, as the server's own counters give it (decode tokens and prompt tokens per step),
is counted in the model's arithmetic, from its config.json: a token through the linear layers
costs 2 FLOPs per weight; the LM head's 2 x hidden x vocabulary FLOPs come once per decode
token and once per question (its last prompt token); attention costs a token
4 x heads x head size FLOPs per key of its context in each layer (scores and weighted values).
Decode tokens attend the answers' mean context (prompt, plus half the answer), prompt tokens the
questions' (the cached prefix, plus half the uncached part), from the level's own requests.
The product rate is this CPU's best for the dtype the server ran: torch's product of two
2048 x 2048 matrices on this process's threads (the server's default), best of 10, a rate the
engine's kernels can at best come near. Element-wise work, memory traffic and the engine's
own time are left out, so the floor is below any real step.

For each level: the FLOPs of a step, the floor (FLOPs over the product rate), the measured
time in the model per step and the share of the product rate it ran at. Then the TPOT goal at
the highest level: its step floor over the measured 1-client TPOT p50, and that times the
level's measured TPOT p99 / p50 (the spread between answers the scheduling leaves: short
answers average fewer steps). Where the last figure is 3 or more, no kernel can meet the goal
on this machine with that spread. Prints a table; nothing is written.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference.model.config import ModelConfig  # noqa: E402


@dataclass(frozen=True)
class TokenFlops:
    """A model's FLOPs for one token: linear layers, one LM head row, attention per context key."""

    linear: int
    head: int
    attention_per_key: int

    @classmethod
    def of(cls, cfg: ModelConfig) -> TokenFlops:
        h, q_out, kv_out = (
            cfg.hidden_size,
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
        )
        per_layer = h * q_out + 2 * h * kv_out + q_out * h + 3 * h * cfg.intermediate_size
        return cls(
            linear=2 * per_layer * cfg.num_layers,
            head=2 * h * cfg.vocab_size,
            attention_per_key=4 * cfg.num_heads * cfg.head_dim * cfg.num_layers,
        )


def step_flops(
    f: TokenFlops,
    decodes: float,
    prompt_tokens: float,
    decode_ctx: float,
    prompt_ctx: float,
    uncached: float,
) -> dict[str, float]:
    """An average step's FLOPs by part (linear layers, LM head, attention): ``decodes`` decode
    tokens at context ``decode_ctx``, ``prompt_tokens`` prompt tokens at context
    ``prompt_ctx``, and an LM head row for each decode token and each question
    (``prompt_tokens / uncached`` of them)."""
    questions = prompt_tokens / uncached if uncached > 0 else 0.0
    return {
        "linear": (decodes + prompt_tokens) * f.linear,
        "head": (decodes + questions) * f.head,
        "attention": f.attention_per_key * (decodes * decode_ctx + prompt_tokens * prompt_ctx),
    }


def level_shape(level: dict) -> dict:
    """A load level's mean request: prompt, cached and answer tokens, and the mean context its
    decode tokens and its prompt tokens attend."""
    reqs = level["per_request"]
    prompt = statistics.fmean(r["prompt_tokens"] for r in reqs)
    cached = statistics.fmean(r["cached_tokens"] for r in reqs)
    answer = statistics.fmean(r["completion_tokens"] for r in reqs)
    return {
        "prompt": prompt,
        "cached": cached,
        "uncached": prompt - cached,
        "answer": answer,
        "decode_ctx": prompt + answer / 2,
        "prompt_ctx": (cached + prompt + 1) / 2,
    }


def product_rate(dtype: torch.dtype, n: int = 2048, repeats: int = 10) -> float:
    """FLOP/s of torch's n x n matrix product in ``dtype`` on this process's threads, best of
    ``repeats`` after a warm-up."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    best = float("inf")
    with torch.inference_mode():
        a @ b
        for _ in range(repeats):
            t = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def floors(result: dict, f: TokenFlops, rate: float) -> list[dict]:
    """Each level of a load result with its average step's FLOPs, floor and measured time."""
    rows = []
    for level in result["levels"]:
        shape = level_shape(level)
        parts = step_flops(
            f,
            level["decode_tokens_per_step"],
            level["prompt_tokens_per_step"],
            shape["decode_ctx"],
            shape["prompt_ctx"],
            shape["uncached"],
        )
        flops = sum(parts.values())
        floor_ms = flops / rate * 1e3
        rows.append(
            {
                "concurrency": level["concurrency"],
                "decodes": level["decode_tokens_per_step"],
                "prompt_tokens": level["prompt_tokens_per_step"],
                "gflop": flops / 1e9,
                "gflop_by_part": {k: v / 1e9 for k, v in parts.items()},
                "floor_ms": floor_ms,
                "step_ms": level["step_ms"],
                "rate_share": floor_ms / level["step_ms"] if level["step_ms"] else None,
                "tpot_p50_ms": level["tpot_p50_ms"],
                "tpot_p99_ms": level["tpot_p99_ms"],
            }
        )
    return rows


def tpot_goal_at_floor(rows: list[dict]) -> dict:
    """The highest level's step floor over the 1-client TPOT p50 (measured), alone and times
    the highest level's measured TPOT p99 / p50, with that level's FLOPs by part."""
    one = min(rows, key=lambda r: r["concurrency"])
    top = max(rows, key=lambda r: r["concurrency"])
    at_floor = top["floor_ms"] / one["tpot_p50_ms"]
    spread = top["tpot_p99_ms"] / top["tpot_p50_ms"]
    return {
        "concurrency": top["concurrency"],
        "gflop_by_part": top["gflop_by_part"],
        "p50_over_1client_p50": at_floor,
        "spread_p99_over_p50": spread,
        "p99_over_1client_p50": at_floor * spread,
        "measured_p99_over_1client_p50": top["tpot_p99_ms"] / one["tpot_p50_ms"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "result",
        type=Path,
        help="a bench/load.py result (JSON), taken on this machine unless --rate",
    )
    ap.add_argument("--model", help="model directory (default: the default model)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument(
        "--rate",
        type=float,
        help="GFLOP/s of the machine FILE was taken on, in place of measuring this one's",
    )
    args = ap.parse_args()
    if args.rate is not None and args.rate <= 0:
        ap.error(f"--rate must be a positive GFLOP/s figure, not {args.rate}")
    try:
        result = json.loads(args.result.read_text())
        levels = result["levels"]
        if not levels:
            raise ValueError("no levels")
        if not all(lv["per_request"] for lv in levels):
            raise ValueError("a level without answers")
    except (OSError, ValueError, KeyError, TypeError) as e:
        ap.error(f"{args.result} is not a bench/load.py result: {e!r}")
    from inference.device import resolve_dtype
    from inference.llm import resolve_model

    cfg = ModelConfig.from_file(resolve_model(args.model) / "config.json")
    if args.rate is not None:
        rate, where = args.rate * 1e9, "given"
    else:
        dtype = resolve_dtype(args.dtype, torch.device("cpu"))
        rate, where = product_rate(dtype), f"{torch.get_num_threads()} threads, {dtype}"
    f = TokenFlops.of(cfg)
    rows = floors(result, f, rate)
    print(
        f"{where}: matrix products at {rate / 1e9:.0f} GFLOP/s; "
        f"a token costs {f.linear / 1e6:.1f} MFLOP in the linear layers, {f.head / 1e6:.1f} in the "
        f"LM head and {f.attention_per_key / 1e3:.1f} kFLOP per key of its context in attention"
    )
    print()
    print(
        "| clients | decode tokens per step | prompt tokens per step | GFLOP per step | floor ms "
        "| measured ms per step | share of the product rate | TPOT p50 ms | TPOT p99 ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        share = f"{r['rate_share']:.0%}" if r["rate_share"] is not None else "-"
        print(
            f"| {r['concurrency']} | {r['decodes']:.1f} | {r['prompt_tokens']:.1f} "
            f"| {r['gflop']:.2f} | {r['floor_ms']:.1f} | {r['step_ms']:.1f} | {share} "
            f"| {r['tpot_p50_ms']:.1f} | {r['tpot_p99_ms']:.1f} |"
        )
    g = tpot_goal_at_floor(rows)
    by = g["gflop_by_part"]
    print()
    print(
        f"a step at {g['concurrency']} clients: {by['linear']:.2f} GFLOP in the linear layers, "
        f"{by['head']:.2f} in the LM head, {by['attention']:.2f} in attention"
    )
    print(
        f"at {g['concurrency']} clients, steps at the floor: TPOT p50 "
        f"{g['p50_over_1client_p50']:.2f}x the 1-client TPOT p50; with the measured p99 / p50 "
        f"of {g['spread_p99_over_p50']:.2f}, TPOT p99 {g['p99_over_1client_p50']:.2f}x "
        f"(goal < 3; measured {g['measured_p99_over_1client_p50']:.2f}x)"
    )


if __name__ == "__main__":
    main()
