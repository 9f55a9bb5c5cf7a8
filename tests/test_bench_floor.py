"""bench/floor.py: the model's arithmetic per token and per step, and the floor it puts under a
load run's steps at this CPU's product rate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from bench import floor
from inference.model.config import ModelConfig

ROOT = Path(__file__).resolve().parent.parent


def test_token_flops_count_every_weight_of_the_real_model(default_model_dir):
    cfg = ModelConfig.from_file(default_model_dir / "config.json")
    f = floor.TokenFlops.of(cfg)
    linear = embed = 0
    with safe_open(default_model_dir / "model.safetensors", "pt") as st:
        for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
            shape = st.get_slice(name).get_shape()
            if len(shape) != 2:
                continue  # the norms' weights: no products
            n = shape[0] * shape[1]
            if name == "model.embed_tokens.weight":
                embed = n  # tied: the LM head's weights too
            else:
                linear += n
    assert f.linear == 2 * linear
    assert f.head == 2 * embed
    assert f.attention_per_key == 4 * 9 * 64 * 30  # 9 heads of 64, 30 layers


def test_step_flops_by_part():
    f = floor.TokenFlops(linear=1000, head=300, attention_per_key=7)
    parts = floor.step_flops(
        f, decodes=2, prompt_tokens=10, decode_ctx=100, prompt_ctx=50, uncached=5
    )
    assert parts == {
        "linear": 12 * 1000,
        "head": (2 + 2) * 300,  # each decode token, and each of the 2 questions' last token
        "attention": 7 * (2 * 100 + 10 * 50),
    }
    assert floor.step_flops(f, 1, 0, 10, 0, 0)["head"] == 300


def _level(concurrency, decodes, prompt_tokens, step_ms, tpot_p50, tpot_p99):
    req = {"prompt_tokens": 1040, "cached_tokens": 1000, "completion_tokens": 32}
    return {
        "concurrency": concurrency,
        "per_request": [req, dict(req, prompt_tokens=1050, cached_tokens=1010)],
        "decode_tokens_per_step": decodes,
        "prompt_tokens_per_step": prompt_tokens,
        "step_ms": step_ms,
        "tpot_p50_ms": tpot_p50,
        "tpot_p99_ms": tpot_p99,
    }


def test_level_shape_is_the_mean_request():
    shape = floor.level_shape(_level(1, 1, 1, 1, 1, 1))
    assert shape == {
        "prompt": 1045,
        "cached": 1005,
        "uncached": 40,
        "answer": 32,
        "decode_ctx": 1045 + 16,
        "prompt_ctx": (1005 + 1045 + 1) / 2,
    }


def test_floors_and_the_tpot_goal_at_the_floor():
    f = floor.TokenFlops(linear=200e6, head=50e6, attention_per_key=70e3)
    result = {"levels": [_level(1, 1, 1, 10.0, 10.0, 12.0), _level(16, 12, 16, 40.0, 44.0, 55.0)]}
    rows = floor.floors(result, f, rate=400e9)
    top = rows[1]
    flops = (12 + 16) * 200e6 + (12 + 16 / 40) * 50e6 + 70e3 * (12 * 1061 + 16 * 1025.5)
    assert top["gflop"] == pytest.approx(flops / 1e9)
    assert top["floor_ms"] == pytest.approx(flops / 400e9 * 1e3)
    assert top["rate_share"] == pytest.approx(top["floor_ms"] / 40.0)
    g = floor.tpot_goal_at_floor(rows)
    assert g["concurrency"] == 16
    assert g["p50_over_1client_p50"] == pytest.approx(top["floor_ms"] / 10.0)
    assert g["spread_p99_over_p50"] == pytest.approx(55.0 / 44.0)
    assert g["p99_over_1client_p50"] == pytest.approx(top["floor_ms"] / 10.0 * 55.0 / 44.0)
    assert g["measured_p99_over_1client_p50"] == pytest.approx(5.5)


def test_product_rate_is_a_rate():
    import torch

    rate = floor.product_rate(torch.float32, n=256, repeats=3)
    assert 1e8 < rate < 1e14


def test_cli_on_a_load_result(tmp_path, default_model_dir):
    result = {"levels": [_level(1, 1, 1.2, 11.0, 10.5, 12.0), _level(16, 12.7, 15.0, 36, 40, 55)]}
    path = tmp_path / "load.json"
    path.write_text(json.dumps(result))
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "floor.py"), str(path), "--dtype", "float32"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    assert "GFLOP/s" in out
    rows = [line for line in out.splitlines() if line.startswith("| 16 |")]
    assert len(rows) == 1 and "| 12.7 | 15.0 |" in rows[0]
    assert "at 16 clients, steps at the floor" in out and "measured 5.24x" in out


def test_cli_with_a_given_rate(tmp_path, default_model_dir):
    result = {"levels": [_level(1, 1, 1.2, 11.0, 10.5, 12.0), _level(16, 12.7, 15.0, 36, 40, 55)]}
    path = tmp_path / "load.json"
    path.write_text(json.dumps(result))
    cmd = [sys.executable, str(ROOT / "bench" / "floor.py"), str(path)]
    out = subprocess.run(
        [*cmd, "--rate", "500"], capture_output=True, text=True, check=True, timeout=300
    ).stdout
    assert out.startswith("given: matrix products at 500 GFLOP/s")
    cfg = ModelConfig.from_file(default_model_dir / "config.json")
    rows = floor.floors(result, floor.TokenFlops.of(cfg), rate=500e9)
    line = next(x for x in out.splitlines() if x.startswith("| 16 |"))
    assert f"| {rows[1]['floor_ms']:.1f} | 36.0 |" in line
    bad = subprocess.run([*cmd, "--rate", "0"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--rate must be a positive GFLOP/s figure" in bad.stderr


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (None, "FileNotFoundError"),
        ("not json", "JSONDecodeError"),
        ('{"levels": []}', "no levels"),
        ('{"rounds": 2}', "KeyError('levels')"),
        ('{"levels": [{"concurrency": 1, "per_request": []}]}', "a level without answers"),
    ],
)
def test_cli_refuses_what_is_not_a_load_result(tmp_path, text, why):
    path = tmp_path / "load.json"
    if text is not None:
        path.write_text(text)
    cmd = [sys.executable, str(ROOT / "bench" / "floor.py"), str(path), "--rate", "100"]
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2
    assert f"{path} is not a bench/load.py result" in bad.stderr and why in bad.stderr
