"""Every Triton kernel launch the runners make, compiled ahead of time for GPUs this machine
does not have.

``launches()`` builds the launches the wrappers make (their own ``*_launch`` functions, over
meta tensors: shapes, strides and dtypes without memory) for the GPU models' shapes in
``MODELS``, every compute dtype, KV dtype and block size; ``compile_launch`` specialises each
as Triton's runtime would on a GPU (the same binder, so ``do_not_specialize`` and the 16-byte
alignment of pointers apply) and compiles it for a target (``TARGETS``: sm_90 for H100/H200,
sm_80 for A100, sm_100 for B200 where the installed Triton knows it). The result holds the
PTX, the cubin's shared memory and registers, and its spills (``cuobjdump``).

    python -m inference.kernels.triton.aot [--targets sm_90,sm_80] [--json FILE] [--jobs N]

compiles them all and reports, one line per failure or limit crossed; tests/test_triton_compile.py
runs it. The kernels must be defined without ``TRITON_INTERPRET`` (this module refuses to run
under it). Compiled kernels are kept in a cache of their own (``cache_dir``: under
``$DOCQA_HOME/triton-aot``, one folder per version of the kernels' sources and of Triton, the
older ones removed), so a second run only reads them; ``TRITON_CACHE_DIR`` overrides it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from inference.kernels.triton.common import Launch

# the GPU models whose shapes the launches take (inference.kv_sizing.KNOWN_CONFIGS): head dims
# 64 and 128, GQA groups 3 and 4
MODELS = ("smollm2-135m", "llama-3-8b")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
KV_DTYPES = (None, "int8", "fp8")  # None: the compute dtype
BLOCK_SIZES = (16, 32, 64)
# shared memory a block may take, bytes (the CUDA programming guide's per-block maximum)
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024, 100: 227 * 1024}
# kernels whose bits the cache promise depends on across their own code paths: compiled with
# fp fusion off (common.py)
NO_FP_FUSION = ("_decode_partition_kernel", "_decode_reduce_kernel", "_prefill_kernel")


def cache_dir() -> Path:
    """Where the compiled launches are kept: a folder named by a hash of Triton's version and
    the kernels' sources, under ``$DOCQA_HOME/triton-aot``; made here, its older siblings
    removed (a change of the kernels compiles them anew, and leaves no stale copies)."""
    import triton

    from inference.model.model_import import docqa_home

    h = hashlib.sha256(triton.__version__.encode())
    for src in sorted(Path(__file__).parent.glob("*.py")):  # the kernels (not this tool)
        if src.name == "aot.py":
            continue
        h.update(src.read_bytes())
    root = docqa_home() / "triton-aot"
    out = root / h.hexdigest()[:16]
    out.mkdir(parents=True, exist_ok=True)
    for old in root.iterdir():
        if old != out and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    return out


def targets(names: list[str] | None = None) -> dict[str, object]:
    """The GPU targets by name (``sm_90``, ...), those the installed Triton compiles for."""
    from triton.backends.compiler import GPUTarget

    known = {"sm_90": 90, "sm_80": 80, "sm_100": 100}
    out = {}
    for name in names or list(known):
        if name not in known:
            raise ValueError(f"unknown target {name!r}; known: {', '.join(known)}")
        if known[name] >= 100 and not _knows_blackwell():
            continue
        out[name] = GPUTarget("cuda", known[name], 32)
    return out


def _knows_blackwell() -> bool:
    from triton import knobs

    try:
        return bool(knobs.nvidia.ptxas_blackwell.path)
    except Exception:  # noqa: BLE001 - an older Triton without the knob
        return False


@dataclass(frozen=True)
class LaunchSpec:
    """A launch and where it comes from (for reports)."""

    name: str  # kernel name
    where: str  # model, dtype, KV dtype, block size, entry point
    launch: Launch


def _meta(*shape, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def _kv_caches(num_blocks, bs, kvh, d, dtype, kv):
    from inference import kv_quant

    kv_dtype = kv_quant.KV8_NAMES[kv] if kv else dtype
    k, v = (
        _meta(num_blocks, bs, kvh, d, dtype=kv_dtype),
        _meta(num_blocks, bs, kvh, d, dtype=kv_dtype),
    )
    if kv:
        for c in (k, v):
            kv_quant.attach(
                c, _meta(kvh, d, dtype=torch.float32), _meta(kvh, d, dtype=torch.float32)
            )
    return k, v


def launches() -> list[LaunchSpec]:
    """The runners' launches (module docstring), one per distinct compiled variant."""
    from inference.kernels.triton import fused, invariant
    from inference.kv_sizing import KNOWN_CONFIGS

    specs: list[LaunchSpec] = []
    for model in MODELS:
        c = KNOWN_CONFIGS[model]
        heads, kvh, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
        for dtype in DTYPES:
            dt = str(dtype).removeprefix("torch.")
            n = 40  # tokens of a step; the row counts are not specialised on
            for bias in (False, True):  # Qwen2's qkv bias
                qkv_out = (heads + 2 * kvh) * d
                b = _meta(qkv_out, dtype=dtype) if bias else None
                _, la = invariant.linear_launch(
                    _meta(n, hidden, dtype=dtype), _meta(qkv_out, hidden, dtype=dtype), b
                )
                specs.append(LaunchSpec("linear", f"{model} {dt} bias={bias}", la))
            _, la = invariant.linear_launch(
                _meta(n, hidden, dtype=dtype), _meta(vocab, hidden, dtype=dtype)
            )
            specs.append(LaunchSpec("linear", f"{model} {dt} lm_head", la))
            for delta in (None, _meta(n, hidden, dtype=dtype)):
                _, la = invariant.add_rms_norm_launch(
                    _meta(n, hidden, dtype=dtype), delta, _meta(hidden, dtype=dtype), 1e-5
                )
                specs.append(LaunchSpec("add_rms_norm", f"{model} {dt}", la))
            _, la = fused.silu_mul_launch(_meta(n, 2 * inter, dtype=dtype), inter)
            specs.append(LaunchSpec("silu_mul", f"{model} {dt}", la))
            for kv in KV_DTYPES:
                for bs in BLOCK_SIZES:
                    where = f"{model} {dt} kv={kv or dt} block={bs}"
                    specs += _attention_launches(heads, kvh, d, dtype, kv, bs, where)
    unique: dict[str, LaunchSpec] = {}
    for s in specs:
        unique.setdefault(_variant(s.launch), s)
    return list(unique.values())


def _attention_launches(heads, kvh, d, dtype, kv, bs, where) -> list[LaunchSpec]:
    from inference.kernels.triton import decode_attention, fused, kv_store, prefill_attention

    nb, seqs, width = 64, 8, 40
    kc, vc = _kv_caches(nb, bs, kvh, d, dtype, kv)
    slots = _meta(24, dtype=torch.int64)
    out = []
    la = kv_store.store_kv_launch(_meta(24, kvh, d, dtype=dtype), _meta(24, kvh, d, dtype=dtype),
                                  kc, vc, slots)  # fmt: skip
    out.append(LaunchSpec("store_kv", where, la))
    qkv = _meta(24, (heads + 2 * kvh) * d, dtype=dtype)
    table = _meta(4096, d, dtype=dtype)
    la = fused.rotary_store_launch(
        qkv, _meta(24, dtype=torch.int64), table, table, heads, kvh, slots, kc, vc
    )
    out.append(LaunchSpec("rotary_store", where, la))
    tables = _meta(seqs, width, dtype=torch.int32)
    lens = _meta(seqs, dtype=torch.int32)
    q = _meta(seqs, heads, d, dtype=dtype)
    _, (part, merge) = decode_attention.decode_launches(q, kc, vc, tables, lens, 0.125)
    out += [LaunchSpec("decode_partition", where, part), LaunchSpec("decode_merge", where, merge)]
    cu = _meta(seqs + 1, dtype=torch.int32)
    _, la = prefill_attention.prefill_launch(
        _meta(100, heads, d, dtype=dtype), kc, vc, tables, cu, lens, 0.125, max_query_len=100
    )
    out.append(LaunchSpec("prefill", where, la))
    return out


def step_variants() -> dict[str, int]:
    """How many compiled variants each kernel needs over the steps serving makes (Llama-3-8B's
    shape, bf16, block size 16): 1 to 64 sequences, block tables 1 to 512 blocks wide,
    contexts and prompt chunks of any length, products of 1 to 512 rows. More than one means
    a step would compile a kernel while serving."""
    from inference.kernels.triton import (
        decode_attention,
        fused,
        invariant,
        kv_store,
        prefill_attention,
    )
    from inference.kv_sizing import KNOWN_CONFIGS

    c = KNOWN_CONFIGS["llama-3-8b"]
    heads, kvh, d, hidden = (c[k] for k in ("num_attention_heads", "num_key_value_heads",
                                            "head_dim", "hidden_size"))  # fmt: skip
    bf16, bs = torch.bfloat16, 16
    kc, vc = _kv_caches(4096, bs, kvh, d, bf16, None)
    seen: dict[str, set] = {}

    def add(name: str, launch: Launch | None) -> None:
        if launch is not None:
            seen.setdefault(name, set()).add(specialization(launch, _any_target()))

    for seqs, width in ((1, 1), (3, 2), (8, 5), (17, 16), (33, 33), (64, 512), (2, 100)):
        tables = _meta(seqs, width, dtype=torch.int32)
        lens = _meta(seqs, dtype=torch.int32)
        q = _meta(seqs, heads, d, dtype=bf16)
        for ctx in (1, width * bs // 2 + 1, width * bs):
            _, (part, merge) = decode_attention.decode_launches(
                q, kc, vc, tables, lens, 0.1, max_seq_len=ctx
            )
            add("decode_partition", part)
            add("decode_merge", merge)
        for tokens in (1, 7, 16, 100, 512):
            cu = _meta(seqs + 1, dtype=torch.int32)
            qp = _meta(tokens, heads, d, dtype=bf16)
            add("prefill", prefill_attention.prefill_launch(qp, kc, vc, tables, cu, lens, 0.1,
                                                            max_query_len=tokens)[1])  # fmt: skip
    for rows in (1, 2, 3, 16, 17, 64, 100, 512):
        x = _meta(rows, hidden, dtype=bf16)
        add("linear", invariant.linear_launch(x, _meta(4096, hidden, dtype=bf16))[1])
        add("add_rms_norm", invariant.add_rms_norm_launch(x, x, _meta(hidden, dtype=bf16), 1e-5)[1])
        add("silu_mul", fused.silu_mul_launch(_meta(rows, 2 * 14336, dtype=bf16), 14336)[1])
        qkv = _meta(rows, (heads + 2 * kvh) * d, dtype=bf16)
        slots, pos = _meta(rows, dtype=torch.int64), _meta(rows, dtype=torch.int64)
        cos = _meta(8192, d, dtype=bf16)
        add("rotary_store",
            fused.rotary_store_launch(qkv, pos, cos, cos, heads, kvh, slots, kc, vc))  # fmt: skip
        kv = _meta(rows, kvh, d, dtype=bf16)
        add("store_kv", kv_store.store_kv_launch(kv, kv, kc, vc, slots))
    return {name: len(v) for name, v in seen.items()}


def specialization(launch: Launch, target) -> tuple:
    """What Triton's runtime keys a launch's compiled variant by on ``target``: its
    signature, constexprs, specialised integers and pointer alignment, and its options."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    _, spec, options = binder(*launch.args, **launch.kwargs)
    return tuple(map(str, spec)), tuple(sorted((k, str(v)) for k, v in options.items()))


def _variant(launch: Launch) -> str:
    return f"{launch.kernel.fn.__name__}|{specialization(launch, _any_target())}"


def _any_target():
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", 90, 32)


def compile_launch(launch: Launch, target):
    """The CompiledKernel of ``launch`` for ``target``, specialised as Triton's runtime would
    specialise it there (module docstring)."""
    import triton
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, launch.kwargs, bound, spec, options
    )
    src = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=target, options=options.__dict__)


@dataclass
class Report:
    """One launch compiled for one target."""

    name: str
    where: str
    target: str
    ok: bool
    error: str = ""
    shared: int = 0  # bytes of shared memory a block takes
    shared_limit: int = 0
    registers: int = 0  # per thread
    spill_bytes: int = 0  # local memory per thread (spills), from cuobjdump
    num_warps: int = 0
    fp_fusion: bool = True
    fma_f32: int = 0  # fma.rn.f32 instructions in the PTX
    async_copies: int = 0  # cp.async instructions in the PTX: loads the loop pipelines
    seconds: float = 0.0


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, local-memory bytes) per thread of a cubin, from ``cuobjdump -res-usage``."""
    import tempfile

    from triton import knobs

    tool = knobs.nvidia.cuobjdump.path
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [tool, "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    reg = re.search(r"REG:(\d+)", text)
    local = re.search(r"LOCAL:(\d+)", text)
    return int(reg.group(1)) if reg else 0, int(local.group(1)) if local else 0


def compile_report(spec: LaunchSpec, target_name: str) -> Report:
    target = targets([target_name])[target_name]
    t0 = time.perf_counter()
    r = Report(spec.name, spec.where, target_name, ok=False)
    r.shared_limit = SHARED_LIMIT[target.arch]
    try:
        ck = compile_launch(spec.launch, target)
    except Exception as e:  # noqa: BLE001 - reported, one line per launch
        r.error = f"{type(e).__name__}: {str(e).strip()[:2000]}"
        r.seconds = time.perf_counter() - t0
        return r
    r.ok = True
    r.shared = int(ck.metadata.shared)
    r.num_warps = int(ck.metadata.num_warps)
    r.fp_fusion = bool(ck.metadata.enable_fp_fusion)
    r.fma_f32 = ck.asm["ptx"].count("fma.rn.f32")
    r.async_copies = ck.asm["ptx"].count("cp.async")
    r.registers, r.spill_bytes = _resource_usage(ck.asm["cubin"])
    r.seconds = time.perf_counter() - t0
    return r


def _compile_one(args: tuple[int, str]) -> Report:
    index, target_name = args
    return compile_report(_SPECS[index], target_name)


_SPECS: list[LaunchSpec] = []


def compile_all(target_names: list[str] | None = None, jobs: int = 1) -> list[Report]:
    """Every launch (``launches``) for every target, ``jobs`` processes at once."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("the kernels compile for a GPU only without TRITON_INTERPRET=1")
    global _SPECS
    _SPECS = launches()
    work = [(i, t) for t in targets(target_names) for i in range(len(_SPECS))]
    if jobs <= 1:
        return [_compile_one(w) for w in work]
    ctx = __import__("multiprocessing").get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        return list(pool.map(_compile_one, work, chunksize=4))


def problems(reports: list[Report]) -> list[str]:
    """One line per launch that failed to compile, crossed its target's shared memory, or
    compiled with fp fusion on where the cache promise needs it off."""
    out = []
    for r in reports:
        at = f"{r.name} [{r.where}] for {r.target}"
        if not r.ok:
            out.append(f"{at}: {r.error.splitlines()[0] if r.error else 'failed'}")
        elif r.shared > r.shared_limit:
            out.append(f"{at}: {r.shared} bytes of shared memory, over {r.shared_limit}")
        elif r.fp_fusion and any(r.name.startswith(k) for k in ("decode", "prefill")):
            out.append(f"{at}: compiled with fp fusion on")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default=None, help="comma-separated, e.g. sm_90,sm_80 (all)")
    ap.add_argument("--json", help="write every report here")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    names = args.targets.split(",") if args.targets else None
    os.environ.setdefault("TRITON_CACHE_DIR", str(cache_dir()))
    t0 = time.perf_counter()
    reports = compile_all(names, args.jobs)
    bad = problems(reports)
    variants = step_variants()
    bad += [f"{k}: {n} compiled variants over serving's steps, not 1" for k, n in variants.items()
            if n != 1]  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            out = {"reports": [asdict(r) for r in reports], "step_variants": variants}
            json.dump(out, f, indent=1)
    spills = sorted({(r.name, r.target, r.spill_bytes) for r in reports if r.spill_bytes})
    print(
        f"{len(reports)} launches compiled for {', '.join(sorted({r.target for r in reports}))} "
        f"in {time.perf_counter() - t0:.0f} s; {len(bad)} problems; spills: "
        + (", ".join(f"{n} on {t}: {b} bytes" for n, t, b in spills) or "none")
    )
    for line in bad:
        print(line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
