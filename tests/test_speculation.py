"""Prompt-lookup speculation: the n-gram index, and answers token for token (logits bit for bit)
those of plain decoding, on the real model."""

import json
import random
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from bench.speculation import PUMP  # the pump manual of the benchmark and test_real_model
from inference import LLM, SamplingParams
from inference.engine.draft_costs import StepCost, StepOutcomes
from inference.engine.sequence import Request
from inference.engine.speculate import (
    SEPARATOR,
    AnswerBank,
    DraftPolicy,
    NgramIndex,
    SpeculationConfig,
)
from prompts import PromptBuilder

ROOT = Path(__file__).resolve().parents[1]
TARX = (ROOT / "app" / "samples" / "tarx-manual.md").read_text()[:5000]
# answers that quote the manual, and answers in other words
QUOTING = {
    "pump": ["How do I reset the pump? Quote the manual.", "What does error E7 mean?"],
    "tarx": ["How do I create a compressed archive? Give the command.", "What does -x do?"],
}
OTHER = {
    "pump": ["Is this pump good for a garden? Answer yes or no.", "Summarize in your words."],
    "tarx": ["Would you recommend tarx? One word.", "Write a haiku about archives."],
}
MANUALS = {"pump": PUMP, "tarx": TARX}


def _seq(tokens):
    return lambda a, b: tokens[a:b]


def test_the_index_built_at_once_equals_the_one_extended_token_by_token():
    toks = [5, 6, 7, 8, 5, 6, 7, 9, 1, 5, 6, 7]
    whole = NgramIndex(2, 4)
    whole.build(toks)
    grown = NgramIndex(2, 4)
    grown.build(toks[:3])
    for n in range(4, len(toks) + 1):
        grown.extend(_seq(toks), n)
    assert whole.tables == grown.tables and grown.length == len(toks)
    # "5 6 7" ends the sequence (no 4-gram does earlier); its latest earlier occurrence
    # (positions 4-6) was followed by 9
    assert whole.propose(_seq(toks), len(toks), 3) == [9, 1, 5]
    # the longest n-gram wins over a shorter, more recent one
    toks2 = [1, 2, 3, 4, 0, 3, 4, 7, 1, 2, 3, 4]
    idx = NgramIndex(1, 4)
    idx.build(toks2)
    assert idx.propose(_seq(toks2), len(toks2), 2) == [0, 3]
    assert idx.propose(_seq(toks2), len(toks2), 0) == []
    none = NgramIndex(2, 3)
    none.build([1, 2, 3, 4])
    assert none.propose(_seq([1, 2, 3, 4]), 4, 4) == []
    with pytest.raises(ValueError, match="n-gram sizes"):
        NgramIndex(3, 2)


def _propose(bank, group, tail, n, k):
    """What ``group``'s answers propose after ``tail`` ([] for a group with none)."""
    answers = bank.get(group)
    return answers.propose(tail, n, k) if answers is not None else []


def test_the_answer_bank_proposes_what_a_groups_earlier_answers_said_next():
    bank = AnswerBank(1, 3, tokens_per_group=16, max_groups=2)
    bank.add(b"a", [1, 2, 3, 4, 5])
    bank.add(b"a", [7, 2, 3, 9])
    bank.add(b"b", [1, 2, 8])
    bank.add(b"a", [6])  # one token says nothing about what follows: not kept
    # the most recent occurrence of "2 3" in group a was followed by 9, then the answer ended
    assert _propose(bank, b"a", [0, 2, 3], 2, 5) == [9]
    assert _propose(bank, b"a", [4], 1, 5) == [5]  # a draft never crosses into the next answer
    assert _propose(bank, b"b", [0, 2, 3], 2, 5) == []  # groups are apart
    assert _propose(bank, b"b", [2], 1, 5) == [8]
    assert _propose(bank, None, [2], 1, 5) == [] and _propose(bank, b"c", [2], 1, 5) == []
    # full: the older answers go, the newer stay (an answer's last half a group at most)
    bank.add(b"a", [10, 11, 12, 13, 14, 15, 16, 17, 18, 19])
    toks = bank.get(b"a").tokens
    assert toks == [7, 2, 3, 9, SEPARATOR, 12, 13, 14, 15, 16, 17, 18, 19, SEPARATOR]
    assert _propose(bank, b"a", [4], 1, 5) == [] and _propose(bank, b"a", [12], 1, 2) == [13, 14]
    bank.add(b"c", [1, 2])  # a third group: the least recently used (b) goes
    assert len(bank) == 2 and bank.get(b"b") is None


def test_a_request_drafts_from_its_groups_answers_after_its_own_tokens():
    policy = DraftPolicy(SpeculationConfig(max_draft_tokens=4))
    policy.bank.add(b"m", [4, 5, 6, 7, 8])
    req = Request("r", [1, 2, 3, 1, 2, 4, 5], SamplingParams())
    assert policy.propose(req, 4) == []  # its own tokens never had "5" followed
    req.draft_group = b"m"
    assert policy.propose(req, 4) == [6, 7, 8]
    own = Request("o", [1, 2, 3, 1, 2], SamplingParams(), draft_group=b"m")
    assert policy.propose(own, 4) == [3, 1, 2]  # its own "1 2" comes first


def test_an_8000_token_prompt_is_indexed_once_and_looked_up_in_microseconds():
    """A behaviour check with a generous bound (the figures are bench/speculation.py's)."""
    import random

    rng = random.Random(0)
    toks = [rng.randrange(49152) for _ in range(8000)]
    idx = NgramIndex(2, 4)
    t0 = time.perf_counter()
    idx.build(toks)
    built = time.perf_counter() - t0
    seq = toks + toks[100:104]
    t0 = time.perf_counter()
    for _ in range(100):
        draft = idx.propose(_seq(seq), len(seq), 8)
    per_lookup = (time.perf_counter() - t0) / 100
    assert draft == toks[104:112]
    assert built < 1.0 and per_lookup < 0.01, (built, per_lookup)


def test_the_policy_drafts_where_rows_are_cheap_and_only_likely_tokens_under_load():
    # rows cost nothing up to 8, then a quarter of a decode row's share each, then their share
    cost = StepCost([(1, 0.010), (8, 0.010), (16, 0.016), (32, 0.020), (64, 0.060)])
    policy = DraftPolicy(SpeculationConfig(max_draft_tokens=8), cost)
    req = Request("r", [1, 2, 3, 1, 2], SamplingParams())
    assert policy.propose(req, 8) == [3, 1, 2]  # "1 2" was followed by 3
    # alone, the free rows carry the whole proposal, whatever its acceptance
    assert policy.plan({req: [3, 1, 2]}, 1, 64) == {req: (3, 1, 2)}
    for _ in range(6):  # its drafts keep missing: its acceptance falls from the engine's
        policy.verified(req, 3, 0)
    assert policy.acceptance(req)[0] < 0.2
    assert policy.plan({req: [3, 1, 2]}, 1, 64) == {req: (3, 1, 2)}  # still free
    # 16 requests decoding: the missing request drafts nothing, one whose drafts held
    # drafts while its tokens are likely enough to pay for their rows
    good = Request("g", [1, 2, 3, 1, 2], SamplingParams())
    for _ in range(6):
        policy.verified(good, 4, 4)
    plan = policy.plan({req: [3, 1, 2], good: [3, 1, 2, 9]}, 16, 64)
    assert req not in plan and len(plan[good]) >= 3, plan
    # the step's rows never pass max_rows
    assert policy.plan({good: [3, 1, 2, 9]}, 16, 17) == {good: (3,)}
    st = req.draft
    assert (st.drafted, st.accepted, st.rejected, st.steps) == (18, 0, 18, 6)
    with pytest.raises(ValueError):
        SpeculationConfig(max_step_rows=1)


def test_a_drafts_first_token_and_the_tokens_after_a_held_one_have_rates_of_their_own():
    policy = DraftPolicy(SpeculationConfig())
    req = Request("r", [1, 2, 3], SamplingParams())
    for held in (0, 8, 0, 8, 0, 8):  # half the drafts start wrong, the others hold whole
        policy.verified(req, 8, held)
    first, then = policy.acceptance(req)
    assert 0.3 < first < 0.7 and then > 0.9, (first, then)
    # a draft's eighth token is nearly as likely as its first (one rate for both would
    # price it at first ** 8)
    assert first * then**7 > 0.5 * first
    st = req.draft
    assert (st.drafted, st.accepted, st.steps) == (48, 24, 6)
    # under load (a drafted row pays above 0.25 here), a request whose drafts start right and
    # then miss drafts its first token alone: it is priced by the first rate, the next by both
    cost = StepCost([(1, 0.010), (8, 0.010), (16, 0.016), (32, 0.020), (64, 0.060)])
    policy = DraftPolicy(SpeculationConfig(), cost)
    short = Request("s", [1, 2, 3], SamplingParams())
    for _ in range(8):
        policy.verified(short, 4, 1)
    first, then = policy.acceptance(short)
    assert first > 0.8 and first * then < 0.25, (first, then)
    assert policy.plan({short: [7, 8, 9, 9]}, 16, 64) == {short: (7,)}


def test_drafts_are_looked_up_only_where_the_plan_could_take_one():
    """``may_pay`` is False only where ``plan`` takes nothing, whatever the drafts are."""
    cost = StepCost([(1, 0.010), (8, 0.010), (16, 0.016), (32, 0.020), (64, 0.060)])
    policy = DraftPolicy(SpeculationConfig(max_draft_tokens=8), cost)
    rng = random.Random(0)
    skipped = taken = 0
    for trial in range(300):
        reqs = [
            Request(f"{trial}.{i}", [1, 2, 3], SamplingParams()) for i in range(rng.randint(1, 24))
        ]
        for r in reqs:
            for _ in range(rng.randint(0, 6)):
                d = rng.randint(1, 8)
                policy.verified(r, d, rng.choice([0, rng.randint(0, d), d]))
        proposals = {r: [5] * rng.randint(1, 8) for r in reqs}
        rows = len(reqs)
        max_rows = rng.choice([rows, rows + 1, 32, 64])
        plan = policy.plan(proposals, rows, max_rows)
        if not policy.may_pay(reqs, rows, max_rows):
            assert plan == {}, (trial, plan)
            skipped += 1
        taken += bool(plan)
    assert skipped >= 30 and taken >= 30, (skipped, taken)
    # alone, rows are free: its drafts are always looked up
    assert policy.may_pay([Request("one", [1, 2], SamplingParams())], 1, 64)


def test_a_batch_size_where_drafting_measured_slower_drafts_only_now_and_then():
    out = StepOutcomes()
    assert [out.bucket(n) for n in (1, 2, 3, 4, 15, 16)] == [0, 1, 1, 2, 3, 4]
    # 16 requests: steps with drafts give 500 tokens/s, steps without 800
    drafted_at = []
    for step in range(1500):
        if out.may_draft(16):
            drafted_at.append(step)
            out.observe(16, True, 20, 0.040)
        else:
            out.observe(16, False, 16, 0.020)
    assert out.losing(16) and not out.losing(2)
    # learning (every other step until 8 of each kind), then retries ever further apart: a
    # retry that still lost doubles the wait, up to RETRY_MAX
    gaps = [b - a for a, b in zip(drafted_at, drafted_at[1:], strict=False)]
    assert gaps[:7] == [2] * 7, gaps
    waits = [g - 1 for g in gaps[7:]]
    assert waits[0] >= out.RETRY and waits[-1] == out.RETRY_MAX, waits
    assert all(b == min(2 * a, out.RETRY_MAX) for a, b in zip(waits, waits[1:], strict=False)), (
        waits
    )
    # a retry sees drafting pay again: it is taken up again
    for _ in range(out.RETRY_MAX):
        out.observe(16, False, 16, 0.020)
    assert out.may_draft(16)
    for _ in range(8):
        out.observe(16, True, 40, 0.030)
    assert not out.losing(16)
    # 2 requests, drafting well ahead: a step without drafts every PLAIN_EVERY_WINNING steps
    plain = 0
    for _ in range(200):
        if out.may_draft(2):
            out.observe(2, True, 6, 0.012)
        else:
            plain += 1
            out.observe(2, False, 2, 0.012)
    assert 200 // (out.PLAIN_EVERY_WINNING + 1) <= plain <= 8 + 200 // out.PLAIN_EVERY
    assert not out.losing(2)
    # one request alone always may: its drafts are priced by its own timed rows
    for _ in range(20):
        out.observe(1, True, 1, 0.1)
        out.observe(1, False, 1, 0.01)
    assert out.may_draft(1)


def test_step_costs_follow_the_engines_own_steps_and_learn_what_drafted_rows_add():
    cost = StepCost([(1, 0.010), (4, 0.016), (8, 0.020)])
    assert cost(1, 1) == 0.010 and cost(2, 2) == pytest.approx(0.012)
    assert cost(4, 16) == pytest.approx(0.016 + 0.012)  # past the points, along the last two
    for _ in range(StepCost.SEEN):  # plain steps of 4 requests take 30 ms here
        cost.observe(4, 4, 0.030)
    assert cost(4, 4) == pytest.approx(0.030)
    # drafted rows, measured against those 30 ms, cost twice what the points say
    assert cost(4, 8) == pytest.approx(0.034)
    for _ in range(60):
        cost.observe(4, 8, 0.038)
    assert cost.scale == pytest.approx(2.0, rel=0.01) and cost(4, 8) == pytest.approx(0.038, 1e-3)
    assert StepCost()(5, 5) == StepCost()(5, 50)  # nothing timed: rows cost alike


# -- the real model ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llms(default_model_dir):
    """The same model twice, with and without speculation, in the dtypes docqa computes in."""
    out = {}
    for dtype in ("bfloat16", "float32"):
        out[dtype] = {
            mode: LLM(default_model_dir, dtype=dtype, kv_cache_gib=0.25, speculate=mode)
            for mode in ("off", "prompt-lookup")
        }
    return out


def _run(llm, prompts, params, speculate=(True,), keep_logits=True):
    """Every prompt at once (one batch); the finished requests, in order."""
    eng = llm.engine
    flags = list(speculate) * len(prompts) if len(speculate) == 1 else list(speculate)
    reqs = [
        eng.add_request(ids, params, keep_logits=keep_logits, speculate=s)
        for ids, s in zip(prompts, flags, strict=True)
    ]
    while not all(r.finished for r in reqs):
        eng.step()
    for r in reqs:
        assert r.error is None, r.error
        eng.release(r)
    return reqs


def _prompts(llm, name, questions):
    builder = PromptBuilder(llm.tokenizer)
    return [builder.build(MANUALS[name], q).token_ids for q in questions]


def _same_answers(plain, spec):
    for p, s in zip(plain, spec, strict=True):
        assert s.output_token_ids == p.output_token_ids
        assert len(s.logits) == len(p.logits)
        for i, (a, b) in enumerate(zip(p.logits, s.logits, strict=True)):
            assert torch.equal(a, b), f"logits differ at output position {i}"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_greedy_answers_and_their_logits_are_bitwise_those_of_plain_decoding(llms, dtype):
    off, on = llms[dtype]["off"], llms[dtype]["prompt-lookup"]
    params = SamplingParams(max_tokens=48)
    accepted = {}
    for name in MANUALS:
        for kind, qs in (("quoting", QUOTING[name]), ("other", OTHER[name])):
            plain = [_run(off, [ids], params)[0] for ids in _prompts(off, name, qs)]
            spec = [_run(on, [ids], params)[0] for ids in _prompts(on, name, qs)]
            _same_answers(plain, spec)
            assert all(p.num_accepted_tokens == 0 for p in plain)
            accepted[name, kind] = sum(s.num_accepted_tokens for s in spec)
            for s in spec:
                d = s.draft
                assert d.accepted + d.rejected == d.drafted
    # answers that quote the manual do take drafted tokens
    assert all(accepted[name, "quoting"] > 0 for name in MANUALS), accepted
    on.engine.kv_manager.check_integrity()


@pytest.mark.slow
def test_seeded_sampled_answers_are_those_of_plain_decoding(llms):
    off, on = llms["bfloat16"]["off"], llms["bfloat16"]["prompt-lookup"]
    for seed in (1, 2):
        params = SamplingParams(max_tokens=40, temperature=0.7, top_p=0.95, seed=seed)
        for name in MANUALS:
            prompts = _prompts(off, name, QUOTING[name][:1])
            plain = _run(off, prompts, params)
            spec = _run(on, prompts, params)
            _same_answers(plain, spec)
    low = SamplingParams(max_tokens=40, temperature=0.2, seed=3)
    spec = _run(on, _prompts(on, "tarx", QUOTING["tarx"][:1]), low)
    assert spec[0].num_accepted_tokens > 0  # a near-greedy answer quotes: drafts were taken


@contextmanager
def _drafting_free(eng):
    """Rows priced alike and nothing measured yet: a batch's requests draft whatever their
    acceptance, where the policy, priced by this machine, might draft nothing under load (the
    tests of verification need steps that carry drafts)."""
    kept = eng.drafts.cost, eng.drafts.outcomes
    eng.drafts.cost, eng.drafts.outcomes = StepCost(), StepOutcomes()
    try:
        yield
    finally:
        eng.drafts.cost, eng.drafts.outcomes = kept


@pytest.mark.slow
def test_a_batch_mixing_requests_with_and_without_drafts_gives_each_its_plain_answer(llms):
    off, on = llms["bfloat16"]["off"], llms["bfloat16"]["prompt-lookup"]
    greedy = SamplingParams(max_tokens=40)
    prompts = _prompts(off, "tarx", QUOTING["tarx"]) + _prompts(off, "pump", QUOTING["pump"])
    alone = [_run(off, [ids], greedy)[0] for ids in prompts]
    with _drafting_free(on.engine):
        mixed = _run(on, prompts, greedy, speculate=(True, False, True, False))
    _same_answers(alone, mixed)
    assert mixed[0].num_accepted_tokens + mixed[2].num_accepted_tokens > 0
    assert mixed[1].draft is None and mixed[3].draft is None


@pytest.mark.slow
def test_answers_drafted_from_their_manuals_earlier_answers_are_the_plain_ones(llms):
    """A draft group's answers: each the plain answer with every logit bit for bit; a question
    asked again takes most of its answer from the first one's drafts; another tenant's
    request of the same group name drafts nothing from them."""
    off, on = llms["bfloat16"]["off"], llms["bfloat16"]["prompt-lookup"]
    eng = on.engine
    params = SamplingParams(max_tokens=48)
    prompts = _prompts(off, "tarx", QUOTING["tarx"] + OTHER["tarx"][:1])
    plain = [_run(off, [ids], params)[0] for ids in prompts]

    def ask(ids, namespace=b""):
        req = eng.add_request(ids, params, keep_logits=True, draft_group="tarx",
                              namespace=namespace)  # fmt: skip
        while not req.finished:
            eng.step()
        eng.release(req)
        return req

    first = [ask(ids) for ids in prompts]
    _same_answers(plain, first)
    again = ask(prompts[0])
    _same_answers(plain[:1], [again])
    n = len(again.output_token_ids)
    assert again.num_accepted_tokens >= n // 2 > first[0].num_accepted_tokens, (n, again.draft)
    other = ask(prompts[0], namespace=b"tenant-b")
    _same_answers(plain[:1], [other])
    assert other.draft_group != again.draft_group
    assert other.num_accepted_tokens < again.num_accepted_tokens
    eng.kv_manager.check_integrity()


@pytest.mark.slow
def test_no_cached_block_holds_a_rejected_drafts_kv(llms):
    """After answers with drafts rejected, every block the cache indexed holds the KV its
    tokens compute: the whole conversation asked again hits the answers' blocks and gives the
    logits a cold run gives, bit for bit."""
    on = llms["bfloat16"]["prompt-lookup"]
    eng = on.engine
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    prompts = _prompts(on, "tarx", QUOTING["tarx"] + OTHER["tarx"])
    with _drafting_free(eng):
        answered = _run(on, prompts, params, keep_logits=False)
    assert sum(r.num_rejected_tokens for r in answered) > 0
    eng.kv_manager.check_integrity()
    bs = eng.kv_spec.block_size
    for r in answered:
        whole = r.prompt_token_ids + r.output_token_ids
        warm = _run(on, [whole], SamplingParams(max_tokens=1), speculate=(False,))[0]
        cold = eng.add_request(whole, SamplingParams(max_tokens=1), use_cache=False,
                               keep_logits=True)  # fmt: skip
        while not cold.finished:
            eng.step()
        eng.release(cold)
        # the answer's full blocks came from the cache (all but the last token's block)
        assert warm.num_cached_tokens >= (len(whole) - 1) // bs * bs
        assert torch.equal(warm.logits[0], cold.logits[0])
    eng.kv_manager.check_integrity()


def test_the_benchmark_measures_a_models_drafted_rows(tmp_path, tiny_model_dir):
    """bench/speculation.py --steps-only on a model given by its directory (not the default
    model): the step cost table of 1, 4 and 16 requests, each plain step 1.00x, and no
    question sets."""
    out = tmp_path / "steps.json"
    bench = str(ROOT / "bench" / "speculation.py")
    flags = ["--steps-only", "--step-repeats", "1", "--json", str(out)]
    cmd = [sys.executable, bench, "--model", str(tiny_model_dir), *flags]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["model"] == tiny_model_dir.name and got["sets"] == {}
    shapes = {(r["requests"], r["extra_rows"]) for r in got["step_costs"]}
    assert shapes == {(n, e) for n in (1, 4, 16) for e in (0, 1, 3, 7, 15)}
    assert all(r["vs_plain"] == 1.0 for r in got["step_costs"] if r["extra_rows"] == 0)
    assert all(r["ms"] > 0 for r in got["step_costs"])
