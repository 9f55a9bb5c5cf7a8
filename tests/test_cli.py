"""`docqa` as a user runs it: a real process, real model, real files."""

import json
import os
import re
import subprocess
import sys

import pytest

GPL = "/usr/share/common-licenses/GPL-3"


def docqa(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ),
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )


def _words(n, tmp_path):
    words = []
    if os.path.exists(GPL):
        with open(GPL) as f:
            words = f.read().split()
    filler = "The archive tool keeps names, owners and times of many files in one archive."
    while len(words) < n:
        words += filler.split()
    p = tmp_path / f"manual{n}.txt"
    p.write_text(" ".join(words[:n]))
    return p


def _assert_one_line_error(r, needle):
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    err = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(err) == 1 and needle in err[0], r.stderr[-2000:]


@pytest.mark.slow
def test_ask_reuses_the_manual_cache(default_model_dir, tmp_path):
    manual = _words(1500, tmp_path)
    r = docqa(
        "ask",
        "--manual",
        str(manual),
        "--json",
        "--max-tokens",
        "8",
        "What is this document?",
        "Who may copy it?",
        "Can it be modified?",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 3
    objs = [json.loads(line) for line in lines]
    for o in objs:
        assert set(o) == {"answer", "usage", "timings"}
        assert set(o["timings"]) == {
            "queue_ms",
            "ttft_ms",
            "prefill_ms",
            "decode_ms",
            "tpot_ms",
            "e2e_ms",
            "ttft_saved_ms",
            "ttft_saved_basis",
        }
    computed = [int(m) for m in re.findall(r"(\d+) computed", r.stderr)]
    assert len(computed) == 3
    q1_prompt = objs[0]["usage"]["prompt_tokens"]
    assert computed[0] == q1_prompt and objs[0]["usage"]["cached_tokens"] == 0
    for o, c in zip(objs[1:], computed[1:], strict=True):
        u = o["usage"]
        question_tokens = 14  # upper bound of the question part of these prompts
        before_question = u["prompt_tokens"] - question_tokens
        assert u["cached_tokens"] >= 0.95 * before_question
        assert c == u["prompt_tokens"] - u["cached_tokens"]
        assert o["timings"]["ttft_saved_ms"] > 0


@pytest.mark.slow
def test_no_cache_computes_everything(default_model_dir, tmp_path):
    manual = _words(200, tmp_path)
    r = docqa(
        "ask",
        "--manual",
        str(manual),
        "--json",
        "--no-cache",
        "--max-tokens",
        "2",
        "Q one?",
        "Q two?",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    for line in r.stdout.strip().splitlines():
        assert json.loads(line)["usage"]["cached_tokens"] == 0


def test_missing_manual(tmp_path):
    _assert_one_line_error(
        docqa("ask", "--manual", str(tmp_path / "nope.txt"), "q"), "does not exist"
    )


def test_empty_manual(tmp_path):
    p = tmp_path / "empty.txt"
    p.write_text("  \n\n")
    _assert_one_line_error(docqa("ask", "--manual", str(p), "q"), "is empty")


def test_binary_manual(tmp_path):
    p = tmp_path / "blob.bin"
    p.write_bytes(bytes(range(256)) * 10)
    _assert_one_line_error(docqa("ask", "--manual", str(p), "q"), "binary")


def test_unknown_model(tmp_path):
    manual = _words(50, tmp_path)
    _assert_one_line_error(
        docqa("ask", "--manual", str(manual), "--model", str(tmp_path / "no-model"), "q"),
        "unknown model",
    )


@pytest.mark.slow
def test_manual_longer_than_context(default_model_dir, tmp_path):
    manual = _words(12000, tmp_path)
    r = docqa("ask", "--manual", str(manual), "q")
    _assert_one_line_error(r, "context is 8,192 tokens")


def test_kv_budget_arithmetic():
    r = docqa("kv-budget", "llama-3-8b", "--context", "4096", "--memory-gib", "8")
    assert r.returncode == 0, r.stderr
    assert "KV cache: 128.00 KiB per token" in r.stdout
    assert "per sequence of 4,096 tokens: 512.00 MiB" in r.stdout
    assert "KV cache size: 65,536 tokens" in r.stdout
    assert "Maximum concurrency for 4,096 tokens per request: 16.00x" in r.stdout


def test_kv_budget_from_config_file(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps(
            {
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "hidden_size": 4096,
                "torch_dtype": "float32",
            }
        )
    )
    r = docqa("kv-budget", "--config", str(cfg), "--context", "1000", "--kv-dtype", "bfloat16")
    assert "KV cache: 128.00 KiB per token" in r.stdout
    _assert_one_line_error(
        docqa("kv-budget", "--config", str(tmp_path / "x.json")), "no config.json"
    )
    _assert_one_line_error(docqa("kv-budget", "gpt-17"), "unknown config name")


def test_kv_budget_shows_a_manual_whole_and_in_parts():
    # llama-3-8b, a 4,096-token window: 128 KiB of KV a token
    r = docqa("kv-budget", "llama-3-8b", "--context", "4096", "--manual-tokens", "3000")
    assert r.returncode == 0, r.stderr
    assert "whole: 3,304 tokens a question; each answer token reads 413.00 MiB" in r.stdout
    assert "parts: one (the manual fits 3,792 tokens)" in r.stdout
    r = docqa(
        "kv-budget",
        "llama-3-8b",
        "--context",
        "4096",
        "--manual-tokens",
        "3000",
        "--max-part-tokens",
        "1000",
    )
    # parts of 1,000 tokens overlapping by 125: 4 parts, 1,304 tokens a question
    assert "about 4 parts; 1,304 tokens a question" in r.stdout, r.stdout
    assert "reads 2.5x less KV per answer token than whole" in r.stdout
    r = docqa("kv-budget", "llama-3-8b", "--context", "4096", "--manual-tokens", "50000")
    assert "whole: does not fit (a prompt gives a manual at most 3,792 tokens)" in r.stdout
    _assert_one_line_error(
        docqa("kv-budget", "--max-part-tokens", "100"), "--max-part-tokens goes with"
    )
    _assert_one_line_error(docqa("kv-budget", "--manual-tokens", "0"), "must be positive, got 0")
    _assert_one_line_error(
        docqa("kv-budget", "--manual-tokens", "9000", "--max-part-tokens", "0"),
        "--max-part-tokens must be positive, got 0",
    )
