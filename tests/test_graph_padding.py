"""What a captured decode graph needs of the CPU-testable parts: the batch sizes steps are
padded to, and padded steps (rows of slot -1 and context 0) that leave the real rows' logits
bitwise equal and write nothing to the pool (torch backend)."""

import pytest
import torch

from inference import LLM, SamplingParams
from inference.engine.scheduler import ScheduledChunk, SchedulerOutput
from inference.runner.graphs import capture_sizes, padded_size


def test_capture_sizes_and_the_size_a_step_replays():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]
    assert capture_sizes(3) == [1, 2, 3] and capture_sizes(1) == [1]
    sizes = capture_sizes(64)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 8, 9, 63, 64)] == [1, 4, 8, 8, 16, 64, 64]
    assert padded_size(65, sizes) is None and padded_size(0, sizes) is None
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_padded_decode_rows_change_no_real_row_and_store_nothing(tiny_model_dir):
    llm = LLM(tiny_model_dir, dtype="float32", kv_cache_gib=0.002, attention_backend="torch")
    eng = llm.engine
    runner = eng.runner
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    reqs = [eng.add_request(list(range(100 + 7 * i, 137 + 7 * i)), params) for i in range(3)]
    while any(not r.output_token_ids for r in reqs):  # prompts done, first tokens sampled
        eng.step()
    chunks = []
    for r in reqs:
        ctx = r.num_computed_tokens
        blocks = eng.kv_manager.allocate(r.request_id, ctx + 1)
        chunks.append(ScheduledChunk(r, 1, ctx, [b.block_id for b in blocks], True, True))
    sched = SchedulerOutput(chunks, [])
    pools = [t.clone() for pair in runner.kv_caches for t in pair]

    def logits(pad_to):
        for t, saved in zip((t for pair in runner.kv_caches for t in pair), pools, strict=True):
            t.copy_(saved)
        x = runner.inputs.prepare(sched, pad_to=pad_to)
        out = runner.model.forward(
            x.input_ids, x.positions, x.meta, runner.kv_caches, x.logits_indices
        )
        return out, [t.clone() for pair in runner.kv_caches for t in pair]

    plain, pool_plain = logits(None)
    padded, pool_padded = logits(8)
    assert padded.shape[0] == 8 and plain.shape[0] == 3
    assert torch.equal(padded[:3], plain)
    for a, b in zip(pool_plain, pool_padded, strict=True):
        assert torch.equal(a, b)  # the padding rows stored nothing
    with pytest.raises(ValueError, match="decode steps only"):
        runner.inputs.prepare(sched, pad_to=2)
