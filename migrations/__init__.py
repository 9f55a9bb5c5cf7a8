"""Alembic migrations for docqa's database (SQLite and Postgres alike).

Apply with ``docqa db upgrade`` (``docqa serve`` applies them at start)."""
