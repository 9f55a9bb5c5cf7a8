"""Prompt-lookup speculation: drafts from the request's own tokens, verified in the step.

An answer about a manual quotes it: option names, command lines, whole sentences. When the
last few tokens of a request (prompt and answer so far) occurred earlier in it, the tokens
that followed them there are a likely continuation. The engine proposes up to ``k`` of them
(the draft), computes the request's next token and the draft's positions in one chunk of
``1 + k`` rows, samples every row, and keeps the longest run of drafted tokens that equal
what was sampled at their positions, plus the token sampled after that run. A row's logits
are the same bits in a chunk of any size (the CPU kernels are row-invariant, the GPU's in
the batch-invariant mode), and a sampled row's draw depends only on the request's seed and
the position (``sampler.position_generator``), so the answer is token for token the one
plain decoding gives; only the number of steps changes.

``NgramIndex`` maps each n-gram (``min_n`` to ``max_n`` tokens) to the position after its
most recent occurrence. It is built once per request from the prompt (numpy: about a
millisecond at 8,000 tokens) and extended by each accepted token; a lookup hashes the last
``n`` tokens (a few microseconds). n-grams are keyed by a 64-bit polynomial hash: a
collision proposes a wrong draft, which verification rejects, never a wrong answer.

Where the request's own tokens hold no earlier occurrence, ``AnswerBank`` proposes what
followed the n-gram in the earlier answers of the request's draft group (a manual, or a part
of one, in one namespace): a question asked again, or answered in an earlier answer's words,
drafts from those answers.

``DraftPolicy`` keeps speculation from losing. A drafted token is worth the chance that it
is accepted: the chance that the request's first drafted token holds, times the chance
that a drafted token holds after its predecessor did for each token before it (both the
request's recent rates; a new request starts from the engine's). The two differ: a draft
often starts wrong, and once it starts right it follows a quoted run (the plain answers of
bench/speculation.py: 0.28-0.32 against 0.77), so one rate for both would overprice a
draft's first token and underprice its tenth. A step's cost by its rows is measured
(``StepCost``: forward passes timed at start, then the engine's own steps). Each step
takes the most valuable drafted tokens of all decoding requests while the step's expected
tokens per second grow: at one request a few rows cost little and drafts are long; under
load the batch's rows already fill the products, extra rows cost nearly their share, and
only drafts likely to hold are taken; a request whose drafts keep missing drafts nothing
until its acceptance recovers (it is verified again only when rows are nearly free).
bench/speculation.py measures the costs and the gains.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from inference.engine.draft_costs import Rate, StepCost, StepOutcomes

SPECULATE_MODES = ("prompt-lookup", "off")  # EngineConfig.speculate

_MULT = np.uint64(0x9E3779B97F4A7C15)  # the golden-ratio multiplier of Fibonacci hashing
_MASK = (1 << 64) - 1


def _key(tokens) -> int:
    """The 64-bit key of an n-gram (Python ints), equal to ``_keys``' for the same tokens."""
    h = 0
    for t in tokens:
        h = ((h * 0x9E3779B97F4A7C15) + t + 1) & _MASK
    return h


def _keys(arr: np.ndarray, n: int) -> np.ndarray:
    """The keys of every n-gram of ``arr`` (uint64), n-gram ``i`` being ``arr[i:i+n]``."""
    m = len(arr) - n + 1
    h = np.zeros(m, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            h = h * _MULT + arr[j : j + m] + np.uint64(1)
    return h


class NgramIndex:
    """Where each n-gram of a token sequence last occurred (module docstring).

    ``tables[n]`` maps an n-gram's key to the position after it, for n-grams whose next
    token is known: after ``extend`` to length ``L``, those ending before position ``L - 1``.
    The n-gram ending at the last token is looked up, not yet indexed, so a lookup finds an
    earlier occurrence."""

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tables: dict[int, dict[int, int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.length = 0  # tokens indexed so far

    def build(self, tokens: list[int]) -> None:
        """Index a whole sequence at once (a prompt)."""
        arr = np.asarray(tokens, dtype=np.uint64)
        for n, table in self.tables.items():
            if len(arr) > n:
                # n-gram i = tokens[i:i+n] is followed by position i + n; the last one (ending
                # at the sequence's last token) has no follower yet
                keys = _keys(arr[:-1], n)
                table.update(zip(keys.tolist(), range(n, n + len(keys)), strict=True))
        self.length = len(tokens)

    def extend(self, seq, length: int) -> None:
        """Index the n-grams that gained a follower as the sequence grew to ``length`` tokens
        (``seq[i]`` is token i: a request's ``token_ids`` slices)."""
        if length <= self.length:
            return
        lo = max(0, self.length - self.max_n - 1)
        window = seq(lo, length)
        for end in range(self.length, length):  # position ``end`` now has a token
            for n, table in self.tables.items():
                if end - n >= 0:
                    table[_key(window[end - n - lo : end - lo])] = end
        self.length = length

    def find(self, tail, n: int, length: int) -> int | None:
        """The position after the most recent earlier occurrence of the last ``n`` tokens of
        ``tail`` in the first ``length`` tokens; None where they did not occur."""
        if len(tail) < n or n not in self.tables:
            return None
        follow = self.tables[n].get(_key(tail[len(tail) - n :]))
        return follow if follow is not None and follow < length else None

    def propose(self, seq, length: int, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest
        n-gram ending the sequence (``length`` tokens, ``seq`` as in ``extend``); [] where
        none occurred."""
        if k <= 0 or length < self.min_n + 1:
            return []
        tail = seq(max(0, length - self.max_n), length)
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            follow = self.find(tail, n, length)
            if follow is not None:
                return seq(follow, min(follow + k, length))
        return []


SEPARATOR = 1 << 40  # between answers in an AnswerBank's sequence (no vocabulary's token id)


class GroupAnswers:
    """One draft group's recent answers as one sequence (answers separated by ``SEPARATOR``)
    and its n-gram index."""

    __slots__ = ("index", "tokens")

    def __init__(self, min_n: int, max_n: int, tokens: list[int] | None = None):
        self.index = NgramIndex(min_n, max_n)
        self.tokens = tokens or []
        if self.tokens:
            self.index.build(self.tokens)

    def append(self, answer: list[int]) -> None:
        toks = self.tokens
        toks.extend([*answer, SEPARATOR])
        self.index.extend(lambda a, b: toks[a:b], len(toks))

    def propose(self, tail, n: int, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent occurrence of the last ``n`` tokens
        of ``tail`` (to the end of that answer); [] where none."""
        follow = self.index.find(tail, n, len(self.tokens))
        if follow is None:
            return []
        draft = self.tokens[follow : follow + k]
        return draft[: draft.index(SEPARATOR)] if SEPARATOR in draft else draft


class AnswerBank:
    """Recent answers of each draft group (a manual, or one part of one), indexed as one
    sequence per group: a request of the group drafts from what its earlier answers said
    after the tokens the request just produced. Questions about one manual are answered in
    the manual's phrases and in the model's own recurring ones, and a question asked again
    is answered the same way, so an answer's next tokens often followed the same words in an
    earlier answer. At most ``tokens_per_group`` tokens a group (the older half dropped when
    full) and ``max_groups`` groups (the least recently used dropped)."""

    def __init__(self, min_n: int, max_n: int, tokens_per_group: int = 4096, max_groups: int = 32):
        self.min_n, self.max_n = min_n, max_n
        self.tokens_per_group, self.max_groups = tokens_per_group, max_groups
        self._groups: dict[bytes, GroupAnswers] = {}

    def __len__(self) -> int:
        return len(self._groups)

    def clear(self) -> None:
        self._groups.clear()

    def copy(self) -> AnswerBank:
        """An independent copy (a benchmark puts one back to replay a question)."""
        other = AnswerBank(self.min_n, self.max_n, self.tokens_per_group, self.max_groups)
        for group, answers in self._groups.items():
            other._groups[group] = GroupAnswers(self.min_n, self.max_n, list(answers.tokens))
        return other

    def get(self, group: bytes | None) -> GroupAnswers | None:
        """The group's answers (the group becomes the most recently used)."""
        if group is None:
            return None
        found = self._groups.pop(group, None)
        if found is not None:
            self._groups[group] = found
        return found

    def add(self, group: bytes | None, answer: list[int]) -> None:
        """An answer of ``group`` (its output tokens) to draft from."""
        if group is None or len(answer) < 2:
            return
        found = self.get(group)
        keep = self.tokens_per_group // 2
        if found is None:
            found = self._groups[group] = GroupAnswers(self.min_n, self.max_n)
            while len(self._groups) > self.max_groups:
                del self._groups[next(iter(self._groups))]
        if len(found.tokens) + len(answer) + 1 > self.tokens_per_group:  # keep the newer
            old = found.tokens[-keep:]
            old = old[old.index(SEPARATOR) + 1 :] if SEPARATOR in old else []
            found = self._groups[group] = GroupAnswers(self.min_n, self.max_n, old)
        found.append(answer[-keep:])


@dataclass(frozen=True)
class SpeculationConfig:
    """Prompt-lookup speculation's settings (``EngineConfig.speculation``)."""

    max_draft_tokens: int = 15  # k at most, per request and step
    min_ngram: int = 1
    max_ngram: int = 4
    # rows a step may carry with drafts (decode and draft rows of every request), whatever
    # the cost table says
    max_step_rows: int = 64
    # how fast a request's acceptance forgets its older verifications (per verification)
    decay: float = 0.8
    # a request's acceptance starts at the engine's, as if from this many drafted tokens
    prior_tokens: float = 2.0

    def __post_init__(self):
        if self.max_draft_tokens < 1:
            raise ValueError("max_draft_tokens must be at least 1")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError("n-gram sizes must satisfy 1 <= min_ngram <= max_ngram")
        if self.max_step_rows < 2:
            raise ValueError("max_step_rows must be at least 2")
        if not 0 < self.decay <= 1:
            raise ValueError("decay must be in (0, 1]")


class DraftState:
    """One request's drafting: its index, its recent acceptance and its counts."""

    __slots__ = ("index", "first", "then", "drafted", "accepted", "steps")

    def __init__(self, config: SpeculationConfig):
        self.index = NgramIndex(config.min_ngram, config.max_ngram)
        self.first = Rate()  # whether a draft's first token held
        self.then = Rate()  # whether a drafted token held after its predecessor did
        self.drafted = 0  # drafted tokens verified
        self.accepted = 0  # of those, equal to the answer's tokens
        self.steps = 0  # verification steps

    @property
    def rejected(self) -> int:
        return self.drafted - self.accepted


class DraftPolicy:
    """Which requests draft and how much: the drafts that make a step's tokens per second
    highest (module docstring)."""

    def __init__(self, config: SpeculationConfig, cost: StepCost | None = None):
        self.config = config
        self.cost = cost or StepCost()
        self.outcomes = StepOutcomes()
        self.bank = AnswerBank(config.min_ngram, config.max_ngram)
        # the engine's rates (decayed), every request's prior
        self.first, self.then = Rate(1.0, 2.0), Rate(1.0, 2.0)

    def state(self, req) -> DraftState:
        if req.draft is None:
            req.draft = DraftState(self.config)
        return req.draft

    def acceptance(self, req) -> tuple[float, float]:
        """The chance that the request's first drafted token holds, and that a drafted token
        holds after its predecessor did: its recent verifications, starting from the
        engine's."""
        st, prior = self.state(req), self.config.prior_tokens
        return (
            st.first.prior(self.first.value, prior),
            st.then.prior(self.then.value, prior),
        )

    def propose(self, req, room: int) -> list[int]:
        """Up to ``room`` tokens after the request's tokens: what followed the most recent
        earlier occurrence of the longest n-gram ending them, in its own prompt and answer or,
        where it has a draft group, in the group's earlier answers (its own first, n for n)."""
        if room <= 0:
            return []
        idx = self.state(req).index
        if idx.length == 0:
            idx.build(req.prompt_token_ids)
        length = req.num_tokens
        idx.extend(req.token_ids, length)
        if length < idx.min_n + 1:
            return []
        tail = req.token_ids(max(0, length - idx.max_n), length)
        answers = self.bank.get(req.draft_group)
        for n in range(min(idx.max_n, len(tail)), idx.min_n - 1, -1):
            follow = idx.find(tail, n, length)
            if follow is not None:
                return req.token_ids(follow, min(follow + room, length))
            if answers is not None:
                draft = answers.propose(tail, n, room)
                if draft:
                    return draft
        return []

    def may_pay(self, reqs, num_rows: int, max_rows: int) -> bool:
        """Whether drafts of ``reqs`` could pay for their rows in a step of ``num_rows`` rows
        without them (``max_rows`` at most): whether some number of drafted tokens, each as
        likely as the likeliest request's first, would raise the step's expected tokens per
        second. Where not, ``plan`` takes no draft of theirs, so nothing need be proposed
        (16 requests' lookups take 0.5 ms a step, 2-3% of their step, for drafts that
        would not be taken)."""
        if not reqs or max_rows <= num_rows:
            return False
        a = max(self.acceptance(r)[0] for r in reqs)  # no drafted token is likelier
        rate = num_rows / self.cost(num_rows, num_rows)
        most = min(max_rows, num_rows + len(reqs) * self.config.max_draft_tokens)
        # the cost is linear in the rows between the timed points, so a drafted row's average
        # extra cost over the first e is lowest at e = 1, at a point or at the most rows
        ends = {1, most - num_rows}
        ends.update(r - num_rows for r, _ in self.cost.points if num_rows < r < most)
        return any((num_rows + e * a) / self.cost(num_rows, num_rows + e) > rate for e in ends)

    def plan(self, proposals: dict, num_rows: int, max_rows: int) -> dict:
        """The drafts a step carries: of the proposals (request -> tokens), for a step of
        ``num_rows`` rows without them (each decoding request's next token), the tokens
        whose expected acceptance (a token is worth the chance that it and every drafted
        token before it hold) gives the most tokens per second of the step's cost, at most
        ``max_rows`` rows in all. Returns request -> the draft it carries."""
        cands = []
        for req, tokens in proposals.items():
            p, then = self.acceptance(req)
            for j in range(len(tokens)):
                cands.append((-p, j, id(req), req))
                p *= then
        cands.sort(key=lambda c: c[:3])
        room = min(len(cands), max_rows - num_rows)
        best, best_rate, tokens = 0, num_rows / self.cost(num_rows, num_rows), float(num_rows)
        for e in range(room):
            tokens -= cands[e][0]
            rate = tokens / self.cost(num_rows, num_rows + e + 1)
            if rate > best_rate:
                best, best_rate = e + 1, rate
        take: dict = {}
        for _, _, _, req in cands[:best]:
            take[req] = take.get(req, 0) + 1
        return {req: tuple(proposals[req][:n]) for req, n in take.items()}

    def verified(self, req, drafted: int, accepted: int) -> None:
        """A verification of ``drafted`` tokens of which the first ``accepted`` held."""
        st, d = self.state(req), self.config.decay
        st.drafted += drafted
        st.accepted += accepted
        st.steps += 1
        if drafted <= 0:
            return
        held = int(accepted > 0)
        # the tokens after the first verified with their predecessor held: up to the first
        # rejected one
        later = accepted - 1 + (accepted < drafted) if held else 0
        for rates, decay in ((st, d), (self, 0.99)):
            rates.first.add(held, 1, decay)
            rates.then.add(accepted - held, later, decay)
