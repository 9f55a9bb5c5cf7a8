"""The batched sampler (its parameters: ``sampling_params.py``).

The sampler turns a step's next-token logits into tokens: greedy rows through one argmax (the
runner's, e.g. the CPU's compiled one), sampled rows through one batched pass of temperature,
top-k and top-p, then a draw per row from the request's own generator. That generator lives
on the device of the logits, made there at the request's first sampled token, and is seeded
for each draw from the request's seed and the position of the token drawn
(``position_seed``): a seeded request repeats its tokens whatever else shares its steps, and
whatever rows were drawn before (a speculative step draws at drafted positions it may
discard).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import xxhash

from inference.engine.sampling_params import SamplingParams

log = logging.getLogger("docqa.engine")


class Request(Protocol):
    """What the sampler reads and keeps of a request (``sequence.Request`` has it)."""

    request_id: str
    params: SamplingParams
    seed: int
    generator: torch.Generator | None

    @property
    def num_tokens(self) -> int: ...


def position_seed(seed: int, position: int) -> int:
    """The seed of the draw of a request's token at ``position`` (its index in prompt plus
    answer): a function of the request's seed and the position alone."""
    h = xxhash.xxh64_intdigest(position.to_bytes(8, "little"), seed & (2**64 - 1))
    return h >> 1  # torch seeds are signed 64-bit


def torch_argmax(logits: torch.Tensor) -> list[int]:
    return torch.argmax(logits, dim=-1).tolist()


class Sampler:
    """Tokens for a step's sampling rows. ``argmax`` is the runner's greedy op (rows [R, V]
    float32 -> R token ids, the first of equal maxima)."""

    def __init__(self, argmax: Callable[[torch.Tensor], list[int]] = torch_argmax):
        self.argmax = argmax

    def __call__(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        positions: Sequence[int] | None = None,
    ) -> list[int | Exception]:
        """``logits`` [R, vocab] float32, row i the logits of the token of ``requests[i]`` at
        ``positions[i]`` (by default the request's next one, ``num_tokens``); a request may
        own several rows (a speculative step's drafted positions). Returns one token id per
        row, or the exception that row's sampling raised (its request fails alone: a failed
        batch is sampled again row by row). Makes each sampled request's generator on first
        use."""
        sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
        if not sampled:
            return self.argmax(logits)
        if positions is None:
            positions = [r.num_tokens for r in requests]
        out: list[int | Exception] = [0] * len(requests)
        if len(sampled) < len(requests):
            greedy = [i for i, r in enumerate(requests) if r.params.greedy]
            for i, tok in zip(greedy, self.argmax(logits[greedy]), strict=True):
                out[i] = tok
        rows = logits if len(sampled) == len(requests) else logits[sampled]
        pos = [positions[i] for i in sampled]
        try:
            tokens: list = self.sample(rows, [requests[i] for i in sampled], pos)
        except Exception:
            tokens = [
                self._sample_alone(rows[j : j + 1], requests[i], pos[j])
                for j, i in enumerate(sampled)
            ]
        for i, tok in zip(sampled, tokens, strict=True):
            out[i] = tok
        return out

    def _sample_alone(self, row: torch.Tensor, req: Request, position: int) -> int | Exception:
        try:
            return self.sample(row, [req], [position])[0]
        except Exception as e:
            log.warning("sampling failed for %s: %s", req.request_id, e)
            return e

    def sample(
        self, logits: torch.Tensor, requests: Sequence[Request], positions: Sequence[int]
    ) -> list[int]:
        """One draw per row of ``logits`` [S, vocab] from its request's distribution, seeded
        by its request's seed and ``positions[i]``."""
        device = logits.device
        params = [r.params for r in requests]
        vocab = logits.shape[1]
        temps = torch.tensor([p.temperature for p in params], device=device)
        x = logits / temps.unsqueeze(1)
        ks = [min(p.top_k, vocab) if p.top_k else vocab for p in params]
        if any(k < vocab for k in ks):
            top = torch.sort(x, dim=-1, descending=True).values
            k_idx = torch.tensor([k - 1 for k in ks], device=device).unsqueeze(1)
            kth = top.gather(1, k_idx)  # each row's k-th largest value (its smallest kept)
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        ps = [p.top_p for p in params]
        if any(p < 1.0 for p in ps):
            sorted_p, order = torch.sort(probs, dim=-1, descending=True)
            cum = torch.cumsum(sorted_p, dim=-1)
            top_p = torch.tensor(ps, device=device).unsqueeze(1)
            # keep the smallest set reaching top_p; rows without top-p keep all
            drop = (cum - sorted_p > top_p) & (top_p < 1.0)
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_p.masked_fill(drop, 0.0))
        draws = []
        for i, (r, p) in enumerate(zip(requests, positions, strict=True)):
            gen = self.generator(r, device).manual_seed(position_seed(r.seed, p))
            draws.append(torch.multinomial(probs[i], 1, generator=gen))
        return torch.cat(draws).tolist()

    @staticmethod
    def generator(req: Request, device: torch.device) -> torch.Generator:
        """The request's generator, made on ``device`` from its seed at first use."""
        if req.generator is None:
            req.generator = torch.Generator(device=device).manual_seed(req.seed)
        return req.generator
