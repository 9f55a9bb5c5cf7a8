"""What drafting costs and what it gains, measured, for prompt-lookup speculation's policy
(``speculate.DraftPolicy``): a step's cost by its rows (``StepCost``), the rates at which
drafted tokens hold (``Rate``), and per batch size whether steps with drafts beat steps
without (``StepOutcomes``)."""

from __future__ import annotations

from dataclasses import dataclass


class StepCost:
    """Seconds of a step of ``seqs`` decoding requests carrying ``rows`` rows in all (their
    drafted rows included, no prompt chunk): the requests' plain decode step, as the engine's
    own steps of that many requests took (a moving average; the points timed at start until
    it has seen a few), plus the drafted rows' extra cost: what the points timed at start
    (``ModelRunner.time_rows``: one request, 1 to 64 rows) add from ``seqs`` rows to ``rows``,
    times a scale learned from the engine's verification steps (extra rows over many requests'
    contexts cost more than over one). Without points nothing was timed: every step costs
    the same, and drafts are limited by ``max_step_rows`` alone."""

    SEEN = 3  # decode steps of a size before their average replaces the points

    def __init__(self, points: list[tuple[int, float]] | None = None):
        self.points = sorted(points or [])
        self.bases: dict[int, tuple[int, float]] = {}  # seqs -> (steps, average seconds)
        self.scale = 1.0  # drafted rows' measured extra cost over the points' prediction

    def interpolate(self, rows: int) -> float:
        """The points' seconds at ``rows``: linear between them, past the last two along
        them."""
        pts = self.points
        if not pts:
            return 1.0
        if len(pts) == 1 or rows <= pts[0][0]:
            return pts[0][1]
        for (r0, t0), (r1, t1) in zip(pts, pts[1:], strict=False):
            if rows <= r1:
                return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)
        (r0, t0), (r1, t1) = pts[-2], pts[-1]
        return t1 + (t1 - t0) * (rows - r1) / (r1 - r0)

    def base(self, seqs: int) -> float:
        n, avg = self.bases.get(seqs, (0, 0.0))
        return avg if n >= self.SEEN else self.interpolate(seqs)

    def extra(self, seqs: int, rows: int) -> float:
        return self.scale * max(0.0, self.interpolate(rows) - self.interpolate(seqs))

    def __call__(self, seqs: int, rows: int) -> float:
        return self.base(seqs) + self.extra(seqs, rows)

    def observe(self, seqs: int, rows: int, seconds: float) -> None:
        """A step of decode and verification rows only: a plain one moves its size's
        average; one with drafted rows, measured against that average, moves the scale."""
        n, avg = self.bases.get(seqs, (0, seconds))
        if rows == seqs:
            self.bases[seqs] = (n + 1, avg + (seconds - avg) * (0.5 if n < self.SEEN else 0.1))
            return
        predicted = self.interpolate(rows) - self.interpolate(seqs)
        if n >= self.SEEN and predicted > 0.02 * avg:
            ratio = min(max((seconds - avg) / predicted, 0.25), 8.0)
            self.scale += (ratio - self.scale) * 0.1


class Rate:
    """A decayed rate of hits over trials."""

    __slots__ = ("hits", "trials")

    def __init__(self, hits: float = 0.0, trials: float = 0.0):
        self.hits, self.trials = hits, trials

    def add(self, hits: int, trials: int, decay: float) -> None:
        self.hits = self.hits * decay + hits
        self.trials = self.trials * decay + trials

    def prior(self, rate: float, weight: float) -> float:
        """The rate, starting from ``rate`` as if from ``weight`` trials."""
        return (self.hits + weight * rate) / (self.trials + weight)

    @property
    def value(self) -> float:
        return self.hits / self.trials


class StepOutcomes:
    """What drafting did for the steps of each batch size, measured: per bucket of decoding
    requests (2-3, 4-7, 8-15, ...; one request alone is priced by the rows timed at start,
    which are its own), the tokens per second of steps with drafts and of steps
    without (moving averages of tokens over wall seconds, decode and verification steps
    only). Where drafting measures slower than not drafting, steps of that size draft only
    now and then, to see whether it pays again: ``RETRY`` steps after it measured slower, then
    twice as many after each retry that still measured slower, up to ``RETRY_MAX`` (a retry
    costs what a losing step does: 16 requests with a drafted row each take 1.9x a plain
    step on 2 Zen 4 cores, so a retry every 16th step would cost the batch about 5% of its
    tokens per second for good); where it pays or is not
    yet measured, a step without drafts is forced when none ran for ``PLAIN_EVERY`` steps
    (``PLAIN_EVERY_WINNING`` where drafting is well ahead; every other step until
    ``SEEN`` plain steps were seen), so that the comparison stays current. The cost model
    chooses the drafts; this keeps its errors from making speculation lose."""

    PLAIN_EVERY = 16  # steps of a bucket with drafts at most between two without
    PLAIN_EVERY_WINNING = 64  # the same where drafting measured a quarter faster or more
    RETRY = 16  # steps of a losing bucket between two with drafts, at first
    RETRY_MAX = 512  # ... doubled after each retry that still lost, up to this
    SEEN = 8  # steps of each kind before their rates are compared
    RATE = 0.2  # the averages' weight of a new step

    def __init__(self):
        self.buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket(seqs: int) -> int:
        return max(seqs, 1).bit_length() - 1

    def _at(self, seqs: int) -> _Bucket:
        return self.buckets.setdefault(self.bucket(seqs), _Bucket())

    def _seen(self, b: _Bucket) -> bool:
        return b.drafted_steps >= self.SEEN and b.plain_steps >= self.SEEN

    def losing(self, seqs: int) -> bool:
        """Whether drafting measured slower than not drafting at this batch size."""
        return self._losing(self._at(seqs))

    def _losing(self, b: _Bucket) -> bool:
        return self._seen(b) and b.drafted_rate < b.plain_rate

    def may_draft(self, seqs: int) -> bool:
        """Whether a step of ``seqs`` decoding requests may carry drafts."""
        if seqs < 2:  # one request: the rows timed at start price its drafts as they are
            return True
        b = self._at(seqs)
        if b.plain_steps < self.SEEN:  # learning the plain rate: every other step plain
            return b.since_plain == 0
        if self._losing(b):
            return b.since_drafted >= (b.retry or self.RETRY)
        winning = self._seen(b) and b.drafted_rate >= 1.25 * b.plain_rate
        return b.since_plain < (self.PLAIN_EVERY_WINNING if winning else self.PLAIN_EVERY)

    def observe(self, seqs: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A decode or verification step of ``seqs`` requests that produced ``tokens``."""
        if seconds <= 0:
            return
        b, rate = self._at(seqs), tokens / seconds
        if drafted:
            retried = self._losing(b)
            b.drafted_rate = b.average(b.drafted_rate, b.drafted_steps, rate, self.RATE)
            b.drafted_steps += 1
            b.since_drafted, b.since_plain = 0, b.since_plain + 1
            if not self._losing(b):
                b.retry = 0
            elif retried:
                b.retry = min(2 * (b.retry or self.RETRY), self.RETRY_MAX)
        else:
            b.plain_rate = b.average(b.plain_rate, b.plain_steps, rate, self.RATE)
            b.plain_steps += 1
            b.since_drafted, b.since_plain = b.since_drafted + 1, 0


@dataclass
class _Bucket:
    """``StepOutcomes`` of one bucket of batch sizes: tokens per second of steps with drafts
    and without (moving averages), their counts, and the steps since the last of each."""

    drafted_rate: float = 0.0
    drafted_steps: int = 0
    plain_rate: float = 0.0
    plain_steps: int = 0
    since_drafted: int = 0
    since_plain: int = 0
    retry: int = 0  # steps between two retries while losing (0: ``StepOutcomes.RETRY``)

    @staticmethod
    def average(avg: float, n: int, value: float, weight: float) -> float:
        return value if n == 0 else avg + (value - avg) * weight
