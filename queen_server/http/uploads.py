"""Reading a file upload (``multipart/form-data``) with a bound: the body is counted as it
arrives and refused past the limit, and the file part is spooled by Starlette's parser
(``python-multipart``: memory up to 1 MiB, then a temporary file), never held whole in memory.

What the form may hold is OpenAI's upload: ``file`` (one file part) and ``purpose`` (text).
``expires_after`` is OpenAI's and refused by name (the queen keeps a file until it is deleted);
any other field is refused as unrecognised, as the JSON routes do.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import BinaryIO

from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from queen_server.errors import InvalidRequest
from queen_server.files.errors import FileTooLarge

FORM_SLACK_BYTES = 64 * 1024  # the parts' headers, boundaries and the purpose, beside the file
MAX_FILENAME_CHARS = 255
DEFAULT_FILENAME = "upload"  # httpx's name for a file sent without one


@dataclass
class Upload:
    filename: str
    purpose: str
    file: BinaryIO
    form: FormData

    async def close(self) -> None:
        await self.form.close()


class _OverLimit(MultiPartException):
    """Raised inside the parser (which then closes what it spooled), answered as 413."""


async def _bounded(stream: AsyncIterator[bytes], limit: int) -> AsyncGenerator[bytes, None]:
    seen = 0
    async for chunk in stream:
        seen += len(chunk)
        if seen > limit:
            raise _OverLimit("over the limit")
        yield chunk


def _too_large(max_file_bytes: int) -> FileTooLarge:
    return FileTooLarge(f"The file is over the limit of {max_file_bytes} bytes "
                        "(APIARY_FILES_MAX_BYTES).")


async def read_upload(request: Request, max_file_bytes: int) -> Upload:
    """The request's ``file`` and ``purpose``; a 400 naming what is wrong with the form, or a
    413 as soon as the body passes ``max_file_bytes`` (plus the form's own few bytes)."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";", 1)[0].strip().lower() != "multipart/form-data":
        raise InvalidRequest("Send the file as multipart/form-data with the fields 'file' and "
                             "'purpose', as the OpenAI SDK does.", param="file",
                             code="invalid_content_type")
    limit = max_file_bytes + FORM_SLACK_BYTES
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(max_file_bytes)
    parser = MultiPartParser(request.headers, _bounded(request.stream(), limit), max_files=1,
                             max_fields=8, max_part_size=FORM_SLACK_BYTES)
    try:
        form = await parser.parse()
    except _OverLimit:
        raise _too_large(max_file_bytes) from None
    except MultiPartException as exc:
        raise InvalidRequest(f"The multipart body could not be read: {exc.message}",
                             param="file", code="invalid_multipart") from None
    try:
        return _upload(form, max_file_bytes)
    except BaseException:
        await form.close()
        raise


def _upload(form: FormData, max_file_bytes: int) -> Upload:
    for key in form:
        if key.startswith("expires_after"):
            raise InvalidRequest("'expires_after' is not supported: the queen keeps a file until "
                                 "it is deleted.", param="expires_after",
                                 code="unsupported_parameter")
        if key not in ("file", "purpose"):
            raise InvalidRequest(f"Unrecognized request argument supplied: {key}", param=key,
                                 code="unknown_parameter")
    files = form.getlist("file")
    purposes = form.getlist("purpose")
    if not files:
        raise InvalidRequest("Missing required parameter: 'file'.", param="file",
                             code="missing_required_parameter")
    if not purposes:
        raise InvalidRequest("Missing required parameter: 'purpose'.", param="purpose",
                             code="missing_required_parameter")
    if len(purposes) > 1:
        raise InvalidRequest("Send one 'purpose'.", param="purpose")
    upload, purpose = files[0], purposes[0]
    if not isinstance(upload, UploadFile):
        raise InvalidRequest("'file' must be a file: a multipart part with a filename.",
                             param="file")
    if not isinstance(purpose, str):
        raise InvalidRequest("'purpose' must be text, not a file.", param="purpose")
    if upload.size is not None and upload.size > max_file_bytes:
        raise _too_large(max_file_bytes)
    filename = upload.filename or DEFAULT_FILENAME
    if len(filename) > MAX_FILENAME_CHARS or any(ord(c) < 32 or ord(c) == 127 for c in filename):
        raise InvalidRequest(f"The file's name must be at most {MAX_FILENAME_CHARS} characters, "
                             "with no control characters.", param="file",
                             code="invalid_filename")
    return Upload(filename, purpose, upload.file, form)
