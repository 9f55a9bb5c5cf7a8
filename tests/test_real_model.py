"""The real default model: logits against transformers' own GGUF loader, and cache numerics."""

import pytest
import torch

from bench.speculation import PUMP
from inference import LLM, SamplingParams
from inference.attention.metadata import AttentionMetadata
from inference.model.llama import LlamaModel
from inference.model.model_import import DEFAULT_GGUF_MEMBER, models_dir
from inference.runner.cpu_runner import cpu_ops
from prompts import PromptBuilder

pytestmark = pytest.mark.slow

MANUAL = PUMP  # a short manual repeated: answers about it quote it
QUESTIONS = [
    "How do I reset the pump?",
    "What does error E7 mean?",
    "How often is the filter cleaned?",
    "Which mode runs continuously?",
]


@pytest.fixture(scope="module")
def bf16_llm(default_model_dir):
    return LLM(default_model_dir, dtype="bfloat16", kv_cache_gib=0.25)


def _first(llm, ids, use_cache, max_tokens=1):
    eng = llm.engine
    req = eng.add_request(
        ids, SamplingParams(max_tokens=max_tokens), use_cache=use_cache, keep_logits=True
    )
    while not req.finished:
        eng.step()
    eng.release(req)
    return req


def test_logits_match_transformers_gguf_loader(default_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    gguf = models_dir() / "gguf" / DEFAULT_GGUF_MEMBER.split("/")[-1]
    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    ops = cpu_ops(torch.float32, torch.float32, "torch", 576)
    ours = LlamaModel.from_pretrained(default_model_dir, torch.float32, ops)
    ids = tokenizer.encode(MANUAL[:700] + " Question: what is mode B?")
    n = len(ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    cfg = ours.cfg
    nblk = -(-n // 16)
    kv = [
        (
            torch.zeros(nblk, 16, cfg.num_kv_heads, cfg.head_dim),
            torch.zeros(nblk, 16, cfg.num_kv_heads, cfg.head_dim),
        )
        for _ in range(cfg.num_layers)
    ]
    meta = AttentionMetadata.build([list(range(nblk))[::-1]], [n], [n], 16)
    got = ours.forward(torch.tensor(ids), torch.arange(n), meta, kv, torch.arange(n))
    rel = float((got - ref).norm() / ref.norm())
    print(f"fp32 logits vs transformers GGUF loader: rel {rel:.2e} over {n} tokens")
    assert rel < 1e-4


def test_float32_model_keeps_its_quantized_weights_with_the_same_logits(
    default_model_dir, tokenizer, monkeypatch
):
    """In float32 the default model's linear layers stay in their GGUF block forms (Q4_1, the
    tied output Q8_0): about a fifth of the float32 bytes, and logits bitwise equal to the
    same model on plain float32 panels, for a prompt and for the decode step after it."""
    from inference.kernels.cpu import linear as cpu_linear
    from inference.kernels.cpu.linear_layer import CPULinear

    if not cpu_linear.linear_f32_panel():
        pytest.skip("linear.c is not built here")
    ids = tokenizer.encode(MANUAL[:400] + " Question: what is mode B?")
    n = len(ids)
    nblk = -(-(n + 1) // 16)
    logits, sizes = {}, {}
    for quantized in ("1", "0"):
        monkeypatch.setenv("DOCQA_QUANTIZED_WEIGHTS", quantized)
        ops = cpu_ops(torch.float32, torch.float32, "torch", 576)
        model = LlamaModel.from_pretrained(default_model_dir, torch.float32, ops)
        cfg = model.cfg
        lins = [model.lm_head] + [
            getattr(layer, name)
            for layer in model.layers
            for name in ("qkv", "o_proj", "gate_up", "down")
        ]
        assert all(isinstance(lin, CPULinear) for lin in lins)
        formats = {cpu_linear.weight_format(lin._panels) for lin in lins}
        assert formats == ({"q4_1", "q8_0"} if quantized == "1" else {"float32"}), formats
        sizes[quantized] = sum(lin._panels.numel() for lin in lins)
        kv = [
            (
                torch.zeros(nblk, 16, cfg.num_kv_heads, cfg.head_dim),
                torch.zeros(nblk, 16, cfg.num_kv_heads, cfg.head_dim),
            )
            for _ in range(cfg.num_layers)
        ]
        table = [list(range(nblk))[::-1]]
        meta = AttentionMetadata.build(table, [n], [n], 16)
        first = model.forward(torch.tensor(ids), torch.arange(n), meta, kv, torch.tensor([n - 1]))
        nxt = int(first[0].argmax())
        meta = AttentionMetadata.build(table, [n + 1], [1], 16, is_decode=[True])
        second = model.forward(torch.tensor([nxt]), torch.tensor([n]), meta, kv, torch.tensor([0]))
        logits[quantized] = (first, second)
    assert sizes["1"] * 4 < sizes["0"]
    assert torch.equal(logits["1"][0], logits["0"][0])
    assert torch.equal(logits["1"][1], logits["0"][1])


def test_bf16_cold_and_warm_are_bitwise_equal(bf16_llm):
    builder = PromptBuilder(bf16_llm.tokenizer)
    prefix, _ = builder.prefix_ids(MANUAL)
    assert len(prefix) % 16 != 0  # the shared prefix ends mid-block
    _first(bf16_llm, builder.build(MANUAL, "Warm-up question?").token_ids, use_cache=True)
    for q in QUESTIONS:
        ids = builder.build(MANUAL, q, manual_ids=(prefix, 0)).token_ids
        warm = _first(bf16_llm, ids, use_cache=True, max_tokens=12)
        cold = _first(bf16_llm, ids, use_cache=False, max_tokens=12)
        # the whole prefix: its full blocks, then its last tokens copied from a block an
        # earlier question filled after them
        assert warm.num_cached_tokens >= len(prefix)
        assert torch.equal(warm.logits[0], cold.logits[0]), q
        assert warm.output_token_ids == cold.output_token_ids, q
    # full-prompt hit: the same prompt again computes its last token only
    again = _first(bf16_llm, ids, use_cache=True)
    assert again.num_cached_tokens == len(ids) - 1
    assert torch.equal(again.logits[0], cold.logits[0])
    bf16_llm.engine.kv_manager.check_integrity()


def test_bf16_decode_logits_equal_alone_and_in_a_batch(bf16_llm):
    """Decode tokens through the compiled CPU kernel: each question's logits at every decode
    step are the same bits alone and with the other questions about the same manual (which
    share its cached blocks) in the step."""
    eng = bf16_llm.engine
    assert eng.runner.attention_backend == "cpu"  # gcc is on every machine the tests run on
    builder = PromptBuilder(bf16_llm.tokenizer)
    prompts = [builder.build(MANUAL, q).token_ids for q in QUESTIONS]
    _first(bf16_llm, prompts[0], use_cache=True)  # the manual cached
    alone = [_first(bf16_llm, ids, use_cache=True, max_tokens=8) for ids in prompts]
    params = SamplingParams(max_tokens=8)
    reqs = [eng.add_request(ids, params, use_cache=True, keep_logits=True) for ids in prompts]
    while any(not r.finished for r in reqs):
        eng.step()
    for a, b, q in zip(alone, reqs, QUESTIONS, strict=True):
        assert a.output_token_ids == b.output_token_ids, q
        assert len(a.logits) == len(b.logits) > 1
        for la, lb in zip(a.logits, b.logits, strict=True):
            assert torch.equal(la, lb), q
        eng.release(b)
    eng.kv_manager.check_integrity()


def test_fp32_greedy_tokens_agree_cold_and_warm(default_model_dir):
    llm = LLM(default_model_dir, dtype="float32", kv_cache_gib=0.25)
    builder = PromptBuilder(llm.tokenizer)
    max_diff = 0.0
    for q in QUESTIONS[:2]:
        ids = builder.build(MANUAL, q).token_ids
        _first(llm, ids, use_cache=True)  # cache the prefix
        warm = _first(llm, ids, use_cache=True, max_tokens=10)
        cold = _first(llm, ids, use_cache=False, max_tokens=10)
        assert warm.num_cached_tokens > 0
        assert warm.output_token_ids == cold.output_token_ids
        max_diff = max(max_diff, float((warm.logits[0] - cold.logits[0]).abs().max()))
    print(f"fp32 max |logit difference| cold vs warm: {max_diff:.2e}")
    assert max_diff < 1e-2


def test_kv_bytes_of_loaded_model(bf16_llm):
    eng = bf16_llm.engine
    assert eng.kv_spec.bytes_per_token == 2 * 30 * 3 * 64 * 2  # 22.5 KiB
    assert eng.runner.allocated_bytes() == eng.kv_spec.total_bytes
