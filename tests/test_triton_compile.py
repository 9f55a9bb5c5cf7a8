"""Every Triton kernel launch the runners make, compiled ahead of time for the GPUs this machine
lacks (sm_90: H100/H200, sm_80: A100, sm_100 where the installed Triton has it), through
``inference/kernels/triton/aot.py``: each compiles, fits its target's shared memory, spills
nothing, and the attention kernels compile with fp fusion off; no kernel compiles a second
variant for another step's shape.

The interpreter accepts code the GPU compiler rejects, so the compiling runs in a subprocess
without ``TRITON_INTERPRET`` (other test modules set it for theirs). Compiled kernels are
cached (``aot.cache_dir``): a run after the first takes seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KINDS = {
    "store_kv",
    "rotary_store",
    "decode_partition",
    "decode_merge",
    "prefill",
    "silu_mul",
    "add_rms_norm",
    "linear",
}
# spills a kernel may have, with the reason (none so far: every launch keeps its registers)
JUSTIFIED_SPILLS: dict[str, str] = {}


def _python(code_or_args: list[str], timeout: int) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [sys.executable, *code_or_args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode in (0, 1), r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("aot") / "aot.json"
    jobs = str(min(2, os.cpu_count() or 1))
    stdout = _python(
        ["-m", "inference.kernels.triton.aot", "--json", str(out), "--jobs", jobs], 3600
    )
    print(stdout.splitlines()[0])
    return json.loads(out.read_text())


def test_every_launch_compiles_for_hopper_and_ampere(compiled):
    reports = compiled["reports"]
    assert {"sm_90", "sm_80"} <= {r["target"] for r in reports}
    assert {r["name"] for r in reports} == KINDS
    failed = [f"{r['name']} [{r['where']}] {r['target']}: {r['error'][:300]}" for r in reports
              if not r["ok"]]  # fmt: skip
    assert not failed, "\n".join(failed)
    # the 8-bit KV cache's kernels among them, int8 and fp8, for every target
    for kv in ("int8", "fp8"):
        for kind in ("store_kv", "rotary_store", "decode_partition", "prefill"):
            for target in ("sm_90", "sm_80"):
                assert any(
                    r["name"] == kind and f"kv={kv}" in r["where"] and r["target"] == target
                    for r in reports
                ), (kind, kv, target)
    # every head dim, dtype and block size of the suite
    where = {r["where"] for r in reports if r["name"] == "decode_partition"}
    for part in ("block=16", "block=32", "block=64", "bfloat16", "float16", "float32"):
        assert any(part in w for w in where), part
    assert {w.split()[0] for w in where} == {"smollm2-135m", "llama-3-8b"}  # head dims 64, 128


def test_shared_memory_fits_every_target(compiled):
    over = [
        f"{r['name']} [{r['where']}] {r['target']}: {r['shared']} > {r['shared_limit']} bytes"
        for r in compiled["reports"]
        if r["shared"] > r["shared_limit"]
    ]
    assert not over, "\n".join(over)


def test_no_kernel_spills_registers(compiled):
    spilled = {
        f"{r['name']} [{r['where']}] {r['target']}": r["spill_bytes"]
        for r in compiled["reports"]
        if r["spill_bytes"] and r["name"] not in JUSTIFIED_SPILLS
    }
    assert not spilled, spilled


def test_attention_compiles_without_fp_fusion(compiled):
    """The cache promise on a GPU: a prefill key tile with the causal mask and one without it
    round a score the same way. With fp fusion off nothing is contracted: the 16-bit attention
    kernels' PTX holds no fma.rn.f32 (their products are tensor-core instructions)."""
    for r in compiled["reports"]:
        if r["name"] in ("prefill", "decode_partition", "decode_merge"):
            assert not r["fp_fusion"], r
            if "float32" not in r["where"].split()[1]:
                assert r["fma_f32"] == 0, r


def test_attention_key_loops_are_pipelined(compiled):
    """The decode and prefill key loops load their next blocks while computing (asynchronous
    copies in the PTX): no branch per block inside the loop keeps the loads in order."""
    for r in compiled["reports"]:
        if r["name"] in ("prefill", "decode_partition") and r["target"] in ("sm_80", "sm_90"):
            assert r["async_copies"] > 0, r


FUSION_PROBE = """
import inspect, json, os, re
from inference.kernels.triton import aot, prefill_attention as pa
os.environ.setdefault("TRITON_CACHE_DIR", str(aot.cache_dir()))
spec = next(s for s in aot.launches() if s.name == "prefill"
            and s.where.startswith("llama-3-8b bfloat16 kv=bfloat16"))
src, first = inspect.getsourcelines(pa._prefill_kernel.fn)
calls = [first + i for i, line in enumerate(src) if "_prefill_tile(" in line]
out = {}
for fusion in (True, False):
    la = spec.launch._replace(kwargs={**spec.launch.kwargs, "enable_fp_fusion": fusion})
    ptx = aot.compile_launch(la, aot.targets(["sm_90"])["sm_90"]).asm["ptx"]
    counts, at = dict.fromkeys(calls, 0), None
    for line in ptx.splitlines():
        if line.strip().startswith(".loc"):
            m = re.search(r"inlined_at \\d+ (\\d+) ", line)
            at = int(m.group(1)) if m else None
        elif "fma.rn.f32" in line and at in counts:
            counts[at] += 1
    out[str(fusion)] = [counts[c] for c in calls]
print(json.dumps(out))
"""


def test_fp_fusion_would_make_unmasked_and_masked_tiles_round_differently():
    """Why fusion is off (the check above can fail): compiled with it on, the GPU compiler
    contracts the score's scale and the running max's subtraction into an FMA in the
    unmasked tiles, which the masked tiles' select keeps apart; off, neither contracts."""
    fma = json.loads(_python(["-c", FUSION_PROBE], 600).strip().splitlines()[-1])
    unmasked_on, masked_on = fma["True"]
    assert unmasked_on > masked_on, fma
    assert fma["False"] == [0, 0], fma


SPECIALIZE_PROBE = """
import json, torch, triton
from inference.kernels.triton import aot, decode_attention as da
plain = triton.jit(da._decode_partition_kernel.fn)  # without do_not_specialize
kc, vc = aot._kv_caches(4096, 16, 8, 128, torch.bfloat16, None)
keys = set()
for seqs, width in ((1, 1), (8, 5), (17, 16), (64, 512)):
    tables = aot._meta(seqs, width, dtype=torch.int32)
    q = aot._meta(seqs, 32, 128, dtype=torch.bfloat16)
    lens = aot._meta(seqs, dtype=torch.int32)
    _, (part, _) = da.decode_launches(q, kc, vc, tables, lens, 0.1, max_seq_len=width * 16)
    keys.add(aot.specialization(part._replace(kernel=plain), aot._any_target()))
print(len(keys))
"""


def test_no_kernel_compiles_again_for_another_steps_shape(compiled):
    """Integers that change from step to step (rows, table widths, partitions) are not
    specialised on, so serving never compiles a kernel mid-step; without ``do_not_specialize``
    the decode kernel would need a variant per table width (the counterfactual below)."""
    assert set(compiled["step_variants"]) == KINDS
    assert all(n == 1 for n in compiled["step_variants"].values()), compiled["step_variants"]
    assert int(_python(["-c", SPECIALIZE_PROBE], 300).strip().splitlines()[-1]) > 1
