"""The compiled layer loop (inference/kernels/cpu/forward.py, csrc/forward.c) against the model's
Python loop: the same kernels with the same arguments, so the same bits, step after step."""

import gc
import weakref

import pytest
import torch
from conftest import write_tiny_model

from inference import LLM, SamplingParams


@pytest.fixture(scope="module")
def kernel_model_dir(tmp_path_factory, default_model_dir):
    """A tiny checkpoint in shapes the CPU kernels take (head size 64, 3 query heads per KV
    head as SmolLM2, inputs in whole blocks of 32), with a qkv bias as Qwen2 has."""
    return write_tiny_model(
        tmp_path_factory.mktemp("kernel-shapes") / "m",
        default_model_dir,
        num_heads=6,
        num_kv_heads=2,
        head_dim=64,
        hidden=192,
        intermediate=320,
        layers=3,
        seed=5,
        qkv_bias=True,
    )


def _compiled_path_here(model_dir, dtype: str) -> bool:
    """Whether this CPU runs the kernel model's layers in one call (asked of the code that
    decides it, never assumed from the CPU the test was written on)."""
    from inference.kernels.cpu.forward import layers_compile_here
    from inference.model.config import ModelConfig

    t = getattr(torch, dtype)
    return layers_compile_here(t, t, ModelConfig.from_file(model_dir), 16)


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 49000, (n,), generator=g).tolist()


def _serve(llm, compiled: bool) -> list:
    """A short request alone, then five at once (a shared 150-token prefix, chunked prompts
    beside decodes), greedy; returns the requests with their logits."""
    eng = llm.engine
    eng.runner.model.compiled_layers = compiled
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    manual = _prompt(1, 150)
    done = []
    first = eng.add_request(_prompt(2, 9), params, keep_logits=True)
    while not first.finished:
        eng.step()
    done.append(first)
    reqs = [
        eng.add_request(manual + _prompt(10 + i, 5 + 9 * i), params, keep_logits=True)
        for i in range(5)
    ]
    while not all(r.finished for r in reqs):
        eng.step()
    eng.kv_manager.check_integrity()
    return done + reqs


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_compiled_layers_give_the_python_loops_bits(kernel_model_dir, dtype):
    if not _compiled_path_here(kernel_model_dir, dtype):
        pytest.skip(f"no compiled {dtype} linear kernel on this CPU: the Python loop runs")
    runs = {}
    for compiled in (True, False):
        llm = LLM(kernel_model_dir, dtype=dtype, kv_cache_gib=0.01, max_num_batched_tokens=64)
        model = llm.engine.runner.model
        taken = model.layer_loop(llm.engine.runner.kv_caches) is not None
        assert taken, "the compiled loop should take a model whose every part has a kernel"
        runs[compiled] = _serve(llm, compiled)
        assert (model.layer_loop(llm.engine.runner.kv_caches) is not None) == compiled
    for fast, slow in zip(runs[True], runs[False], strict=True):
        assert fast.output_token_ids == slow.output_token_ids
        assert len(fast.logits) == len(slow.logits) == 6
        for a, b in zip(fast.logits, slow.logits, strict=True):
            assert torch.equal(a, b)


def test_models_without_kernels_for_every_part_keep_the_python_loop(tiny_model_dir):
    # head size 16: no attention kernel takes it
    llm = LLM(tiny_model_dir, dtype="float32", kv_cache_gib=0.002)
    assert llm.engine.runner.model.layer_loop(llm.engine.runner.kv_caches) is None
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[_prompt(3, 20)], sampling_params=params)
    assert len(out[0].token_ids) == 3


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_deleted_engine_frees_its_memory_at_once(kernel_model_dir, dtype):
    """No reference cycle keeps an engine's runner, model or KV pool alive after the last
    reference goes (the runner's sampler and the model's compiled layer loop hold none back):
    a second engine in the same process finds the memory free without a garbage collection."""
    gc.collect()
    gc.disable()
    try:
        llm = LLM(kernel_model_dir, dtype=dtype, kv_cache_gib=0.01, max_num_batched_tokens=64)
        llm.generate(
            prompt_token_ids=[_prompt(4, 30)], sampling_params=SamplingParams(max_tokens=2)
        )
        runner = llm.engine.runner
        if runner.prefault is not None:  # the pool's pages mapped in the background hold it
            runner.prefault.join()
        held = [llm.engine, runner, runner.model, runner.sampler, runner.kv_caches[0][0]]
        refs = [weakref.ref(x) for x in held]
        del llm, runner, held
        alive = [type(r()).__name__ for r in refs if r() is not None]
        assert not alive, f"kept alive by a reference cycle: {alive}"
    finally:
        gc.enable()
