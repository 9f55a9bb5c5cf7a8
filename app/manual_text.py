"""Reading a manual file as text, with the errors a user can act on."""

from __future__ import annotations

from pathlib import Path

from inference.errors import DocqaError

MAX_MANUAL_BYTES = 4 * 2**20


class ManualError(DocqaError):
    code = "bad_manual"


def read_manual_file(path: str | Path) -> str:
    """Text of a txt/md manual; ManualError for a missing, empty, binary or oversized file."""
    p = Path(path)
    if not p.exists():
        raise ManualError(f"manual {p} does not exist")
    if not p.is_file():
        raise ManualError(f"manual {p} is not a regular file")
    size = p.stat().st_size
    if size > MAX_MANUAL_BYTES:
        raise ManualError(f"manual {p} is {size:,} bytes; the limit is {MAX_MANUAL_BYTES:,} bytes")
    return manual_text_from_bytes(p.read_bytes(), str(p))


def manual_text_from_bytes(data: bytes, name: str = "manual") -> str:
    if b"\x00" in data:
        raise ManualError(f"{name} is binary (it contains NUL bytes); give a UTF-8 text file")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ManualError(
            f"{name} is not UTF-8 text (invalid byte at offset {e.start}); give a UTF-8 text file"
        ) from None
    if not text.strip():
        raise ManualError(f"{name} is empty")
    return text
