"""Second-question TTFT against the same question with ``cache: "bypass"``, over HTTP against a
running ``docqa serve`` (or one this script starts), at several manual lengths.

    .venv/bin/python bench/api_ttft.py [--url http://127.0.0.1:8000] [--lengths 1000 2000 4000]

TTFT is the engine's own (``timings.ttft_ms`` of the answer object) and, beside it, the client's
time to the first SSE token event. Prints a markdown table and writes JSON under bench/results/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from bench.ttft import manual_text  # noqa: E402

RESULTS = Path(__file__).parent / "results"
QUESTIONS = [
    "Which conditions does the license place on distributing modified versions?",
    "What does the manual say about warranties?",
    "How do I keep existing files when extracting?",
    "Which option compresses the archive?",
    "What exit status means a fatal error?",
]


def client_ttft(c: httpx.Client, body: dict) -> tuple[float, dict]:
    """(ms to the first token event, the final answer object) of a streamed /v1/ask."""
    t0 = time.perf_counter()
    first = None
    final = None
    event = None
    with c.stream("POST", "/v1/ask", json={**body, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                if event == "token" and first is None:
                    first = (time.perf_counter() - t0) * 1000
                if event == "answer":
                    final = json.loads(line[6:])
    return first if first is not None else (time.perf_counter() - t0) * 1000, final


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server (default: start one on a temporary SQLite)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1000, 2000, 4000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--api-key")
    args = ap.parse_args()

    srv = None
    if args.url:
        url = args.url
    else:
        from svc_helpers import Server

        tmp = Path(tempfile.mkdtemp(prefix="docqa-bench-"))
        srv = Server(tmp, f"sqlite:///{tmp / 'docqa.db'}", name="bench").start()
        url = srv.url
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    from inference.llm import resolve_model
    from inference.model.tokenizer import TextTokenizer

    tok = TextTokenizer(resolve_model(None))
    rows = []
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=600) as c:
            for n in args.lengths:
                text = f"Edition {uuid.uuid4().hex}\n" + manual_text(tok, n)
                m = c.post("/v1/manuals", json={"title": f"bench {n}", "text": text}).json()
                base = {"manual_id": m["id"], "max_tokens": 1}
                first = c.post("/v1/ask", json={**base, "question": QUESTIONS[0]}).json()
                warm, cold = [], []
                for i in range(args.repeats):
                    q = QUESTIONS[1 + i % (len(QUESTIONS) - 1)] + f" ({i})"
                    cms, ca = client_ttft(c, {**base, "question": q, "cache": "bypass"})
                    wms, wa = client_ttft(c, {**base, "question": q})
                    assert wa["usage"]["cached_tokens"] > 0 and ca["usage"]["cached_tokens"] == 0
                    cold.append((ca["timings"]["ttft_ms"], cms, ca))
                    warm.append((wa["timings"]["ttft_ms"], wms, wa))
                med = statistics.median
                row = {
                    "manual_tokens": m["tokens"],
                    "prompt_tokens": warm[0][2]["usage"]["prompt_tokens"],
                    "cached_tokens": warm[0][2]["usage"]["cached_tokens"],
                    "first_question_ttft_ms": first["timings"]["ttft_ms"],
                    "bypass_ttft_ms": med(x[0] for x in cold),
                    "second_ttft_ms": med(x[0] for x in warm),
                    "bypass_client_ttft_ms": med(x[1] for x in cold),
                    "second_client_ttft_ms": med(x[1] for x in warm),
                    "ttft_saved_ms_reported": med(x[2]["timings"]["ttft_saved_ms"] for x in warm),
                }
                row["ratio"] = row["second_ttft_ms"] / row["bypass_ttft_ms"]
                row["client_ratio"] = row["second_client_ttft_ms"] / row["bypass_client_ttft_ms"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        if srv is not None:
            srv.stop()
    print()
    print(
        "| manual tokens | prompt | cached | bypass TTFT ms | 2nd question TTFT ms | ratio "
        "| client bypass ms | client 2nd ms | client ratio | ttft_saved_ms reported |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['manual_tokens']:,} | {r['prompt_tokens']:,} | {r['cached_tokens']:,} "
            f"| {r['bypass_ttft_ms']:.0f} | {r['second_ttft_ms']:.0f} | {r['ratio']:.3f} "
            f"| {r['bypass_client_ttft_ms']:.0f} | {r['second_client_ttft_ms']:.0f} "
            f"| {r['client_ratio']:.3f} | {r['ttft_saved_ms_reported']:.0f} |"
        )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"api-ttft-{dt.date.today().isoformat()}.json"
    out.write_text(
        json.dumps(
            {"machine": platform.processor() or platform.machine(), "url": url, "rows": rows},
            indent=2,
        )
    )
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
