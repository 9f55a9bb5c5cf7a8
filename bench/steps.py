"""In-process engine step times for the batch shapes serving produces, with a breakdown by part.

    .venv/bin/python bench/steps.py [--manual-tokens 1000] [--question-tokens 48]
        [--decodes 1 4 16] [--repeats 20] [--no-breakdown] [--compare-layers]
        [--dtype auto|float32|bfloat16]

One engine (the default model, ``--dtype``, ``auto`` by default) caches ``manuals``
manuals; requests then ask about them in turn.
Each shape is timed as the median of ``repeats`` forward passes of the model with the same
inputs (the KV writes land in the same slots every time): ``N decodes`` is N requests each
decoding one token after the manual and a question; ``question`` adds one question's prefill
(all of it past the cached manual) to the step. With the breakdown, a second set of passes
times the linear layers, the attention and the fused element-wise steps one by one through the
model's Python layer loop (each call timed alone: the sum runs over the total by the timer's
cost and by the Python loop's own). ``--compare-layers`` times
each shape with the model's compiled layer loop (inference/kernels/cpu/forward.py, the default) and
with its Python loop in turn, several times, and prints both medians and their ratio in place
of the breakdown (the two give the same bits). Prints a table; nothing is written.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from ttft import manual_text  # noqa: E402

from inference import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from inference.engine.scheduler import ScheduledChunk, SchedulerOutput  # noqa: E402
from inference.kernels.cpu.linear_layer import CPULinear  # noqa: E402
from inference.llm import resolve_model  # noqa: E402
from prompts import PromptBuilder  # noqa: E402


def _prepare(engine, prompts: list[list[int]]):
    """Requests for ``prompts`` with every prompt token computed (the manual from the cache)."""
    reqs = []
    for ids in prompts:
        req = engine.add_request(ids, SamplingParams(max_tokens=64, ignore_eos=True))
        reqs.append(req)
    while any(not r.output_token_ids for r in reqs):
        engine.step()
    for r in reqs:  # room for the next token's KV
        engine.kv_manager.allocate(r.request_id, r.num_tokens)
    return reqs


def _inputs(engine, chunks):
    """Model inputs for ``chunks`` of (request, tokens, start), filled by the runner as a step
    of the engine fills them (each chunk's last token sampled)."""
    sched = SchedulerOutput(
        [
            ScheduledChunk(req, n, ctx, engine.kv_manager.block_ids(req.request_id), n == 1, True)
            for req, n, ctx in chunks
        ],
        [],
    )
    x = engine.runner.inputs.prepare(sched)
    # copies: the runner's buffers are filled again for the next shape
    meta = x.meta
    meta.slot_mapping, meta.block_tables = meta.slot_mapping.clone(), meta.block_tables.clone()
    meta.seq_lens, meta.cu_seqlens_q = meta.seq_lens.clone(), meta.cu_seqlens_q.clone()
    return (
        x.input_ids.clone(),
        x.positions.clone(),
        meta,
        engine.runner.kv_caches,
        x.logits_indices.clone(),
    )


class _Timer:
    """Wraps the parts of a forward pass to sum their time by name."""

    def __init__(self, engine):
        self.engine = engine
        self.totals: dict[str, float] = defaultdict(float)
        self._saved = []

    def _wrap(self, owner, attr, name):
        fn = getattr(owner, attr)
        self._saved.append((owner, attr, fn))
        setattr(owner, attr, self._timed(fn, name))

    def _timed(self, fn, name):
        totals = self.totals

        def timed(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            totals[name] += time.perf_counter() - t0
            return out

        return timed

    def __enter__(self):
        model = self.engine.runner.model
        self._wrap(CPULinear, "__call__", "linears")
        self._wrap(model.ops.attention, "attention", "attention")
        # the model reads its element-wise steps from its ops table: a timed copy for the block
        self._ops = model.ops
        model.ops = dataclasses.replace(
            model.ops,
            **{
                f: self._timed(getattr(model.ops, f), "element-wise")
                for f in ("add_rms_norm", "silu_mul", "rotary_store")
            },
        )
        return self

    def __exit__(self, *exc):
        self.engine.runner.model.ops = self._ops
        for owner, attr, fn in reversed(self._saved):
            setattr(owner, attr, fn)


@contextlib.contextmanager
def _layer_loop(model, compiled: bool):
    """The model's compiled layer loop on or off for the block, then as it was."""
    saved = model.compiled_layers
    model.compiled_layers = compiled
    try:
        yield
    finally:
        model.compiled_layers = saved


def _compare_layers(model, inputs, repeats: int, turns: int = 5) -> dict[bool, list[float]]:
    """Median ms of ``repeats`` passes with the compiled layer loop and with the Python one,
    ``turns`` times each in turn (the machine's speed drifts)."""
    out: dict[bool, list[float]] = {True: [], False: []}
    with torch.inference_mode():
        for _ in range(turns):
            for compiled in (True, False):
                with _layer_loop(model, compiled):
                    for _ in range(2):
                        model.forward(*inputs)
                    times = []
                    for _ in range(repeats):
                        t0 = time.perf_counter()
                        model.forward(*inputs)
                        times.append(time.perf_counter() - t0)
                out[compiled].append(statistics.median(times) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--manual-tokens", type=int, default=1000)
    ap.add_argument("--manuals", type=int, default=4, help="the decodes' manuals, in turn")
    ap.add_argument("--question-tokens", type=int, default=48)
    ap.add_argument("--decodes", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no-breakdown", action="store_true")
    ap.add_argument("--only", help="time only the steps whose name this regular expression matches")
    ap.add_argument(
        "--compare-layers",
        action="store_true",
        help="time the compiled layer loop against the Python one, side by side",
    )
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    args = ap.parse_args()

    engine = LLMEngine(EngineConfig(model_dir=resolve_model(None), dtype=args.dtype))
    tok = engine.tokenizer
    builder = PromptBuilder(tok)
    base = manual_text(tok, args.manual_tokens)
    texts = [f"Edition {m}\n{base}" for m in range(args.manuals)]
    prefixes = [builder.prefix_ids(t) for t in texts]

    def question(i: int) -> list[int]:
        words = " ".join(f"step {i} option {j}" for j in range(args.question_tokens))
        q_ids = tok.encode(words)[: args.question_tokens]
        m = i % args.manuals
        return builder.build(texts[m], tok.decode(q_ids), manual_ids=prefixes[m]).token_ids

    _prepare(engine, [question(-m) for m in range(args.manuals)])  # caches the manuals
    most = max(args.decodes)
    reqs = _prepare(engine, [question(i) for i in range(1, most + 1)])
    asker = engine.add_request(question(args.manuals * 1000), SamplingParams(max_tokens=1))
    engine.scheduler.waiting.remove(asker)  # its step is built here, not scheduled
    hit = engine.scheduler._lookup(asker)
    q_start = hit.num_cached_tokens if hit else 0
    engine.kv_manager.allocate(asker.request_id, asker.num_tokens, hit)
    print(
        f"{torch.get_num_threads()} threads, {engine.runner.dtype}, {args.manuals} manuals, "
        f"prefix {len(prefixes[0][0])} tokens"
    )
    q_len = asker.num_tokens - q_start

    shapes = []
    for n in args.decodes:
        dec = [(r, 1, r.num_tokens - 1) for r in reqs[:n]]
        shapes.append((f"{n} decode{'s' if n > 1 else ''}", dec))
    shapes.append((f"question ({q_len} tokens)", [(asker, q_len, q_start)]))
    n = most
    dec = [(r, 1, r.num_tokens - 1) for r in reqs[:n]]
    shapes.append((f"{n} decodes + question", [*dec, (asker, q_len, q_start)]))

    forward = engine.runner.model.forward
    if args.compare_layers:
        print("| step | compiled loop ms | Python loop ms | compiled / Python |")
        print("|---|---|---|---|")
    else:
        print("| step | median ms | linears | attention | element-wise | rest |")
        print("|---|---|---|---|---|---|")
    for name, chunks in shapes:
        if args.only and not re.fullmatch(args.only, name):
            continue
        inputs = _inputs(engine, chunks)
        if args.compare_layers:
            loops = _compare_layers(engine.runner.model, inputs, args.repeats)
            c, p = statistics.median(loops[True]), statistics.median(loops[False])
            print(f"| {name} | {c:.1f} | {p:.1f} | {c / p:.2f} |")
            continue
        with torch.inference_mode():
            for _ in range(3):
                forward(*inputs)
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                forward(*inputs)
                times.append(time.perf_counter() - t0)
            med = statistics.median(times) * 1e3
            parts = ""
            if not args.no_breakdown:
                # the parts are timed through the Python loop, which calls them one by one
                with _layer_loop(engine.runner.model, False), _Timer(engine) as timer:
                    for _ in range(args.repeats):
                        forward(*inputs)
                p = {k: v * 1e3 / args.repeats for k, v in timer.totals.items()}
                lin, att, ew = p.get("linears", 0), p.get("attention", 0), p.get("element-wise", 0)
                parts = f"{lin:.1f} | {att:.1f} | {ew:.1f} | {max(med - lin - att - ew, 0):.1f}"
        print(f"| {name} | {med:.1f} | {parts} |")


if __name__ == "__main__":
    main()
