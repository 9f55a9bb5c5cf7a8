"""Which model: answers with known right answers, scored, and the speed they cost.

    .venv/bin/python bench/quality.py [--model DIR|NAME] [--dtype auto] [--max-tokens 48]
        [--json bench/results/quality-DATE.json] [--show]

Twenty questions over the bundled tarx manual and the tests' pump manual, each with the
answer the manual gives: an option name (``-k`` or ``--keep``), a number, a command, a phrase.
An option question is answered right when the first option the answer names is the one the
manual gives (short or long form, case-sensitive: ``-c`` is not ``-C``); any other question when
the answer contains the known value or phrase as whole words. The score is the share of right
answers: exact match on the known answer, not a judgement of the prose around it.

Each question runs as a user's request would: the chat prompt with the manual first, greedy,
``--max-tokens`` at most. Per question: TTFT with the manual's prefix not cached (``cold``, the
whole prompt computed, one token), then the answer with the prefix cached (``warm``, the
question and template tokens computed), its decode tokens/s (tokens after the first over the
time from first token to last). Prints a row per question (``--show`` adds the answers) and a
summary: accuracy, median cold and warm TTFT, decode tokens/s.

Run it on each model to compare (``docqa model list`` names them); bench/RESULTS.md keeps the
default model's figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from speculation import PUMP  # noqa: E402

from inference import LLM, SamplingParams  # noqa: E402
from prompts import PromptBuilder  # noqa: E402

TARX = (ROOT / "app" / "samples" / "tarx-manual.md").read_text()


_AN_OPTION = re.compile(r"(?<![\w-])--?[A-Za-z][\w-]*")


class Option:
    """Right when the first option the answer names is this one, in its short or long form
    (an answer that lists several options is judged by the one it gives first)."""

    def __init__(self, short: str, long: str):
        self.forms = (short, long)

    def __call__(self, answer: str) -> bool:
        first = _AN_OPTION.search(answer)
        return first is not None and first.group(0) in self.forms


class Phrase:
    """Right when the answer contains the pattern."""

    def __init__(self, pattern: str):
        self.pattern = re.compile(pattern)

    def __call__(self, answer: str) -> bool:
        return self.pattern.search(answer) is not None


def words(*forms: str) -> Phrase:
    """Any of ``forms`` as whole words, case-insensitive."""
    return Phrase(r"(?i:(?<!\w)(?:" + "|".join(re.escape(f) for f in forms) + r")(?!\w))")


# (manual, question, the known answer)
QUESTIONS: list[tuple[str, str, Option | Phrase]] = [
    ("tarx", "Which option compresses the archive?", Option("-z", "--gzip")),
    ("tarx", "How do I keep existing files when extracting?", Option("-k", "--keep")),
    ("tarx", "How do I list the contents of an archive?", Option("-t", "--list")),
    ("tarx", "Which option creates a new archive?", Option("-c", "--create")),
    ("tarx", "Which option extracts files from an archive?", Option("-x", "--extract")),
    ("tarx", "Which option names the archive file to use?", Option("-f", "--file")),
    ("tarx", "Which option prints each file name as it is processed?", Option("-v", "--verbose")),
    (
        "tarx",
        "Which option changes to a directory before doing anything?",
        Option("-C", "--directory"),
    ),
    (
        "tarx",
        "What exit status does tarx return when every file was processed?",
        words("0", "zero"),
    ),
    ("tarx", "What exit status does tarx return on a fatal error?", words("2", "two")),
    (
        "tarx",
        "Give the command that creates a compressed archive of the directory docs.",
        Phrase(r"tarx -czf docs\.tar\.gz docs"),
    ),
    (
        "tarx",
        "What file name endings do gzip-compressed archives have?",
        Phrase(r"\.tgz|\.tar\.gz"),
    ),
    ("pump", "How long does mode B run?", words("15 minutes", "fifteen minutes")),
    ("pump", "Which mode runs continuously?", Phrase(r"(?i:mode a\b)|^\s*A\b")),
    (
        "pump",
        "How long must the red button be held to reset the pump?",
        words("5 seconds", "five seconds"),
    ),
    ("pump", "What does error E7 mean?", Phrase(r"(?i:overheat)")),
    (
        "pump",
        "What does error E4 mean?",
        Phrase(r"(?i:dirty filter|filter is dirty|filter needs cleaning)"),
    ),
    ("pump", "How often must the filter be cleaned?", words("30 days", "thirty days")),
    (
        "pump",
        "How long should the pump cool after error E7?",
        words("one hour", "1 hour", "an hour"),
    ),
    ("pump", "When does mode C run?", Phrase(r"(?i:float switch)")),
]
MANUALS = {"tarx": TARX, "pump": PUMP}


def run(model: str | None, dtype: str, max_tokens: int, show: bool) -> dict:
    llm = LLM(model, dtype=dtype, kv_cache_gib=0.5)
    engine = llm.engine
    builder = PromptBuilder(llm.tokenizer)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    prefixes = {name: builder.prefix_ids(text) for name, text in MANUALS.items()}
    rows = []
    for name, question, check in QUESTIONS:
        built = builder.build(
            MANUALS[name],
            question,
            max_model_len=engine.max_model_len,
            max_tokens=max_tokens,
            manual_ids=prefixes[name],
        )
        ids = [built.token_ids]
        cold = llm.generate(prompt_token_ids=ids, sampling_params=one, use_cache=False)[0]
        llm.generate(prompt_token_ids=ids, sampling_params=one)  # the prefix cached
        out = llm.generate(prompt_token_ids=ids, sampling_params=params)[0]
        answer = out.text.strip()
        right = check(answer)
        n = len(out.token_ids)
        rows.append(
            {
                "manual": name,
                "question": question,
                "answer": answer,
                "right": right,
                "prompt_tokens": len(built.token_ids),
                "cached_tokens": out.num_cached_tokens,
                "cold_ttft_ms": cold.metrics.ttft_ms,
                "warm_ttft_ms": out.metrics.ttft_ms,
                "completion_tokens": n,
                "decode_ms": out.metrics.decode_ms,
            }
        )
        mark = "right" if right else "WRONG"
        print(
            f"{mark:5}  {name:4}  cold {cold.metrics.ttft_ms:7.1f} ms  warm "
            f"{out.metrics.ttft_ms:6.1f} ms  {question}",
            flush=True,
        )
        if show:
            print(f"       -> {answer[:200]!r}", flush=True)
    decode_tokens = sum(max(r["completion_tokens"] - 1, 0) for r in rows)
    decode_s = sum(r["decode_ms"] for r in rows) / 1000
    cfg = json.loads((engine.config.model_dir / "config.json").read_text())
    summary = {
        "model": engine.config.model_dir.name,
        "family": cfg.get("model_type"),
        "quantization": cfg.get("gguf_quantization") or cfg.get("torch_dtype"),
        "dtype": str(engine.runner.dtype).replace("torch.", ""),
        "right": sum(r["right"] for r in rows),
        "questions": len(rows),
        "accuracy": sum(r["right"] for r in rows) / len(rows),
        "cold_ttft_ms_median": statistics.median(r["cold_ttft_ms"] for r in rows),
        "warm_ttft_ms_median": statistics.median(r["warm_ttft_ms"] for r in rows),
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s else 0.0,
        "by_manual": {
            m: f"{sum(r['right'] for r in rows if r['manual'] == m)}/"
            f"{sum(1 for r in rows if r['manual'] == m)}"
            for m in MANUALS
        },
        "cpu": platform.processor() or platform.machine(),
        "max_tokens": max_tokens,
    }
    return {"summary": summary, "rows": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model directory or name (default model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--json", help="write the rows and the summary here")
    p.add_argument("--show", action="store_true", help="print each answer")
    args = p.parse_args()
    t0 = time.perf_counter()
    result = run(args.model, args.dtype, args.max_tokens, args.show)
    s = result["summary"]
    print()
    print(
        f"model {s['model']} ({s['family']}, {s['quantization']}, {s['dtype']}): "
        f"{s['right']}/{s['questions']} right ({s['accuracy']:.0%}; "
        + ", ".join(f"{m} {v}" for m, v in s["by_manual"].items())
        + ")"
    )
    print(
        f"TTFT median: cold {s['cold_ttft_ms_median']:.1f} ms, warm "
        f"{s['warm_ttft_ms_median']:.1f} ms; decode {s['decode_tokens_per_s']:.1f} tokens/s "
        f"({time.perf_counter() - t0:.0f} s in all)"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
