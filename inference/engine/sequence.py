"""A request's state inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from inference.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class RequestTimes:
    """Wall-clock marks (time.perf_counter seconds) and accumulated prefill time."""

    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    prefill_s: float = 0.0


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    namespace: bytes = b""  # cache namespace (tenant), chosen by the server
    use_cache: bool = True  # False: cache "bypass"
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in this request's blocks
    num_cached_tokens: int = -1  # prompt tokens served from cache (set at first admission)
    num_preemptions: int = 0
    finish_reason: str | None = None  # stop | length | abort | error
    error: Exception | None = None  # why a request finished with "error"
    times: RequestTimes = field(default_factory=RequestTimes)
    # sampling (temperature > 0): the seed of the request's generator, which the sampler makes
    # on the device of the logits at the first sampled token and keeps here
    seed: int = 0
    generator: torch.Generator | None = None
    keep_logits: bool = False  # keep each sampled position's logits (tests, logprobs)
    logits: list[torch.Tensor] = field(default_factory=list)  # [vocab] float32 each
    # chained hashes of the prompt's full blocks in this request's namespace (``prompt_hashes``)
    prompt_block_hashes: list[bytes] | None = None
    # second tier (Redis): a lookup in flight (``tier_io.TierLookup``) holds the request back
    # from admission; the hashes of blocks it loaded tell which cached tokens came from there
    tier_lookup: Any = None
    tier_loaded: set[bytes] = field(default_factory=set)
    # the block hash this request claimed in the second tier (it computes that prefix; other
    # replicas wait for it): released once its prompt is computed or it finishes
    tier_claim: bytes | None = None
    # when its lookup last answered (perf_counter), and whether it has looked again since
    # (``TierIO.relook``: an answer gone stale while it waited for admission)
    tier_answered_at: float | None = None
    tier_relooked: bool = False
    num_tier_cached_tokens: int = 0  # of num_cached_tokens, those loaded from the second tier
    # prompt-lookup speculation: whether this request drafts (when the engine does), and its
    # drafting state once it decodes (``speculate.DraftState``: index, k, counts)
    speculate: bool = True
    draft: Any = None
    # the requests whose answers this one may draft from (``speculate.AnswerBank``): one
    # manual, or one part of one; None: its own prompt and answer only
    draft_group: bytes | None = None

    @property
    def num_accepted_tokens(self) -> int:
        """Drafted tokens that became the answer's."""
        return self.draft.accepted if self.draft is not None else 0

    @property
    def num_rejected_tokens(self) -> int:
        """Drafted tokens verified and discarded."""
        return self.draft.rejected if self.draft is not None else 0

    def prompt_hashes(self, hasher) -> list[bytes]:
        """The chained hashes of the prompt's full blocks (``BlockHasher.chain`` in this
        request's namespace), computed once."""
        if self.prompt_block_hashes is None:
            self.prompt_block_hashes = hasher.chain(self.prompt_token_ids)
        return self.prompt_block_hashes

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt and output, without joining the two whole lists (a
        step's chunk of a long prompt's answer is a token or a few)."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
