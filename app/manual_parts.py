"""A manual stored as parts (longer than the model's window): the rows that store it, and the
part each question is answered from.

``part_rows`` cuts a manual (``app/parts.py``) into parts of at most a prompt's room, with their
exact prompt ids, and the paragraphs full-text search ranks. ``rank_parts`` asks the database
which paragraphs hold the question's words (Postgres: a tsvector with a GIN index; SQLite:
FTS5) and scores them with BM25 (a summary's one-line entry counting for the definition it
sums up); ``choose_part`` picks the part.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from sqlalchemy import func, select, text

from app.answer import PartScore
from app.db import Manual, ManualPart, ManualPassage
from app.errors import NotFound, ServiceError
from app.parts import part_header, part_overlap, passages, split_manual

# a follow-up stays on the previous turn's part unless another ranks this much higher
CLEARLY_BETTER = 1.5
PART_SCORES_SHOWN = 4  # the best-ranked parts an answer lists


def choose_part(ranked: Sequence[PartScore], num_parts: int, previous: int | None = None) -> int:
    """The part that answers: the best ranked; in a conversation the previous turn's part
    unless another ranks clearly better (its history stays cached); part 0 when nothing
    matches at all."""
    if previous is not None and 0 <= previous < num_parts:
        best = ranked[0] if ranked else None
        before = next((r.score for r in ranked if r.index == previous), 0.0)
        if best is None or best.index == previous or best.score <= CLEARLY_BETTER * before:
            return previous
        return best.index
    return ranked[0].index if ranked and ranked[0].score > 0 else 0


_FTS_WORD = re.compile(r"[^\W_]+(?:[.'-][^\W_]+)*", re.UNICODE)
MAX_QUERY_TERMS = 32
# words of questions that say nothing of where the answer is (Postgres's english
# configuration drops its own list; FTS5 has none)
_STOP_TEXT = """a an and are as at be by can do does for from how i if in is it its me my of on or
so that the their there these this to was what when where which who why will with you your should
would could may might must"""
_STOP_WORDS = frozenset(_STOP_TEXT.split())


def fts5_terms(text: str) -> list[str]:
    """The words of ``text`` as FTS5 queries of one phrase each (quoted: no operator syntax),
    stop words left out, first occurrences in order, at most MAX_QUERY_TERMS."""
    words = dict.fromkeys(
        w.lower() for w in _FTS_WORD.findall(text) if len(w) > 1 and w.lower() not in _STOP_WORDS
    )
    return ['"' + w.replace('"', "") + '"' for w in list(words)[:MAX_QUERY_TERMS]]


def bm25(hits: dict[str, list[tuple[int, int, int]]], num_docs: int, avg_len: float) -> dict:
    """Okapi BM25 of each passage from the database's per-term matches: ``hits[term]`` lists
    (passage, length, the term's count there) of the passages that hold it. Lucene's inverse
    document frequency, ln(1 + (N - n + 0.5) / (n + 0.5)), stays positive for a term most
    passages hold (FTS5's bm25() drops such terms altogether). Length normalization is mild
    (b = 0.3): a definition of several lines is not outranked by a one-line mention."""
    k1, b = 1.2, 0.3
    scores: dict[int, float] = {}
    for rows in hits.values():
        if not rows:
            continue
        idf = math.log(1 + (num_docs - len(rows) + 0.5) / (len(rows) + 0.5))
        for doc, length, tf in rows:
            norm = tf * (k1 + 1) / (tf + k1 * (1 - b + b * length / max(avg_len, 1.0)))
            scores[doc] = scores.get(doc, 0.0) + idf * norm
    return scores


_NAME = re.compile(r"\$[?#@*!$0-9-]|[^\s,;:?!()\"'`]+")
# "the wait builtin", "the IFS variable", "the option globstar": a plain word a question names
# by what it is
_KIND = r"(?:builtin|command|variable|option|parameter)s?"
_CUED = (
    re.compile(rf"([\w.-]+)\s+{_KIND}\b", re.IGNORECASE),
    re.compile(rf"\bthe\s+{_KIND}\s+([\w.-]+)", re.IGNORECASE),
)
NAMED_BOOST = 2.0


def named_in(question: str) -> set[str]:
    """The names a question spells out: words with a dash, a digit, a capital, ``_`` or ``$``
    in them (``--cacert``, ``-e``, ``PS1``, ``HISTSIZE``, ``$?``: the parameter ``?`` as
    well), as it spells them, and a plain word it calls a builtin, command, variable, option
    or parameter (``the wait builtin``). Another plain lowercase word is left out: ``set`` in
    "what does PS1 set?" is no name."""
    out = set()
    for w in _NAME.findall(question):
        w = w.strip(".'")
        if w.startswith("$") and len(w) > 1:
            out.add(w[1:])
        spelled = any(c.isupper() or c.isdigit() or c in "_$" for c in w) and not w.istitle()
        if spelled or (w.startswith("-") and len(w) > 1):
            out.add(w)
    for m in (m for cue in _CUED for m in cue.finditer(question)):
        w = m.group(1).strip(".'")
        if w.lower() not in _STOP_WORDS and not re.fullmatch(_KIND, w, re.IGNORECASE):
            out.add(w)
    return out


_HYPHENATED = re.compile(r"(?<![\w-])[^\W\d_]+(?:-[^\W\d_]+)+\b")


def compounds(query: str) -> list[str]:
    """Each hyphenated word of ``query`` written as one (``read-only`` -> ``readonly``): a
    manual names a thing by the compound a user spells with a hyphen (a builtin, an option)."""
    return list(dict.fromkeys(w.replace("-", "") for w in _HYPHENATED.findall(query)))


def defined_names(term: str) -> set[str]:
    """What a definition's term line names: the first word of each comma-separated form
    (``-L, --location`` -> -L and --location; ``wait [-fn] [id ...]`` -> wait)."""
    out = set()
    for form in term.split(","):
        words = form.split()
        if words:
            out.add(words[0].rstrip("=:"))
    return out


def part_scores(scores: dict[int, float], part_of: dict[int, int]) -> dict[int, float]:
    """A part's score: the sum of its best PASSAGES_PER_PART passages' (a part that answers
    with a definition and its mentions outranks one with a single stray match)."""
    per: dict[int, list[float]] = {}
    for doc, score in scores.items():
        per.setdefault(part_of[doc], []).append(score)
    return {p: sum(sorted(v, reverse=True)[:PASSAGES_PER_PART]) for p, v in per.items()}


# Postgres: the passages of one manual that hold each lexeme of the query (English stems of
# docqa_english, migrations/versions/0005: english's stemmer without its stop words, so the
# question's words less _STOP_WORDS count on both databases; one-letter lexemes dropped, as
# fts5_terms drops them: the e of "set -e" is the named option's, not a word to search), with
# its occurrences in the text, in the term the passage defines (weight A) and in its section's
# heading (weight B), from the passages' tsvectors; the GIN index finds those holding any
_PG_TERMS = text(
    """
    WITH q AS (
        SELECT array_agg(DISTINCT lexeme) AS lexemes,
               to_tsquery('simple', string_agg(DISTINCT quote_literal(lexeme), ' | ')) AS any_of
        FROM unnest(to_tsvector('docqa_english', translate(:query, '<>', '  ')))
        WHERE length(lexeme) > 1
    )
    SELECT u.lexeme, s.id, s.part_idx, s.term, length(s.content),
           (SELECT count(*) FROM unnest(u.weights) w WHERE w = 'D'),
           (SELECT count(*) FROM unnest(u.weights) w WHERE w = 'B'),
           (SELECT count(*) FROM unnest(u.weights) w WHERE w = 'A')
    FROM q, manual_passages s, unnest(s.search) u
    WHERE s.manual_id = :manual_id AND s.search @@ q.any_of AND u.lexeme = ANY(q.lexemes)
    """
)
# SQLite: the passages of one manual that hold one term (an FTS5 phrase) in their text, their
# section's heading, their defined term: one index lookup each, by column filter
_SQLITE_TERM = text(
    """
    SELECT s.id, s.part_idx, s.term, length(s.content),
           max(m.col = 'content'), max(m.col = 'heading'), max(m.col = 'term')
    FROM (SELECT rowid, 'content' AS col FROM manual_passages_fts
           WHERE manual_passages_fts MATCH :in_content
          UNION ALL
          SELECT rowid, 'heading' FROM manual_passages_fts
           WHERE manual_passages_fts MATCH :in_heading
          UNION ALL
          SELECT rowid, 'term' FROM manual_passages_fts WHERE manual_passages_fts MATCH :in_term) m
    JOIN manual_passages s ON s.id = m.rowid
    WHERE s.manual_id = :manual_id
    GROUP BY s.id
    """
)
# a word in the term a passage defines counts as TERM_WEIGHT times one in its text; in its
# section's heading, HEADING_WEIGHT times (each counted once: whether it is there, not how
# often, which ranked as well on bench/parts.py's questions and needs no pass over the text;
# a heading weight of 2 ranked one more of its 64 questions first on SQLite, and one fewer of
# the 33 it holds out)
TERM_WEIGHT, HEADING_WEIGHT = 2, 1
PASSAGES_PER_PART = 3


def part_rows(
    tok, builder, title: str, text: str, limit: int
) -> tuple[list[ManualPart], list[ManualPassage]]:
    """The manual's parts, each of at most ``limit`` prompt tokens with its header line
    (split again with a smaller budget in the rare case joins add tokens past it)."""
    header = len(builder.manual_token_ids(part_header(title, 999, 999, "")))
    budget = limit - header - 48  # the part title's tokens, at most 160 characters
    for _ in range(4):
        parts = split_manual(text, tok.count_batch, budget, part_overlap(budget), tok.cut_offsets)
        rows, worst = [], 0
        for p in parts:
            body = part_header(title, p.index, len(parts), p.title) + p.text
            ids = builder.manual_token_ids(body)
            worst = max(worst, len(ids) - limit)
            rows.append(
                ManualPart(
                    idx=p.index,
                    title=p.title,
                    start_char=p.start,
                    end_char=p.end,
                    content=p.text,
                    token_ids=ids,
                    token_count=len(ids),
                )
            )
        if worst <= 0:
            found = [
                ManualPassage(
                    part_idx=x.part,
                    heading=f"{x.heading} / {x.within}"[:512] if x.within else x.heading,
                    term=x.term[:512],
                    content=text[x.start : x.end],
                )
                for x in passages(text, parts)
            ]
            return rows, found
        budget -= worst + 16
    raise ServiceError("invalid_manual", "the manual could not be split into parts that fit")


async def rank_parts(conn, manual_id: str, query: str) -> list[PartScore]:
    """The manual's parts ranked for ``query``, best first, each by its best passages: the
    database's full-text search finds the passages that hold a word of the query, in their
    text, heading or defined term (Postgres: their tsvectors, english stems; SQLite: FTS5,
    porter stems), ``bm25`` scores them, ``part_scores`` adds up each part's best."""
    hits: dict[str, list[tuple[int, int, int]]] = {}
    part_of: dict[int, int] = {}
    joined = compounds(query)
    query = " ".join([query, *joined])

    def weighted(tf: int, th: int, tt: int) -> int:
        return min(tf, 1) + HEADING_WEIGHT * min(th, 1) + TERM_WEIGHT * min(tt, 1)

    terms: dict[int, str] = {}
    if conn.dialect.name == "postgresql":
        # the question's words less the stop words FTS5's search leaves out too (english's
        # own list drops the rest)
        kept = (w for w in query.split() if w.strip(".,;:?!'\"()").lower() not in _STOP_WORDS)
        params = {"query": " ".join(kept)[:20_000], "manual_id": manual_id}
        rows = (await conn.execute(_PG_TERMS, params)).all()
        for lexeme, sid, part, term, n, *tfs in rows:
            hits.setdefault(lexeme, []).append((sid, n, weighted(*tfs)))
            part_of[sid], terms[sid] = part, term
    else:
        for word in fts5_terms(query):
            params = {
                "in_content": f"content : {word}",
                "in_heading": f"heading : {word}",
                "in_term": f"term : {word}",
                "manual_id": manual_id,
            }
            rows = (await conn.execute(_SQLITE_TERM, params)).all()
            hits[word] = [(sid, n, weighted(*tfs)) for sid, _, _, n, *tfs in rows]
            part_of.update((sid, part) for sid, part, *_ in rows)
            terms.update((sid, term) for sid, _, term, *_ in rows)
    if not part_of:
        return []
    num, avg_len = (
        await conn.execute(
            select(func.count(), func.avg(func.length(ManualPassage.content))).where(
                ManualPassage.manual_id == manual_id
            )
        )
    ).one()
    scores = bm25(hits, int(num), float(avg_len or 1.0))
    named = named_in(query) | set(joined)
    for sid in scores:
        if named and named & defined_names(terms.get(sid, "")):
            scores[sid] *= 1 + NAMED_BOOST  # the definition of what the question names
    sizes = {sid: n for rows in hits.values() for sid, n, _ in rows}  # passages' characters
    await _to_definitions(conn, manual_id, scores, part_of, terms, sizes)
    best = part_scores(scores, part_of)
    titles = dict(
        (
            await conn.execute(
                select(ManualPart.idx, ManualPart.title).where(ManualPart.manual_id == manual_id)
            )
        ).all()
    )
    ranked = sorted(best.items(), key=lambda kv: (-kv[1], kv[0]))
    return [PartScore(i, titles.get(i, ""), round(sc, 4)) for i, sc in ranked]


ENTRY_CHARS = 240  # the longest line of a summary (of a page up to 200 columns wide)


def _name_like(term: str) -> bool:
    """Whether a term names something a summary can point to: a form of three characters or
    more besides its dashes (``--compress, -z``, ``RSYNC_RSH``; not ``-c`` or a bullet)."""
    return any(len(n.lstrip("-")) >= 3 for n in defined_names(term))


async def _to_definitions(conn, manual_id, scores, part_of, terms, sizes) -> None:
    """Credit a summary's entry to the definition it sums up: a passage that is one line
    starting with its term (``--bwlimit=RATE  limit socket I/O bandwidth`` in an option
    summary), where the manual defines the same term at length elsewhere, gives its score to
    the definition's first passage, whose part holds the answer (the best entry of each
    definition is added to it)."""
    asked = {terms[s] for s in scores if sizes[s] <= ENTRY_CHARS and _name_like(terms.get(s, ""))}
    if not asked:
        return
    rows = (
        await conn.execute(
            select(
                ManualPassage.id,
                ManualPassage.part_idx,
                ManualPassage.term,
                func.length(ManualPassage.content),
                func.substr(ManualPassage.content, 1, ENTRY_CHARS + 600),
            )
            .where(ManualPassage.manual_id == manual_id, ManualPassage.term.in_(asked))
            .order_by(ManualPassage.id)
        )
    ).all()
    by_term: dict[str, list] = {}
    for row in rows:
        part_of.setdefault(row[0], row[1])
        by_term.setdefault(row[2], []).append(row)
    given: dict[int, float] = {}
    for term, found in by_term.items():
        entries, starts, size = [], [], 0
        for sid, _, _, n, head in found:
            line = head.strip()
            if n <= ENTRY_CHARS and "\n" not in line and line.startswith(term):
                entries.append((sid, len(line)))
                continue
            size += n
            if line.startswith(term):
                starts.append(sid)
        for sid, n in entries:
            if starts and sid in scores and 2 * n <= size:
                given[starts[0]] = max(given.get(starts[0], 0.0), scores.pop(sid))
    for sid, score in given.items():
        scores[sid] = scores.get(sid, 0.0) + score


async def list_parts(conn, manual_ids: Sequence[str]) -> dict[str, list[tuple]]:
    """(index, title, tokens, start, end) of each stored part of these manuals."""
    rows = (
        await conn.execute(
            select(
                ManualPart.manual_id,
                ManualPart.idx,
                ManualPart.title,
                ManualPart.token_count,
                ManualPart.start_char,
                ManualPart.end_char,
            )
            .where(ManualPart.manual_id.in_(list(manual_ids)))
            .order_by(ManualPart.manual_id, ManualPart.idx)
        )
    ).all()
    out: dict[str, list[tuple]] = {}
    for mid, *part in rows:
        out.setdefault(mid, []).append(tuple(part))
    return out


async def search_parts(conn, tenant: str, manual_id: str, question: str) -> dict:
    """The parts of a manual ranked for ``question``, and the one it would be answered
    from (a manual that is one part: that part)."""
    row = (
        await conn.execute(
            select(Manual.part_count, Manual.title).where(
                Manual.id == manual_id, Manual.tenant == tenant
            )
        )
    ).first()
    if row is None:
        raise NotFound("manual", manual_id)
    num_parts = row[0] or 1
    if num_parts == 1:
        ranked = [PartScore(0, row[1], 0.0)]
    else:
        ranked = await rank_parts(conn, manual_id, question)
    return {
        "manual_id": manual_id,
        "question": question,
        "parts": ranked,
        "chosen": choose_part(ranked, num_parts),
    }
