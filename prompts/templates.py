"""Chat layouts per model family, as segments of control tokens and plain text.

Every segment boundary sits at a control token or right after a newline, so a segment's ids do
not depend on what follows it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChatFormat:
    """How one family marks turns. ``turn_open``/``turn_close`` are control-token strings;
    ``role_text`` is the plain text that names a role after ``turn_open``."""

    name: str
    begin: tuple[str, ...]  # control tokens opening the conversation
    turn_open: str
    role_suffix: str  # plain text after the role name
    turn_close: str  # control token closing a turn
    after_close: str  # plain text after the close (e.g. a newline)
    system_role: str = "system"
    user_role: str = "user"
    assistant_role: str = "assistant"
    end_of_turn: str = ""  # the token generation stops at
    # turn markers an older vocabulary spells in plain text where it has no token for them
    text_markers: tuple[str, ...] = ()


CHATML = ChatFormat(
    "chatml", (), "<|im_start|>", "\n", "<|im_end|>", "\n", end_of_turn="<|im_end|>"
)
LLAMA3 = ChatFormat(
    "llama3",
    ("<|begin_of_text|>",),
    "<|start_header_id|>",
    "<|end_header_id|>\n\n",
    "<|eot_id|>",
    "",
    end_of_turn="<|eot_id|>",
)
# Mistral's [INST] form has no system role: instructions and manual open the first user turn.
MISTRAL = ChatFormat(
    "mistral",
    ("<s>",),
    "[INST]",
    " ",
    "[/INST]",
    "",
    end_of_turn="</s>",
    text_markers=("[INST]", "[/INST]"),
)


def detect_format(chat_template: str) -> ChatFormat:
    if "<|im_start|>" in chat_template:
        return CHATML
    if "<|start_header_id|>" in chat_template:
        return LLAMA3
    if "[INST]" in chat_template:
        return MISTRAL
    return CHATML
