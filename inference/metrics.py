"""Per-request timings and the prefill cost model behind ``ttft_saved_ms``."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass

import numpy as np

# how a request's ``ttft_saved_ms`` was obtained
SAVED_NONE = "none"  # no prompt token came from the cache: nothing saved
SAVED_ESTIMATE = "estimate"  # the cost model's prediction of the prefill the cache skipped
SAVED_COLD_RUN = "cold_run"  # the estimate, capped by a cold run of the same prompt measured here


@dataclass(frozen=True)
class RequestMetrics:
    """The answer object's timings, all in milliseconds, measured by the engine."""

    queue_ms: float  # arrival -> first scheduled
    ttft_ms: float  # arrival -> first token sampled
    prefill_ms: float  # time in steps that computed this request's prompt chunks
    decode_ms: float  # first token -> last token
    tpot_ms: float  # decode_ms / (completion_tokens - 1); 0 when <= 1 token
    e2e_ms: float  # arrival -> finish
    ttft_saved_ms: float  # the prefill the cache skipped (PrefillCostModel.saved)
    ttft_saved_basis: str = SAVED_NONE  # how ttft_saved_ms was obtained (SAVED_*)

    def to_dict(self) -> dict:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}


class PrefillCostModel:
    """Predicts the time of a prompt's prefill from the prefill steps the engine ran.

    A step of prompt chunks alone (no decode tokens) costs about ``a + b * new_tokens + c *
    attention_pairs`` seconds, where a chunk of ``n`` new tokens over ``ctx`` cached ones attends
    ``n * ctx + n * (n + 1) / 2`` (query, key) pairs. Two parts are learned apart:

    - the shape ``(a, b, c)``: a least-squares fit of the steps' relative errors (a question's
      30-token step counts as much as a 512-token chunk), each older step weighted down by
      ``SHAPE_DECAY`` (half of its weight after about 70 steps); the engine gives it its first
      steps at start (``ModelRunner.profile_reserve`` times a few), so it is fitted before the first
      question;
    - the machine's speed now: the recent steps' seconds over the shape's prediction of them
      (sums, each older step weighted down by ``SPEED_DECAY``, half after two steps, so the
      long steps weigh as much as their time), so another process starting to share the CPU
      shows in the next estimates and one that stops lets them fall.

    A prompt is predicted as the scheduler computes it: chunks of at most ``chunk_tokens``
    tokens, each over the context before it, one step each.
    """

    MIN_SAMPLES = 3
    SHAPE_DECAY = 0.99
    SPEED_DECAY = 0.5

    def __init__(self, chunk_tokens: int = 512, cold_runs: int = 1024):
        self.chunk_tokens = max(1, chunk_tokens)
        self._xtx = np.zeros((3, 3))
        self._xty = np.zeros(3)
        self._n = 0
        self._sizes: set[int] = set()  # token counts seen (a fit needs at least two)
        self._coef: np.ndarray | None = None
        self._seen_s = 0.0  # recent steps' seconds (decayed sums), and the shape's prediction
        self._predicted_s = 0.0  # of them
        self.speed = 1.0  # their ratio
        # measured cold prefills (no cached token), by prompt digest: ms, most recent last
        self._cold: OrderedDict[bytes, float] = OrderedDict()
        self._cold_max = cold_runs

    @staticmethod
    def features(chunks: list[tuple[int, int]]) -> np.ndarray:
        """chunks: (new_tokens, cached_context) per sequence in the step."""
        tokens = sum(n for n, _ in chunks)
        pairs = sum(n * c + n * (n + 1) / 2 for n, c in chunks)
        return np.array([1.0, float(tokens), float(pairs)])

    def observe(self, chunks: list[tuple[int, int]], seconds: float) -> None:
        """One step of prompt chunks alone and the seconds it took."""
        x = self.features(chunks)
        shape = self._shape()
        if shape is not None:
            predicted = float(x @ shape)
            if predicted > 0:
                self._seen_s = self.SPEED_DECAY * self._seen_s + seconds
                self._predicted_s = self.SPEED_DECAY * self._predicted_s + predicted
                self.speed = min(max(self._seen_s / self._predicted_s, 0.1), 10.0)
        w = 1.0 / max(seconds, 1e-6) ** 2  # relative errors
        self._xtx = self.SHAPE_DECAY * self._xtx + w * np.outer(x, x)
        self._xty = self.SHAPE_DECAY * self._xty + w * x * seconds
        self._n += 1
        self._sizes.add(int(x[1]))
        self._coef = None

    @property
    def fitted(self) -> bool:
        return self._n >= self.MIN_SAMPLES and len(self._sizes) >= 2

    def _shape(self) -> np.ndarray | None:
        if not self.fitted:
            return None
        if self._coef is None:
            ridge = np.diag([0.0, 1e-12, 1e-18]) * float(self._xtx[0, 0])
            coef, *_ = np.linalg.lstsq(self._xtx + ridge, self._xty, rcond=None)
            self._coef = np.maximum(coef, 0.0)
        return self._coef

    def predict_s(self, new_tokens: int, context: int) -> float:
        """Seconds to compute ``new_tokens`` prompt tokens after ``context`` cached ones, in the
        scheduler's chunks, at the machine's speed now; 0 until fitted."""
        shape = self._shape()
        if shape is None or new_tokens <= 0:
            return 0.0
        total, done = 0.0, 0
        while done < new_tokens:
            n = min(self.chunk_tokens, new_tokens - done)
            total += float(self.features([(n, context + done)]) @ shape)
            done += n
        return total * self.speed

    def record_cold(self, digest: bytes, ttft_ms: float) -> None:
        """A prompt computed with nothing from the cache took ``ttft_ms`` to its first token."""
        self._cold[digest] = ttft_ms
        self._cold.move_to_end(digest)
        while len(self._cold) > self._cold_max:
            self._cold.popitem(last=False)

    def saved(
        self, prompt_tokens: int, cached_tokens: int, digest: bytes | None = None
    ) -> tuple[float, str]:
        """(milliseconds, basis) the cache saved a prompt of which ``cached_tokens`` were
        reused: the predicted cold prefill less the predicted prefill of the rest after the
        cached context, never below 0, and never above the cold TTFT measured for the same
        prompt (``digest``) where one was."""
        if cached_tokens <= 0:
            return 0.0, SAVED_NONE
        cold = self.predict_s(prompt_tokens, 0)
        warm = self.predict_s(prompt_tokens - cached_tokens, cached_tokens)
        ms = max(0.0, (cold - warm) * 1000.0)
        measured = self._cold.get(digest) if digest is not None else None
        if measured is not None and ms > measured:
            return measured, SAVED_COLD_RUN
        return ms, SAVED_ESTIMATE
