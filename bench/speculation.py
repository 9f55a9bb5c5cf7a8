"""Prompt-lookup speculation side by side with plain decoding, in one process.

    .venv/bin/python bench/speculation.py [--model DIR|NAME] [--max-tokens 128] [--dtype auto]
        [--repeats 2] [--steps-only] [--json bench/results/speculation-DATE.json]

One engine of the default model with prompt-lookup drafts (a question's draft group is its
manual), the bundled tarx manual and the tests' pump manual cached; plain decoding is the
same engine's requests with ``speculate=False`` (and no draft group): the same weights, pool
and memory, so the comparison is not one of two engines' memory placements (two engines in
one process differed by 2-6% a step on the same work, by the order they were made in).
Two question sets per manual: answers that quote the manual (how-to, which option, what a
message means) and answers that do not (yes/no, opinions, summaries in other words).

1. **Step cost of extra rows**: N requests (1, 4, 16) decoding after a manual, each carrying
   0, 1, 3, 7 or 15 drafted rows; the median forward pass of ``--step-repeats`` passes of each
   shape, and its ratio to the plain decode step. Where the ratio starts to climb is where
   the policy's ``max_step_rows`` stops drafts.
2. **Batch 1**: every question alone, greedy, on each engine in turn (``--repeats`` times,
   the best kept), each drafting from its own prompt and answer and from the answers of the
   questions before it about the same manual (its draft group; never its own earlier
   answer): decode tokens/s (the answer's tokens after the first over the time from first
   token to last), the acceptance rate (accepted over drafted tokens), the mean tokens a
   decode step produced, and whether the answers are the same token for token. Then the
   ceiling (``ceiling``): the plain answers replayed with verification free, tokens per step
   with the engine's drafts and with the best of every earlier occurrence (a tree of all
   candidate drafts), and what either gives one request at the costs its steps took in
   these runs, by rows: drafts of the best single length, and a bound with every draft cut
   to the run that holds.
3. **Asked again**: every question a second time alone, its first answer among the
   group's: the same figures.
4. **16 clients**: 16 questions of a set at once on each engine (an in-process batch), with
   no earlier answers to draft from, ``--client-repeats`` times with the engines in turn:
   output tokens/s over the batch's wall time (the run of the median ratio), and the same
   answers.

Prints a table; ``--json`` writes the figures. ``--model`` runs it on another model (a
directory, or a name ``docqa model list`` shows); ``--steps-only`` stops after the step costs
(what a drafted row costs on that model's shape here, whatever its answers).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference import LLM, SamplingParams  # noqa: E402
from inference.engine.scheduler import ScheduledChunk, SchedulerOutput  # noqa: E402
from prompts import PromptBuilder  # noqa: E402

# a short manual repeated, the one tests/test_real_model.py and tests/test_speculation.py ask
PUMP = (
    "The pump has three modes. Mode A runs continuously. Mode B runs for 15 minutes every hour. "
    "Mode C runs only when the float switch closes. To reset the pump, hold the red button for "
    "5 seconds until the light blinks twice. The filter must be cleaned every 30 days; a dirty "
    "filter triggers error E4. Error E7 means the motor is overheating: switch the pump off and "
    "let it cool for one hour. "
) * 6
MANUALS = {
    "tarx": (ROOT / "app" / "samples" / "tarx-manual.md").read_text(),
    "pump": PUMP,
}
QUOTING = {
    "tarx": [
        "How do I create a compressed archive of a directory? Give the command.",
        "How do I extract an archive? Quote the manual.",
        "What does the -x option do?",
        "How do I list the contents of an archive?",
        "Which option sets the compression level?",
        "What does the manual say in its DESCRIPTION section?",
        "How do I exclude files when creating an archive?",
        "Show the EXAMPLES section.",
    ],
    "pump": [
        "How do I reset the pump? Quote the manual.",
        "What does error E7 mean?",
        "What does error E4 mean?",
        "How often must the filter be cleaned?",
        "Describe mode B in the manual's words.",
        "Which mode runs continuously?",
        "What should I do when the motor overheats?",
        "What are the three modes?",
    ],
}
OTHER = {
    "tarx": [
        "Would you recommend tarx to a beginner? Answer yes or no.",
        "Is tarx faster than zip? One word.",
        "Write a haiku about archives.",
        "Summarize the manual in your own words, in one sentence.",
        "What is your opinion of the option names?",
        "Translate 'archive' into French.",
        "Is this manual well written?",
        "Name a color.",
    ],
    "pump": [
        "Is this pump good for a garden? Answer yes or no.",
        "Summarize the manual in your own words.",
        "Write a short poem about water.",
        "Would you buy this pump?",
        "What is 2 + 2?",
        "Give the pump a friendly name.",
        "Is the reset procedure easy? One word.",
        "Describe the pump's color.",
    ],
}


MODES = ("off", "prompt-lookup")  # a request's speculate=False, and True


def _prompts(llm: LLM, questions: dict[str, list[str]]) -> list[list[int]]:
    builder = PromptBuilder(llm.tokenizer)
    return [builder.build(MANUALS[m], q).token_ids for m, qs in questions.items() for q in qs]


def _groups(questions: dict[str, list[str]]) -> list[str]:
    """Each question's draft group: its manual."""
    return [m for m, qs in questions.items() for _ in qs]


def _run(llm: LLM, prompts: list[list[int]], max_tokens: int, groups=None, mode="off"):
    """The prompts at once, drafting (``mode``) or not (``groups``: their draft groups, where
    they draft; a plain answer joins no group); (requests, wall seconds)."""
    eng = llm.engine
    params = SamplingParams(max_tokens=max_tokens)
    spec = mode != "off"
    groups = groups if groups and spec else [None] * len(prompts)
    t0 = time.perf_counter()
    pairs = zip(prompts, groups, strict=True)
    reqs = [eng.add_request(ids, params, speculate=spec, draft_group=g) for ids, g in pairs]
    while not all(r.finished for r in reqs):
        eng.step()
    wall = time.perf_counter() - t0
    for r in reqs:
        assert r.error is None, r.error
        eng.release(r)
    return reqs, wall


def _decode_stats(reqs) -> dict:
    """Decode tokens/s over the requests (tokens after the first over first-to-last time),
    acceptance, tokens per decode step."""
    tokens = sum(len(r.output_token_ids) - 1 for r in reqs)
    seconds = sum(r.times.finished - r.times.first_token for r in reqs)
    accepted = sum(r.num_accepted_tokens for r in reqs)
    drafted = sum(r.num_accepted_tokens + r.num_rejected_tokens for r in reqs)
    steps = tokens - accepted
    return {
        "decode_tokens": tokens,
        "decode_tok_s": tokens / seconds if seconds else 0.0,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": accepted / drafted if drafted else 0.0,
        "tokens_per_step": tokens / steps if steps else 1.0,
    }


def _same(a, b) -> bool:
    return all(x.output_token_ids == y.output_token_ids for x, y in zip(a, b, strict=True))


def index_costs() -> dict:
    """The n-gram index at an 8,000-token prompt: its build, a lookup, a token added."""
    import random

    from inference.engine.speculate import NgramIndex

    rng = random.Random(0)
    toks = [rng.randrange(49152) for _ in range(8000)] + [1, 2, 3]
    idx = NgramIndex(1, 4)
    t0 = time.perf_counter()
    for _ in range(10):
        idx = NgramIndex(1, 4)
        idx.build(toks)
    build = (time.perf_counter() - t0) / 10
    seq = toks + toks[100:104]

    def tokens(a: int, b: int) -> list[int]:
        return seq[a:b]

    t0 = time.perf_counter()
    for _ in range(1000):
        idx.propose(tokens, len(seq), 15)
    lookup = (time.perf_counter() - t0) / 1000
    t0 = time.perf_counter()
    for n in range(len(toks) + 1, len(seq) + 1):
        idx.extend(tokens, n)
    extend = (time.perf_counter() - t0) / 4
    return {"build_ms": build * 1000, "lookup_us": lookup * 1e6, "extend_us": extend * 1e6}


def _agreement(src: list[int], f: int, end: int, answer: list[int], i: int, cap: int) -> int:
    """How many tokens of ``src`` from ``f`` (before ``end``) equal ``answer``'s from ``i``."""
    n = 0
    while n < cap and f + n < end and i + n < len(answer) and src[f + n] == answer[i + n]:
        n += 1
    return n


def _starts(runs: list[int], k: int) -> list[int]:
    """The positions where an answer's decode steps start, its position i accepting
    ``runs[i]`` drafted tokens (position 0, the prefill's token, not counted), drafts of at
    most ``k`` tokens."""
    i, out = 1, []
    while i < len(runs):
        out.append(i)
        i += min(runs[i], k) + 1
    return out


def ceiling(config, reqs, groups, costs: list[dict]) -> dict:
    """What drafts from earlier occurrences could give these plain answers (``reqs``, in the
    order they were asked, each drafting from the earlier answers of its group), replayed
    with verification free: at each position, the run of drafted tokens that would hold
    (1) with the engine's draft (``DraftPolicy.propose``: the most recent occurrence of the
    longest n-gram) and (2) with the best draft of all (every earlier occurrence of every
    n-gram of ``min_ngram`` to ``max_ngram`` tokens, in the prompt, the answer so far and the
    group's earlier answers: what a tree of every candidate draft verified at once would
    hold). Tokens per decode step at drafts of at most k tokens; then, at the step costs of
    ``costs`` (one request's steps by rows, as ``step_costs`` gives them; past the last row
    count, its cost), the speedup of drafts of one length k at its best k, and a bound no
    policy passes: each step's draft cut to exactly the run that holds, a
    step costing its 1 + run rows (a tree of drafts costs at least the rows of its longest
    path)."""
    from inference.engine.draft_costs import StepCost
    from inference.engine.sequence import Request
    from inference.engine.speculate import DraftPolicy

    kmax, lo, hi = config.max_draft_tokens, config.min_ngram, config.max_ngram
    policy = DraftPolicy(config)
    rule_runs, best_runs, earlier = [], [], {}
    for r, group in zip(reqs, groups, strict=True):
        prompt, answer = r.prompt_token_ids, r.output_token_ids
        req = Request("replay", list(prompt), SamplingParams(), draft_group=group.encode())
        seq, bank = prompt + answer, earlier.setdefault(group, [])
        rule, best = [0], [0]
        for i in range(1, len(answer)):
            req.output_token_ids = answer[:i]
            end = len(prompt) + i
            draft = policy.propose(req, kmax)
            rule.append(_agreement(draft, 0, len(draft), answer, i, kmax))
            run = 0
            for n in range(lo, min(hi, end) + 1):
                tail = seq[end - n : end]
                for src, stop in [(seq, end)] + [(b, len(b)) for b in bank]:
                    for s in range(stop - n):
                        if src[s : s + n] == tail:
                            run = max(run, _agreement(src, s + n, stop, answer, i, kmax))
            best.append(run)
        rule_runs.append(rule)
        best_runs.append(best)
        policy.bank.add(group.encode(), answer)
        bank.append(answer)
    tokens = sum(len(a) - 1 for a in rule_runs)
    # a step of 1 + k rows over a plain one: linear between the points, the last past them
    one = StepCost([(c["extra_rows"], c["vs_plain"]) for c in costs if c["requests"] == 1])

    def cost(k: int) -> float:
        return one.interpolate(min(k, one.points[-1][0]))

    out = {"k": list(range(1, kmax + 1)), "engine_tokens_per_step": [], "best_tokens_per_step": []}
    for k in out["k"]:
        for name, runs in (("engine", rule_runs), ("best", best_runs)):
            out[f"{name}_tokens_per_step"].append(tokens / sum(len(_starts(x, k)) for x in runs))
    for name, runs in (("engine", rule_runs), ("best", best_runs)):
        at_k = [t / cost(k) for k, t in zip(out["k"], out[f"{name}_tokens_per_step"], strict=True)]
        top = max(range(kmax), key=at_k.__getitem__)
        out[f"{name}_speedup_at_k"], out[f"{name}_best_k"] = at_k[top], top + 1
        # every step's draft exactly as long as the run that holds: the fewest rows
        seconds = sum(cost(x[i]) for x in runs for i in _starts(x, kmax))
        out[f"{name}_speedup_bound"] = tokens / seconds
    return out


class _StepTimes:
    """The engine's own decode and verification steps while it answers one request at a
    time, timed by their rows (1 + the draft's tokens): what a drafted row costs in the
    runs themselves, for ``ceiling`` (the forward passes of ``step_costs``, timed apart,
    moved between runs on this machine's neighbours more than the runs did)."""

    def __init__(self, llm: LLM):
        self.runner = llm.engine.runner
        self.execute = self.runner.execute
        self.times: dict[int, list[float]] = {}

        def timed(sched):
            t0 = time.perf_counter()
            out = self.execute(sched)
            if len(sched.chunks) == 1 and sched.num_decode_tokens == sched.num_tokens:
                self.times.setdefault(sched.num_tokens, []).append(time.perf_counter() - t0)
            return out

        self.runner.execute = timed

    def stop(self) -> None:
        self.runner.execute = self.execute

    def costs(self, least: int = 5) -> list[dict]:
        """``step_costs``' rows for one request: each row count seen ``least`` times, its
        median step over the plain one's."""
        plain = statistics.median(self.times[1])
        return [
            {"requests": 1, "extra_rows": rows - 1, "rows": rows, "steps": len(t),
             "ms": statistics.median(t) * 1000, "vs_plain": statistics.median(t) / plain}
            for rows, t in sorted(self.times.items()) if len(t) >= least
        ]  # fmt: skip


def step_costs(llm: LLM, sizes: list[int], extras: list[int], repeats: int) -> list[dict]:
    """The median forward pass of N decoding requests carrying E drafted rows each."""
    eng = llm.engine
    builder = PromptBuilder(llm.tokenizer)
    rows = []
    for n in sizes:
        prompts = [
            builder.build(MANUALS["tarx"], QUOTING["tarx"][i % 8]).token_ids for i in range(n)
        ]
        params = SamplingParams(max_tokens=64, ignore_eos=True)
        reqs = [eng.add_request(ids, params, speculate=False) for ids in prompts]
        while any(not r.output_token_ids for r in reqs):
            eng.step()
        base = None
        for e in extras:
            for r in reqs:  # room for the drafted rows' KV
                eng.kv_manager.allocate(r.request_id, r.num_tokens + e)
            draft = tuple(r.prompt_token_ids[-e:]) if e else ()
            chunks = [
                ScheduledChunk(
                    r,
                    1 + e,
                    r.num_tokens - 1,
                    eng.kv_manager.block_ids(r.request_id),
                    e == 0,
                    True,
                    draft,
                )
                for r in reqs
            ]
            sched = SchedulerOutput(chunks, [])
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                eng.runner.run_model(sched)
                times.append(time.perf_counter() - t0)
            ms = statistics.median(times) * 1000
            base = base or ms
            rows.append({"requests": n, "extra_rows": e, "rows": n * (1 + e), "ms": ms,
                         "vs_plain": ms / base})  # fmt: skip
        for r in reqs:
            eng.abort(r.request_id)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory or name (default model)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeats", type=int, default=1, help="batch-1 runs per question")
    ap.add_argument("--step-repeats", type=int, default=15)
    ap.add_argument("--client-repeats", type=int, default=5, help="16-client runs per set")
    ap.add_argument("--steps-only", action="store_true", help="stop after the step costs")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    llm = LLM(args.model, dtype=args.dtype, kv_cache_gib=0.5, speculate="prompt-lookup")
    out: dict = {
        "model": llm.engine.config.model_dir.name,
        "machine": platform.processor() or platform.machine(),
        "dtype": str(llm.engine.runner.dtype),
        "threads": torch.get_num_threads(),
        "max_tokens": args.max_tokens,
        "config": vars(llm.engine.config.speculation),
    }
    _run(llm, _prompts(llm, {m: ["Hello?"] for m in MANUALS}), 1)  # the manuals cached

    out["index"] = index_costs()
    print(
        "n-gram index of an 8,000-token prompt: built in {build_ms:.2f} ms, a lookup "
        "{lookup_us:.1f} us, a token added {extend_us:.1f} us".format(**out["index"])
    )
    print("step cost of drafted rows (median forward pass)")
    steps = step_costs(llm, [1, 4, 16], [0, 1, 3, 7, 15], args.step_repeats)
    out["step_costs"] = steps
    for r in steps:
        print(
            f"  {r['requests']:>2} requests + {r['extra_rows']} rows each ({r['rows']:>3} rows): "
            f"{r['ms']:7.1f} ms  {r['vs_plain']:.2f}x"
        )

    out["sets"] = {}
    sets = () if args.steps_only else (("quoting", QUOTING), ("other", OTHER))
    policy = llm.engine.drafts
    for name, questions in sets:
        prompts, groups = _prompts(llm, questions), _groups(questions)
        # batch 1: each question alone, plain and drafting in turn, the best of the repeats;
        # each repeat drafts from the answers of the questions before it (never its own)
        policy.bank.clear()
        alone: dict[str, list] = {"off": [], "prompt-lookup": []}
        timed = _StepTimes(llm)
        for ids, g in zip(prompts, groups, strict=True):
            before = policy.bank.copy()
            for mode in MODES:
                runs = []
                for _ in range(args.repeats):
                    policy.bank = before.copy()
                    runs.append(_run(llm, [ids], args.max_tokens, [g], mode)[0][0])
                alone[mode].append(max(runs, key=lambda r: _decode_stats([r])["decode_tok_s"]))
        same1 = _same(alone["off"], alone["prompt-lookup"])
        s_off, s_on = _decode_stats(alone["off"]), _decode_stats(alone["prompt-lookup"])
        timed.stop()
        costs = timed.costs()
        bound = ceiling(policy.config, alone["off"], groups, costs)
        bound["step_costs"] = costs
        # asked again: each question a second time alone, its first answer in the bank
        again = {
            mode: [_run(llm, [ids], args.max_tokens, [g], mode)[0][0]
                   for ids, g in zip(prompts, groups, strict=True)]
            for mode in MODES
        }  # fmt: skip
        a_off, a_on = _decode_stats(again["off"]), _decode_stats(again["prompt-lookup"])
        # 16 clients: the set's 16 questions at once, no earlier answers to draft from; the
        # engines in turn (which goes first alternating), the median of the runs' ratios
        ratios, rates, same16 = [], [], True
        for rep in range(args.client_repeats):
            batch = {}
            for mode in MODES[:: 1 if rep % 2 == 0 else -1]:
                policy.bank.clear()
                batch[mode] = _run(llm, prompts[:16], args.max_tokens, groups[:16], mode)
            same16 = same16 and _same(batch["off"][0], batch["prompt-lookup"][0])
            rate = {
                mode: sum(len(r.output_token_ids) for r in reqs) / wall
                for mode, (reqs, wall) in batch.items()
            }
            rates.append(rate)
            ratios.append(rate["prompt-lookup"] / rate["off"])
        mid = sorted(range(len(ratios)), key=ratios.__getitem__)[len(ratios) // 2]
        tok16 = rates[mid]
        b_on = _decode_stats(batch["prompt-lookup"][0])
        row = {
            "questions": len(prompts),
            "batch1_decode_tok_s": {"off": s_off["decode_tok_s"], "on": s_on["decode_tok_s"]},
            "batch1_speedup": s_on["decode_tok_s"] / s_off["decode_tok_s"],
            "batch1_acceptance": s_on["acceptance"],
            "batch1_tokens_per_step": s_on["tokens_per_step"],
            "batch1_same_answers": same1,
            "batch1_ceiling": bound,
            "again_decode_tok_s": {"off": a_off["decode_tok_s"], "on": a_on["decode_tok_s"]},
            "again_speedup": a_on["decode_tok_s"] / a_off["decode_tok_s"],
            "again_tokens_per_step": a_on["tokens_per_step"],
            "again_same_answers": _same(alone["off"], again["prompt-lookup"]),
            "clients16_output_tok_s": {"off": tok16["off"], "on": tok16["prompt-lookup"]},
            "clients16_ratio": ratios[mid],
            "clients16_ratios": ratios,
            "clients16_acceptance": b_on["acceptance"],
            "clients16_tokens_per_step": b_on["tokens_per_step"],
            "clients16_same_answers": same16,
            "answer_tokens": s_off["decode_tokens"] + len(prompts),
        }
        out["sets"][name] = row
        print(
            f"{name:8s} batch 1: {s_off['decode_tok_s']:6.1f} -> {s_on['decode_tok_s']:6.1f} "
            f"decode tok/s ({row['batch1_speedup']:.2f}x), acceptance "
            f"{s_on['acceptance']:.2f}, {s_on['tokens_per_step']:.2f} tokens/step, same "
            f"answers: {same1}\n"
            f"         verified free (k = 1 .. {len(bound['k'])}): the engine's drafts "
            f"{bound['engine_tokens_per_step'][-1]:.2f} tokens/step, every earlier occurrence "
            f"{bound['best_tokens_per_step'][-1]:.2f}; at the steps' own costs "
            f"{bound['engine_speedup_at_k']:.2f}x and {bound['best_speedup_at_k']:.2f}x at "
            f"the best k ({bound['engine_best_k']}, {bound['best_best_k']}), at most "
            f"{bound['engine_speedup_bound']:.2f}x and {bound['best_speedup_bound']:.2f}x "
            "(each draft cut to what holds)\n"
            f"         asked again: {a_off['decode_tok_s']:6.1f} -> {a_on['decode_tok_s']:6.1f} "
            f"({row['again_speedup']:.2f}x), {a_on['tokens_per_step']:.2f} tokens/step, same "
            f"answers: {row['again_same_answers']}\n"
            f"         16 clients: {tok16['off']:6.1f} -> {tok16['prompt-lookup']:6.1f} "
            f"output tok/s ({row['clients16_ratio']:.2f}x, the median of "
            f"{', '.join(f'{r:.2f}' for r in ratios)}), acceptance "
            f"{b_on['acceptance']:.2f}, {b_on['tokens_per_step']:.2f} tokens/step, same "
            f"answers: {same16}"
        )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
