"""Benchmark models (``--model random:NAME``, inference/model/bench_model.py): random weights
of a known shape with the default tokenizer, served only when asked for."""

import json

from test_cli import _assert_one_line_error, docqa

from inference.model.bench_model import benchmark_model_dir


def test_a_benchmark_models_directory_has_its_shape_and_the_default_tokenizer(
    default_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("DOCQA_HOME", str(tmp_path))
    src = tmp_path / "models" / default_model_dir.name
    src.mkdir(parents=True)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (src / f).write_bytes((default_model_dir / f).read_bytes())
    d = benchmark_model_dir("random:llama-2-7b")
    cfg = json.loads((d / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_key_value_heads"]) == (
        4096,
        32,
        32,
    )
    # llama-2's 32,000 ids are fewer than the tokenizer's 49,152: every id it gives must fit
    assert cfg["vocab_size"] == 49152
    assert (d / "tokenizer.json").read_bytes() == (
        default_model_dir / "tokenizer.json"
    ).read_bytes()


def test_a_benchmark_model_is_served_only_when_asked_for(default_model_dir, tmp_path):
    """``--model random:NAME``: random weights of a known shape with the default tokenizer, for
    a machine without weight files. Refused without ``--benchmark-weights``; with it the
    service answers (noise) and ``/v1/engine`` says the weights are random."""
    from svc_helpers import Server

    _assert_one_line_error(
        docqa("serve", "--model", "random:smollm2-135m"), "add --benchmark-weights"
    )
    _assert_one_line_error(
        docqa("serve", "--model", "random:gpt-17", "--benchmark-weights"), "unknown benchmark"
    )
    srv = Server(tmp_path, f"sqlite:///{tmp_path / 'b.db'}", name="bench",
                 args=("--model", "random:smollm2-135m", "--benchmark-weights"))  # fmt: skip
    srv.start()
    try:
        with srv.client() as c:
            e = c.get("/v1/engine").json()
            assert e["weights"] == "random" and e["model"] == "random-smollm2-135m"
            man = c.post("/v1/manuals", json={"title": "t", "text": "tarx extracts archives."})
            r = c.post("/v1/ask", json={"manual_id": man.json()["id"], "question": "What?",
                                        "max_tokens": 4, "ignore_eos": True})  # fmt: skip
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        srv.stop()
