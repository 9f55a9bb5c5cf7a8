"""Load test in the shape of SGLang's generated-shared-prefix workload, over HTTP.

    .venv/bin/python bench/load.py [--url http://127.0.0.1:8000] [--concurrency 1 4 16]
        [--groups 4] [--prompts-per-group 8] [--manual-tokens 1000] [--question-tokens 32]
        [--output-tokens 32] [--output-spread 0.5] [--requests-per-client 4] [--ramp-s auto]
        [--rounds 1] [--out FILE]

Each concurrency level gets ``groups`` fresh manuals (the shared prefixes), warms them, then
``groups * prompts-per-group`` questions (at least ``requests-per-client`` per client, spread
over the manuals) are asked by that many concurrent clients, each asking its next question
when its answer is complete (streamed ``/v1/ask``, greedy, ``ignore_eos``). Each answer's
length is drawn uniformly from ``output-tokens`` +- ``output-spread`` of it, as answers differ:
with one fixed length, clients whose questions were admitted in the same step finish in the
same step forever after, and their next questions arrive as one burst. Clients start spread
evenly over ``ramp-s`` seconds, as independent users arrive; ``auto`` is the mean duration of
one request at the first level, and ``--ramp-s 0`` starts them all at once. Reports request
throughput, output tokens/s, TTFT and TPOT p50/p99 (client side) and the cache hit rate, as a
table and as JSON under bench/results/, with the share of a core the clients themselves took
(all of them run in one thread on one selector, bench/sse_clients.py, so that the load
generator takes as little as it can of the CPU the server runs on) and the engine's own steps
at each level, from the server's /metrics: time in the model per step, the engine thread's time
per step outside the model (scheduling, inputs, sampling, the tokens' hand-off and waits for
the interpreter lock the event loop holds), the decode and prompt tokens a step carried, and
the time in the model of the steps that carried decode tokens only and of the mixed ones, with
prompt tokens beside them: the answers decoding in a mixed step wait for its prompt work.
``--rounds R`` runs the levels R times in turn and pools each level's answers, so that a slow
spell of the machine falls on every level alike; the ratios of each round are printed too.
Each level also reports the CPU time this machine's hypervisor gave to other guests while the
clients asked (``steal`` in /proc/stat, as a share of all CPU time; blank off Linux): on a
virtual machine a level with steal ran slower than the machine, and a ratio between levels
that stole differently is skewed. With ``--url`` it is the steal of the machine the clients run
on.
Without ``--url`` it starts its own server.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from svc_helpers import metrics  # noqa: E402

from bench.sse_clients import run_clients  # noqa: E402
from bench.ttft import manual_text  # noqa: E402
from inference.kernels.cpu import build as cpu_build  # noqa: E402

RESULTS = Path(__file__).parent / "results"
WORDS = [
    "valve",
    "pump",
    "filter",
    "pressure",
    "manual",
    "reset",
    "cycle",
    "mode",
    "option",
    "archive",
    "extract",
    "compress",
    "list",
    "error",
    "status",
    "file",
    "folder",
    "key",
    "button",
    "display",
    "power",
    "cable",
    "light",
    "sensor",
    "alarm",
    "timer",
]
LLAMA_CPP_ZEN5_DECODE_TOK_S = 94  # llama.cpp's llama-server, same model, AMD Zen 5, 2 threads


def cpu_model() -> str:
    """The CPU's model name with its family and model numbers (one model name, "AMD EPYC",
    covers several generations), and whether it has AVX-512 and AMX."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model") and key not in fields:
                    fields[key] = value.strip()
    except OSError:
        pass
    if "model name" not in fields:
        return platform.processor() or platform.machine()
    name = fields["model name"]
    if "cpu family" in fields and "model" in fields:
        flags = cpu_build.cpu_flags()
        vec = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
        if "amx_bf16" in flags:
            vec += ", AMX"
        name += f" (family {fields['cpu family']}, model {fields['model']}, {vec})"
    return name


def _machine_of(path: Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("machine")
    except (OSError, ValueError):
        return None


def llama_cpp_decode() -> tuple[float, str]:
    """llama-server's decode tokens/s one request at a time on this machine, from the newest
    bench/peers.py run here ((tokens - 1) / (end - first token), median), with where it came
    from; the Zen 5 figure when no run here is on record."""
    here = f"{cpu_model()}, {os.cpu_count()} cores"
    runs = []
    for path in RESULTS.glob("peers-*.json"):
        try:
            run = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if run.get("versions", {}).get("machine", "").startswith(here):
            # newest llama-server measurement first ("YYYY-MM-DD HH:MM", as peers.py writes it)
            runs.append((run.get("runs", {}).get("llama-server", ""), path.name, run))
    for _, name, run in sorted(runs, key=lambda r: (r[0], r[1]), reverse=True):
        rates = [
            (r["output_tokens"] - 1) / ((r["e2e_ms"] - r["ttft_ms"]) / 1000)
            for r in run.get("records", [])
            if r["system"] == "llama-server"
            and r["concurrency"] == 1
            and not r.get("error")
            and r["output_tokens"] > 1
            and r["e2e_ms"] > r["ttft_ms"]
        ]
        if rates:
            return statistics.median(rates), f"measured here by bench/peers.py, {name}"
    return float(LLAMA_CPP_ZEN5_DECODE_TOK_S), "not measured here; this figure is from a Zen 5"


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def question(rng: random.Random, tok, n_tokens: int) -> str:
    words = [rng.choice(WORDS) for _ in range(n_tokens)]
    text = "About the " + " ".join(words)
    ids = tok.encode(text)[: n_tokens - 1]
    return tok.decode(ids) + "?"


def record(
    body: dict, token_times: list[float], t0: float, end: float, final: dict, since: float
) -> dict:
    """One answer's figures, client side (ms), beside the engine's own; ``since``: the
    level's start."""
    n = final["usage"]["completion_tokens"]
    first = token_times[0] if token_times else end
    return {
        "start_s": t0 - since,
        "ttft_ms": (first - t0) * 1000,
        "tpot_ms": (end - first) * 1000 / (n - 1) if n > 1 else 0.0,
        "e2e_ms": (end - t0) * 1000,
        "completion_tokens": n,
        "prompt_tokens": final["usage"]["prompt_tokens"],
        "cached_tokens": final["usage"]["cached_tokens"],
        "engine_ttft_ms": final["timings"]["ttft_ms"],
        "engine_tpot_ms": final["timings"]["tpot_ms"],
    }


STEP_METRICS = {
    "steps": "docqa:scheduler_step_seconds_count",
    "step_s": "docqa:scheduler_step_seconds_sum",
    "decode_tokens": "docqa:decode_tokens_per_step_sum",
    "prompt_tokens": "docqa:prefill_tokens_per_step_sum",
    "iteration_s": "docqa:engine_iteration_seconds_sum",
}
# the steps by what they carried (servers that show them): decode tokens only, or prompt tokens
# beside decode tokens
_BY_KIND = "docqa:scheduler_step_seconds_by_kind"
KIND_METRICS = {
    f"{kind}_{key}": f'{_BY_KIND}_{part}{{kind="{kind}"}}'
    for kind in ("decode", "mixed")
    for key, part in (("steps", "count"), ("step_s", "sum"))
}


def cpu_ticks(stat: str = "/proc/stat") -> tuple[int, int] | None:
    """(steal, total): this machine's CPU time given to other guests, and all its CPU time,
    in clock ticks since boot, from /proc/stat (None where there is no such file)."""
    try:
        with open(stat) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal (guest time is inside user and nice)
    ticks = [int(v) for v in fields[1:9]]
    return ticks[7], sum(ticks)


def engine_counters(c: httpx.Client) -> dict[str, float] | None:
    """The engine's step counters from /metrics (None when the server does not show them)."""
    try:
        m = metrics(c)
    except httpx.HTTPError:
        return None
    if not all(name in m for name in STEP_METRICS.values()):
        return None
    out = {key: m[name] for key, name in STEP_METRICS.items()}
    if all(name in m for name in KIND_METRICS.values()):
        out |= {key: m[name] for key, name in KIND_METRICS.items()}
    return out


def run_level(url, headers, tok, args, concurrency: int, rng: random.Random, ramp_s: float) -> dict:
    with httpx.Client(base_url=url, headers=headers, timeout=900) as c:
        manual_ids = []
        for g in range(args.groups):
            text = f"Edition {uuid.uuid4().hex} part {g}\n" + manual_text(tok, args.manual_tokens)
            m = c.post("/v1/manuals", json={"title": f"load {g}", "text": text}).json()
            c.post(f"/v1/manuals/{m['id']}/warm").raise_for_status()
            manual_ids.append(m["id"])
        before = engine_counters(c)
    n_jobs = max(args.groups * args.prompts_per_group, concurrency * args.requests_per_client)
    jobs = [
        {
            "manual_id": manual_ids[i % len(manual_ids)],
            "question": question(rng, tok, args.question_tokens),
            "max_tokens": rng.randint(
                max(2, round(args.output_tokens * (1 - args.output_spread))),
                round(args.output_tokens * (1 + args.output_spread)),
            ),
            "ignore_eos": True,
            "stream": True,
        }
        for i in range(n_jobs)
    ]
    rng.shuffle(jobs)
    results: list[dict] = []
    ticks0 = cpu_ticks()
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    run_clients(
        url,
        headers,
        lambda: jobs.pop() if jobs else None,
        [i * ramp_s / concurrency for i in range(concurrency)],
        lambda *a: results.append(record(*a, since=t0)),
    )
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    ticks1 = cpu_ticks()
    steal_ticks = (
        None
        if ticks0 is None or ticks1 is None
        else [b - a for a, b in zip(ticks0, ticks1, strict=True)]
    )
    engine = None
    if before is not None:
        with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
            after = engine_counters(c)
        if after is not None:
            engine = {k: after[k] - before[k] for k in after if k in before}
    return summarize(concurrency, ramp_s, results, wall, cpu, engine, steal_ticks)


def summarize(
    concurrency: int,
    ramp_s: float,
    results: list[dict],
    wall: float,
    client_cpu: float,
    engine: dict[str, float] | None,
    steal_ticks: list[int] | None = None,
) -> dict:
    """A level's figures over its answers (several rounds' answers pooled, walls and engine
    counters added). ``engine``: the engine's step counters over the level (the steps the
    server ran while its clients asked: their count, seconds in the model, and the decode and
    prompt tokens they carried), or None where /metrics does not show them. ``steal_ticks``:
    [stolen, all] CPU ticks of the machine over the level (``cpu_ticks``), or None."""
    ttft = [r["ttft_ms"] for r in results]
    tpot = [r["tpot_ms"] for r in results]
    out_tokens = sum(r["completion_tokens"] for r in results)
    steps = engine["steps"] if engine else 0

    def ms_per_step(kind: str) -> float | None:
        n = (engine or {}).get(f"{kind}_steps")
        return engine[f"{kind}_step_s"] * 1000 / n if n else None

    return {
        "concurrency": concurrency,
        "ramp_s": ramp_s,
        "requests": len(results),
        "wall_s": wall,
        "request_throughput": len(results) / wall,
        "output_tokens_per_s": out_tokens / wall,
        "ttft_p50_ms": statistics.median(ttft),
        "ttft_p99_ms": pct(ttft, 0.99),
        "tpot_p50_ms": statistics.median(tpot),
        "tpot_p99_ms": pct(tpot, 0.99),
        "cache_hit_rate": sum(r["cached_tokens"] for r in results)
        / sum(r["prompt_tokens"] for r in results),
        "client_cpu_s": client_cpu,
        "client_cpu_share": client_cpu / wall,  # of one core, taken by this load generator
        "cpu_steal_ticks": steal_ticks,
        # of all this machine's CPU time over the level, given by its hypervisor to other guests
        "cpu_steal_share": steal_ticks[0] / steal_ticks[1]
        if steal_ticks and steal_ticks[1]
        else None,
        "engine": engine,
        "step_ms": engine["step_s"] * 1000 / steps if steps else None,
        # of the level's wall time, the share the engine spent in model steps (the rest: its
        # own work between steps, or idle waiting for the front end)
        "model_share": engine["step_s"] / wall if steps else None,
        # the engine thread's time per step outside the model (scheduling, inputs, sampling,
        # the tokens' hand-off, waits for the interpreter lock)
        "outside_model_ms": (engine["iteration_s"] - engine["step_s"]) * 1000 / steps
        if steps
        else None,
        "decode_tokens_per_step": engine["decode_tokens"] / steps if steps else None,
        "prompt_tokens_per_step": engine["prompt_tokens"] / steps if steps else None,
        # time in the model per step of decode tokens only, and per step that also carried
        # prompt tokens (what a question's prefill costs the answers decoding beside it)
        "decode_step_ms": ms_per_step("decode"),
        "mixed_step_ms": ms_per_step("mixed"),
        "per_request": results,
    }


def pooled(rounds: list[list[dict]]) -> list[dict]:
    """Each level's answers from every round together."""
    out = []
    for same in zip(*rounds, strict=True):
        engines = [lvl["engine"] for lvl in same]
        out.append(
            summarize(
                same[0]["concurrency"],
                same[-1]["ramp_s"],
                [r for lvl in same for r in lvl["per_request"]],
                sum(lvl["wall_s"] for lvl in same),
                sum(lvl["client_cpu_s"] for lvl in same),
                None
                if None in engines
                else {k: sum(e[k] for e in engines) for k in set.intersection(*map(set, engines))},
                None
                if any(lvl.get("cpu_steal_ticks") is None for lvl in same)
                else [sum(t) for t in zip(*(lvl["cpu_steal_ticks"] for lvl in same), strict=True)],
            )
        )
    return out


def goals_of(levels: list[dict]) -> dict:
    base, top = levels[0], levels[-1]
    return {
        "throughput_x": top["output_tokens_per_s"] / base["output_tokens_per_s"],
        "ttft_p50_x": top["ttft_p50_ms"] / base["ttft_p50_ms"],
        "tpot_p99_over_1client_p50": top["tpot_p99_ms"] / base["tpot_p50_ms"],
    }


def _revision() -> str:
    """This tree's commit, ``+changes`` when tracked files differ from it ("" outside git)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT).returncode != 0
    except OSError:
        return ""
    return head + ("+changes" if head and dirty else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server (default: start one on a temporary SQLite)")
    ap.add_argument("--api-key")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--prompts-per-group", type=int, default=8)
    ap.add_argument("--manual-tokens", type=int, default=1000)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument(
        "--output-spread",
        type=float,
        default=0.5,
        help="answer lengths are uniform in output-tokens * (1 +- spread); 0: all equal",
    )
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the concurrency levels this many times in turn and pool each level's "
        "answers (the machine's speed drifts; levels run side by side compare fairly)",
    )
    ap.add_argument(
        "--ramp-s",
        default="auto",
        help="seconds over which the clients start (auto: one request's mean duration at the "
        "first level; 0: all at once)",
    )
    ap.add_argument("--max-batched-tokens", type=int, default=None, help="for a started server")
    ap.add_argument(
        "--server-args",
        default="",
        help="more options for a started server, as one string "
        '(e.g. "--prefill-tokens-with-decodes 16")',
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--out", type=Path, help="the JSON results file (default: bench/results/load-DATE.json)"
    )
    args = ap.parse_args()

    from inference.llm import resolve_model
    from inference.model.tokenizer import TextTokenizer

    tok = TextTokenizer(resolve_model(None))
    srv = None
    if args.url:
        url = args.url
    else:
        from svc_helpers import Server

        tmp = Path(tempfile.mkdtemp(prefix="docqa-load-"))
        extra = ("--kv-cache-gib", "1")
        if args.max_batched_tokens:
            extra += ("--max-batched-tokens", str(args.max_batched_tokens))
        extra += tuple(shlex.split(args.server_args))
        srv = Server(tmp, f"sqlite:///{tmp / 'docqa.db'}", args=extra, name="load").start()
        url = srv.url
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed)
    rounds: list[list[dict]] = []
    try:
        ramp = 0.0 if args.ramp_s == "auto" else float(args.ramp_s)
        for _ in range(args.rounds):
            rounds.append([])
            for n in args.concurrency:
                lvl = run_level(url, headers, tok, args, n, rng, ramp if n > 1 else 0.0)
                rounds[-1].append(lvl)
                if args.ramp_s == "auto" and len(rounds) == 1 and len(rounds[0]) == 1:
                    ramp = statistics.mean(r["e2e_ms"] for r in lvl["per_request"]) / 1000
                print(
                    json.dumps({k: v for k, v in lvl.items() if k != "per_request"}),
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        if srv is not None:
            srv.stop()
    levels = pooled(rounds)
    base = levels[0]

    def steal_of(lvl: dict) -> str:
        share = lvl.get("cpu_steal_share")
        return "" if share is None else f"{share:.1%}"

    print(
        f"\nworkload: {args.groups} manuals x {args.prompts_per_group} questions, manual "
        f"~{args.manual_tokens} tokens, question ~{args.question_tokens}, output "
        f"{args.output_tokens} +- {args.output_spread:.0%} (greedy, ignore_eos), manuals warmed "
        "first; clients start over "
        f"{levels[-1]['ramp_s']:.2f} s\n"
    )
    print(
        "| clients | req/s | output tok/s | x 1 client | TTFT p50 ms | TTFT p99 ms "
        "| TPOT p50 ms | TPOT p99 ms | cache hit rate | client CPU | CPU steal |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for lvl in levels:
        print(
            f"| {lvl['concurrency']} | {lvl['request_throughput']:.2f} "
            f"| {lvl['output_tokens_per_s']:.1f} "
            f"| {lvl['output_tokens_per_s'] / base['output_tokens_per_s']:.2f} "
            f"| {lvl['ttft_p50_ms']:.0f} | {lvl['ttft_p99_ms']:.0f} "
            f"| {lvl['tpot_p50_ms']:.1f} | {lvl['tpot_p99_ms']:.1f} "
            f"| {lvl['cache_hit_rate']:.3f} | {lvl['client_cpu_share']:.1%} "
            f"| {steal_of(lvl)} |"
        )
    if all(lvl["step_ms"] is not None for lvl in levels):
        print(
            "\nengine steps while the clients asked (from /metrics): time in the model per step, "
            "the engine thread's time per step outside it, the tokens a step carried, and the "
            "time in the model of the steps with decode tokens only and of those with prompt "
            "tokens beside them\n"
        )
        print(
            "| clients | steps | ms per step | ms outside the model | decode tokens per step "
            "| prompt tokens per step | ms per decode-only step | ms per mixed step "
            "| wall time in model steps |"
        )
        print("|---|---|---|---|---|---|---|---|---|")

        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v:.1f}"

        for lvl in levels:
            print(
                f"| {lvl['concurrency']} | {lvl['engine']['steps']:.0f} | {lvl['step_ms']:.1f} "
                f"| {lvl['outside_model_ms']:.2f} "
                f"| {lvl['decode_tokens_per_step']:.1f} | {lvl['prompt_tokens_per_step']:.1f} "
                f"| {ms(lvl['decode_step_ms'])} | {ms(lvl['mixed_step_ms'])} "
                f"| {lvl['model_share']:.1%} |"
            )
    decode = 1000 / base["tpot_p50_ms"] if base["tpot_p50_ms"] else float("nan")
    llama, llama_source = llama_cpp_decode()
    print(
        f"\n1-client decode: {decode:.1f} tokens/s; llama.cpp's llama-server: {llama:.1f} "
        f"tokens/s ({llama_source})"
    )
    top = levels[-1]
    goals = goals_of(levels)
    by_round = [goals_of(r) for r in rounds]

    def ratios(g: dict) -> str:
        return (
            f"output tok/s {g['throughput_x']:.2f}x (goal >= 4), TTFT p50 {g['ttft_p50_x']:.2f}x "
            f"(goal < 3), TPOT p99 / 1-client TPOT p50 {g['tpot_p99_over_1client_p50']:.2f}x "
            "(goal < 3)"
        )

    print(f"at {top['concurrency']} clients: {ratios(goals)}")
    if len(rounds) > 1:
        for i, (g, r) in enumerate(zip(by_round, rounds, strict=True), 1):
            steals = [steal_of(lvl) for lvl in r]
            stolen = f"; CPU steal by level {', '.join(steals)}" if all(steals) else ""
            print(f"  round {i}: {ratios(g)}{stolen}")
    RESULTS.mkdir(exist_ok=True)
    machine = f"{cpu_model()}, {os.cpu_count()} cores"
    out = args.out or RESULTS / f"load-{dt.date.today().isoformat()}.json"
    n = 2
    while not args.out and out.exists() and _machine_of(out) != machine:  # kept: another machine
        out = RESULTS / f"load-{dt.date.today().isoformat()}-{n}.json"
        n += 1
    out.write_text(
        json.dumps(
            {
                "machine": machine,
                "revision": _revision(),  # the tree a started server ran
                "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "levels": levels,  # every round's answers pooled per level
                "goals": goals,
                "goals_by_round": by_round,
                "rounds": [
                    [{k: v for k, v in lvl.items() if k != "per_request"} for lvl in r]
                    for r in rounds
                ],
                "decode_tokens_per_s_1_client": decode,
                "llama_cpp_decode_tokens_per_s": llama,
                "llama_cpp_decode_source": llama_source,
            },
            indent=2,
        )
    )
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
