"""The ``docqa`` command line: model import, KV budget arithmetic, questions about a manual."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from importlib import resources
from pathlib import Path

from app.cli_kv_budget import cmd_kv_budget
from inference.engine.speculate import SPECULATE_MODES
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


def cmd_model_list(args) -> int:
    """The imported models: name, family, size, quantization, window, KV bytes per token."""
    from dataclasses import asdict

    from inference.kv_sizing import format_bytes
    from inference.model.model_import import list_models, models_dir

    rows = list_models()
    if args.json:
        print(json.dumps([{**asdict(m), "path": str(m.path)} for m in rows], indent=2))
        return 0
    if not rows:
        print(f"no models under {models_dir()} (docqa model import [--gguf FILE])")
        return 0
    head = ("NAME", "FAMILY", "PARAMS", "QUANT", "WINDOW", "KV/TOKEN", "DISK")
    table = [
        (
            m.name,
            m.family,
            f"{m.parameters / 1e6:,.0f}M",
            m.quantization,
            f"{m.window:,}",
            format_bytes(m.kv_bytes_per_token),
            format_bytes(m.disk_bytes),
        )
        for m in rows
    ]
    widths = [max(len(r[i]) for r in [head, *table]) for i in range(len(head))]
    for r in [head, *table]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return 0


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
    llm = LLM(
        args.model,
        dtype=args.dtype,
        kv_cache_gib=args.kv_cache_gib,
        kv_dtype=args.kv_dtype,
        speculate=args.speculate,
    )
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
                "completion_tokens_details": {
                    "accepted_prediction_tokens": out.accepted_prediction_tokens,
                    "rejected_prediction_tokens": out.rejected_prediction_tokens,
                },
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
        speculate=args.speculate,
        parts=None if args.parts is None else args.parts == "on",
        max_part_tokens=args.max_part_tokens,
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
    mi.add_argument(
        "--gguf",
        help="import this GGUF file instead (llama, mistral, qwen2, qwen3; F32/F16/BF16, Q8_0, "
        "Q4_0/1, Q5_0/1, Q2_K..Q6_K)",
    )
    mi.add_argument("--output", help="directory to write (default: under $DOCQA_HOME/models)")
    mi.add_argument("--force", action="store_true", help="import again even if present")
    mi.set_defaults(func=cmd_model_import)
    ml = msub.add_parser("list", help="the imported models (serve one with serve --model NAME)")
    ml.add_argument("--json", action="store_true", help="as JSON")
    ml.set_defaults(func=cmd_model_list)

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
    kb.add_argument(
        "--manual-tokens",
        type=int,
        help="a manual's length: its prompts whole and as parts (--max-part-tokens), side by side",
    )
    kb.add_argument(
        "--max-part-tokens",
        type=int,
        help="with --manual-tokens: parts of at most this many tokens (default: the window's room)",
    )
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
        sp.add_argument(
            "--speculate",
            choices=SPECULATE_MODES,
            default="off",
            help="prompt-lookup drafts (the same answers in fewer steps) or off (the default)",
        )

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
        "--speculate",
        choices=SPECULATE_MODES,
        default=None,
        help="prompt-lookup: answers that quote the manual take several tokens a step, the "
        "same tokens as without; off, the default (env DOCQA_SPECULATE)",
    )
    s.add_argument(
        "--max-part-tokens",
        type=int,
        default=None,
        help="store manuals longer than this as parts of at most this many tokens, each "
        "question answered from the part full-text search ranks first (default: only manuals "
        "longer than the model's window, in parts as large as it allows; env "
        "DOCQA_MAX_PART_TOKENS)",
    )
    s.add_argument(
        "--parts",
        choices=["on", "off"],
        default=None,
        help="off: refuse a manual longer than the window instead of storing it as parts "
        "(env DOCQA_PARTS; on by default)",
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
