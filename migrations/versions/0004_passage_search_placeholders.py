"""the passages' tsvector reads a placeholder such as <speed> as a word

Postgres's text parser takes ``<speed>`` for a markup tag and indexes nothing of it, so the
term ``--limit-rate <speed>`` held no ``speed``; the generated column now reads ``<`` and ``>``
as spaces (SQLite's FTS5 tokenizer already does).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-05
"""

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def _search_column(text_of) -> None:
    op.execute("DROP INDEX IF EXISTS ix_manual_passages_search")
    op.execute("ALTER TABLE manual_passages DROP COLUMN IF EXISTS search")
    op.execute(
        "ALTER TABLE manual_passages ADD COLUMN search tsvector GENERATED ALWAYS AS "
        f"(setweight(to_tsvector('english', {text_of('term')}), 'A') || "
        f"setweight(to_tsvector('english', {text_of('heading')}), 'B') || "
        f"to_tsvector('english', {text_of('content')})) STORED"
    )
    op.execute("CREATE INDEX ix_manual_passages_search ON manual_passages USING GIN (search)")


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _search_column(lambda col: f"translate({col}, '<>', '  ')")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _search_column(lambda col: col)
