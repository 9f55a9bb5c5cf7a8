"""Reading a manual file as text, with the errors a user can act on."""

from __future__ import annotations

from pathlib import Path

from inference.errors import DocqaError

MAX_MANUAL_BYTES = 4 * 2**20
# an upload's text at most, once extracted (a manual must fit the model's context, far less)
MAX_MANUAL_CHARS = 4 * 2**20
MAX_PDF_PAGES = 2000
# a PDF's page content at most, once decompressed: what text extraction walks (a few KB a page
# in a real manual; extraction takes about a second a megabyte)
MAX_PDF_CONTENT_BYTES = 4 * 2**20


class ManualError(DocqaError):
    code = "bad_manual"


class ManualTooLarge(ManualError):
    """An upload whose content expands past a limit (``limit``, in the message's unit)."""

    code = "manual_too_large"

    def __init__(self, message: str, limit: int):
        super().__init__(message)
        self.limit = limit


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


class UnsupportedManualType(DocqaError):
    code = "unsupported_media_type"


TEXT_EXTENSIONS = {".txt": "txt", ".text": "txt", ".md": "md", ".markdown": "md"}
HTML_EXTENSIONS = {".html": "html", ".htm": "html", ".xhtml": "html"}
SUPPORTED = ".txt, .md, .html, .pdf"
_CONTENT_TYPES = {
    "text/plain": "txt",
    "text/markdown": "md",
    "text/x-markdown": "md",
    "text/html": "html",
    "application/xhtml+xml": "html",
    "application/pdf": "pdf",
}


def manual_kind(filename: str | None, content_type: str | None) -> str:
    """txt | md | html | pdf from the file name's extension, else from its content type."""
    ext = Path(filename or "").suffix.lower()
    if ext in TEXT_EXTENSIONS:
        return TEXT_EXTENSIONS[ext]
    if ext in HTML_EXTENSIONS:
        return "html"
    if ext == ".pdf":
        return "pdf"
    ctype = (content_type or "").split(";")[0].strip().lower()
    if not ext and ctype in _CONTENT_TYPES:
        return _CONTENT_TYPES[ctype]
    what = f"'{ext}'" if ext else f"content type '{ctype or 'none'}'"
    raise UnsupportedManualType(f"unsupported file type {what}; supported: {SUPPORTED}")


def html_to_text(html: str) -> str:
    import html2text

    conv = html2text.HTML2Text()
    conv.body_width = 0  # no hard wrapping: lines stay as the document has them
    conv.ignore_images = True
    conv.ignore_links = True
    conv.unicode_snob = True
    return conv.handle(html)


def pdf_to_text(data: bytes, name: str) -> str:
    import io

    from pypdf import PdfReader
    from pypdf.errors import PyPdfError

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            raise ManualError(f"{name} is an encrypted PDF; upload an unencrypted file")
        if len(reader.pages) > MAX_PDF_PAGES:
            raise ManualTooLarge(
                f"{name} has {len(reader.pages):,} pages; the limit is {MAX_PDF_PAGES:,}",
                MAX_PDF_PAGES,
            )
        pages, content, chars = [], 0, 0
        for page in reader.pages:
            stream = page.get_contents()
            content += len(stream.get_data()) if stream is not None else 0
            if content > MAX_PDF_CONTENT_BYTES:
                raise ManualTooLarge(
                    f"{name}'s pages decompress to more than {MAX_PDF_CONTENT_BYTES:,} bytes "
                    "of content (the limit)",
                    MAX_PDF_CONTENT_BYTES,
                )
            pages.append(page.extract_text() or "")
            chars += len(pages[-1])
            if chars > MAX_MANUAL_CHARS:
                raise _too_many_chars(name)
    except ManualError:
        raise
    except (PyPdfError, ValueError, KeyError, TypeError, OSError) as e:
        raise ManualError(f"{name} is not a readable PDF ({type(e).__name__}: {e})") from None
    text = "\n\n".join(p.strip() for p in pages if p.strip())
    if not text.strip():
        raise ManualError(f"{name} has no extractable text (a scanned PDF needs OCR first)")
    return text


def _too_many_chars(name: str) -> ManualTooLarge:
    return ManualTooLarge(
        f"{name}'s text is longer than {MAX_MANUAL_CHARS:,} characters (the limit)",
        MAX_MANUAL_CHARS,
    )


def extract_manual_text(data: bytes, kind: str, name: str = "manual") -> str:
    """Plain text of an uploaded file of ``kind`` (from ``manual_kind``); ManualTooLarge when
    it expands past the limits above. CPU-bound: callers on an event loop run it in a
    thread."""
    if not data:
        raise ManualError(f"{name} is empty")
    if kind == "pdf":
        if not data.startswith(b"%PDF-"):
            raise ManualError(f"{name} is not a PDF (it does not start with %PDF-)")
        return pdf_to_text(data, name)
    text = manual_text_from_bytes(data, name)
    if kind == "html":
        text = html_to_text(text)
        if not text.strip():
            raise ManualError(f"{name} has no text once its HTML markup is removed")
    if len(text) > MAX_MANUAL_CHARS:
        raise _too_many_chars(name)
    return text
