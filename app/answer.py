"""The answer object every question endpoint returns (``/v1/ask``, a conversation's next turn,
the final server-sent event of a streamed answer).

- ``usage.cached_tokens`` is always present, 0 included: prompt tokens whose KV was reused
  (device pool plus Redis); ``prompt_tokens - cached_tokens`` tokens were computed.
- ``timings``, in milliseconds, measured by the engine: ``queue_ms`` arrival to first
  scheduled; ``ttft_ms`` arrival to first token sampled; ``prefill_ms`` time spent computing
  this request's prompt chunks; ``decode_ms`` first token to last; ``tpot_ms`` =
  decode_ms / (completion_tokens - 1), 0 when completion_tokens <= 1; ``e2e_ms`` arrival to
  finish; ``ttft_saved_ms`` = fit(prompt_tokens, context 0) - fit(computed tokens, context
  cached_tokens), where fit is the engine's prefill cost model (fitted at start, then
  following the prefill steps it runs and the machine's speed now; ``inference/metrics.py``),
  never above a cold run of the same prompt measured by the engine; ``ttft_saved_basis`` says
  how it was obtained: ``estimate`` (the cost model), ``cold_run`` (capped by that
  measurement), ``none`` (nothing came from the cache: 0). A request with ``cache: "bypass"``
  is the measured comparison.
- ``warnings``: prompt-linter findings and notes such as dropped history turns.
- ``part`` and ``part_scores``: for a manual stored as parts (longer than the model's window),
  the part the answer came from and the full-text search scores of the best-ranked parts.
"""

from __future__ import annotations

from msgspec import Struct, field


class Usage(Struct):
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cached_tokens_by_tier: dict[str, int]
    # speculation (OpenAI's names): drafted tokens that became the answer's, and those
    # verified and discarded; both 0 where nothing was drafted
    completion_tokens_details: dict[str, int] = field(
        default_factory=lambda: {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
    )


class Timings(Struct):
    queue_ms: float
    ttft_ms: float
    prefill_ms: float
    decode_ms: float
    tpot_ms: float
    e2e_ms: float
    ttft_saved_ms: float
    ttft_saved_basis: str = "none"


class Ledger(Struct):
    """What the cache saved answering about one manual, over every answer stored (turns,
    one-shot questions, OpenAI-style calls naming it)."""

    answers: int
    prompt_tokens: int
    cached_tokens: int
    cached_tokens_by_tier: dict[str, int]
    ttft_saved_ms: float


class PartRef(Struct):
    """The part of a manual an answer came from (a manual longer than the window is stored
    as parts, each its own cached prefix)."""

    index: int  # 0-based
    title: str  # the sections it holds


class PartScore(Struct):
    index: int
    title: str
    score: float  # the full-text search rank of the question against the part (higher first)


class Answer(Struct):
    id: str
    conversation_id: str | None
    answer: str
    finish_reason: str
    usage: Usage
    timings: Timings
    warnings: list[str]
    # a manual stored as parts: the part that answered, and the best-ranked parts' scores
    # (that part among them); null and empty for a manual that is one prompt prefix
    part: PartRef | None = None
    part_scores: list[PartScore] = field(default_factory=list)
