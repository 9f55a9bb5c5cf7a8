"""Per-request timings and the online prefill cost model behind ``ttft_saved_ms``."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class RequestMetrics:
    """The answer object's timings, all in milliseconds, measured by the engine."""

    queue_ms: float  # arrival -> first scheduled
    ttft_ms: float  # arrival -> first token sampled
    prefill_ms: float  # time in steps that computed this request's prompt chunks
    decode_ms: float  # first token -> last token
    tpot_ms: float  # decode_ms / (completion_tokens - 1); 0 when <= 1 token
    e2e_ms: float  # arrival -> finish
    ttft_saved_ms: float  # fit(prompt, 0) - fit(computed, cached); 0 until fitted

    def to_dict(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in asdict(self).items()}


class PrefillCostModel:
    """Least-squares fit of a step's time from the prefill work it did, learned online.

    time(step) ~ a + b * new_tokens + c * attention_pairs, where a chunk of ``n`` new tokens
    over ``ctx`` cached ones attends ``n * ctx + n * (n + 1) / 2`` (query, key) pairs. Only
    steps without decode tokens are used, so the fit is the cost of prefill alone.
    """

    MIN_SAMPLES = 4

    def __init__(self):
        self._xtx = np.zeros((3, 3))
        self._xty = np.zeros(3)
        self._n = 0
        self._coef: np.ndarray | None = None
        self._tokens_seen: set[int] = set()

    @staticmethod
    def features(chunks: list[tuple[int, int]]) -> np.ndarray:
        """chunks: (new_tokens, cached_context) per sequence in the step."""
        tokens = sum(n for n, _ in chunks)
        pairs = sum(n * c + n * (n + 1) / 2 for n, c in chunks)
        return np.array([1.0, float(tokens), float(pairs)])

    def observe(self, chunks: list[tuple[int, int]], seconds: float) -> None:
        x = self.features(chunks)
        self._xtx += np.outer(x, x)
        self._xty += x * seconds
        self._n += 1
        self._tokens_seen.add(int(x[1]) // 16)
        self._coef = None

    @property
    def fitted(self) -> bool:
        return self._n >= self.MIN_SAMPLES and len(self._tokens_seen) >= 2

    def _solve(self) -> np.ndarray | None:
        if not self.fitted:
            return None
        if self._coef is None:
            ridge = np.diag([0.0, 1e-12, 1e-18]) * max(self._n, 1)
            coef, *_ = np.linalg.lstsq(self._xtx + ridge, self._xty, rcond=None)
            self._coef = np.maximum(coef, 0.0)
        return self._coef

    def predict_s(self, new_tokens: int, context: int) -> float:
        coef = self._solve()
        if coef is None or new_tokens <= 0:
            return 0.0
        return float(self.features([(new_tokens, context)]) @ coef)

    def saved_ms(self, prompt_tokens: int, cached_tokens: int) -> float:
        if cached_tokens <= 0 or not self.fitted:
            return 0.0
        cold = self.predict_s(prompt_tokens, 0)
        warm = self.predict_s(prompt_tokens - cached_tokens, cached_tokens)
        return max(0.0, (cold - warm) * 1000.0)
