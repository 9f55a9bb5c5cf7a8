"""Alembic environment: async engine (aiosqlite or asyncpg), run from a synchronous caller.

``docqa db upgrade`` and ``docqa serve`` call this before any event loop runs (it starts its
own with ``asyncio.run``). On Postgres, a transaction-scoped advisory lock serializes replicas
that start at the same time: the second waits, then finds the schema current.
"""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy import pool, text
from sqlalchemy.ext.asyncio import create_async_engine

from app.db.models import Base

# pg_advisory_xact_lock key: any fixed 64-bit number owned by docqa's migrations
MIGRATION_LOCK_KEY = 0x646F637161  # "docqa"

config = context.config
target_metadata = Base.metadata


def _do_run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.execute(text(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_KEY})"))
        context.run_migrations()


async def _run_async(url: str) -> None:
    engine = create_async_engine(url, poolclass=pool.NullPool)
    try:
        async with engine.connect() as conn:
            await conn.run_sync(_do_run)
    finally:
        await engine.dispose()


def run_migrations_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    asyncio.run(_run_async(config.get_main_option("sqlalchemy.url")))
