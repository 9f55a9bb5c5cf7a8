"""/v1/manuals: upload (multipart file or JSON), list, read, delete, warm."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path, PureWindowsPath

import msgspec
from litestar import Controller, Request, Response, delete, get, post
from litestar.datastructures import UploadFile
from litestar.openapi.spec import (
    Encoding,
    Example,
    OpenAPIFormat,
    OpenAPIMediaType,
    OpenAPIType,
    Operation,
    RequestBody,
    Schema,
)
from sqlalchemy import delete as sa_delete
from sqlalchemy import select

from app.answer import Ledger
from app.api.errors import ApiError
from app.api.schemas import (
    MAX_TITLE_CHARS,
    ManualCreate,
    ManualDetail,
    ManualId,
    ManualList,
    ManualOut,
    PageLimit,
    PageOffset,
    PartOut,
    PartRanked,
    PartSearchOut,
    PinOut,
    QuestionQuery,
    WarmOut,
)
from app.db import Manual
from app.errors import NotFound
from app.manual_parts import search_parts
from app.manual_text import extract_manual_text, manual_kind
from app.qa import QAService

_EXAMPLE_MANUAL = {
    "title": "tarx",
    "text": "tarx packs files into an archive. -z compresses the archive; -k keeps existing "
    "files when extracting; -C DIR extracts into DIR. Exit status 2 means a fatal error.",
}
_CONTENT_TYPES = ("text/plain", "text/markdown", "text/html", "application/pdf")


@dataclass
class _UploadOperation(Operation):
    """The upload takes multipart ``file`` (+ optional ``title``) or JSON ``{title, text}``."""

    def __post_init__(self):
        title = Schema(type=OpenAPIType.STRING, min_length=1, max_length=MAX_TITLE_CHARS)
        self.request_body = RequestBody(
            required=True,
            content={
                "application/json": OpenAPIMediaType(
                    schema=Schema(
                        type=OpenAPIType.OBJECT,
                        properties={
                            "title": title,
                            "text": Schema(type=OpenAPIType.STRING, min_length=1),
                        },
                        required=["title", "text"],
                        additional_properties=False,
                    ),
                    examples={"manual": Example(value=_EXAMPLE_MANUAL)},
                ),
                "multipart/form-data": OpenAPIMediaType(
                    schema=Schema(
                        type=OpenAPIType.OBJECT,
                        properties={
                            "file": Schema(
                                type=OpenAPIType.STRING,
                                format=OpenAPIFormat.BINARY,
                                description="txt, md, html or pdf",
                            ),
                            "title": title,
                        },
                        required=["file"],
                    ),
                    encoding={"file": Encoding(content_type=", ".join(_CONTENT_TYPES))},
                ),
            },
        )


def manual_out(m: Manual, parts: list[tuple] | None = None, detail: bool = False) -> ManualOut:
    """A manual's body; ``parts``: its stored parts' (index, title, tokens), none for a manual
    that is one prompt prefix (then listed as its one part)."""
    fields = dict(
        id=m.id,
        title=m.title,
        tokens=m.token_count,
        sha256=m.sha256,
        source_type=m.source_type,
        created_at=m.created_at,
        ledger=Ledger(
            answers=m.answers or 0,
            prompt_tokens=m.answered_prompt_tokens or 0,
            cached_tokens=m.cached_tokens or 0,
            cached_tokens_by_tier={
                "device": (m.cached_tokens or 0) - (m.cached_tokens_redis or 0),
                "redis": m.cached_tokens_redis or 0,
            },
            ttft_saved_ms=round(m.ttft_saved_ms or 0.0, 1),
        ),
        parts=[PartOut(*p) for p in parts]
        if parts
        else [PartOut(0, m.title, m.token_count, 0, len(m.content))],
    )
    return ManualDetail(**fields, text=m.content) if detail else ManualOut(**fields)


class ManualController(Controller):
    path = "/manuals"
    tags = ["manuals"]

    @post(
        "/",
        operation_class=_UploadOperation,
        operation_id="createManual",
        status_code=201,
        summary="Upload a manual",
        description=(
            "Multipart `file` (txt, md, html, pdf) or JSON `{title, text}`. 201 with the new "
            "manual; 200 with the stored one when this tenant already uploaded the same text."
        ),
    )
    async def create(self, request: Request, qa: QAService, tenant: str) -> Response[ManualOut]:
        settings = qa.settings
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype == "multipart/form-data":
            form = await request.form()
            upload = form.get("file")
            if not isinstance(upload, UploadFile):
                raise ApiError(400, "invalid_request", "the multipart body needs a 'file' part")
            data = await upload.read()
            await upload.close()
            # the file's own name: a client's path parts (either separator) are dropped
            name = PureWindowsPath(upload.filename or "").name or "upload"
            if len(data) > settings.max_upload_bytes:
                raise ApiError(
                    413,
                    "file_too_large",
                    f"{name} is {len(data):,} bytes; the limit is {settings.max_upload_bytes:,}",
                    settings.max_upload_bytes,
                )
            kind = manual_kind(name, upload.content_type)
            text = await asyncio.to_thread(extract_manual_text, data, kind, name)
            title = str(form.get("title") or Path(name).stem or "untitled")
        elif ctype == "application/json":
            raw = await request.body()
            try:
                body = msgspec.json.decode(raw, type=ManualCreate)
            except msgspec.ValidationError as e:
                raise ApiError(400, "invalid_request", f"invalid manual: {e}") from None
            except msgspec.DecodeError as e:
                raise ApiError(400, "malformed_json", f"the body is not valid JSON: {e}") from None
            size = len(body.text.encode("utf-8"))
            if size > settings.max_upload_bytes:
                raise ApiError(
                    413,
                    "file_too_large",
                    f"the text is {size:,} bytes; the limit is {settings.max_upload_bytes:,}",
                    settings.max_upload_bytes,
                )
            if "\x00" in body.text:
                raise ApiError(400, "invalid_manual", "the text contains NUL characters")
            text, title, kind = body.text, body.title, "json"
        else:
            raise ApiError(
                415,
                "unsupported_media_type",
                f"send multipart/form-data with a 'file' part or application/json; got "
                f"{ctype or 'no content type'}",
            )
        manual, created = await qa.create_manual(tenant, title, text, kind)
        parts = (await qa.manual_parts([manual.id])).get(manual.id)
        return Response(manual_out(manual, parts), status_code=201 if created else 200)

    @get("/", summary="List manuals", operation_id="listManuals")
    async def list_manuals(
        self,
        qa: QAService,
        tenant: str,
        limit: PageLimit = 100,
        offset: PageOffset = 0,
    ) -> ManualList:
        async with qa.db.session() as s:
            rows = list(
                await s.scalars(
                    select(Manual)
                    .where(Manual.tenant == tenant)
                    .order_by(Manual.created_at, Manual.id)
                    .limit(limit)
                    .offset(offset)
                )
            )
        parts = await qa.manual_parts([m.id for m in rows if (m.part_count or 1) > 1])
        return ManualList(items=[manual_out(m, parts.get(m.id)) for m in rows])

    @get("/{manual_id:str}", summary="Read a manual, its text included", operation_id="getManual")
    async def get_manual(self, qa: QAService, tenant: str, manual_id: ManualId) -> ManualDetail:
        m = await qa.get_manual(tenant, manual_id)
        parts = (await qa.manual_parts([m.id])).get(m.id) if (m.part_count or 1) > 1 else None
        return manual_out(m, parts, detail=True)

    @delete(
        "/{manual_id:str}",
        summary="Delete a manual and its conversations",
        operation_id="deleteManual",
    )
    async def delete_manual(self, qa: QAService, tenant: str, manual_id: ManualId) -> None:
        async with qa.db.transaction() as s:
            res = await s.execute(
                sa_delete(Manual).where(Manual.id == manual_id, Manual.tenant == tenant)
            )
            if res.rowcount == 0:
                raise NotFound("manual", manual_id)
        await qa.cache.unpin(tenant, manual_id)

    @get(
        "/{manual_id:str}/parts",
        summary="Rank the manual's parts for a question",
        operation_id="searchManualParts",
        description=(
            "A manual longer than the model's window is stored as parts, each its own cached "
            "prefix; a question is answered from the part full-text search ranks first. This "
            "shows that ranking without answering."
        ),
    )
    async def search_parts(
        self, qa: QAService, tenant: str, manual_id: ManualId, question: QuestionQuery
    ) -> PartSearchOut:
        async with qa.db.engine.connect() as conn:
            found = await search_parts(conn, tenant, manual_id, question)
        return PartSearchOut(
            manual_id=found["manual_id"],
            question=found["question"],
            parts=[PartRanked(p.index, p.title, p.score) for p in found["parts"]],
            chosen=found["chosen"],
        )

    @post(
        "/{manual_id:str}/warm",
        status_code=200,
        summary="Prefill the manual into the cache",
        operation_id="warmManual",
    )
    async def warm(self, qa: QAService, tenant: str, manual_id: ManualId) -> WarmOut:
        manual = await qa.get_manual(tenant, manual_id)
        return WarmOut(**(await qa.cache.warm(tenant, manual)))

    @post(
        "/{manual_id:str}/pin",
        status_code=200,
        operation_id="pinManual",
        summary="Keep the manual's prefix in the cache",
        description=(
            "Warms the manual if needed, then keeps its prefix blocks out of eviction until "
            "unpinned, within the pin budget (a share of the KV pool; see /v1/engine)."
        ),
    )
    async def pin(self, qa: QAService, tenant: str, manual_id: ManualId) -> PinOut:
        manual = await qa.get_manual(tenant, manual_id)
        return PinOut(**(await qa.cache.pin(tenant, manual)))

    @post(
        "/{manual_id:str}/unpin",
        status_code=200,
        summary="Let the manual's prefix be evicted",
        operation_id="unpinManual",
    )
    async def unpin(self, qa: QAService, tenant: str, manual_id: ManualId) -> PinOut:
        await qa.get_manual(tenant, manual_id)
        await qa.cache.unpin(tenant, manual_id)
        c = qa.runner.counters()
        return PinOut(
            manual_id=manual_id,
            pinned=False,
            pinned_tokens=0,
            pinned_blocks_total=c.get("pinned_blocks", 0),
            pin_budget_blocks=c.get("pin_budget_blocks", 0),
        )
