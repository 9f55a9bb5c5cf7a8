"""Questions about manuals: prompt layout from stored ids, generation on the engine thread,
answer objects, and storage of each turn. No database session stays open while the model
generates: reads happen before submission, the turn is written after the answer is complete
(or cancelled).

The service knows nothing of HTTP: it raises ``app.errors`` and yields plain events
(``app.answer_events``); the API layer turns them into status codes
and server-sent events."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import msgspec
from sqlalchemy import case, func, select, text, update
from sqlalchemy.exc import IntegrityError

from app.answer import Answer, PartRef, PartScore, Timings, Usage
from app.answer_events import AnswerDone, AnswerFailed, Event, IncrementalDecoder, TokenText
from app.db import Conversation, Database, Manual, ManualPart, ManualPassage, Message
from app.db.models import new_id
from app.engine_runner import Completion, EngineRunner, RequestHandle
from app.errors import NotFound, ServiceError
from app.parts import part_header, part_overlap, passages, split_manual
from app.settings import MIN_QUESTION_ROOM, Settings
from inference import SamplingParams
from prompts import BuiltPrompt, PromptLayoutTooLong, Turn

log = logging.getLogger("docqa.qa")

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class PromptManual:
    """What a prompt needs of a stored manual: its token ids and the tokenizer they came from;
    its text only where that was another tokenizer (the text is then encoded again)."""

    token_ids: list[int]
    tokenizer_fingerprint: str
    content: str = ""
    # a manual stored as parts: the part chosen for the question, and the ranked parts' scores
    part: PartRef | None = None
    part_scores: list[PartScore] = field(default_factory=list)


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
_STOP_WORDS = frozenset(
    [
        "a",
        "an",
        "and",
        "are",
        "as",
        "at",
        "be",
        "by",
        "can",
        "do",
        "does",
        "for",
        "from",
        "how",
        "i",
        "if",
        "in",
        "is",
        "it",
        "its",
        "me",
        "my",
        "of",
        "on",
        "or",
        "so",
        "that",
        "the",
        "their",
        "there",
        "these",
        "this",
        "to",
        "was",
        "what",
        "when",
        "where",
        "which",
        "who",
        "why",
        "will",
        "with",
        "you",
        "your",
        "should",
        "would",
        "could",
        "may",
        "might",
        "must",
    ]
)


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


_NAME = re.compile(r"[^\s,;:?!()\"'`]+")
NAMED_BOOST = 2.0


def named_in(question: str) -> set[str]:
    """The names a question spells out: words with a dash, a digit, a capital, ``_`` or ``$``
    in them (``--cacert``, ``-e``, ``PS1``, ``HISTSIZE``), as it spells them. A plain lowercase
    word is left out: ``set`` in "what does PS1 set?" is no name."""
    out = set()
    for w in _NAME.findall(question):
        w = w.strip(".'")
        if any(c.isupper() or c.isdigit() or c in "-_$" for c in w) and not w.istitle():
            out.add(w)
    return out


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


# Postgres: the passages of one manual that hold each lexeme of the query (to_tsvector's english
# stems, stop words dropped), with its occurrences in the text, in the term the passage defines
# (weight A) and in its section's heading (weight B), from the passages' tsvectors; the GIN
# index finds those holding any of them
_PG_TERMS = text(
    """
    WITH q AS (
        SELECT array_agg(DISTINCT lexeme) AS lexemes,
               to_tsquery('simple', string_agg(DISTINCT quote_literal(lexeme), ' | ')) AS any_of
        FROM unnest(to_tsvector('english', :query))
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
# often, which ranked as well on bench/parts.py's questions and needs no pass over the text)
TERM_WEIGHT, HEADING_WEIGHT = 2, 1
PASSAGES_PER_PART = 3


@dataclass
class Job:
    """One question on its way through the engine."""

    request_id: str
    prompt: BuiltPrompt
    params: SamplingParams
    namespace: bytes
    use_cache: bool
    question: str = ""
    conversation_id: str | None = None
    tenant: str | None = None  # who may cancel it
    warnings: list[str] = field(default_factory=list)
    manual_id: str | None = None  # the manual whose ledger the answer adds to
    speculate: bool = True  # prompt-lookup drafts (the answer is the same without)
    part: PartRef | None = None  # the part of the manual that answers
    part_scores: list[PartScore] = field(default_factory=list)


class QAService:
    def __init__(self, settings: Settings, db: Database, runner: EngineRunner):
        self.settings = settings
        self.db = db
        self.runner = runner
        self.cancel_relay = None  # CancelRelay when replicas share a Redis
        self._tasks: set[asyncio.Task] = set()

    @property
    def num_pending(self) -> int:
        """Answers not yet stored (or given) to their caller."""
        return len(self._tasks)

    # -- tenants and manuals ---------------------------------------------------------------------
    def namespace(self, tenant: str) -> bytes:
        """The cache namespace: the tenant's when auth is on, empty when it is off."""
        return tenant.encode() if self.settings.auth_enabled else b""

    @property
    def tokenizer_fingerprint(self) -> str:
        return self.runner.engine.tokenizer.fingerprint.hex()

    async def get_manual(self, tenant: str, manual_id: str) -> Manual:
        async with self.db.session() as s:
            m = await s.scalar(
                select(Manual).where(Manual.id == manual_id, Manual.tenant == tenant)
            )
        if m is None:
            raise NotFound("manual", manual_id)
        return m

    async def prompt_manual(
        self,
        tenant: str,
        manual_id: str,
        question: str = "",
        context: str = "",
        part: int | None = None,
        previous_part: int | None = None,
    ) -> PromptManual:
        """The manual a question is about, for its prompt: selects of the columns a prompt
        needs, not the whole row through a session (cheaper for the event loop's thread); the
        text is read only for a manual stored under another tokenizer. A manual stored as
        parts gives the part that answers: ``part`` where the request names one, else the one
        full-text search ranks first for the question (with ``context``, the conversation's
        recent questions), staying on ``previous_part`` unless another ranks clearly better."""
        where = (Manual.id == manual_id, Manual.tenant == tenant)
        async with self.db.engine.connect() as conn:
            # one select: a manual that is one part brings its ids along, one stored as parts
            # (whose ids the prompt does not use) does not
            whole_ids = case((Manual.part_count <= 1, Manual.token_ids), else_=None)
            row = (
                await conn.execute(
                    select(
                        Manual.tokenizer_fingerprint, Manual.part_count, Manual.title, whole_ids
                    ).where(*where)
                )
            ).first()
            if row is None:
                raise NotFound("manual", manual_id)
            fingerprint, num_parts, title, ids = row
            num_parts = num_parts or 1
            if part is not None and not 0 <= part < num_parts:
                raise ServiceError(
                    "invalid_request",
                    f"part {part} does not exist: this manual has {num_parts} "
                    f"part{'s' if num_parts > 1 else ''} (0 to {num_parts - 1})",
                    num_parts - 1,
                )
            if num_parts == 1:
                text_ = ""
                if fingerprint != self.tokenizer_fingerprint:
                    text_ = await conn.scalar(select(Manual.content).where(*where))
                return PromptManual(ids, fingerprint, text_)
            ranked = await self.rank_parts(conn, manual_id, num_parts, f"{question}\n{context}")
            chosen = part if part is not None else choose_part(ranked, num_parts, previous_part)
            p = (
                await conn.execute(
                    select(ManualPart.title, ManualPart.token_ids, ManualPart.content).where(
                        ManualPart.manual_id == manual_id, ManualPart.idx == chosen
                    )
                )
            ).first()
        if p is None:
            raise NotFound("manual part", f"{manual_id} part {chosen}")
        part_title, ids, content = p
        shown = ranked[:PART_SCORES_SHOWN]
        if all(r.index != chosen for r in shown):
            score = next((r.score for r in ranked if r.index == chosen), 0.0)
            shown = [*shown, PartScore(chosen, part_title, score)]
        text_ = ""
        if fingerprint != self.tokenizer_fingerprint:
            text_ = part_header(title, chosen, num_parts, part_title) + content
        return PromptManual(ids, fingerprint, text_, PartRef(chosen, part_title), shown)

    async def rank_parts(self, conn, manual_id: str, num_parts: int, query: str) -> list[PartScore]:
        """The manual's parts ranked for ``query``, best first, each by its best passages: the
        database's full-text search finds the passages that hold a word of the query, in their
        text, heading or defined term (Postgres: their tsvectors, english stems; SQLite: FTS5,
        porter stems), ``bm25`` scores them, ``part_scores`` adds up each part's best."""
        hits: dict[str, list[tuple[int, int, int]]] = {}
        part_of: dict[int, int] = {}

        def weighted(tf: int, th: int, tt: int) -> int:
            return min(tf, 1) + HEADING_WEIGHT * min(th, 1) + TERM_WEIGHT * min(tt, 1)

        terms: dict[int, str] = {}
        if conn.dialect.name == "postgresql":
            params = {"query": query[:20_000], "manual_id": manual_id}
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
        named = named_in(query)
        for sid in scores:
            if named and named & defined_names(terms.get(sid, "")):
                scores[sid] *= 1 + NAMED_BOOST  # the definition of what the question names
        best = part_scores(scores, part_of)
        titles = dict(
            (
                await conn.execute(
                    select(ManualPart.idx, ManualPart.title).where(
                        ManualPart.manual_id == manual_id
                    )
                )
            ).all()
        )
        ranked = sorted(best.items(), key=lambda kv: (-kv[1], kv[0]))
        return [PartScore(i, titles.get(i, ""), round(sc, 4)) for i, sc in ranked]

    async def manual_parts(self, manual_ids: Sequence[str]) -> dict[str, list[tuple]]:
        """(index, title, tokens, start, end) of each stored part of these manuals."""
        if not manual_ids:
            return {}
        async with self.db.engine.connect() as conn:
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

    async def search_parts(self, tenant: str, manual_id: str, question: str) -> dict:
        """The parts of a manual ranked for ``question``, and the one it would be answered
        from (a manual that is one part: that part)."""
        async with self.db.engine.connect() as conn:
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
                ranked = await self.rank_parts(conn, manual_id, num_parts, question)
        return {
            "manual_id": manual_id,
            "question": question,
            "parts": ranked,
            "chosen": choose_part(ranked, num_parts),
        }

    async def part_prefixes(self, manual: Manual) -> list[list[int]]:
        """The prompt prefix of every part of a manual (one for a manual that is one part)."""
        if (manual.part_count or 1) == 1:
            return [self.manual_prefix(manual)[0]]
        async with self.db.engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(
                        ManualPart.idx, ManualPart.title, ManualPart.token_ids, ManualPart.content
                    )
                    .where(ManualPart.manual_id == manual.id)
                    .order_by(ManualPart.idx)
                )
            ).all()
        builder = self.runner.builder
        out = []
        for idx, title, ids, content in rows:
            if manual.tokenizer_fingerprint == self.tokenizer_fingerprint:
                out.append(builder.prefix_ids(manual_token_ids=ids)[0])
            else:
                header = part_header(manual.title, idx, manual.part_count, title)
                out.append(builder.prefix_ids(header + content)[0])
        return out

    def manual_prefix(self, manual: Manual | PromptManual) -> tuple[list[int], int]:
        builder = self.runner.builder
        if manual.tokenizer_fingerprint == self.tokenizer_fingerprint:
            return builder.prefix_ids(manual_token_ids=manual.token_ids)
        return builder.prefix_ids(manual.content)  # stored for another tokenizer: re-encode

    async def create_manual(
        self, tenant: str, title: str, text: str, source_type: str
    ) -> tuple[Manual, bool]:
        """(manual, created). The same text again from the same tenant returns the stored one."""
        self.runner.require_ready()
        text = text.strip()
        if not text:
            raise ServiceError("invalid_manual", "the manual has no text")
        title = title.strip()[:512] or "untitled"
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        existing = await self._find_manual(tenant, digest)
        if existing is not None:
            return existing, False
        builder = self.runner.builder
        ids = await asyncio.to_thread(builder.manual_token_ids, text)
        prefix, _ = builder.prefix_ids(manual_token_ids=ids)
        max_len = self.runner.engine.max_model_len
        overhead = len(prefix) - len(ids)
        limit = max_len - MIN_QUESTION_ROOM - overhead
        part_limit = limit
        if self.settings.max_part_tokens is not None:
            part_limit = min(limit, self.settings.max_part_tokens)
        parts: list[ManualPart] = []
        found: list[ManualPassage] = []
        if self.settings.parts and len(ids) > part_limit:
            parts, found = await asyncio.to_thread(self._split, title, text, part_limit)
        elif len(ids) > limit:
            raise ServiceError(
                "manual_too_long",
                f"the manual is {len(ids):,} tokens; with the system instructions ({overhead} "
                f"tokens) and room for a question and an answer ({MIN_QUESTION_ROOM} tokens) it "
                f"must fit the model's context of {max_len:,} tokens, so a manual may have at "
                f"most {limit:,} tokens (this server stores no manual as parts: --parts off)",
                limit,
            )
        manual = Manual(
            id=new_id("man"),
            tenant=tenant,
            title=title,
            source_type=source_type,
            content=text,
            sha256=digest,
            token_ids=ids,
            token_count=len(ids),
            tokenizer_fingerprint=self.tokenizer_fingerprint,
            part_count=max(1, len(parts)),
        )
        for row in (*parts, *found):
            row.manual_id = manual.id
        try:
            async with self.db.transaction() as s:
                s.add(manual)
                await s.flush()  # the manual's row before its parts' (their foreign key)
                s.add_all(parts)
                s.add_all(found)
        except IntegrityError:  # the same upload raced us; return the stored one
            existing = await self._find_manual(tenant, digest)
            if existing is None:
                raise
            return existing, False
        return manual, True

    def _split(
        self, title: str, text: str, limit: int
    ) -> tuple[list[ManualPart], list[ManualPassage]]:
        """The manual's parts, each of at most ``limit`` prompt tokens with its header line
        (split again with a smaller budget in the rare case joins add tokens past it)."""
        tok = self.runner.engine.tokenizer
        builder = self.runner.builder
        header = len(builder.manual_token_ids(part_header(title, 999, 999, "")))
        budget = limit - header - 48  # the part title's tokens, at most 160 characters
        for _ in range(4):
            parts = split_manual(
                text, tok.count_batch, budget, part_overlap(budget), tok.cut_offsets
            )
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
                        heading=x.heading[:512],
                        term=x.term[:512],
                        content=text[x.start : x.end],
                    )
                    for x in passages(text, parts)
                ]
                return rows, found
            budget -= worst + 16
        raise ServiceError("invalid_manual", "the manual could not be split into parts that fit")

    async def _find_manual(self, tenant: str, digest: str) -> Manual | None:
        async with self.db.session() as s:
            return await s.scalar(
                select(Manual).where(Manual.tenant == tenant, Manual.sha256 == digest)
            )

    # -- prompts ----------------------------------------------------------------------------------
    def params(
        self,
        max_tokens: int | None,
        temperature: float,
        top_p: float,
        seed: int | None,
        ignore_eos: bool = False,
    ) -> SamplingParams:
        """A question's sampling; ``max_tokens`` defaults to the server's default and may not
        exceed its cap (``--max-tokens-cap``)."""
        cap = self.settings.max_tokens_cap
        if max_tokens is not None and max_tokens > cap:
            raise ServiceError(
                "invalid_request",
                f"max_tokens is {max_tokens:,}; this server answers with at most {cap:,} tokens",
                cap,
            )
        return SamplingParams(
            max_tokens=max_tokens or self.settings.default_max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            ignore_eos=ignore_eos,
        )

    def pin_key(self, tenant: str, manual_id: str) -> str:
        return f"{tenant}\x00{manual_id}"

    async def pin(self, tenant: str, manual: Manual) -> dict:
        """Warm the manual if needed, then hold its prefix blocks (every part's, for a manual
        stored as parts) out of eviction."""
        await self.warm(tenant, manual)
        prefixes = await self.part_prefixes(manual)
        ns, key = self.namespace(tenant), self.pin_key(tenant, manual.id)
        keys = [key] if len(prefixes) == 1 else [f"{key}\x00{i}" for i in range(len(prefixes))]

        def pin_all(e):
            return sum(e.pin(k, p, ns) for k, p in zip(keys, prefixes, strict=True))

        tokens = await self.runner.call(pin_all)
        c = self.runner.counters()
        return {
            "manual_id": manual.id,
            "pinned": tokens > 0,
            "pinned_tokens": tokens,
            "pinned_blocks_total": c["pinned_blocks"],
            "pin_budget_blocks": c["pin_budget_blocks"],
        }

    async def unpin(self, tenant: str, manual_id: str) -> bool:
        if not self.runner.ready:
            return False
        key = self.pin_key(tenant, manual_id)
        return await self.runner.call(lambda e: bool(e.unpin(key) + e.unpin_prefix(key + "\x00")))

    def build(
        self,
        manual: Manual | PromptManual,
        question: str,
        history: Sequence[Turn],
        max_tokens: int,
    ) -> BuiltPrompt:
        builder = self.runner.builder
        try:
            return builder.build(
                manual.content,
                question,
                history,
                max_model_len=self.runner.engine.max_model_len,
                max_tokens=max_tokens,
                manual_ids=self.manual_prefix(manual),
            )
        except PromptLayoutTooLong as e:
            raise ServiceError("prompt_too_long", str(e), e.limit) from None

    def history(self, messages: Sequence[Message]) -> list[Turn]:
        """Earlier (question, answer ids) turns; an answer cut short gets its end-of-turn token
        so the next turn opens cleanly."""
        eot = self.runner.builder.end_of_turn_id()
        turns: list[Turn] = []
        pending: str | None = None
        for m in messages:
            if m.role == "user":
                pending = m.content
            elif m.role == "assistant" and pending is not None:
                ids = list(m.token_ids)
                if not ids or ids[-1] != eot:
                    ids.append(eot)
                turns.append(Turn(pending, ids))
                pending = None
        return turns

    # -- running ----------------------------------------------------------------------------------
    async def cancel_local(self, request_id: str, tenant: str) -> dict | None:
        """Cancel an answer running on this replica (its blocks freed at once; a conversation
        turn is stored with finish reason ``cancelled``): the outcome, or None where no answer
        of ``tenant`` with that id runs here."""
        handle = self.runner.find(request_id)
        if handle is None or handle.owner != tenant:
            return None
        handle.cancel()
        done = await asyncio.shield(handle.final)
        return {
            "id": request_id,
            "cancelled": done.finish_reason == "cancelled",
            "finish_reason": done.finish_reason,
            "completion_tokens": len(done.output_token_ids),
        }

    async def cancel(self, request_id: str, tenant: str) -> dict | None:
        """``cancel_local``, else the replica running it, asked over Redis (``CancelRelay``)."""
        done = await self.cancel_local(request_id, tenant)
        if done is None and self.cancel_relay is not None:
            done = await self.cancel_relay.cancel_elsewhere(request_id, tenant)
        return done

    async def submit(self, job: Job) -> tuple[RequestHandle, asyncio.Task]:
        handle = await self.runner.submit(
            job.prompt.token_ids,
            job.params,
            request_id=job.request_id,
            namespace=job.namespace,
            use_cache=job.use_cache,
            owner=job.tenant,
            speculate=job.speculate,
        )
        task = asyncio.get_running_loop().create_task(self._complete(job, handle))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return handle, task

    async def _complete(self, job: Job, handle: RequestHandle) -> Answer:
        completion = await handle.final
        answer = self.answer(job, completion)
        if job.conversation_id is not None:
            await self._store_turn(job, completion, answer)
        elif job.manual_id is not None and answer.usage.completion_tokens:
            try:
                async with self.db.transaction() as s:
                    await self.record_ledger(s, job, answer)
            except Exception as e:  # the answer stands; only its ledger entry is lost
                log.warning("the ledger of %s was not updated: %s", job.manual_id, e)
                answer.warnings.append(f"this answer is not in the manual's ledger: {e}")
        return answer

    @staticmethod
    async def record_ledger(s, job: Job, answer: Answer) -> None:
        """Add an answer to its manual's ledger (``Manual.answers`` and the rest), in the
        session's transaction: one UPDATE of sums, so replicas sharing the database never lose
        an answer to another's."""
        u, t = answer.usage, answer.timings
        await s.execute(
            update(Manual)
            .where(Manual.id == job.manual_id, Manual.tenant == job.tenant)
            .values(
                answers=Manual.answers + 1,
                answered_prompt_tokens=Manual.answered_prompt_tokens + u.prompt_tokens,
                cached_tokens=Manual.cached_tokens + u.cached_tokens,
                cached_tokens_redis=Manual.cached_tokens_redis + u.cached_tokens_by_tier["redis"],
                ttft_saved_ms=Manual.ttft_saved_ms + t.ttft_saved_ms,
            )
        )

    def answer(self, job: Job, c: Completion) -> Answer:
        tok = self.runner.engine.tokenizer
        cached = c.num_cached_tokens
        redis = c.num_tier_cached_tokens
        return Answer(
            id=job.request_id,
            conversation_id=job.conversation_id,
            answer=tok.decode(c.output_token_ids).strip(),
            finish_reason=c.finish_reason,
            usage=Usage(
                prompt_tokens=len(c.prompt_token_ids),
                cached_tokens=cached,
                completion_tokens=len(c.output_token_ids),
                cached_tokens_by_tier={"device": cached - redis, "redis": redis},
                completion_tokens_details={
                    "accepted_prediction_tokens": c.accepted_prediction_tokens,
                    "rejected_prediction_tokens": c.rejected_prediction_tokens,
                },
            ),
            timings=Timings(**c.metrics.to_dict()),
            warnings=list(job.warnings),
            part=job.part,
            part_scores=list(job.part_scores),
        )

    async def _store_turn(self, job: Job, c: Completion, answer: Answer) -> None:
        q_ids = self.runner.engine.tokenizer.encode(job.question.strip())
        for attempt in range(5):
            try:
                async with self.db.transaction() as s:
                    last = await s.scalar(
                        select(func.max(Message.seq)).where(
                            Message.conversation_id == job.conversation_id
                        )
                    )
                    seq = (last if last is not None else -1) + 1
                    s.add(
                        Message(
                            conversation_id=job.conversation_id,
                            seq=seq,
                            role="user",
                            content=job.question,
                            token_ids=q_ids,
                        )
                    )
                    s.add(
                        Message(
                            id=job.request_id,
                            conversation_id=job.conversation_id,
                            seq=seq + 1,
                            role="assistant",
                            content=answer.answer,
                            token_ids=c.output_token_ids,
                            finish_reason=answer.finish_reason,
                            usage=msgspec.to_builtins(answer.usage),
                            timings=msgspec.to_builtins(answer.timings),
                            warnings=list(answer.warnings),
                            part=job.part.index if job.part is not None else None,
                        )
                    )
                    if job.manual_id is not None and answer.usage.completion_tokens:
                        await self.record_ledger(s, job, answer)
                return
            except IntegrityError as e:
                # a concurrent turn took this seq, or the conversation was deleted meanwhile
                async with self.db.session() as s:
                    alive = await s.get(Conversation, job.conversation_id)
                if alive is None:
                    log.info("conversation %s was deleted; answer not stored", job.conversation_id)
                    answer.warnings.append(
                        "the conversation was deleted; this answer is not stored"
                    )
                    return
                log.debug("retrying turn storage (%s): %s", attempt, e)
                await asyncio.sleep(0.01 * (attempt + 1))
        raise RuntimeError(f"could not store a turn of {job.conversation_id}")

    async def text_deltas(self, handle: RequestHandle) -> AsyncIterator[str]:
        """The answer's text as it grows, one non-empty delta per engine step."""
        decoder = IncrementalDecoder(self.runner.engine.tokenizer)
        while True:
            ids = await handle.tokens.get()
            if ids is None:
                return
            delta = decoder.push(ids)
            if delta:
                yield delta

    async def events(self, handle: RequestHandle, task: asyncio.Task) -> AsyncIterator[Event]:
        """The answer as it grows (``TokenText``, one per engine step that adds text), then
        ``AnswerDone`` (or ``AnswerFailed``). A consumer that stops early cancels the request
        (the task stores the partial answer with finish reason ``cancelled``)."""
        try:
            async for delta in self.text_deltas(handle):
                yield TokenText(delta)
            try:
                answer = await asyncio.shield(task)
            except Exception as e:
                log.error("request %s failed: %s", handle.request_id, e)
                yield AnswerFailed(getattr(e, "code", "engine_error"), str(e))
                return
            yield AnswerDone(answer)
        finally:
            if not handle.final.done():
                handle.cancel()

    async def warm(self, tenant: str, manual: Manual) -> dict:
        """Prefill the manual's prefix (every part's, in turn, for a manual stored as parts)
        into the cache, and wait until Redis holds it where there is a Redis tier."""
        ns = self.namespace(tenant)
        t0 = time.perf_counter()
        out = {"prompt_tokens": 0, "cached_tokens": 0, "computed_tokens": 0, "redis_tokens": 0}
        redis_status = "disabled"
        for prefix in await self.part_prefixes(manual):
            job = Job(
                request_id=f"warm_{uuid.uuid4().hex}",
                prompt=BuiltPrompt(prefix, len(prefix), 0, 0),
                params=SamplingParams(max_tokens=1),
                namespace=ns,
                use_cache=True,
            )
            handle, task = await self.submit(job)
            c = await handle.final
            await task
            probe = prefix + [0]
            cached = await self.runner.call(
                lambda e, probe=probe: (
                    e.kv_manager.find_cached_prefix(probe, ns, partial=True).num_cached_tokens
                )
            )
            redis_status, redis_tokens = await self._warm_tier(prefix, ns)
            out["prompt_tokens"] += len(prefix)
            out["cached_tokens"] += cached
            out["computed_tokens"] += len(prefix) - c.num_cached_tokens
            out["redis_tokens"] += redis_tokens
        return {
            "manual_id": manual.id,
            "prompt_tokens": out["prompt_tokens"],
            "cached_tokens": out["cached_tokens"],
            "computed_tokens": out["computed_tokens"],
            "elapsed_ms": round((time.perf_counter() - t0) * 1000, 3),
            "redis": redis_status,
            "redis_cached_tokens": out["redis_tokens"],
            "parts": manual.part_count or 1,
        }

    async def _warm_tier(self, prefix: list[int], ns: bytes) -> tuple[str, int]:
        """Wait until Redis holds the prefix's full blocks (writing again those it lacks, e.g.
        written while Redis was down or trimmed since). Returns (tier status, tokens held)."""
        engine = self.runner.engine
        tier = engine.tier
        if tier is None:
            return "disabled", 0
        hashes = engine.kv_manager.hasher(ns).chain(prefix)
        bs = engine.kv_manager.block_size
        for attempt in range(2):
            if not tier.up:
                break
            await asyncio.wait_for(asyncio.wrap_future(tier.flush()), timeout=120)
            present = await asyncio.to_thread(tier.count_present, hashes)
            if present == len(hashes) or attempt:
                return tier.status, present * bs
            await self.runner.call(lambda e: e.write_prefix_to_tier(prefix, ns))
        return tier.status, 0
