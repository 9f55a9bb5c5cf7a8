"""CPU attention kernel timings, per layer, for the token groups serving produces.

    .venv/bin/python bench/attention.py [--against REV] [--repeats 8] [--dtype float32|bfloat16]

Times ``docqa_decode_attention`` (inference/kernels/cpu/csrc/decode_attention.c) with float32
queries and K/V, or with ``--dtype bfloat16`` ``docqa_attention_bf16`` (on the tile unit where
the CPU has AMX, as the engine runs it), on five shapes: one decode token after a 1,080-token
context; 16 decode tokens about 4 manuals of 1,056 tokens; a 45-token question after a cached
1,000-token manual; the second 512-token chunk of a manual's prompt; the 16 decodes and the
question in one step (a step under load). Each is cut into units by the engine's own step plan
(``CPUBackend.plan``). Each shape runs over 30 layers twice: with one pool that stays in the
caches (20 MB), and cold, the layers taking turns over four 50 MB pools. With ``--against REV``
the kernel source at git revision REV is built beside the working tree's, and the two are
called in turn, repeat by repeat, on the same data (each with the groups it takes: units of up
to 48 query rows on the float32 register-tiled path, 16 elsewhere in float32); the table gives
both, their ratio and the largest difference between their outputs. Prints a markdown table;
nothing is written."""

from __future__ import annotations

import argparse
import ctypes
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference.attention.backends import CPUBackend  # noqa: E402
from inference.attention.metadata import AttentionMetadata  # noqa: E402
from inference.kernels.cpu import attention as cpu_attention  # noqa: E402
from inference.kernels.cpu import build as cpu_build  # noqa: E402

BS, KVH, HEADS, DIM, LAYERS = 16, 3, 9, 64, 30
GROUP = HEADS // KVH


def load(src: Path) -> ctypes.CDLL:
    lib = cpu_attention.attention_library_at(cpu_build.build(src))
    # a revision before the register-tiled path has no such entry
    tiled = getattr(lib, "docqa_decode_attention_tiled", None)
    lib.tiled = bool(tiled and tiled(0, 0, DIM))
    return lib


def source_at(rev: str, into: Path) -> Path:
    """decode_attention.c and the headers it includes, as of git revision ``rev`` (the
    sources lie in inference/kernels/cpu/csrc/, before that in inference/csrc/)."""
    listing = subprocess.run(
        ["git", "ls-tree", "--name-only", rev, "inference/kernels/cpu/csrc/", "inference/csrc/"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for path in listing:
        if path.endswith((".h", "decode_attention.c")):
            text = subprocess.run(
                ["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, check=True
            ).stdout
            (into / Path(path).name).write_bytes(text)
    return into / "decode_attention.c"


class Shapes:
    """The pools and the three shapes' tokens (tables, contexts), shared by every kernel."""

    def __init__(self, num_blocks: int, pools: int, seed: int = 0, dtype=torch.float32):
        gen = torch.Generator().manual_seed(seed)
        shape = (num_blocks, BS, KVH, DIM)
        self.k = [torch.randn(shape, generator=gen).to(dtype) for _ in range(pools)]
        self.v = [torch.randn(shape, generator=gen).to(dtype) for _ in range(pools)]
        self.bf16 = dtype == torch.bfloat16
        rng = random.Random(seed)
        free = list(range(1, num_blocks))
        rng.shuffle(free)
        manuals = [[free.pop() for _ in range(66)] for _ in range(4)]
        own = [[free.pop() for _ in range(3)] for _ in range(16)]
        decodes = [(manuals[i % 4] + own[i], 1080 + i) for i in range(16)]
        self.cases = {
            "1 decode": ("decode", decodes[:1]),
            "16 decodes, 4 manuals": ("decode", decodes),
            "45-token question after 1,000 cached": ("prompt", (manuals[0] + own[0], 1000, 45)),
            "512-token prompt chunk at 512": ("prompt", (manuals[1] + own[1], 512, 512)),
            # a step under load: answers decoding while a new question is computed
            "16 decodes and the 45-token question": (
                "mixed",
                (decodes, (manuals[0] + [free.pop() for _ in range(3)], 1000, 45)),
            ),
        }

    def units(self, kind, spec, tiled: bool):
        """The step's plan (``CPUBackend.plan``: query rows, block tables, contexts, group
        starts, shared keys), as the engine builds it for the bf16 kernel, or for a float32
        one with (``tiled``) or without the register-tiled path."""
        if kind == "decode":
            tables = [t for t, _ in spec]
            lens = [c for _, c in spec]
            meta = AttentionMetadata.build(
                tables, lens, [1] * len(spec), BS, "cpu", [True] * len(spec)
            )
        elif kind == "mixed":
            decodes, (table, first, n) = spec
            meta = AttentionMetadata.build(
                [t for t, _ in decodes] + [table],
                [c for _, c in decodes] + [first + n],
                [1] * len(decodes) + [n],
                BS,
                "cpu",
                [True] * len(decodes) + [False],
            )
        else:
            table, first, n = spec
            meta = AttentionMetadata.build([table], [first + n], [n], BS, "cpu", [False])
        return CPUBackend().plan(meta, torch.device("cpu"), BS, GROUP, self.bf16, tiled)


def run(lib, shapes: Shapes, plan, q, out) -> float:
    t = plan.q_rows.shape[0]
    bt, ctx, starts, shared = plan.tables, plan.ctx, plan.group_start, plan.group_shared
    q_start = plan.q_rows * q.stride(0)
    out_start = plan.q_rows * out.stride(0)
    start = time.perf_counter()
    for layer in range(LAYERS):
        k = shapes.k[layer % len(shapes.k)]
        v = shapes.v[layer % len(shapes.v)]
        if shapes.bf16:
            rc = lib.docqa_attention_bf16(
                q.data_ptr(), q_start.data_ptr(), t, starts.data_ptr(), shared.data_ptr(),
                shared.shape[0], k.data_ptr(), v.data_ptr(), bt.data_ptr(), bt.stride(0),
                ctx.data_ptr(), HEADS, KVH, DIM, BS, 0.125, out.data_ptr(), out_start.data_ptr(),
                torch.get_num_threads(),
            )  # fmt: skip
            if rc != 0:
                raise SystemExit("the kernel refused the shape")
            continue
        rc = lib.docqa_decode_attention(
            q.data_ptr(), 0, q_start.data_ptr(), t, starts.data_ptr(), shared.data_ptr(),
            shared.shape[0], k.data_ptr(), v.data_ptr(), 0, bt.data_ptr(), bt.stride(0),
            ctx.data_ptr(), HEADS, KVH, DIM, BS, 0.125, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise SystemExit("the kernel refused the shape")
    return (time.perf_counter() - start) / LAYERS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--against", metavar="REV", help="a git revision's kernel, side by side")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    libs = {"this tree": load(cpu_attention.SOURCE)}
    if args.against:
        tmp = Path(tempfile.mkdtemp(prefix="docqa-attention-"))
        libs = {args.against: load(source_at(args.against, tmp)), **libs}
    names = list(libs)
    print(
        f"{torch.get_num_threads()} threads, {args.dtype}"
        f"{' on the tile unit' if dtype == torch.bfloat16 and libs[names[-1]].amx else ''}, "
        f"{HEADS} query heads, {KVH} KV heads, head "
        f"size {DIM}, blocks of {BS} tokens; ms per layer, best of {args.repeats}\n"
    )
    head = " | ".join(names)
    ratio = f" | {names[1]} / {names[0]} | max difference" if len(names) == 2 else ""
    print(f"| shape | pool | {head}{ratio} |")
    print("|---|---|" + "---|" * (len(names) + (2 if ratio else 0)))
    for pool, (num_blocks, pools) in {"in cache": (320, 1), "cold": (4096, 4)}.items():
        shapes = Shapes(num_blocks, pools, dtype=dtype)
        for name, (kind, spec) in shapes.cases.items():
            units = {n: shapes.units(kind, spec, libs[n].tiled) for n in names}
            best = dict.fromkeys(names, float("inf"))
            outs = {}
            tokens = units[names[0]].q_rows.shape[0]
            q = torch.randn(tokens, HEADS, DIM, generator=torch.Generator().manual_seed(1))
            q = q.to(dtype)
            for _ in range(args.repeats):
                for n in names:
                    out = torch.empty(tokens, HEADS, DIM, dtype=dtype)
                    best[n] = min(best[n], run(libs[n], shapes, units[n], q, out))
                    outs[n] = torch.empty_like(out).index_copy_(0, units[n].q_rows, out)
            cells = " | ".join(f"{best[n] * 1e3:.2f}" for n in names)
            if ratio:
                diff = (outs[names[0]].float() - outs[names[1]].float()).abs().max().item()
                cells += f" | {best[names[1]] / best[names[0]]:.2f}x | {diff:.1e}"
            print(f"| {name} | {pool} | {cells} |")


if __name__ == "__main__":
    main()
