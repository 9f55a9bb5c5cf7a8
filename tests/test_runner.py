"""The runner boundary: the step's inputs the runner fills, the batched sampler, pins as holds
apart from the request table, and a fingerprint that follows what computes the KV."""

import pytest
import torch

from inference import LLM, SamplingParams
from inference.attention.metadata import AttentionMetadata
from inference.engine import sampler as sampler_module
from inference.engine.sampler import Sampler
from inference.engine.scheduler import ScheduledChunk, SchedulerOutput
from inference.engine.sequence import Request
from inference.runner.inputs import InputBuffers


def _prompt(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 49000, (n,), generator=g).tolist()


def _run(eng, req):
    while not req.finished:
        eng.step()
    eng.release(req)
    return req


def test_input_buffers_hold_what_the_metadata_of_lists_holds():
    """The persistent buffers filled for a step give the same tensors as metadata built from
    lists, and a step after a wider one leaves no stale block ids inside its tables."""
    bufs = InputBuffers(64, 4, 8, 4, torch.device("cpu"))
    a = Request("a", list(range(100, 110)), SamplingParams())  # a prompt chunk of 6 after 4
    b = Request("b", list(range(200, 205)), SamplingParams())
    b.output_token_ids.append(7)  # a decode token after 5 prompt tokens
    wide = SchedulerOutput(
        [
            ScheduledChunk(a, 6, 4, [9, 3, 5], False, True),
            ScheduledChunk(b, 1, 5, [2, 8], True, True),
        ],
        [],
    )
    x = bufs.prepare(wide)
    want = AttentionMetadata.build([[9, 3, 5], [2, 8]], [10, 6], [6, 1], 4, is_decode=[False, True])
    assert x.input_ids.tolist() == list(range(104, 110)) + [7]
    assert x.positions.tolist() == [4, 5, 6, 7, 8, 9, 5]
    for name in ("slot_mapping", "block_tables", "seq_lens", "cu_seqlens_q"):
        assert torch.equal(getattr(x.meta, name), getattr(want, name)), name
    assert x.meta.is_decode_list == [False, True] and x.meta.num_blocks_list == [3, 2]
    assert x.logits_indices.tolist() == [5, 6] and wide.sampling == [a, b]
    narrow = SchedulerOutput([ScheduledChunk(b, 1, 5, [2, 8], True, True)], [])
    x = bufs.prepare(narrow)
    assert x.meta.block_tables.tolist() == [[2, 8]]
    x = bufs.prepare(SchedulerOutput([wide.chunks[1], wide.chunks[0]], []))
    assert x.meta.block_tables.tolist() == [[2, 8, 0], [9, 3, 5]]  # padded with 0 again


def test_sampler_makes_each_generator_on_the_logits_device_and_repeats_with_a_seed(monkeypatch):
    made = []
    real = torch.Generator

    def recording(device=None):
        made.append(torch.device(device))
        return real(device="cpu")

    monkeypatch.setattr(sampler_module.torch, "Generator", recording)
    logits = torch.randn(3, 50, generator=real().manual_seed(0))
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20)
    runs = []
    for _ in range(2):
        reqs = [Request(f"r{i}", [1], params, seed=i) for i in range(2)]
        greedy = Request("g", [1], SamplingParams())
        sampler = Sampler()
        batch = [sampler(logits, [reqs[0], greedy, reqs[1]]) for _ in range(5)]
        runs.append(batch)
        assert all(t[1] == int(logits[1].argmax()) for t in batch)  # greedy row
        assert all(r.generator is not None for r in reqs) and greedy.generator is None
    assert runs[0] == runs[1]  # the same seeds draw the same tokens
    assert made and all(d == logits.device for d in made)


def test_a_seeded_sampled_request_repeats_on_the_torch_backend(tiny_model_dir):
    """Alone or beside other requests, the same seed gives the same tokens."""
    llm = LLM(tiny_model_dir, dtype="bfloat16", kv_cache_gib=0.01, attention_backend="torch")
    assert llm.engine.runner.attention_backend == "torch"
    sp = SamplingParams(max_tokens=8, temperature=0.8, seed=11, ignore_eos=True)
    ids = _prompt(50, 30)
    alone = llm.generate(prompt_token_ids=[ids], sampling_params=sp)[0]
    again = llm.generate(prompt_token_ids=[ids], sampling_params=sp)[0]
    others = [_prompt(51 + i, 20) for i in range(3)]
    batch = llm.generate(prompt_token_ids=[others[0], ids, *others[1:]], sampling_params=sp)
    assert alone.token_ids == again.token_ids == batch[1].token_ids
    assert len(alone.token_ids) == 8


def test_a_callers_request_id_never_touches_a_pins_blocks(tiny_model_dir):
    """A pin is a hold outside the request table: a request named ``pin:x`` (what a pin under
    ``x`` once was) runs and finishes with its own blocks, and the pin keeps its own."""
    eng = LLM(tiny_model_dir, dtype="bfloat16", kv_cache_gib=0.002).engine
    manual = _prompt(60, 100)
    _run(eng, eng.add_request(manual + [5], SamplingParams(max_tokens=1)))
    assert eng.pin("x", manual) == 96
    pinned = eng.kv_manager.find_cached_prefix(manual + [0]).blocks
    before = [b.ref_cnt for b in pinned]
    for rid in ("pin:x", "tier:x"):
        req = eng.add_request(_prompt(61, 40), SamplingParams(max_tokens=3), request_id=rid)
        _run(eng, req)
        assert len(req.output_token_ids) == 3
        eng.kv_manager.check_integrity()
    # the pool is filled with other prompts until every unpinned block was reused
    for i in range(8):
        _run(eng, eng.add_request(_prompt(70 + i, 150), SamplingParams(max_tokens=1)))
    assert [b.ref_cnt for b in pinned] == before
    assert eng.kv_manager.find_cached_prefix(manual + [0]).num_cached_tokens == 96
    assert eng.unpin("x") and not eng.unpin("x")
    assert all(b.ref_cnt == 0 for b in pinned)
    eng.kv_manager.check_integrity()


def test_a_request_id_already_in_the_engine_is_refused(tiny_model_dir):
    eng = LLM(tiny_model_dir, dtype="bfloat16", kv_cache_gib=0.002).engine
    eng.add_request(_prompt(80, 10), SamplingParams(max_tokens=2), request_id="same")
    with pytest.raises(ValueError, match="already in the engine"):
        eng.add_request(_prompt(81, 10), SamplingParams(max_tokens=2), request_id="same")
    eng.abort("same")


def test_the_fingerprint_follows_what_computes_the_kv(tiny_model_dir):
    """Engines that compute KV the same way share a fingerprint (and so prefix-cache keys in
    Redis); another attention backend or dtype gives another."""

    def fingerprint(**kw):
        kw.setdefault("dtype", "bfloat16")
        eng = LLM(tiny_model_dir, kv_cache_gib=0.002, **kw).engine
        return eng.fingerprint, eng.runner.model.compute_signature()

    torch_a, sig = fingerprint(attention_backend="torch")
    torch_b, _ = fingerprint(attention_backend="torch")
    assert torch_a == torch_b
    assert sig.startswith("cpu|attention=torch|") and "linear=" in sig
    assert fingerprint(attention_backend="cpu")[0] != torch_a
    assert fingerprint(attention_backend="torch", dtype="float32")[0] != torch_a


def test_a_row_whose_sampling_fails_fails_alone():
    """NaN logits in one row (a model that blew up for one request): that row's entry is the
    exception, the other rows are sampled as usual; temperatures under 1e-5 are greedy."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 40, generator=gen)
    logits[1] = float("nan")
    params = SamplingParams(temperature=0.7)
    reqs = [Request(f"r{i}", [1], params, seed=i) for i in range(3)]
    out = Sampler()(logits, reqs)
    assert isinstance(out[1], Exception)
    assert all(isinstance(t, int) and 0 <= t < 40 for t in (out[0], out[2]))
    tiny = Request("t", [1], SamplingParams(temperature=1e-38))
    assert tiny.params.greedy and Sampler()(logits[:1], [tiny]) == [int(logits[0].argmax())]


class _HostReads(torch.overrides.TorchFunctionMode):
    """Records every read back to the host (tolist, item, cpu, numpy) of a tensor sharing
    storage with the watched ones."""

    READS = (torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.numpy)

    def __init__(self, watched):
        super().__init__()
        self.ptrs = {t.untyped_storage().data_ptr() for t in watched}
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        t = args[0] if args else None
        if func in self.READS and isinstance(t, torch.Tensor) and self._watched(t):
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))

    def _watched(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.ptrs


def test_planning_a_mixed_step_reads_nothing_back_from_the_device():
    """A step's plans (the torch reference's work items, the Triton backend's split of decode
    rows and prompt chunks) come from the runner's host copies: on a GPU a read of a device
    tensor would make the host wait for every queued kernel before layer 0."""
    from inference.attention.backends import TritonBackend
    from inference.attention.reference import paged_attention_reference

    bufs = InputBuffers(64, 4, 8, 16, torch.device("cpu"))
    a = Request("a", list(range(100, 140)), SamplingParams())
    b = Request("b", list(range(200, 230)), SamplingParams())
    b.output_token_ids.append(7)
    sched = SchedulerOutput(
        [ScheduledChunk(a, 24, 16, [3, 1, 4], False, True),
         ScheduledChunk(b, 1, 30, [5, 2], True, True)],
        [],
    )  # fmt: skip
    meta = bufs.prepare(sched).meta
    # the device's tensors apart from the host's, as on a GPU (on the CPU they are one)
    for name in ("block_tables", "seq_lens", "cu_seqlens_q", "slot_mapping"):
        setattr(meta, name, getattr(meta, name).clone())
    watched = (meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, meta.slot_mapping)
    kc = torch.randn(8, 16, 2, 16)
    q = torch.randn(25, 4, 16)
    with _HostReads(watched) as mode:
        paged_attention_reference(q, kc, kc.clone(), meta, 0.25, flash=False)
        TritonBackend._split(TritonBackend.__new__(TritonBackend), meta, q.device)
    assert not mode.reads, mode.reads
