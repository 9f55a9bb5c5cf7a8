"""manuals longer than the window as parts, with full-text search over their passages

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def _manual_id() -> sa.Column:
    return sa.Column(
        "manual_id", sa.String(40), sa.ForeignKey("manuals.id", ondelete="CASCADE"), nullable=False
    )


def upgrade() -> None:
    op.create_table(
        "manual_parts",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        _manual_id(),
        sa.Column("idx", sa.Integer(), nullable=False),
        sa.Column("title", sa.String(512), nullable=False),
        sa.Column("start_char", sa.Integer(), nullable=False),
        sa.Column("end_char", sa.Integer(), nullable=False),
        sa.Column("content", sa.Text(), nullable=False),
        sa.Column("token_ids", sa.LargeBinary(), nullable=False),
        sa.Column("token_count", sa.Integer(), nullable=False),
        sa.UniqueConstraint("manual_id", "idx", name="uq_manual_parts_manual_idx"),
    )
    op.create_table(
        "manual_passages",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        _manual_id(),
        sa.Column("part_idx", sa.Integer(), nullable=False),
        sa.Column("heading", sa.String(512), nullable=False),
        sa.Column("term", sa.String(512), nullable=False),
        sa.Column("content", sa.Text(), nullable=False),
    )
    op.create_index("ix_manual_passages_manual_id", "manual_passages", ["manual_id"])
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            "ALTER TABLE manual_passages ADD COLUMN search tsvector GENERATED ALWAYS AS "
            "(setweight(to_tsvector('english', term), 'A') || "
            "setweight(to_tsvector('english', heading), 'B') || "
            "to_tsvector('english', content)) STORED"
        )
        op.execute("CREATE INDEX ix_manual_passages_search ON manual_passages USING GIN (search)")
    else:  # SQLite: an FTS5 index of the passages' text, kept by triggers
        op.execute(
            "CREATE VIRTUAL TABLE manual_passages_fts USING fts5(term, heading, content, "
            "content='manual_passages', content_rowid='id', tokenize='porter unicode61')"
        )
        op.execute(
            "CREATE TRIGGER manual_passages_ai AFTER INSERT ON manual_passages BEGIN "
            "INSERT INTO manual_passages_fts(rowid, term, heading, content) "
            "VALUES (new.id, new.term, new.heading, new.content); END"
        )
        op.execute(
            "CREATE TRIGGER manual_passages_ad AFTER DELETE ON manual_passages BEGIN "
            "INSERT INTO manual_passages_fts(manual_passages_fts, rowid, term, heading, content) "
            "VALUES ('delete', old.id, old.term, old.heading, old.content); END"
        )
    with op.batch_alter_table("manuals") as batch:
        batch.add_column(sa.Column("part_count", sa.Integer(), nullable=False, server_default="1"))
    with op.batch_alter_table("messages") as batch:
        batch.add_column(sa.Column("part", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("messages") as batch:
        batch.drop_column("part")
    with op.batch_alter_table("manuals") as batch:
        batch.drop_column("part_count")
    if op.get_bind().dialect.name != "postgresql":
        op.execute("DROP TRIGGER IF EXISTS manual_passages_ad")
        op.execute("DROP TRIGGER IF EXISTS manual_passages_ai")
        op.execute("DROP TABLE IF EXISTS manual_passages_fts")
    op.drop_table("manual_passages")
    op.drop_table("manual_parts")
