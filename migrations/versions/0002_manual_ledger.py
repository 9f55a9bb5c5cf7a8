"""the manuals' ledger of what the cache saved

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_COLUMNS = (
    ("answers", sa.Integer()),
    ("answered_prompt_tokens", sa.Integer()),
    ("cached_tokens", sa.Integer()),
    ("cached_tokens_redis", sa.Integer()),
    ("ttft_saved_ms", sa.Float()),
)


def upgrade() -> None:
    with op.batch_alter_table("manuals") as batch:
        for name, kind in _COLUMNS:
            batch.add_column(sa.Column(name, kind, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("manuals") as batch:
        for name, _ in reversed(_COLUMNS):
            batch.drop_column(name)
