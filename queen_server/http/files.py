"""OpenAI's Files API (issue 37): ``POST /v1/files`` (multipart ``file`` and ``purpose``),
``GET /v1/files`` (a cursor page), ``GET``/``DELETE /v1/files/{file_id}`` and
``GET /v1/files/{file_id}/content``, as the official SDK calls them.

Files belong to the caller that uploaded them (``owner_of``): a key by its id, a development key
by its hash, and, on an open queen, whoever sends no known key: they share the ``open`` caller's
files (an address is no identity behind NAT or a proxy; a caller that wants its files to itself
sends a key, which an open queen still honours). Another caller's file answers 404, as a
missing one does, and never shows in its list. Uploads are not billed; the work is in
``queen_server.files``.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse

from queen_server.billing.service import Principal
from queen_server.files.errors import FilesUnavailable
from queen_server.files.records import FileRecord
from queen_server.files.service import Files
from queen_server.http.deps import json_response, queen
from queen_server.http.uploads import read_upload
from shared_schema import ErrorResponse, FileDeleted, FileList, FileObject
from shared_schema.files import FINE_TUNE

router = APIRouter()

OPEN_OWNER = "open"
MAX_PAGE = 10_000  # OpenAI's largest (and default) page


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


UNAVAILABLE = {503: _error("The file storage or the database failed, or this queen keeps no "
                           "files (no database)")}
NOT_FOUND = {404: _error("No file with this id belongs to the caller")}
UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object",
    "required": ["file", "purpose"],
    "properties": {
        "file": {"type": "string", "format": "binary",
                 "description": "OpenAI's chat fine-tuning JSONL, one example per line"},
        "purpose": {"type": "string", "enum": [FINE_TUNE]},
    },
}}}}}


def owner_of(principal: Principal) -> str:
    """Whose files a caller reaches (see the module's docstring)."""
    if principal.key is not None:
        return f"key:{principal.key.id}"
    if principal.digest is not None:
        return f"dev:{principal.digest}"
    return OPEN_OWNER


async def caller_files(request: Request) -> tuple[Files, str]:
    """The queen's files and the caller's owner name (a 401 before anything else)."""
    state = queen(request)
    principal = await state.billing.authenticate(request.headers.get("authorization"))
    if state.files is None:
        raise FilesUnavailable("This queen runs without a database and keeps no files.")
    return state.files, owner_of(principal)


def file_object(record: FileRecord) -> FileObject:
    return FileObject(id=record.id, bytes=record.bytes,
                      created_at=int(record.created_at.timestamp()),
                      filename=record.filename, purpose=record.purpose)


@router.post("/v1/files", response_model=FileObject, openapi_extra=UPLOAD_BODY,
             summary="Upload a file for fine-tuning (checked whole first: OpenAI's chat JSONL)",
             responses={413: _error("The file is over APIARY_FILES_MAX_BYTES"), **UNAVAILABLE})
async def create_file(request: Request) -> Response:
    files, owner = await caller_files(request)
    upload = await read_upload(request, files.limits.max_bytes)
    try:
        record = await files.create(owner, upload.filename, upload.purpose, upload.file)
    finally:
        await upload.close()
    return json_response(file_object(record).model_dump(mode="json"))


@router.get("/v1/files", response_model=FileList, summary="The caller's files, a page at a time",
            responses=UNAVAILABLE)
async def list_files(
    request: Request,
    purpose: str | None = None,
    limit: int = Query(MAX_PAGE, ge=1, le=MAX_PAGE),
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> Response:
    files, owner = await caller_files(request)
    page = await files.page(owner, purpose=purpose, limit=limit, order=order, after=after)
    data = [file_object(record) for record in page.records]
    answer = FileList(data=data, first_id=data[0].id if data else None,
                      last_id=data[-1].id if data else None, has_more=page.has_more)
    return json_response(answer.model_dump(mode="json"))


@router.get("/v1/files/{file_id}", response_model=FileObject, summary="One of the caller's files",
            responses={**NOT_FOUND, **UNAVAILABLE})
async def retrieve_file(request: Request, file_id: str) -> Response:
    files, owner = await caller_files(request)
    return json_response(file_object(await files.get(owner, file_id)).model_dump(mode="json"))


@router.delete("/v1/files/{file_id}", response_model=FileDeleted,
               summary="Delete one of the caller's files (its bytes too)",
               responses={**NOT_FOUND, **UNAVAILABLE})
async def delete_file(request: Request, file_id: str) -> Response:
    files, owner = await caller_files(request)
    fine_tuning = queen(request).fine_tuning
    if fine_tuning is not None:  # a file a running job trains on stays until the job ends
        await fine_tuning.check_deletable(owner, file_id)
    record = await files.delete(owner, file_id)
    return json_response(FileDeleted(id=record.id, deleted=True).model_dump(mode="json"))


@router.get("/v1/files/{file_id}/content", summary="The bytes of one of the caller's files",
            response_class=StreamingResponse,
            responses={200: {"description": "The file as it was uploaded",
                             "content": {"application/octet-stream": {
                                 "schema": {"type": "string", "format": "binary"}}}},
                       **NOT_FOUND, **UNAVAILABLE})
async def file_content(request: Request, file_id: str) -> Response:
    files, owner = await caller_files(request)
    record, body = await files.content(owner, file_id)
    return StreamingResponse(body, media_type="application/octet-stream",
                             headers={"Content-Length": str(record.bytes)})
