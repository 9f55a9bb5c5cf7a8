"""Apply Alembic migrations programmatically (``docqa db upgrade``, and at ``docqa serve`` start).

Call from synchronous code only: the migration environment runs its own event loop.
"""

from __future__ import annotations

import logging
from importlib import resources
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from inference.errors import DocqaError

log = logging.getLogger("docqa.db")


class DatabaseError(DocqaError):
    code = "database_unavailable"


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(resources.files("migrations")))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def _ensure_sqlite_dir(url: str) -> None:
    if url.startswith("sqlite") and ":///" in url:
        path = url.split(":///", 1)[1].split("?", 1)[0]
        if path and path != ":memory:":
            Path(path).expanduser().parent.mkdir(parents=True, exist_ok=True)


def head_revision() -> str:
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def upgrade(url: str, revision: str = "head") -> None:
    _ensure_sqlite_dir(url)
    try:
        command.upgrade(alembic_config(url), revision)
    except (OSError, ConnectionError) as e:
        raise DatabaseError(f"cannot reach the database at {_safe(url)}: {e}") from None
    except Exception as e:
        # driver errors (asyncpg, sqlite) arrive wrapped in SQLAlchemy's DBAPIError
        from sqlalchemy.exc import DBAPIError

        if isinstance(e, DBAPIError):
            raise DatabaseError(f"migrating {_safe(url)} failed: {e.orig}") from None
        raise
    log.info("database %s is at revision %s", _safe(url), head_revision())


async def current_revision(conn) -> str | None:
    return await conn.run_sync(lambda c: MigrationContext.configure(c).get_current_revision())


def _safe(url: str) -> str:
    """The URL without a password."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url.split("@")[-1]
