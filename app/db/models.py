"""Tables: manuals, conversations, messages. Every row belongs to a tenant (directly or through
its conversation); queries always filter by it."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from app.db.types import TokenIds, UTCDateTime


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    pass


class Manual(Base):
    __tablename__ = "manuals"
    __table_args__ = (UniqueConstraint("tenant", "sha256", name="uq_manuals_tenant_sha256"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("man"))
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    title: Mapped[str] = mapped_column(String(512))
    source_type: Mapped[str] = mapped_column(String(16))  # txt, md, html, pdf, json
    content: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64))
    token_ids: Mapped[list[int]] = mapped_column(TokenIds)
    token_count: Mapped[int] = mapped_column(Integer)
    tokenizer_fingerprint: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # the ledger of what the cache saved answering about this manual, added to by every
    # answer in the transaction that stores it (app.turn_store.record_ledger)
    answers: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    answered_prompt_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    cached_tokens_redis: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    ttft_saved_ms: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    # 1: the manual is one prompt prefix; more: it is stored as that many parts (ManualPart)
    part_count: Mapped[int] = mapped_column(Integer, default=1, server_default="1")

    conversations: Mapped[list[Conversation]] = relationship(
        back_populates="manual", cascade="all, delete-orphan", passive_deletes=True
    )


class Conversation(Base):
    __tablename__ = "conversations"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("conv"))
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    manual_id: Mapped[str] = mapped_column(ForeignKey("manuals.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    manual: Mapped[Manual] = relationship(back_populates="conversations")
    messages: Mapped[list[Message]] = relationship(
        back_populates="conversation",
        cascade="all, delete-orphan",
        passive_deletes=True,
        order_by="Message.seq",
    )


class Message(Base):
    __tablename__ = "messages"
    __table_args__ = (Index("ix_messages_conversation_seq", "conversation_id", "seq", unique=True),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("msg"))
    conversation_id: Mapped[str] = mapped_column(ForeignKey("conversations.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(Integer)  # order within the conversation
    role: Mapped[str] = mapped_column(String(16))  # user | assistant
    content: Mapped[str] = mapped_column(Text)
    token_ids: Mapped[list[int]] = mapped_column(TokenIds)
    finish_reason: Mapped[str | None] = mapped_column(String(16), nullable=True)
    usage: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    timings: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    warnings: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    part: Mapped[int | None] = mapped_column(Integer, nullable=True)  # the part that answered
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    conversation: Mapped[Conversation] = relationship(back_populates="messages")


class ManualPart(Base):
    """One part of a manual longer than the model's window: its text (the overlap with the
    part before included), that text's prompt ids (the part's header line first) and where it
    lies in the manual."""

    __tablename__ = "manual_parts"
    __table_args__ = (UniqueConstraint("manual_id", "idx", name="uq_manual_parts_manual_idx"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    manual_id: Mapped[str] = mapped_column(ForeignKey("manuals.id", ondelete="CASCADE"))
    idx: Mapped[int] = mapped_column(Integer)  # 0-based position
    title: Mapped[str] = mapped_column(String(512))
    start_char: Mapped[int] = mapped_column(Integer)  # overlap included
    end_char: Mapped[int] = mapped_column(Integer)
    content: Mapped[str] = mapped_column(Text)
    token_ids: Mapped[list[int]] = mapped_column(TokenIds)  # header line + content, as prompted
    token_count: Mapped[int] = mapped_column(Integer)


class ManualPassage(Base):
    """A paragraph of a manual stored as parts, with the part it belongs to and the section
    it is in: what full-text search ranks (a generated ``tsvector`` column with a GIN index on
    Postgres, an FTS5 table kept by triggers on SQLite: migrations/versions/0003 and 0004)."""

    __tablename__ = "manual_passages"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    manual_id: Mapped[str] = mapped_column(ForeignKey("manuals.id", ondelete="CASCADE"), index=True)
    part_idx: Mapped[int] = mapped_column(Integer)
    # its section's, and the definitions it is nested in ("SHELL BUILTIN COMMANDS / set ...")
    heading: Mapped[str] = mapped_column(String(512))
    term: Mapped[str] = mapped_column(String(512))  # what it defines ("" for running text)
    content: Mapped[str] = mapped_column(Text)
