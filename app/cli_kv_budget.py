"""``docqa kv-budget``: the KV cache's capacity for a model, a dtype and a memory size, and
what a workload (percentiles, or an exported one replayed through the scheduler) would run."""

from __future__ import annotations

from inference.errors import DocqaError


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
    if args.manual_tokens is not None:
        _manual_prompts(args.manual_tokens, args.max_part_tokens, context, bpt)
    elif args.max_part_tokens is not None:
        raise DocqaError("--max-part-tokens goes with --manual-tokens (the manual's length)")

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


def _manual_prompts(manual: int, max_part: int | None, context: int, bpt: int) -> None:
    """A manual of ``manual`` tokens as whole-manual prompts and as parts: the prompt a question
    brings, the KV each answer token reads, and what caching every prefix takes."""
    from app.parts import part_overlap
    from app.settings import MIN_QUESTION_ROOM
    from inference.kv_sizing import format_bytes

    if manual < 1:
        raise DocqaError(f"--manual-tokens must be positive, got {manual}")
    if max_part is not None and max_part < 1:
        raise DocqaError(f"--max-part-tokens must be positive, got {max_part}")
    room = context - MIN_QUESTION_ROOM - INSTRUCTION_TOKENS  # a manual's share of a prompt
    asked = QUESTION_TOKENS  # the question and its answer, about
    print(f"a manual of {manual:,} tokens, in prompts of at most {context:,} tokens:")
    if manual <= room:
        whole = INSTRUCTION_TOKENS + manual + asked
        print(
            f"  whole: {whole:,} tokens a question; each answer token reads "
            f"{format_bytes(whole * bpt)} of KV; the cached prefix {format_bytes(manual * bpt)}"
        )
    else:
        print(f"  whole: does not fit (a prompt gives a manual at most {room:,} tokens)")
    part = min(max_part or room, room)
    if manual <= part:
        print(f"  parts: one (the manual fits {part:,} tokens); --max-part-tokens splits it")
        return
    overlap = part_overlap(part)
    count = -(-(manual - overlap) // (part - overlap))
    held = manual + (count - 1) * overlap + count * INSTRUCTION_TOKENS
    per_q = INSTRUCTION_TOKENS + part + asked
    print(
        f"  parts of at most {part:,} tokens (overlap {overlap}): about {count} parts; "
        f"{per_q:,} tokens a question; each answer token reads {format_bytes(per_q * bpt)} of "
        f"KV; every part's prefix cached {format_bytes(held * bpt)}"
    )
    if manual <= room:
        ratio = (INSTRUCTION_TOKENS + manual + asked) / per_q
        print(f"  a question on parts reads {ratio:.1f}x less KV per answer token than whole")


INSTRUCTION_TOKENS = 48  # system instructions and a part's header line, about
QUESTION_TOKENS = 256  # a question and its answer, about


REPLAYS = 5  # arrival orders the replay averages (its first preemption varies with the order)
