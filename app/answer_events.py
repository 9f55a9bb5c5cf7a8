"""What an answer streams as it is generated: text deltas decoded from token ids as they come,
then the answer object or the failure. Plain events: the API layer turns them into server-sent
events (native or OpenAI-shaped)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from app.answer import Answer


class IncrementalDecoder:
    """Text deltas of a growing list of token ids; holds back an incomplete UTF-8 sequence.

    Each push decodes a window of the ids, not all of them: the text of ``ids[start:read]``
    has been given out already, ``ids[start:]`` is decoded, and what follows that text is the
    delta; the window then moves to the ids just given out. Both texts are decoded from the
    same first id, so a decoder that treats a sequence's start apart (a leading space) does it
    to both alike, and a window starts where a delta ended, on a whole character. A step costs
    the same at the thousandth token of an answer as at the first."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.start = 0  # the window's first id
        self.read = 0  # ids whose text has been given out

    def push(self, ids: Sequence[int]) -> str:
        self.ids.extend(ids)
        before = self.tok.decode(self.ids[self.start : self.read])
        text = self.tok.decode(self.ids[self.start :])
        if text.endswith("\ufffd") or len(text) <= len(before) or not text.startswith(before):
            return ""
        self.start, self.read = self.read, len(self.ids)
        return text[len(before) :]


@dataclass(frozen=True)
class TokenText:
    """More of the answer's text."""

    text: str


@dataclass(frozen=True)
class AnswerDone:
    """The whole answer object, last."""

    answer: Answer


@dataclass(frozen=True)
class AnswerFailed:
    """The engine failed the request; nothing more follows."""

    code: str
    message: str


Event = TokenText | AnswerDone | AnswerFailed
