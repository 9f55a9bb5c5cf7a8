"""A manual longer than the model's window, cut into parts that each fit.

``split_manual`` cuts at headings where it can (a section stays whole when it fits in the room
left), else between paragraphs, else between sentences, else between tokens (one unbroken line
of text is still cut). Each part after the first begins with the end of the one before it (up
to ``overlap`` tokens of whole paragraphs), so a passage that straddles a cut is whole in one
part. Token counts come from the caller's tokenizer, one batch for the whole manual; a part's
exact count (its text tokenized as a prompt lays it out) is the caller's to check against the
window (``QAService`` stores it).

A part's title names the sections it holds (their headings, or the section it continues); its
prompt opens with ``part_header``: the manual's title, the part's position and that title.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# a heading: markdown (# Title), a man page's section (NAME, SHELL GRAMMAR), or a numbered one
_HEADING = re.compile(
    r"^(?:#{1,6}\s+(?P<md>\S.{0,150})"
    r"|(?P<caps>[A-Z][A-Z0-9 ,/&()'_-]{1,60})"
    r"|(?P<num>\d+(?:\.\d+)*\.?\s+[A-Z]\S.{0,100}))\s*$"
)
_PARAGRAPHS = re.compile(r"\n[ \t]*\n+|\f")
_SENTENCE_END = re.compile(r"(?<=[.!?:;])\s+|\n")
MAX_TITLE_CHARS = 160


@dataclass(frozen=True)
class Piece:
    """A run of the manual's text: [start, end) in characters."""

    start: int
    end: int
    tokens: int
    heading: str | None = None  # the heading this piece opens with


@dataclass(frozen=True)
class Part:
    index: int
    title: str
    start: int  # characters of the manual, overlap included
    end: int
    text: str
    overlap_start: int  # where the text new to this part begins (== start for the first)


def heading_of(paragraph: str) -> str | None:
    """The heading a paragraph opens with, or None."""
    first = paragraph.lstrip("\n").split("\n", 1)[0].rstrip()
    if not first or first != first.lstrip() or len(first) > 160:
        return None
    m = _HEADING.match(first)
    if m is None:
        return None
    if m.group("caps") is not None and sum(c.isalpha() for c in first) < 3:
        return None
    return (m.group("md") or m.group("caps") or m.group("num")).strip()


def _spans(text: str, pattern: re.Pattern, start: int, end: int) -> list[tuple[int, int]]:
    """[start, end) cut after each match of ``pattern`` (the separator stays with the run
    before it); empty runs dropped."""
    out, at = [], start
    for m in pattern.finditer(text, start, end):
        if m.end() > at and m.start() > at:
            out.append((at, m.end()))
            at = m.end()
    if at < end:
        out.append((at, end))
    return [(a, b) for a, b in out if text[a:b].strip()]


def split_manual(
    text: str,
    count_tokens: Callable[[Sequence[str]], list[int]],
    budget: int,
    overlap: int,
    token_cuts: Callable[[str, int], list[int]],
) -> list[Part]:
    """Parts of ``text`` of at most ``budget`` tokens each (as ``count_tokens`` counts pieces;
    a part's own count can differ by a few tokens where pieces join). ``token_cuts(s, n)``
    gives character offsets that cut ``s`` into runs of at most ``n`` tokens (for text with no
    sentence end to cut at)."""
    if budget < 16:
        raise ValueError(f"a part needs room for at least 16 tokens, got {budget}")
    overlap = max(0, min(overlap, budget // 4))
    paragraphs = _spans(text, _PARAGRAPHS, 0, len(text))
    counts = count_tokens([text[a:b] for a, b in paragraphs])
    pieces: list[Piece] = []
    for (a, b), n in zip(paragraphs, counts, strict=True):
        heading = heading_of(text[a:b])
        if n <= budget:
            pieces.append(Piece(a, b, n, heading))
            continue
        # a paragraph longer than a part: its sentences, then token runs of what is still long
        sentences = _spans(text, _SENTENCE_END, a, b)
        sizes = count_tokens([text[x:y] for x, y in sentences])
        first = True
        run: list[tuple[int, int, int]] = []  # sentences gathered up to the budget
        for (x, y), m in zip(sentences, sizes, strict=True):
            if m > budget:
                cuts = token_cuts(text[x:y], budget)
                bounds = [x] + [x + c for c in cuts] + [y]
                sub = [(p, q) for p, q in zip(bounds, bounds[1:], strict=False) if q > p]
                for (p, q), k in zip(sub, count_tokens([text[p:q] for p, q in sub]), strict=True):
                    run.append((p, q, k))
            else:
                run.append((x, y, m))
        acc: list[tuple[int, int, int]] = []
        for p, q, k in run:
            if acc and sum(r[2] for r in acc) + k > budget:
                pieces.append(
                    Piece(acc[0][0], acc[-1][1], sum(r[2] for r in acc), heading if first else None)
                )
                first, acc = False, []
            acc.append((p, q, k))
        if acc:
            pieces.append(
                Piece(acc[0][0], acc[-1][1], sum(r[2] for r in acc), heading if first else None)
            )
    if not pieces:
        return []
    # tokens from each piece to the next heading (the section it is in, from here on)
    to_next_heading = [0] * len(pieces)
    run_total = 0
    for i in range(len(pieces) - 1, -1, -1):
        run_total += pieces[i].tokens
        to_next_heading[i] = run_total
        if pieces[i].heading is not None:
            run_total = 0
    # [first piece, last piece) of each part, and the overlap tokens it may repeat before it
    groups: list[tuple[int, int, int]] = []
    start, used, allowance = 0, 0, 0
    for i, piece in enumerate(pieces):
        over = used + piece.tokens > budget
        # a section that does not fit the room left starts a part of its own, where the part so
        # far is at least half full
        section_break = (
            piece.heading is not None
            and i > start
            and used >= budget // 2
            and used + to_next_heading[i] > budget
        )
        if i > start and (over or section_break):
            groups.append((start, i, allowance))
            allowance = min(overlap, budget - piece.tokens)
            start, used = i, _overlap_tokens(pieces, start, i, allowance)
        used += piece.tokens
    groups.append((start, len(pieces), allowance))

    parts: list[Part] = []
    last_heading: str | None = None
    for index, (first, end, allowance) in enumerate(groups):
        lead = first
        if index:  # the end of the part before: whole paragraphs, up to its allowance
            used, lead = 0, first
            while lead - 1 >= groups[index - 1][0] and used + pieces[lead - 1].tokens <= allowance:
                used += pieces[lead - 1].tokens
                lead -= 1
        headings = [p.heading for p in pieces[first:end] if p.heading]
        if last_heading and pieces[first].heading is None:  # it opens inside a section
            headings.insert(0, f"{last_heading} (continued)")
        if headings:
            title = ", ".join(headings)
        else:
            title = f"characters {pieces[first].start:,}-{pieces[end - 1].end:,}"
        if len(title) > MAX_TITLE_CHARS:
            title = title[: MAX_TITLE_CHARS - 3].rstrip(", ") + "..."
        for p in pieces[lead:end]:
            if p.heading:
                last_heading = p.heading
        s, e = pieces[lead].start, pieces[end - 1].end
        parts.append(Part(index, title, s, e, text[s:e].strip(), pieces[first].start))
    return parts


def _overlap_tokens(pieces: Sequence[Piece], prev_first: int, first: int, overlap: int) -> int:
    """Tokens of the paragraphs before ``first`` that the next part repeats."""
    used, j = 0, first
    while j - 1 >= prev_first and used + pieces[j - 1].tokens <= overlap:
        used += pieces[j - 1].tokens
        j -= 1
    return used


def part_overlap(budget: int) -> int:
    """Tokens a part repeats of the one before: up to 256, an eighth of a small part."""
    return min(256, budget // 8)


def part_header(manual_title: str, part: int, parts: int, title: str) -> str:
    """The line that opens a part's text in its prompt."""
    return f"{manual_title} - part {part + 1} of {parts}: {title}\n\n"


PASSAGE_CHARS = 1200  # a passage longer than this is cut at line or sentence ends


@dataclass(frozen=True)
class Passage:
    """A paragraph (or a piece of a long one): the unit full-text search ranks. A part's rank
    for a question is that of its best passage, so a definition of a few lines is found in a
    part of thousands of tokens."""

    part: int  # the part whose new text holds it
    heading: str  # the section it is in ("" before the first heading)
    term: str  # the term it defines or continues defining ("" for running text)
    start: int
    end: int
    within: str = ""  # the definitions it is nested in ("set [-abef...]" around "-e")


def _indent(line: str) -> int:
    return len(line.expandtabs(8)) - len(line.expandtabs(8).lstrip())


# a term of one or more comma-separated forms ("-z", "--compress, -z"), two spaces, its text
_TERM_ON_LINE = re.compile(r"^\s*(\S{1,40}(?:, \S{1,40})*)\s{2,}\S")
_TERM_THEN_TEXT = re.compile(r"^\s*(\S{1,40}) (\S.*)$")


def _term_line(line: str, following: str | None, previous: str | None = None) -> str | None:
    """The term ``line`` defines: a line of at most 80 characters with the next indented
    deeper (``HISTSIZE`` / ``-s, --silent`` over their descriptions), or an indented short word
    followed by two spaces and its description (``PS1    The value of...``); not a line that
    goes on with the text of the line before (``below).  The options ...``: two spaces after
    a sentence), unless a description follows it, indented deeper."""
    if not line.strip():
        return None
    m = _TERM_ON_LINE.match(line.expandtabs(8))
    deeper = bool(following and following.strip() and _indent(following) > _indent(line))
    if m and _indent(line) > 0 and (deeper or not _goes_on(line, previous)):
        return m.group(1)
    if deeper and len(line.strip()) <= 80 and not _goes_on(line, previous):
        # a term as wide as its column, one space, then its text at the column the lines
        # below go on at (``speed_download The average download speed...``): the first word
        m = _TERM_THEN_TEXT.match(line.expandtabs(8))
        if m and m.start(2) == _indent(following) and len(m.group(2).split()) >= 3:
            return m.group(1)
        return line.strip()
    return None


def _text_column(line: str) -> int:
    """Where a line's running text starts: after the term of ``PS1    The value...``."""
    m = _TERM_ON_LINE.match(line.expandtabs(8))
    return m.end() - 1 if m and _indent(line) > 0 else _indent(line)


def _goes_on(line: str, previous: str | None) -> bool:
    """Whether ``line`` goes on with the text of the line before (at its text's column)."""
    return bool(previous and previous.strip() and _text_column(previous) == _indent(line))


def defined_term_of(paragraph: str) -> str | None:
    """The term a paragraph's first line defines, or None."""
    lines = paragraph.strip("\n").split("\n")
    return _term_line(lines[0], lines[1] if len(lines) > 1 else None)


STACKED_FORMS = 4  # the most forms of one term stacked over its text


def _stacked_term(lines: Sequence[str]) -> tuple[str, int] | None:
    """A term of several forms stacked a line each over its text, as texinfo's and pod's
    pages lay out an option (``-m`` / ``--mirror`` / its text indented deeper): the forms
    joined (``-m, --mirror``) and how many lines they take; None for one line or none."""
    ind = _indent(lines[0]) if lines else 0
    if ind == 0:
        return None
    for j, line in enumerate(lines[:STACKED_FORMS]):
        form = line.strip()
        if not form or _indent(line) != ind or len(form) > 40 or "  " in form:
            return None
        following = lines[j + 1] if j + 1 < len(lines) else ""
        if following.strip() and _indent(following) > ind:
            return (", ".join(x.strip() for x in lines[: j + 1]), j + 1) if j else None
    return None


def _definitions(
    text: str, a: int, b: int, heading: bool
) -> list[tuple[int, int, str | None, int]]:
    """[a, b) cut before each line that starts a definition: (start, end, its term or None,
    the term line's indentation); with ``heading``, the first line is the section's heading."""
    lines = text[a:b].split("\n")
    out: list[tuple[int, int, str | None, int]] = []
    at = a
    first = 1 if heading else 0  # the line a definition may start at
    stacked = _stacked_term(lines[first:])
    for i, line in enumerate(lines):
        term = None
        if stacked is not None and first <= i < first + stacked[1]:
            term = stacked[0] if i == first else None
        elif i or not heading:
            following = lines[i + 1] if i + 1 < len(lines) else None
            term = _term_line(line, following, lines[i - 1] if i else None)
        if term is not None and (not out or at > out[-1][0]):
            if out:
                out[-1] = (out[-1][0], at, out[-1][2], out[-1][3])
            out.append((at, b, term, _indent(line)))
        elif not out:
            out.append((at, b, None, 0))
        at += len(line) + 1
    return out


def passages(text: str, parts: Sequence[Part], max_chars: int = PASSAGE_CHARS) -> list[Passage]:
    """The passages of a manual split into ``parts``, each given to the part that brings its
    start (a passage in an overlap belongs to the part before): its paragraphs, cut before
    each definition (an option, a variable, a command, as a man page lays them out) and at
    most ``max_chars`` long. A passage has its section's heading, and the term it defines
    where it is in a definition (the term line or indented under it), and the definitions
    that one is nested in (an option of a builtin: the builtin's)."""
    out: list[Passage] = []
    heading = ""
    terms: list[tuple[str, int]] = []  # the definitions open here, outermost first
    starts = [p.overlap_start for p in parts]
    k = 0
    for a, b in _spans(text, _PARAGRAPHS, 0, len(text)):
        h = heading_of(text[a:b])
        if h:
            heading, terms = h, []
        for x0, y0, found, indent in _definitions(text, a, b, h is not None):
            first = text[x0:y0].strip("\n").split("\n", 1)[0]
            # a definition ends where a line is back at its term's level or out of it
            level = indent if found is not None else _indent(first)
            while terms and level <= terms[-1][1]:
                terms.pop()
            if found is not None:
                terms.append((found, indent))
            label = terms[-1][0] if terms else ""
            within = " / ".join(t for t, _ in terms[:-1])
            runs = [(x0, y0)]
            if y0 - x0 > max_chars:  # at line or sentence ends, then at most max_chars each
                runs = []
                for x, y in _spans(text, _SENTENCE_END, x0, y0):
                    while y - x > max_chars:
                        cut = text.rfind(" ", x, x + max_chars)
                        cut = cut if cut > x else x + max_chars
                        runs.append((x, cut))
                        x = cut
                    if runs and y - runs[-1][0] <= max_chars and runs[-1][1] == x:
                        runs[-1] = (runs[-1][0], y)
                    else:
                        runs.append((x, y))
            for x, y in runs:
                while k + 1 < len(starts) and starts[k + 1] <= x:
                    k += 1
                if text[x:y].strip():
                    out.append(Passage(k, heading[:512], label[:512], x, y, within[:512]))
    return out
