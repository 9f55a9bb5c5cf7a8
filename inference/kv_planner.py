"""Capacity planning over a workload's real lengths, and the replay that checks it.

A workload is a list of requests, each a prompt length and an answer length in tokens (JSON
lines, e.g. from ``docqa workload export``, or three percentiles of each given by hand). The
plan answers, for a model shape, a KV dtype and a memory budget:

- how the device memory splits into weights, a runtime reserve and the KV pool, and how many
  tokens the pool caches;
- how many sequences fit at once, each at its whole context (prompt + answer), at the p50, p90
  and p99 context: the conservative numbers (no request is ever preempted);
- the concurrency the scheduler reaches with this mix before it must preempt
  (``Plan.concurrency``). In continuous batching requests join and leave all the time, so at
  any moment the running ones are spread over their answers: a request holds its prompt's
  blocks and, on average over its life, the blocks of about half its answer. And a request runs
  for as many steps as its answer has tokens, so long answers are running more of the time
  than their share of arrivals (Little's law): the running set's mean footprint is the
  workload's blocks-times-steps over its steps, sum(o * held) / sum(o), with ``held`` a
  request's blocks averaged over its decode steps. The estimate is the pool's blocks over that.
  It assumes the pool, not the step's token budget, is what runs out: with prompts long
  against ``max_num_batched_tokens`` the budget can bind first (``budget_bound``; ``replay``
  shows it), and where the two bounds are close, prompts queue for the budget and the pool
  runs out with fewer requests running than either says.

``replay`` checks that last estimate against the engine's own scheduler and block pool: the
workload arrives at a slowly rising rate, every step's forward pass is a no-op that keeps the
scheduler's bookkeeping (the chunk's tokens computed, one token appended per sampled request,
a request finished at its answer length), and the replay reports the number of requests running
when the scheduler first preempts.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from inference.engine.sampling_params import SamplingParams
from inference.engine.scheduler import Scheduler, SchedulerConfig
from inference.engine.sequence import Request

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Workload:
    """Requests as (prompt tokens, answer tokens)."""

    requests: tuple[tuple[int, int], ...]

    def __post_init__(self):
        if not self.requests:
            raise ValueError("a workload needs at least one request")
        for p, o in self.requests:
            if p < 1 or o < 1:
                raise ValueError(f"prompt and answer lengths must be at least 1, got {p}, {o}")

    @classmethod
    def from_jsonl(cls, path: str | Path) -> Workload:
        """One JSON object a line with ``prompt_tokens`` and ``output_tokens`` (integers)."""
        reqs = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                    reqs.append((int(d["prompt_tokens"]), int(d["output_tokens"])))
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(
                        f'{path}:{lineno}: expected {{"prompt_tokens": N, "output_tokens": '
                        f"N}}, got {line.strip()[:80]!r} ({e})"
                    ) from None
        if not reqs:
            raise ValueError(f"{path} holds no requests")
        return cls(tuple(reqs))

    @classmethod
    def from_percentiles(
        cls, prompt: tuple[int, int, int], output: tuple[int, int, int], n: int = 1000
    ) -> Workload:
        """A workload of ``n`` requests whose prompt and answer lengths have these p50, p90
        and p99: each length's quantile function drawn as straight lines through (0, p50 / 2),
        (0.5, p50), (0.9, p90), (0.99, p99) and (1, p99), read at n evenly spaced points; the
        prompt and answer lengths of a request are drawn independently (a fixed shuffle)."""
        for name, q in (("prompt", prompt), ("output", output)):
            if not (0 < q[0] <= q[1] <= q[2]):
                raise ValueError(f"{name} percentiles must be 0 < p50 <= p90 <= p99, got {q}")
        knots_u = (0.0, 0.5, 0.9, 0.99, 1.0)

        def lengths(q: tuple[int, int, int]) -> list[int]:
            knots = (q[0] / 2, q[0], q[1], q[2], q[2])
            out = []
            for i in range(n):
                u = (i + 0.5) / n
                k = next(j for j in range(1, 5) if u <= knots_u[j])
                t = (u - knots_u[k - 1]) / (knots_u[k] - knots_u[k - 1])
                out.append(max(1, round(knots[k - 1] + t * (knots[k] - knots[k - 1]))))
            return out

        outputs = lengths(output)
        random.Random(0).shuffle(outputs)
        return cls(tuple(zip(lengths(prompt), outputs, strict=True)))

    def contexts(self) -> list[int]:
        return sorted(p + o for p, o in self.requests)

    def percentile(self, values: list[int], pct: float) -> int:
        """The nearest-rank percentile of sorted ``values``."""
        rank = max(1, math.ceil(pct / 100 * len(values)))
        return values[rank - 1]


def mean_blocks_held(prompt: int, output: int, block_size: int) -> float:
    """The blocks a request holds, averaged over its decode steps: its context runs from
    ``prompt + 1`` to ``prompt + output`` tokens (the first answer token is sampled from the
    prompt's last position)."""
    total = 0
    # sum of ceil(c / bs) for c in [prompt + 1, prompt + output], in closed form per block
    lo, hi = prompt + 1, prompt + output
    c = lo
    while c <= hi:
        b = -(-c // block_size)
        end = min(hi, b * block_size)
        total += b * (end - c + 1)
        c = end + 1
    return total / output


def running_footprint(workload: Workload, block_size: int) -> float:
    """The mean blocks held by a running request of this mix (module docstring)."""
    steps = sum(o for _, o in workload.requests)
    return sum(o * mean_blocks_held(p, o, block_size) for p, o in workload.requests) / steps


def budget_bound(workload: Workload, max_num_batched_tokens: int) -> float:
    """The requests of this mix a step budget of ``max_num_batched_tokens`` tokens keeps
    running: every token of a request (prompt and answer) passes through some step, and a
    request lives its answer's steps plus its prompt's chunks, so at full budget the running
    count is the budget times the steps a request lives over the tokens it costs."""
    steps = sum(o + -(-p // max_num_batched_tokens) for p, o in workload.requests)
    tokens = sum(p + o for p, o in workload.requests)
    return max_num_batched_tokens * steps / tokens


@dataclass(frozen=True)
class ModelShape:
    """What sizing needs of a model config."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int | None = None
    intermediate_size: int | None = None
    vocab_size: int | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096

    @classmethod
    def from_config(cls, d: dict) -> ModelShape:
        heads = int(d.get("num_attention_heads", d.get("num_key_value_heads", 1)))
        hidden = d.get("hidden_size")
        return cls(
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or int(hidden) // heads),
            hidden_size=int(hidden) if hidden else None,
            intermediate_size=int(d["intermediate_size"]) if d.get("intermediate_size") else None,
            vocab_size=int(d["vocab_size"]) if d.get("vocab_size") else None,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        )

    @property
    def has_weights_shape(self) -> bool:
        return None not in (self.hidden_size, self.intermediate_size, self.vocab_size)

    def num_params(self) -> int:
        """Parameters of a Llama-family model of this shape (norms included)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * layer + h + head

    def kv_bytes_per_token(self, kv_elem_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * kv_elem_bytes

    def runtime_reserve_bytes(self, dtype_bytes: int, batched_tokens: int, max_seqs: int) -> int:
        """Activations of one step of ``batched_tokens`` tokens (the widest live buffers:
        qkv, gate/up, their outputs and the residual stream, in the compute dtype) and the
        float32 logits of ``max_seqs`` rows, twice over for the allocator's slack."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        qkv = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        per_token = (qkv + 3 * i + 4 * h) * dtype_bytes
        return 2 * (batched_tokens * per_token + max_seqs * v * 4)


@dataclass(frozen=True)
class Plan:
    block_size: int
    bytes_per_token: int
    kv_bytes: int
    num_blocks: int
    weights_bytes: int | None = None
    reserve_bytes: int | None = None
    device_bytes: int | None = None
    usable_bytes: int | None = None
    fit_at: dict[int, tuple[int, int]] = field(default_factory=dict)  # pct: (context, seqs)
    concurrency: float | None = None  # the mix's, in continuous batching, as the pool allows
    max_num_seqs: int | None = None
    budget_concurrency: float | None = None  # as the step's token budget allows

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def plan(
    shape: ModelShape,
    kv_elem_bytes: int,
    *,
    block_size: int = 16,
    kv_bytes: int | None = None,
    device_bytes: int | None = None,
    utilization: float = 0.9,
    dtype_bytes: int = 2,
    reserve_bytes: int | None = None,
    max_num_batched_tokens: int = 512,
    max_num_seqs: int | None = None,
    workload: Workload | None = None,
) -> Plan:
    """A ``Plan`` for a KV budget given directly (``kv_bytes``) or left over from a device's
    memory (``device_bytes`` times ``utilization``, less the weights and a runtime reserve)."""
    bpt = shape.kv_bytes_per_token(kv_elem_bytes)
    weights = reserve = usable = None
    if kv_bytes is None:
        if device_bytes is None:
            raise ValueError("give the KV memory, or the device memory to split")
        if not shape.has_weights_shape:
            raise ValueError(
                "splitting device memory needs hidden_size, intermediate_size and vocab_size"
            )
        weights = shape.num_params() * dtype_bytes
        if reserve_bytes is None:
            reserve_bytes = shape.runtime_reserve_bytes(
                dtype_bytes, max_num_batched_tokens, max_num_seqs or 256
            )
        reserve = reserve_bytes
        usable = int(device_bytes * utilization)
        kv_bytes = usable - weights - reserve
        if kv_bytes <= 0:
            raise ValueError(
                f"the weights ({weights / 2**30:.2f} GiB) and runtime reserve "
                f"({reserve / 2**30:.2f} GiB) leave no KV memory in "
                f"{usable / 2**30:.2f} GiB"
            )
    num_blocks = kv_bytes // (bpt * block_size)
    fit_at, concurrency, budget_concurrency = {}, None, None
    if workload is not None:
        ctx = workload.contexts()
        for pct in PERCENTILES:
            c = workload.percentile(ctx, pct)
            fit_at[pct] = (c, int(num_blocks // -(-c // block_size)))
        concurrency = num_blocks / running_footprint(workload, block_size)
        if max_num_seqs:
            concurrency = min(concurrency, float(max_num_seqs))
        budget_concurrency = budget_bound(workload, max_num_batched_tokens)
    return Plan(
        block_size,
        bpt,
        int(kv_bytes),
        int(num_blocks),
        weights,
        reserve,
        device_bytes,
        usable,
        fit_at,
        concurrency,
        max_num_seqs,
        budget_concurrency,
    )


@dataclass(frozen=True)
class ReplayResult:
    concurrency: int  # requests running when the scheduler first preempted
    steps: int
    finished: int  # requests finished before then
    preempted: bool  # False: the workload ran out before any preemption


def replay(
    workload: Workload,
    num_blocks: int,
    *,
    block_size: int = 16,
    max_num_batched_tokens: int = 512,
    max_num_seqs: int = 4096,
    ramp_lifetimes: float = 4.0,
    max_requests: int = 20000,
    seed: int = 0,
) -> ReplayResult:
    """The workload through the engine's scheduler and block pool (module docstring).

    Requests are drawn from the workload in a fixed shuffled order, cycling, and arrive at a
    rate that rises linearly: the pool would be full after about ``ramp_lifetimes`` request
    lifetimes, slow enough that the running set is spread over its answers as in a steady
    state. Prompts are unique (no prefix is shared)."""
    from prefix_store import KVCacheManager

    kv = KVCacheManager(num_blocks, block_size, b"replay")
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens, max_num_seqs), kv)
    order = list(workload.requests)
    random.Random(seed).shuffle(order)
    mean_prompt = sum(p for p, _ in order) / len(order)
    mean_out = sum(o for _, o in order) / len(order)
    # a request's life in steps: its prompt chunks, then one token a step
    life = mean_prompt / max_num_batched_tokens + mean_out
    target = num_blocks / running_footprint(workload, block_size)  # only sets the ramp's pace
    # arrivals by step s: a * s^2 / 2, rate a * s; the rate of `target` concurrent requests
    # (target / life) is reached after ramp_lifetimes lives
    a = target / life / (ramp_lifetimes * life)
    arrived = 0
    steps = finished = peak = 0
    token = 1
    while arrived < max_requests:
        due = int(a * steps * steps / 2) + 1
        while arrived < min(due, max_requests):
            p, o = order[arrived % len(order)]
            ids = [token + j for j in range(p)]  # unique tokens: no prefix is shared
            token += p
            req = Request(
                f"r{arrived}",
                ids,
                SamplingParams(max_tokens=o, ignore_eos=True),
                use_cache=False,
                max_model_len=p + o + 1,
            )
            sched.add(req)
            arrived += 1
        out = sched.schedule()
        if out.preempted:
            return ReplayResult(peak, steps, finished, True)
        for c in out.chunks:  # the no-op forward pass: the bookkeeping the engine does
            c.request.num_computed_tokens = c.num_context_tokens + c.num_new_tokens
        for req in out.sampling:
            req.output_token_ids.append(0)
            if len(req.output_token_ids) >= req.params.max_tokens:
                sched.finish(req, "length")
                finished += 1
        peak = max(peak, len(sched.running))
        steps += 1
    return ReplayResult(peak, steps, finished, False)
