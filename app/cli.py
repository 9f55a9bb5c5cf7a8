"""The ``docqa`` command line: model import, KV budget arithmetic, questions about a manual."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from importlib import resources
from pathlib import Path

from inference.errors import DocqaError

KV_DTYPE_HELP = (
    "KV cache dtype: the compute dtype by default; int8 or fp8 hold twice the tokens in the "
    "same memory"
)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("urllib3", "filelock", "alembic.runtime.plugins"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def cmd_model_import(args) -> int:
    from inference.model.model_import import default_model_dir, import_default_model, import_gguf

    if args.gguf:
        src = Path(args.gguf)
        out = Path(args.output) if args.output else (Path(default_model_dir()).parent / src.stem)
        path = import_gguf(src, out, force=args.force)
    else:
        path = import_default_model(force=args.force)
    print(path)
    return 0


def _percentiles(raw: str | None, flag: str) -> tuple[int, int, int] | None:
    if raw is None:
        return None
    try:
        values = tuple(int(v) for v in raw.split(","))
    except ValueError:
        values = ()
    if len(values) != 3:
        raise DocqaError(f"{flag} takes three token counts P50,P90,P99 (e.g. 800,2400,6000)")
    return values


def _kv_elem_bytes(name: str) -> tuple[str, int]:
    import torch

    from inference import kv_quant
    from inference.model.config import dtype_name, parse_dtype

    kv8 = kv_quant.parse_kv_dtype(name)
    dtype = kv8 if kv8 is not None else parse_dtype(name)
    return dtype_name(dtype), torch.empty((), dtype=dtype).element_size()


def cmd_kv_budget(args) -> int:
    from inference.kv_planner import ModelShape, Workload, plan, replay
    from inference.kv_sizing import KNOWN_CONFIGS, format_bytes
    from inference.model.config import read_config_json

    if args.config:
        p, d = read_config_json(args.config)
        label = str(p)
    else:
        name = (args.name or "smollm2-135m").lower()
        if name not in KNOWN_CONFIGS:
            raise DocqaError(
                f"unknown config name {name!r}; known: {', '.join(sorted(KNOWN_CONFIGS))}"
            )
        d = KNOWN_CONFIGS[name]
        label = name
    try:
        shape = ModelShape.from_config(d)
    except KeyError as e:
        raise DocqaError(f"{label} lacks the field {e.args[0]!r}") from None
    compute = args.dtype or d.get("torch_dtype") or "bfloat16"
    kv_name, elem = _kv_elem_bytes(args.kv_dtype or compute)
    _, dtype_bytes = _kv_elem_bytes(compute)
    layers, kv_heads, head_dim = shape.num_layers, shape.num_kv_heads, shape.head_dim
    context = args.context or shape.max_position_embeddings
    bpt = shape.kv_bytes_per_token(elem)
    print(f"config: {label}")
    print(
        f"layers {layers}, KV heads {kv_heads}, head dim {head_dim}, KV dtype "
        f"{kv_name} ({elem} byte{'s' if elem > 1 else ''})"
    )
    print(
        f"KV cache: {bpt / 1024:.2f} KiB per token "
        f"(2 x {layers} x {kv_heads} x {head_dim} x {elem} = {bpt:,} bytes)"
    )
    print(f"per sequence of {context:,} tokens: {format_bytes(bpt * context)}")

    if args.workload and (args.prompt_tokens or args.output_tokens):
        raise DocqaError("give --workload or --prompt-tokens/--output-tokens, not both")
    workload = None
    if args.workload:
        try:
            workload = Workload.from_jsonl(args.workload)
        except OSError as e:
            raise DocqaError(f"cannot read the workload {args.workload}: {e.strerror}") from None
    elif args.prompt_tokens or args.output_tokens:
        prompt = _percentiles(args.prompt_tokens, "--prompt-tokens")
        output = _percentiles(args.output_tokens, "--output-tokens")
        if prompt is None or output is None:
            raise DocqaError("give both --prompt-tokens and --output-tokens (P50,P90,P99 each)")
        workload = Workload.from_percentiles(prompt, output)
    if args.memory_gib and args.device_memory_gib:
        raise DocqaError("give --memory-gib (the KV pool) or --device-memory-gib, not both")
    if not (args.memory_gib or args.device_memory_gib):
        if workload is not None:
            raise DocqaError("planning a workload needs --memory-gib or --device-memory-gib")
        return 0
    kw = dict(
        block_size=args.block_size,
        dtype_bytes=dtype_bytes,
        max_num_batched_tokens=args.max_batched_tokens,
        max_num_seqs=args.max_seqs,
        workload=workload,
    )
    if args.memory_gib:
        pl = plan(shape, elem, kv_bytes=int(args.memory_gib * 2**30), **kw)
    else:
        reserve = int(args.reserve_gib * 2**30) if args.reserve_gib is not None else None
        pl = plan(
            shape,
            elem,
            device_bytes=int(args.device_memory_gib * 2**30),
            utilization=args.gpu_memory_utilization,
            reserve_bytes=reserve,
            **kw,
        )
        print(
            f"device memory {format_bytes(pl.device_bytes)} x {args.gpu_memory_utilization:g} = "
            f"{format_bytes(pl.usable_bytes)}: weights {format_bytes(pl.weights_bytes)} "
            f"({shape.num_params() / 1e9:.2f} B parameters x {dtype_bytes} bytes), runtime reserve "
            f"{format_bytes(pl.reserve_bytes)}, KV {format_bytes(pl.kv_bytes)}"
        )
    print(f"KV cache size: {pl.num_tokens:,} tokens in {format_bytes(pl.kv_bytes)}")
    print(f"Maximum concurrency for {context:,} tokens per request: {pl.num_tokens / context:.2f}x")
    if workload is None:
        return 0
    n = len(workload.requests)
    mean_p = sum(p for p, _ in workload.requests) / n
    mean_o = sum(o for _, o in workload.requests) / n
    print(f"workload: {n:,} requests, mean prompt {mean_p:,.0f} tokens, mean answer {mean_o:,.0f}")
    for pct, (ctx, seqs) in pl.fit_at.items():
        print(f"p{pct} context {ctx:,} tokens: {seqs:,} sequences fit at once at full length")
    cap = f" (capped by --max-seqs {args.max_seqs})" if args.max_seqs else ""
    print(
        f"concurrency before the first preemption, this mix in continuous batching: "
        f"{pl.concurrency:.1f}{cap}"
    )
    budget = pl.budget_concurrency
    if budget < pl.concurrency:
        print(
            f"the step budget (--max-batched-tokens {args.max_batched_tokens}) keeps only "
            f"{budget:.1f} of this mix running: it binds before the KV pool"
        )
    elif budget < 1.5 * pl.concurrency:
        print(
            f"the step budget (--max-batched-tokens {args.max_batched_tokens}) keeps at most "
            f"{budget:.1f} running, close to the pool's bound: prompts queue for it, and the "
            "pool may run out with fewer requests running"
        )
    if args.replay:
        runs = [
            replay(
                workload,
                pl.num_blocks,
                block_size=args.block_size,
                max_num_batched_tokens=args.max_batched_tokens,
                max_num_seqs=args.max_seqs or 1_000_000,
                seed=seed,
            )
            for seed in range(REPLAYS)
        ]
        seen = [r.concurrency for r in runs]
        mean = sum(seen) / len(seen)
        if all(r.preempted for r in runs):
            print(
                f"replayed through the scheduler ({REPLAYS} arrival orders): {mean:.1f} running "
                f"at the first preemption ({min(seen)}..{max(seen)}); estimate / replay = "
                f"{pl.concurrency / mean:.3f}"
            )
        else:
            print(
                f"replayed through the scheduler: no preemption in "
                f"{max(r.steps for r in runs):,} steps, at most {max(seen):,} running: the step "
                f"budget (--max-batched-tokens {args.max_batched_tokens}) binds before the KV "
                "pool"
            )
    return 0


REPLAYS = 5  # arrival orders the replay averages (its first preemption varies with the order)


def cmd_workload_export(args) -> int:
    """Every answered turn of the stored conversations as {"prompt_tokens", "output_tokens"}
    JSON lines, for ``docqa kv-budget --workload``."""
    from app.db.workload import export_workload, parse_since
    from app.settings import Settings

    since = parse_since(args.since)  # before the output file is opened: nothing written
    settings = Settings.from_env(database_url=args.database_url)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as out:
            n = export_workload(settings.database_url, out, since)
    else:
        n = export_workload(settings.database_url, sys.stdout, since)
    print(f"{n} turns", file=sys.stderr)
    return 0


def _sample_manual() -> Path:
    return Path(str(resources.files("app").joinpath("samples/tarx-manual.md")))


def _print_answer(idx: int, question: str, result: dict, computed: int, as_json: bool) -> None:
    if as_json:
        print(json.dumps({k: result[k] for k in ("answer", "usage", "timings")}), flush=True)
        return
    u, t = result["usage"], result["timings"]
    print(f"Q{idx}: {question}")
    print(f"A{idx}: {result['answer']}")
    print(
        f"   usage: prompt_tokens={u['prompt_tokens']} cached_tokens={u['cached_tokens']} "
        f"completion_tokens={u['completion_tokens']} (computed {computed} prompt tokens)"
    )
    print("   timings: " + " ".join(f"{k}={v:.1f}" for k, v in t.items()))
    print(flush=True)


def cmd_ask(args) -> int:
    from app.manual_text import read_manual_file
    from inference.llm import LLM
    from prompts import PromptBuilder, PromptLayoutTooLong

    manual_path = Path(args.manual) if args.manual else _sample_manual()
    questions = args.questions
    text = read_manual_file(manual_path)
    if args.max_tokens < 1 or args.max_tokens > args.max_tokens_cap:
        raise DocqaError(
            f"--max-tokens must be between 1 and {args.max_tokens_cap}, got {args.max_tokens}"
        )
    llm = LLM(args.model, dtype=args.dtype, kv_cache_gib=args.kv_cache_gib, kv_dtype=args.kv_dtype)
    engine = llm.engine
    builder = PromptBuilder(llm.tokenizer)
    from inference.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    prefix = builder.prefix_ids(text)
    for i, q in enumerate(questions, 1):
        if not q.strip():
            raise DocqaError(f"question {i} is empty")
        try:
            built = builder.build(
                text,
                q,
                max_model_len=engine.max_model_len,
                max_tokens=args.max_tokens,
                manual_ids=prefix,
            )
        except PromptLayoutTooLong as e:
            raise DocqaError(f"manual {manual_path} is too long: {e}") from None
        for w in built.warnings:
            logging.getLogger("docqa").warning(w)
        before = engine.prompt_tokens_computed
        out = llm.generate(
            prompt_token_ids=[built.token_ids], sampling_params=params, use_cache=not args.no_cache
        )[0]
        computed = engine.prompt_tokens_computed - before
        result = {
            "answer": out.text.strip(),
            "usage": {
                "prompt_tokens": len(built.token_ids),
                "cached_tokens": out.num_cached_tokens,
                "completion_tokens": len(out.token_ids),
                "cached_tokens_by_tier": {"device": out.num_cached_tokens, "redis": 0},
            },
            "timings": out.metrics.to_dict(),
        }
        logging.getLogger("docqa").info(
            "question %d: %d prompt tokens, %d cached, %d computed",
            i,
            len(built.token_ids),
            out.num_cached_tokens,
            computed,
        )
        _print_answer(i, q, result, computed, args.json)
    return 0


def cmd_serve(args) -> int:
    """Migrate the database, then serve the REST API (the model loads in the background;
    /ready answers 503 until it has)."""
    import uvicorn

    from app.api.app import create_app
    from app.db.migrate import upgrade
    from app.settings import Settings
    from app.shutdown import DrainingServer

    settings = Settings.from_env(
        model=args.model,
        benchmark_weights=args.benchmark_weights,
        batch_invariant=args.batch_invariant,
        cuda_graphs=args.cuda_graphs,
        dtype=args.dtype,
        kv_cache_gib=args.kv_cache_gib,
        kv_dtype=args.kv_dtype,
        max_tokens_cap=args.max_tokens_cap,
        num_threads=args.threads,
        pin_budget=args.pin_budget,
        max_num_batched_tokens=args.max_batched_tokens,
        prefill_tokens_with_decodes=args.prefill_tokens_with_decodes,
    )
    upgrade(settings.database_url)  # before the event loop starts (Alembic runs its own)
    app = create_app(settings)
    logging.getLogger("docqa").info(
        "serving on http://%s:%d (auth %s)",
        args.host,
        args.port,
        "on" if settings.auth_enabled else "off",
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning" if not args.verbose else "info",
        timeout_graceful_shutdown=5,
    )
    DrainingServer(config, app.state, settings.shutdown_grace_s).run()
    return 0


def cmd_db_upgrade(args) -> int:
    from app.db.migrate import head_revision, upgrade
    from app.settings import Settings

    settings = Settings.from_env()
    upgrade(settings.database_url, args.revision)
    print(f"database at revision {head_revision() if args.revision == 'head' else args.revision}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="docqa", description="Prefix-caching document Q&A.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("model", help="manage models")
    msub = m.add_subparsers(dest="model_command", required=True)
    mi = msub.add_parser("import", help="import the default model (or --gguf FILE)")
    mi.add_argument("--gguf", help="import this Llama-family GGUF file instead")
    mi.add_argument("--output", help="directory to write (default: under $DOCQA_HOME/models)")
    mi.add_argument("--force", action="store_true", help="import again even if present")
    mi.set_defaults(func=cmd_model_import)

    kb = sub.add_parser(
        "kv-budget", help="KV cache arithmetic and capacity planning for a model config"
    )
    kb.add_argument("name", nargs="?", help="a known config name (default smollm2-135m)")
    kb.add_argument("--config", help="path to a config.json (or its directory)")
    kb.add_argument("--memory-gib", type=float, help="KV memory budget in GiB")
    kb.add_argument(
        "--device-memory-gib",
        type=float,
        help="device memory in GiB: split into weights, a runtime reserve and the KV pool",
    )
    kb.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of the device memory docqa may use (default 0.9)",
    )
    kb.add_argument(
        "--reserve-gib",
        type=float,
        help="runtime reserve in GiB (default: one step's activations and logits, doubled)",
    )
    kb.add_argument("--context", type=int, help="tokens per sequence (default: the model's)")
    kb.add_argument("--kv-dtype", help="KV dtype (default: the config's torch_dtype); int8, fp8")
    kb.add_argument("--dtype", help="weights' dtype (default: the config's torch_dtype)")
    kb.add_argument("--block-size", type=int, default=16, help="tokens per KV block (16)")
    kb.add_argument(
        "--workload",
        help="JSON lines of {prompt_tokens, output_tokens} (docqa workload export)",
    )
    kb.add_argument("--prompt-tokens", help="prompt length percentiles P50,P90,P99")
    kb.add_argument("--output-tokens", help="answer length percentiles P50,P90,P99")
    kb.add_argument(
        "--max-batched-tokens", type=int, default=512, help="the engine's step budget (512)"
    )
    kb.add_argument("--max-seqs", type=int, help="cap on requests running at once")
    kb.add_argument(
        "--replay",
        action="store_true",
        help="also replay the workload through the engine's scheduler and block pool",
    )
    kb.set_defaults(func=cmd_kv_budget)

    wl = sub.add_parser("workload", help="the service's stored workload")
    wl_sub = wl.add_subparsers(dest="workload_command", required=True)
    we = wl_sub.add_parser(
        "export", help="stored turns' prompt and answer lengths as JSON lines (kv-budget)"
    )
    we.add_argument("--output", "-o", help="file to write (default: standard output)")
    we.add_argument("--database-url", help="default: DOCQA_DATABASE_URL or the SQLite file")
    we.add_argument("--since", help="only turns created at or after this ISO date/time")
    we.set_defaults(func=cmd_workload_export)

    def engine_args(sp):
        sp.add_argument("--model", default=None, help="model directory or name (default model)")
        sp.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
        sp.add_argument(
            "--kv-cache-gib",
            type=float,
            default=None,
            help="KV pool size on CPU (default: a quarter of free memory, <= 4)",
        )
        sp.add_argument("--kv-dtype", default=None, help=KV_DTYPE_HELP)
        sp.add_argument("--max-tokens", type=int, default=128, help="answer length cap")
        sp.add_argument(
            "--max-tokens-cap", type=int, default=1024, help="upper bound of --max-tokens"
        )
        sp.add_argument("--json", action="store_true", help="one JSON object per answer")
        sp.add_argument("--no-cache", action="store_true", help="compute every prompt cold")

    a = sub.add_parser("ask", help="answer questions about a manual, in order")
    a.add_argument("--manual", required=True, help="a UTF-8 text or markdown file")
    a.add_argument("questions", nargs="+", metavar="QUESTION")
    engine_args(a)
    a.set_defaults(func=cmd_ask)

    s = sub.add_parser("serve", help="run the REST API (migrates the database first)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--model",
        default=None,
        help="model directory or name (default model); random:NAME for a benchmark model",
    )
    s.add_argument(
        "--benchmark-weights",
        action="store_true",
        default=None,
        help="serve a random:NAME model (random weights of a known shape: answers are noise; "
        "env DOCQA_BENCHMARK_WEIGHTS=1)",
    )
    s.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    s.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="KV pool size on CPU (default: a quarter of free memory, <= 4)",
    )
    s.add_argument("--kv-dtype", default=None, help=KV_DTYPE_HELP + " (env DOCQA_KV_DTYPE)")
    s.add_argument(
        "--cuda-graphs",
        action="store_true",
        default=None,
        help="CUDA: replay decode steps from graphs captured at start (env DOCQA_CUDA_GRAPHS=1)",
    )
    s.add_argument(
        "--batch-invariant",
        action="store_true",
        default=None,
        help="CUDA: products and norms whose rows never depend on the batch, so a cache hit "
        "never changes an answer there either (env DOCQA_BATCH_INVARIANT=1; the CPU always is)",
    )
    s.add_argument(
        "--max-tokens-cap", type=int, default=1024, help="upper bound of a request's max_tokens"
    )
    s.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    s.add_argument(
        "--pin-budget",
        type=float,
        default=0.25,
        help="share of the KV pool that pinned manuals may hold (default 0.25)",
    )
    s.add_argument(
        "--max-batched-tokens",
        type=int,
        default=512,
        help="tokens per engine step, decodes and prompt chunks together (default 512)",
    )
    s.add_argument(
        "--prefill-tokens-with-decodes",
        type=int,
        default=0,
        help="prompt tokens per engine step while answers are decoding (default 0: up to "
        "--max-batched-tokens)",
    )
    s.set_defaults(func=cmd_serve)

    d = sub.add_parser("db", help="database migrations")
    dsub = d.add_subparsers(dest="db_command", required=True)
    du = dsub.add_parser("upgrade", help="apply migrations to DOCQA_DATABASE_URL")
    du.add_argument("revision", nargs="?", default="head")
    du.set_defaults(func=cmd_db_upgrade)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return args.func(args)
    except DocqaError as e:
        print(f"docqa: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"docqa: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("docqa: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
