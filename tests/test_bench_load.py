"""bench/load.py's accounting of the CPU time a virtual machine's hypervisor takes away, and the
one-command GPU run of the whole service (bench/gpu_run.sh service) tried on the CPU."""

from __future__ import annotations

import sys
import time

import pytest

from bench import load


def _answer(ttft_ms: float, tpot_ms: float) -> dict:
    return {
        "ttft_ms": ttft_ms,
        "tpot_ms": tpot_ms,
        "e2e_ms": ttft_ms + 31 * tpot_ms,
        "completion_tokens": 32,
        "cached_tokens": 1008,
        "prompt_tokens": 1040,
    }


def test_cpu_ticks_read_the_steal_field(tmp_path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice, then one line per CPU
    stat.write_text("cpu  100 2 30 4000 5 6 7 89 50 0\ncpu0 50 1 15 2000 2 3 3 40 25 0\n")
    assert load.cpu_ticks(str(stat)) == (89, 4239)
    stat.write_text("intr 1 2 3\n")
    assert load.cpu_ticks(str(stat)) is None
    assert load.cpu_ticks(str(tmp_path / "missing")) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_cpu_ticks_count_steal_within_all_cpu_time():
    before = load.cpu_ticks()
    end = time.perf_counter() + 0.2
    while time.perf_counter() < end:  # busy: the clock ticks on
        pass
    after = load.cpu_ticks()
    assert before is not None and after is not None
    stolen, total = after[0] - before[0], after[1] - before[1]
    assert total > 0 and 0 <= stolen <= total


def test_pooled_levels_add_their_steal_ticks():
    rounds = [
        [load.summarize(16, 0.5, [_answer(100, 40)], 4.0, 0.1, None, [30, 1000])],
        [load.summarize(16, 0.5, [_answer(120, 42)], 4.0, 0.1, None, [10, 1000])],
    ]
    assert rounds[0][0]["cpu_steal_share"] == pytest.approx(0.03)
    (level,) = load.pooled(rounds)
    assert level["cpu_steal_ticks"] == [40, 2000]
    assert level["cpu_steal_share"] == pytest.approx(0.02)
    # a round without the figure (not Linux) leaves the pooled level without one
    rounds[1][0] = load.summarize(16, 0.5, [_answer(120, 42)], 4.0, 0.1, None, None)
    assert rounds[1][0]["cpu_steal_share"] is None
    assert load.pooled(rounds)[0]["cpu_steal_share"] is None


def test_the_gpu_service_run_works_on_the_cpu(default_model_dir, tmp_path):
    """bench/gpu_run.sh service --dry-run: the one-command GPU run of the whole service (benchmark
    model, server, load, files under $OUT) on this CPU with a small shape, so it is known to
    work before a GPU is at hand."""
    import json
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    r = subprocess.run(
        ["bench/gpu_run.sh", "service", "--dry-run"],
        cwd=root,
        env={**os.environ, "OUT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    engine = json.loads((tmp_path / "gpu-service-engine.json").read_text())
    assert engine["weights"] == "random" and engine["model"] == "random-smollm2-135m"
    load = json.loads((tmp_path / "gpu-service-load.json").read_text())
    level = load["levels"][0]
    assert level["requests"] >= 2 and 0 < level["model_share"] <= 1
