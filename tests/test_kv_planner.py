"""Capacity planning (inference/kv_planner.py, ``docqa kv-budget``): the estimate of the
concurrency a workload reaches before the first preemption against the engine's scheduler and
block pool replaying it; the memory split; workloads from files, percentiles and the service's
own stored conversations."""

import json
import random
import re

import pytest
from test_cli import _assert_one_line_error, docqa

from inference.kv_planner import (
    ModelShape,
    Workload,
    mean_blocks_held,
    plan,
    replay,
    running_footprint,
)
from inference.kv_sizing import KNOWN_CONFIGS

_rng = random.Random(7)
CHATS = Workload(tuple((_rng.randint(40, 300), _rng.randint(20, 400)) for _ in range(400)))
MANUALS = Workload(tuple((_rng.randint(1500, 6000), _rng.randint(20, 200)) for _ in range(400)))
MIX = Workload(CHATS.requests[:240] + MANUALS.requests[:160])


@pytest.mark.parametrize(
    "name,workload,kv_gib",
    [("short chats", CHATS, 0.6), ("long manuals", MANUALS, 5.0), ("a mix", MIX, 2.0)],
)
def test_planner_concurrency_is_within_10_percent_of_the_replayed_scheduler(name, workload, kv_gib):
    """The planner's estimate for SmolLM2 in bf16 against the mean, over three arrival
    orders, of the requests running when the engine's scheduler first preempts (a step budget
    that lets the KV pool, not the budget, run out)."""
    shape = ModelShape.from_config(KNOWN_CONFIGS["smollm2-135m"])
    pl = plan(shape, 2, kv_bytes=int(kv_gib * 2**30), workload=workload)
    assert 50 <= pl.concurrency <= 400, pl.concurrency  # enough requests for a mean to settle
    runs = [replay(workload, pl.num_blocks, max_num_batched_tokens=8192, seed=s) for s in range(3)]
    assert all(r.preempted for r in runs)
    seen = sum(r.concurrency for r in runs) / len(runs)
    assert abs(pl.concurrency / seen - 1) <= 0.10, (name, pl.concurrency, seen)
    assert pl.fit_at[99][1] < seen  # the conservative count: everyone at full p99 length
    if workload is MIX:  # a footprint averaged over arrivals, not steps, is off for a mix
        per_request = sum(mean_blocks_held(p, o, 16) for p, o in MIX.requests) / 400
        assert pl.num_blocks / per_request < 0.85 * seen


def test_the_step_budget_can_bind_before_the_pool():
    """Manuals of thousands of tokens through a 512-token step budget: prompts are admitted
    slower than the pool fills, so the replay never preempts (``docqa kv-budget --replay`` then
    says the budget binds)."""
    pl = plan(ModelShape.from_config(KNOWN_CONFIGS["smollm2-135m"]), 2, kv_bytes=5 * 2**30)
    r = replay(MANUALS, pl.num_blocks, max_num_batched_tokens=512, max_requests=400)
    assert not r.preempted and r.concurrency < 0.8 * pl.num_blocks / running_footprint(MANUALS, 16)


def test_blocks_held_over_an_answer():
    for p, o, bs in [(1, 1, 16), (15, 1, 16), (16, 40, 16), (100, 333, 16), (7, 9, 8)]:
        brute = sum(-(-c // bs) for c in range(p + 1, p + o + 1)) / o
        assert mean_blocks_held(p, o, bs) == pytest.approx(brute)


def test_workload_from_percentiles_has_them():
    w = Workload.from_percentiles((800, 2400, 6000), (150, 400, 900))
    prompts = sorted(p for p, _ in w.requests)
    outputs = sorted(o for _, o in w.requests)
    for values, want in ((prompts, (800, 2400, 6000)), (outputs, (150, 400, 900))):
        got = tuple(w.percentile(values, pct) for pct in (50, 90, 99))
        for g, x in zip(got, want, strict=True):
            assert abs(g - x) <= 0.01 * x, (got, want)


def test_memory_split_of_a_known_model():
    shape = ModelShape.from_config(KNOWN_CONFIGS["llama-3-8b"])
    assert shape.num_params() == 8_030_261_248  # Llama-3-8B's published count
    pl = plan(shape, 1, device_bytes=141 * 2**30, utilization=0.9, reserve_bytes=2**30)
    assert pl.weights_bytes == 2 * 8_030_261_248
    assert pl.kv_bytes == int(141 * 2**30 * 0.9) - pl.weights_bytes - 2**30
    assert pl.bytes_per_token == 2 * 32 * 8 * 128  # fp8: one byte an element
    smol = ModelShape.from_config(KNOWN_CONFIGS["smollm2-135m"])
    assert smol.num_params() == 134_515_008  # tied embeddings: one vocab x hidden matrix
    with pytest.raises(ValueError, match="leave no KV memory"):
        plan(shape, 2, device_bytes=8 * 2**30)


def test_kv_budget_plans_a_workload_file(tmp_path):
    f = tmp_path / "w.jsonl"
    f.write_text(
        "\n".join(json.dumps({"prompt_tokens": p, "output_tokens": o}) for p, o in MIX.requests)
    )
    r = docqa("kv-budget", "--memory-gib", "1", "--workload", str(f), "--kv-dtype", "int8",
              "--max-batched-tokens", "8192", "--replay")  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "KV cache: 11.25 KiB per token" in out and "KV dtype int8 (1 byte)" in out
    assert "KV cache size: 93,200 tokens" in out  # twice bf16's 46,592 in 1 GiB
    assert "workload: 400 requests" in out
    for pct in (50, 90, 99):
        assert f"p{pct} context" in out
    assert "concurrency before the first preemption" in out
    est = float(re.search(r"continuous batching: ([0-9.]+)", out).group(1))
    seen = float(re.search(r"orders\): ([0-9.]+) running", out).group(1))
    assert abs(est / seen - 1) <= 0.10, out
    # the engine's default budget: long manuals' prompts bind it
    r = docqa("kv-budget", "--memory-gib", "5", "--workload", str(f), "--replay")
    assert "binds before the KV pool" in r.stdout, r.stdout

    r = docqa("kv-budget", "llama-3-8b", "--device-memory-gib", "80", "--prompt-tokens",
              "800,2400,6000", "--output-tokens", "150,400,900", "--kv-dtype", "fp8")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "weights 14.96 GiB" in r.stdout and "runtime reserve" in r.stdout


def test_kv_budget_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_tokens": 10, "output_tokens": 5}\n{"prompt": 3}\n')
    _assert_one_line_error(
        docqa("kv-budget", "--memory-gib", "1", "--workload", str(bad)), "bad.jsonl:2"
    )
    _assert_one_line_error(
        docqa("kv-budget", "--memory-gib", "1", "--prompt-tokens", "10,20"), "P50,P90,P99"
    )
    _assert_one_line_error(
        docqa("kv-budget", "--prompt-tokens", "1,2,3", "--output-tokens", "1,2,3"),
        "--memory-gib or --device-memory-gib",
    )
    _assert_one_line_error(docqa("kv-budget", "--kv-dtype", "int4"), "unknown dtype")
    _assert_one_line_error(
        docqa("workload", "export", "--since", "last week", "-o", str(tmp_path / "w.jsonl")),
        "--since must be an ISO date",
    )
    assert not (tmp_path / "w.jsonl").exists()  # nothing written


def test_workload_export_reads_the_services_conversations(sqlite_server, tmp_path):
    """Turns of a conversation asked over HTTP, then ``docqa workload export`` on that
    server's database: one line per answered turn with the usage the answers reported."""
    with sqlite_server.client() as c:
        man = c.post("/v1/manuals", json={"title": "t", "text": "tarx extracts archives. " * 40})
        assert man.status_code in (200, 201), man.text
        conv = c.post("/v1/conversations", json={"manual_id": man.json()["id"]})
        assert conv.status_code == 201, conv.text
        usages = []
        for q in ("What does tarx do?", "Which files?"):
            r = c.post(f"/v1/conversations/{conv.json()['id']}/messages",
                       json={"content": q, "max_tokens": 6})  # fmt: skip
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])
    out = tmp_path / "w.jsonl"
    r = docqa("workload", "export", "--database-url", sqlite_server.database_url, "-o", str(out))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    want = [
        {"prompt_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"]}
        for u in usages
    ]
    assert all(w in rows for w in want)
    r = docqa("workload", "export", "--database-url", sqlite_server.database_url,
              "--since", "2999-01-01")  # fmt: skip
    assert r.returncode == 0 and r.stdout == ""
