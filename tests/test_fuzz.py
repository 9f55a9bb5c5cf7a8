"""Schemathesis against a real ``docqa serve`` (SQLite): every operation of /schema fuzzed, then
the stateful phase following the schema's links from uploads to conversations, questions and
cancellations. Any 5xx fails the test."""

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from svc_helpers import Server

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).parent / "fuzz" / "schemathesis.toml"
MIN_CASES = 2000


def test_fuzzing_the_api_finds_no_server_error(default_model_dir, tmp_path):
    # short answers: the fuzz is about the API surface, and an answer of the default cap
    # (1,024 tokens) would take most of its time
    srv = Server(
        tmp_path, f"sqlite:///{tmp_path / 'fuzz.db'}", args=("--max-tokens-cap", "16"), name="fuzz"
    ).start()
    try:
        cmd = [
            sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "run",
            f"{srv.url}/schema/openapi.json", "--checks", "not_a_server_error",
            "--max-examples", "100", "--workers", "1", "--seed", "6",
            "--generation-database", "none", "--no-color", "--request-timeout", "120",
            "--report", "har", "--report-dir", str(tmp_path / "report"),
        ]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    finally:
        srv.stop()
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    cases = int(re.search(r"(\d+) generated", out).group(1))
    assert cases >= MIN_CASES, out[-3000:]
    assert re.search(r"Stateful \(in", out), out[-3000:]
    # the stateful phase reached the operations that need ids other operations return
    har = json.loads(next((tmp_path / "report").glob("har-*.json")).read_text())
    reached = Counter()
    for entry in har["log"]["entries"]:
        url, status = entry["request"]["url"], entry["response"]["status"]
        assert status < 500, (url, status, entry["response"]["content"].get("text", "")[:500])
        for name, pattern in (
            ("conversation", r"/v1/conversations/conv_[0-9a-f]+(/messages)?$"),
            ("cancel", r"/v1/requests/(msg_|chatcmpl-)[0-9a-f]+/cancel$"),
            ("manual", r"/v1/manuals/man_[0-9a-f]+(/\w+)?$"),
        ):
            if re.search(pattern, url):
                reached[name] += 1
    assert reached["conversation"] and reached["cancel"] and reached["manual"], reached
    print(f"{cases} cases, stateful reached {dict(reached)}")
