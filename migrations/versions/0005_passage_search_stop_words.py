"""the passages' tsvector keeps stop words: the question decides which words count

Postgres's ``english`` configuration drops its stop words when it indexes, among them words
that say where an answer is ("only", "same", "further"), while SQLite's FTS5 drops none. The
generated column now uses ``docqa_english``: the same English stemmer without a stop-word
list, and a question leaves out the same stop words on both databases
(``app/manual_parts.py``).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-06
"""

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

# the token types the english configuration stems (the rest keep its mapping: simple)
_WORDS = "asciiword, word, hword, hword_part, hword_asciipart, asciihword"


def _search_column(config: str) -> None:
    op.execute("DROP INDEX IF EXISTS ix_manual_passages_search")
    op.execute("ALTER TABLE manual_passages DROP COLUMN IF EXISTS search")
    op.execute(
        "ALTER TABLE manual_passages ADD COLUMN search tsvector GENERATED ALWAYS AS "
        f"(setweight(to_tsvector('{config}', translate(term, '<>', '  ')), 'A') || "
        f"setweight(to_tsvector('{config}', translate(heading, '<>', '  ')), 'B') || "
        f"to_tsvector('{config}', translate(content, '<>', '  '))) STORED"
    )
    op.execute("CREATE INDEX ix_manual_passages_search ON manual_passages USING GIN (search)")


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(
        "CREATE TEXT SEARCH DICTIONARY docqa_english_stem (TEMPLATE = snowball, Language = english)"
    )
    op.execute("CREATE TEXT SEARCH CONFIGURATION docqa_english (COPY = english)")
    op.execute(
        f"ALTER TEXT SEARCH CONFIGURATION docqa_english ALTER MAPPING FOR {_WORDS} "
        "WITH docqa_english_stem"
    )
    _search_column("docqa_english")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    _search_column("english")
    op.execute("DROP TEXT SEARCH CONFIGURATION docqa_english")
    op.execute("DROP TEXT SEARCH DICTIONARY docqa_english_stem")
