"""The CUDA runner end to end on CPU tensors under Triton's interpreter: its own ops table (the
fused RMSNorm, rotary-with-store and SiLU-mul kernels, the Triton attention kernels, torch's or
the batch-invariant Triton products) and its own sizing, behind the real engine, against the
torch reference engine; 16-bit, int8 and fp8 KV caches.

What the interpreter can show: the same greedy tokens as the reference; a cache hit's tokens
equal to the cold run's and its logits within float32 rounding (the interpreter's products are
numpy's, which round a row by its place in the block: bitwise equality is checked on a GPU by
bench/gpu.py); a request's tokens alone and in a batch equal.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined

import pytest  # noqa: E402
import torch  # noqa: E402

from inference import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from inference.runner.cuda_runner import CUDARunner  # noqa: E402

MANUAL = list(range(1000, 1083))  # 83 tokens: five full blocks and a partial one
QUESTIONS = [list(range(2000 + 50 * i, 2000 + 50 * i + n)) for i, n in enumerate((7, 20))]


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory, default_model_dir):
    """The tiny model with a vocabulary of 3,072 (the interpreter runs the LM head's product
    tile by tile in Python: the default vocabulary's would take minutes a test)."""
    from conftest import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-vocab") / "m", default_model_dir,
                            vocab=3072)  # fmt: skip


def _config(model_dir, kv_dtype, invariant=False, backend="triton") -> EngineConfig:
    return EngineConfig(
        model_dir=model_dir,
        dtype="float32",
        kv_dtype=kv_dtype,
        kv_cache_gib=0.002,
        attention_backend=backend,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        batch_invariant=invariant,
    )


def _run(eng: LLMEngine, prompts, use_cache=True, max_tokens=3):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    reqs = [eng.add_request(p, params, use_cache=use_cache, keep_logits=True) for p in prompts]
    while any(not r.finished for r in reqs):
        eng.step()
    for r in reqs:
        eng.release(r)
    return reqs


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize(
    "kv_dtype,invariant", [(None, False), (None, True), ("int8", True), ("fp8", False)]
)
def test_the_cuda_runner_serves_as_the_reference_does(small_vocab_model, kv_dtype, invariant):
    prompts = [MANUAL + q for q in QUESTIONS]
    ref = LLMEngine(_config(small_vocab_model, kv_dtype, backend="torch"))
    expected = [_run(ref, [p], use_cache=False)[0] for p in prompts]
    ref.close()

    config = _config(small_vocab_model, kv_dtype, invariant)
    eng = LLMEngine(config, runner=CUDARunner(config, torch.device("cpu")))
    sig = eng.runner.model.compute_signature()
    assert sig.startswith("cuda|attention=triton|fused"), sig
    assert ("mode=batch-invariant" in sig) == invariant
    kinds = {lin.kind for lin in eng.runner.model.linears()}
    assert kinds == ({"triton-invariant"} if invariant else {"torch"})

    cold = [_run(eng, [p], use_cache=False)[0] for p in prompts]
    for got, want in zip(cold, expected, strict=True):
        assert got.output_token_ids == want.output_token_ids
        for a, b in zip(got.logits, want.logits, strict=True):
            assert _rel(a, b) < 1e-4
    # a cache hit: the manual's blocks from the first question, then each question warm
    _run(eng, [prompts[0]])
    warm = [_run(eng, [p])[0] for p in prompts]
    for w, c in zip(warm, cold, strict=True):
        assert w.num_cached_tokens >= 80
        assert w.output_token_ids == c.output_token_ids
        for a, b in zip(w.logits, c.logits, strict=True):
            assert _rel(a, b) < 1e-5
    # alone and batched: the same tokens
    batched = _run(eng, prompts, use_cache=False)
    for b, c in zip(batched, cold, strict=True):
        assert b.output_token_ids == c.output_token_ids
        for x, y in zip(b.logits, c.logits, strict=True):
            assert _rel(x, y) < 1e-5
    eng.kv_manager.check_integrity()
    eng.close()


def test_the_cuda_runner_refuses_block_sizes_its_kernels_cannot_read(tiny_model_dir):
    """A block of 8 tokens passes the engine's configuration but not the Triton kernels, whose
    dot products take at least 16 keys: refused when the runner starts, not at the first
    forward pass."""
    config = EngineConfig(
        model_dir=tiny_model_dir, dtype="float32", kv_cache_gib=0.002, block_size=8
    )
    with pytest.raises(ValueError, match="block_size must be a power of two >= 16"):
        CUDARunner(config, torch.device("cpu"))
    cpu_triton = EngineConfig(
        model_dir=tiny_model_dir,
        dtype="float32",
        kv_cache_gib=0.002,
        block_size=8,
        attention_backend="triton",
    )
    with pytest.raises(ValueError, match="block_size must be a power of two >= 16"):
        LLMEngine(cpu_triton)


def test_start_up_logs_the_measured_and_the_planned_reserve(tiny_model_dir, caplog):
    config = _config(tiny_model_dir, None)
    with caplog.at_level("INFO", logger="docqa.engine"):
        runner = CUDARunner(config, torch.device("cpu"))
    line = next(r.getMessage() for r in caplog.records if "activation reserve" in r.getMessage())
    assert "MiB measured" in line and "MiB planned" in line, line
    # under the interpreter the start-up steps stay one block of tokens, two sequences
    assert (runner.reserve.prefill_tokens, runner.reserve.decode_seqs) == (16, 2)
    assert runner.reserve.planned_bytes > 0 and runner.prefill_samples == []
