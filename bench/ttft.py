"""Cold vs warm TTFT at several manual lengths, and prefill/decode throughput beside
transformers, measured side by side in one run on this machine.

    .venv/bin/python bench/ttft.py [--lengths 500 1000 2000 4000] [--repeats 3]

Cold: the question computed with the cache bypassed. Warm: the same manual already cached by an
earlier question, a new question asked. Prints a markdown table and writes JSON under
bench/results/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from inference import LLM, SamplingParams
from prompts import PromptBuilder

RESULTS = Path(__file__).parent / "results"
SOURCES = ["/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0"]


def manual_text(tokenizer, n_tokens: int) -> str:
    text = ""
    for src in SOURCES:
        if Path(src).exists():
            text += Path(src).read_text()
    sample = Path(__file__).parent.parent / "app" / "samples" / "tarx-manual.md"
    while len(tokenizer.encode(text)) < n_tokens:
        text += "\n" + sample.read_text()
    return tokenizer.decode(tokenizer.encode(text)[:n_tokens])


def run_one(llm, ids, use_cache, max_tokens=1):
    out = llm.generate(
        prompt_token_ids=[ids],
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        use_cache=use_cache,
    )[0]
    return out


def bench_docqa(llms: dict, lengths, repeats):
    """Each length for each engine in turn (KV dtypes side by side: a slow spell of the
    machine falls on all of them alike); returns each engine's rows and decode tokens/s."""
    rows: dict[str, list] = {kv: [] for kv in llms}
    for n in lengths:
        for kv, llm in llms.items():
            row = bench_length(llm, n, repeats)
            rows[kv].append(row)
            print(
                f"  {n} tokens, KV {kv}: cold {row['cold_ttft_ms']:.0f} ms, "
                f"warm {row['warm_ttft_ms']:.0f} ms"
            )
    decode = {}
    for kv, llm in llms.items():
        builder = PromptBuilder(llm.tokenizer)
        text = manual_text(llm.tokenizer, max(lengths))
        ids = builder.build(text, "Describe the manual in detail.").token_ids
        out = run_one(llm, ids, True, max_tokens=48)
        decode[kv] = 1000.0 / out.metrics.tpot_ms if out.metrics.tpot_ms else 0.0
    return rows, decode


def bench_length(llm, n, repeats) -> dict:
    """Cold and warm TTFT of questions about a manual of ``n`` tokens (medians)."""
    builder = PromptBuilder(llm.tokenizer)
    text = manual_text(llm.tokenizer, n)
    prefix = builder.prefix_ids(text)

    def ask(q, text=text, prefix=prefix):
        return builder.build(text, q, manual_ids=prefix).token_ids

    run_one(llm, ask("Warm-up: what is this manual about?"), True)
    cold, warm, cold_prefill = [], [], []
    cached = 0
    for r in range(repeats):
        ids = ask(f"Question {r}: what does section {r + 2} say?")
        c = run_one(llm, ids, use_cache=False)
        w = run_one(llm, ids, use_cache=True)
        cold.append(c.metrics.ttft_ms)
        cold_prefill.append(len(ids) / (c.metrics.prefill_ms / 1000))
        warm.append(w.metrics.ttft_ms)
        cached = w.num_cached_tokens
        saved = w.metrics.ttft_saved_ms
    row = {
        "manual_tokens": n,
        "prompt_tokens": len(ids),
        "cached_tokens": cached,
        "cold_ttft_ms": statistics.median(cold),
        "warm_ttft_ms": statistics.median(warm),
        "ttft_saved_ms_reported": saved,
        "cold_prefill_tok_s": statistics.median(cold_prefill),
    }
    row["warm_over_cold"] = row["warm_ttft_ms"] / row["cold_ttft_ms"]
    return row


def bench_transformers(model_dir, dtype, ids_by_len, decode_tokens=32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    prefill = {}
    with torch.inference_mode():
        model(torch.tensor([ids_by_len[min(ids_by_len)][:64]]))  # warm-up
        for n, ids in ids_by_len.items():
            t = time.perf_counter()
            model(torch.tensor([ids]))
            prefill[n] = len(ids) / (time.perf_counter() - t)
        ids = ids_by_len[min(ids_by_len)]
        t = time.perf_counter()
        model.generate(torch.tensor([ids]), max_new_tokens=1, min_new_tokens=1, do_sample=False)
        first = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(
            torch.tensor([ids]),
            max_new_tokens=decode_tokens,
            min_new_tokens=decode_tokens,
            do_sample=False,
        )
        total = time.perf_counter() - t
    decode = (decode_tokens - 1) / max(total - first, 1e-9)
    return prefill, decode


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[500, 1000, 2000, 4000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--kv-dtypes",
        nargs="+",
        default=["default"],
        help="KV dtypes measured side by side (default: the compute dtype's), e.g. default int8",
    )
    ap.add_argument("--no-transformers", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    llms = {
        kv: LLM(None, dtype=args.dtype, kv_dtype=None if kv == "default" else kv, kv_cache_gib=1.0)
        for kv in args.kv_dtypes
    }
    llm = next(iter(llms.values()))
    print(f"docqa on {llm.engine.model_dir.name}, {args.dtype}, {torch.get_num_threads()} threads")
    by_kv, decode_by_kv = bench_docqa(llms, args.lengths, args.repeats)
    rows, decode = by_kv[args.kv_dtypes[0]], decode_by_kv[args.kv_dtypes[0]]
    hf_prefill, hf_decode = {}, None
    if not args.no_transformers:
        builder = PromptBuilder(llm.tokenizer)
        ids_by_len = {
            n: builder.build(manual_text(llm.tokenizer, n), "What does section 2 say?").token_ids
            for n in args.lengths
        }
        dtype = getattr(torch, args.dtype)
        hf_prefill, hf_decode = bench_transformers(llm.engine.model_dir, dtype, ids_by_len)
    print()
    print(
        "| manual tokens | cached | cold TTFT ms | warm TTFT ms | warm/cold | reported saved ms "
        "| docqa prefill tok/s | transformers prefill tok/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        hf = hf_prefill.get(r["manual_tokens"])
        r["transformers_prefill_tok_s"] = hf
        print(
            f"| {r['manual_tokens']:,} | {r['cached_tokens']:,} | {r['cold_ttft_ms']:.0f} "
            f"| {r['warm_ttft_ms']:.0f} | {r['warm_over_cold']:.3f} "
            f"| {r['ttft_saved_ms_reported']:.0f} | {r['cold_prefill_tok_s']:.0f} "
            f"| {hf:.0f} |"
            if hf
            else f"| {r['manual_tokens']:,} | {r['cached_tokens']:,} | {r['cold_ttft_ms']:.0f} "
            f"| {r['warm_ttft_ms']:.0f} | {r['warm_over_cold']:.3f} "
            f"| {r['ttft_saved_ms_reported']:.0f} | {r['cold_prefill_tok_s']:.0f} | - |"
        )
    print(
        f"\ndecode tokens/s: docqa {decode:.1f}"
        + (f", transformers {hf_decode:.1f}" if hf_decode else "")
    )
    if len(llms) > 1:
        base = args.kv_dtypes[0]
        print("\n| KV dtype | " + " | ".join(f"cold TTFT {n:,}" for n in args.lengths)
              + " | " + " | ".join(f"warm TTFT {n:,}" for n in args.lengths)
              + f" | decode tok/s ({max(args.lengths):,}-token manual) |")  # fmt: skip
        print("|---" * (2 + 2 * len(args.lengths)) + "|")
        for kv in args.kv_dtypes:
            cells = [
                f"{r['cold_ttft_ms']:.0f} ({r['cold_ttft_ms'] / b['cold_ttft_ms']:.2f}x)"
                for r, b in zip(by_kv[kv], by_kv[base], strict=True)
            ] + [
                f"{r['warm_ttft_ms']:.0f} ({r['warm_ttft_ms'] / b['warm_ttft_ms']:.2f}x)"
                for r, b in zip(by_kv[kv], by_kv[base], strict=True)
            ]
            d = decode_by_kv[kv]
            print(f"| {kv} | " + " | ".join(cells)
                  + f" | {d:.1f} ({d / decode_by_kv[base]:.2f}x) |")  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = dt.date.today().isoformat()
    report = {
        "date": stamp,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "model": llm.engine.model_dir.name,
        "dtype": args.dtype,
        "rows": rows,
        "decode_tok_s": {"docqa": decode, "transformers": hf_decode},
        "by_kv_dtype": {kv: {"rows": by_kv[kv], "decode_tok_s": decode_by_kv[kv]} for kv in by_kv},
    }
    path = RESULTS / f"ttft-{stamp}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
