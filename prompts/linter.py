"""The prefix linter: volatile content before the manual defeats the prefix cache.

Anything that changes between requests (dates, times, UUIDs, request counters) must come after
the manual, or every request hashes to a new chain and nothing is reused.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_PATTERNS = [
    (
        "date",
        re.compile(
            r"\b\d{4}-\d{2}-\d{2}\b|\b\d{1,2}/\d{1,2}/\d{2,4}\b|\b(?:Mon|Tue|Wed|Thu"
            r"|Fri|Sat|Sun)[a-z]*,? \d{1,2} "
        ),
    ),
    ("time", re.compile(r"\b\d{1,2}:\d{2}(?::\d{2})?\b")),
    (
        "uuid",
        re.compile(
            r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-"
            r"[0-9a-fA-F]{12}\b"
        ),
    ),
    ("counter", re.compile(r"(?i)\b(?:request|req|session|turn|attempt|counter|seq)[ _#:-]*\d+\b")),
    ("timestamp", re.compile(r"\b1[5-9]\d{8}(?:\.\d+)?\b")),
]


class LintFinding(NamedTuple):
    kind: str  # date | time | uuid | counter | timestamp
    segment: str  # which segment holds it (e.g. "system")
    text: str  # the matched text

    def message(self) -> str:
        return (
            f"volatile content ({self.kind} {self.text!r}) in the {self.segment} segment, "
            "before the manual: it changes the prefix hash and defeats the cache; "
            "move it after the manual"
        )


def lint_prefix(segments: dict[str, str]) -> list[LintFinding]:
    """Findings for text that sits before the manual, keyed by segment name."""
    out = []
    for name, text in segments.items():
        for kind, pat in _PATTERNS:
            for m in pat.finditer(text):
                out.append(LintFinding(kind, name, m.group(0)))
    return out
