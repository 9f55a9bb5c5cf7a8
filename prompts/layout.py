"""Prompt layout: system instructions -> manual -> earlier turns -> question -> assistant header.

Each segment is tokenized on its own and the ids concatenated, so the ids of the fixed part
(``prefix_len`` tokens: header, instructions, manual) never depend on the question or history:
the same manual gives the same prefix ids, hence the same block hashes, for every question.
User text is encoded with special-token parsing off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from prompts.linter import lint_prefix
from prompts.templates import ChatFormat, detect_format

DEFAULT_SYSTEM_PROMPT = (
    "You are docqa, an assistant that answers questions about the manual below. Answer from "
    "the manual only, briefly and precisely. If the manual does not say, say so."
)


class Tokenizer(Protocol):
    chat_template: str

    def encode(self, text: str) -> list[int]: ...
    def special_id(self, token: str) -> int | None: ...


class Turn(NamedTuple):
    question: str
    answer_token_ids: list[int]  # the stored generated ids, end-of-turn token included


@dataclass
class BuiltPrompt:
    token_ids: list[int]
    prefix_len: int  # tokens of header + instructions + manual: the cacheable prefix
    manual_start: int  # first token of the manual text
    num_history_turns: int  # earlier turns kept
    warnings: list[str] = field(default_factory=list)


class PromptBuilder:
    def __init__(self, tokenizer: Tokenizer, system_prompt: str = DEFAULT_SYSTEM_PROMPT):
        self.tok = tokenizer
        self.fmt: ChatFormat = detect_format(tokenizer.chat_template)
        self.system_prompt = system_prompt
        self._special_cache: dict[str, list[int]] = {}
        # a model that reasons in <think> blocks (Qwen3) answers directly after an empty one,
        # as its template writes with enable_thinking off
        self._no_think: list[int] = []
        think, end = tokenizer.special_id("<think>"), tokenizer.special_id("</think>")
        if "<think>" in (tokenizer.chat_template or "") and think is not None and end is not None:
            self._no_think = [think, *tokenizer.encode("\n\n"), end, *tokenizer.encode("\n\n")]

    def _special(self, token: str) -> list[int]:
        if token not in self._special_cache:
            tid = self.tok.special_id(token)
            if tid is not None:
                self._special_cache[token] = [tid]
            elif token in self.fmt.text_markers:
                # Mistral 7B v0.1/v0.2 and Llama 2 spell [INST] in text: no token of its own
                self._special_cache[token] = self.tok.encode(self._lead() + token)
            else:
                raise ValueError(f"the tokenizer has no {token!r} token for {self.fmt.name}")
        return list(self._special_cache[token])

    def end_of_turn_id(self) -> int:
        return self._special(self.fmt.end_of_turn)[0]

    def _lead(self) -> str:
        """The space a SentencePiece vocabulary writes before a turn's first word (``[INST]
        You`` is ``▁You``); its tokenizer encodes every segment as it is, no space added."""
        return " " if getattr(self.tok, "prefix_space", False) else ""

    # -- segments ------------------------------------------------------------------------------
    def _open(self, role: str) -> list[int]:
        f = self.fmt
        if f.name == "mistral":
            # a SentencePiece tokenizer puts the space before the turn's text itself
            if getattr(self.tok, "prefix_space", False):
                return self._special(f.turn_open)
            return self._special(f.turn_open) + self.tok.encode(f.role_suffix)
        return self._special(f.turn_open) + self.tok.encode(role + f.role_suffix)

    def _close(self) -> list[int]:
        f = self.fmt
        ids = self._special(f.turn_close)
        return ids + (self.tok.encode(f.after_close) if f.after_close else [])

    def manual_token_ids(self, manual_text: str) -> list[int]:
        """The manual segment's ids, as ``prefix_ids`` lays them out (stored per manual)."""
        return self.tok.encode(manual_text.strip() + "\n")

    def prefix_ids(
        self, manual_text: str | None = None, manual_token_ids: Sequence[int] | None = None
    ) -> tuple[list[int], int]:
        """(ids of header + instructions + manual, index where the manual starts).

        Pass the manual's text, or its ids from ``manual_token_ids`` to skip re-encoding."""
        if (manual_text is None) == (manual_token_ids is None):
            raise ValueError("pass exactly one of manual_text and manual_token_ids")
        f = self.fmt
        ids: list[int] = []
        for t in f.begin:
            ids += self._special(t)
        if f.name == "mistral":  # no system role: the prefix opens the first user turn
            ids += self._open(f.user_role)
        else:
            ids += self._open(f.system_role)
        lead = self._lead() if f.name == "mistral" else ""
        ids += self.tok.encode(lead + self.system_prompt + "\n\nMANUAL:\n")
        manual_start = len(ids)
        if manual_token_ids is None:
            manual_token_ids = self.manual_token_ids(manual_text)
        ids += list(manual_token_ids)
        if f.name != "mistral":
            ids += self._close()
        return ids, manual_start

    def _question_ids(self, question: str, first_turn: bool) -> list[int]:
        f = self.fmt
        if f.name == "mistral":
            if first_turn:  # continue the user turn the prefix opened
                return self.tok.encode("\nQUESTION: " + question.strip()) + self._close()
            text = self._lead() + question.strip()
            return self._open(f.user_role) + self.tok.encode(text) + self._close()
        return self._open(f.user_role) + self.tok.encode(question.strip()) + self._close()

    def _assistant_open(self) -> list[int]:
        f = self.fmt
        if f.name == "mistral":
            return []
        return self._open(f.assistant_role) + self._no_think

    def _turn_ids(self, turn: Turn, first_turn: bool) -> list[int]:
        ids = self._question_ids(turn.question, first_turn) + self._assistant_open()
        ids += list(turn.answer_token_ids)
        if self.fmt.after_close and self.fmt.name != "mistral":
            ids += self.tok.encode(self.fmt.after_close)
        return ids

    def chat_ids(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """A plain chat (no manual): ``(role, content)`` turns in the model's template, then the
        assistant header. Roles: system, user, assistant."""
        f = self.fmt
        ids: list[int] = []
        for t in f.begin:
            ids += self._special(t)
        pending_system = ""
        for role, content in messages:
            if f.name == "mistral":
                if role == "system":
                    pending_system += content.strip() + "\n\n"
                    continue
                if role == "user":
                    ids += self._open(f.user_role)
                    ids += self.tok.encode(self._lead() + pending_system + content.strip())
                    ids += self._close()
                    pending_system = ""
                else:
                    ids += self.tok.encode(" " + content.strip())
                    ids += [self.end_of_turn_id()]
                continue
            name = {"system": f.system_role, "user": f.user_role, "assistant": f.assistant_role}
            ids += self._open(name[role]) + self.tok.encode(content.strip()) + self._close()
        return ids + self._assistant_open()

    # -- whole prompt ----------------------------------------------------------------------------
    def build(
        self,
        manual_text: str,
        question: str,
        history: Sequence[Turn] = (),
        max_model_len: int | None = None,
        max_tokens: int = 0,
        manual_ids: tuple[list[int], int] | None = None,
    ) -> BuiltPrompt:
        """Lay out a prompt. With ``max_model_len``, the oldest turns are dropped until
        prompt + ``max_tokens`` fits; if manual + question + max_tokens alone do not fit,
        ValueError states both numbers."""
        prefix, manual_start = manual_ids or self.prefix_ids(manual_text)
        warnings = [f.message() for f in lint_prefix({"system": self.system_prompt})]
        turns = [self._turn_ids(t, i == 0) for i, t in enumerate(history)]
        q_ids = self._question_ids(question, not history) + self._assistant_open()
        dropped = 0
        if max_model_len is not None:
            base = len(prefix) + len(q_ids) + max_tokens
            if base > max_model_len:
                raise PromptLayoutTooLong(
                    f"manual and question are {len(prefix) + len(q_ids):,} tokens plus "
                    f"max_tokens {max_tokens:,}; this model's context is {max_model_len:,} "
                    "tokens",
                    base,
                    max_model_len,
                )
            while turns and base + sum(len(t) for t in turns) > max_model_len:
                turns.pop(0)
                dropped += 1
            if dropped and turns:  # the new first turn must close the prefix's system turn
                kept = list(history)[dropped:]
                turns = [self._turn_ids(t, i == 0) for i, t in enumerate(kept)]
            if dropped and not turns:
                q_ids = self._question_ids(question, True) + self._assistant_open()
            if dropped:
                warnings.append(
                    f"dropped the {dropped} oldest conversation turn(s) to fit the "
                    f"context of {max_model_len:,} tokens"
                )
        ids = list(prefix)
        for t in turns:
            ids += t
        ids += q_ids
        return BuiltPrompt(ids, len(prefix), manual_start, len(history) - dropped, warnings)


class PromptLayoutTooLong(ValueError):
    def __init__(self, message: str, needed: int, limit: int):
        super().__init__(message)
        self.needed = needed
        self.limit = limit
