"""Prompt layout per model family, and the prefix linter."""

from prompts.layout import (
    DEFAULT_SYSTEM_PROMPT,
    BuiltPrompt,
    PromptBuilder,
    PromptLayoutTooLong,
    Turn,
)
from prompts.linter import LintFinding, lint_prefix
from prompts.templates import CHATML, LLAMA3, MISTRAL, ChatFormat, detect_format

__all__ = [
    "CHATML",
    "DEFAULT_SYSTEM_PROMPT",
    "LLAMA3",
    "MISTRAL",
    "BuiltPrompt",
    "ChatFormat",
    "LintFinding",
    "PromptBuilder",
    "PromptLayoutTooLong",
    "Turn",
    "detect_format",
    "lint_prefix",
]
