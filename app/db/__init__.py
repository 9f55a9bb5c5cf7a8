"""Storage: SQLAlchemy 2 (async) models, engine set-up and Alembic migrations."""

from app.db.models import Base, Conversation, Manual, ManualPart, ManualPassage, Message
from app.db.session import Database

__all__ = ["Base", "Conversation", "Database", "Manual", "ManualPart", "ManualPassage", "Message"]
