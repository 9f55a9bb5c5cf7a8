"""The async engine and session factory, with SQLite set up for a server (foreign keys on,
WAL, busy timeout)."""

from __future__ import annotations

from contextlib import asynccontextmanager

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

SQLITE_BUSY_TIMEOUT_MS = 10_000


def _sqlite_pragmas(dbapi_conn, _record):
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def create_engine(url: str, **kwargs):
    if url.startswith("sqlite"):
        engine = create_async_engine(url, **kwargs)
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    kwargs.setdefault("pool_size", 10)
    return create_async_engine(url, **kwargs)


class Database:
    """One engine per process; sessions are opened per unit of work and never held open while
    the model generates."""

    def __init__(self, url: str):
        self.url = url
        self.engine = create_engine(url)
        self.sessionmaker = async_sessionmaker(self.engine, expire_on_commit=False)

    @asynccontextmanager
    async def session(self):
        async with self.sessionmaker() as s:
            yield s

    @asynccontextmanager
    async def transaction(self):
        async with self.sessionmaker() as s, s.begin():
            yield s

    async def close(self) -> None:
        await self.engine.dispose()


__all__ = ["AsyncSession", "Database", "create_engine"]
