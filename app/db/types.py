"""Column types that behave the same on SQLite and Postgres."""

from __future__ import annotations

import sys
from array import array
from datetime import UTC

from sqlalchemy import DateTime, LargeBinary
from sqlalchemy.types import TypeDecorator


class TokenIds(TypeDecorator):
    """A list of token ids stored as packed little-endian int32 bytes (4 bytes per token)."""

    impl = LargeBinary
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is None:
            return None
        a = array("i", value)
        if sys.byteorder != "little":
            a.byteswap()
        return a.tobytes()

    def process_result_value(self, value, dialect):
        if value is None:
            return None
        a = array("i")
        a.frombytes(bytes(value))
        if sys.byteorder != "little":
            a.byteswap()
        return a.tolist()


class UTCDateTime(TypeDecorator):
    """Timezone-aware UTC datetimes on both databases (SQLite stores them without a zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value

    def process_result_value(self, value, dialect):
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value
