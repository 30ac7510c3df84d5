"""OpenAI's Files API shapes (issue 37): a file, the answer to a delete, a page of the list.

The queen keeps files for fine-tuning only, so a file's ``purpose`` is ``fine-tune`` and its
``status`` is ``processed`` (it was checked whole before it was stored). ``OPENAI_PURPOSES`` are
the purposes OpenAI defines, so that a refusal can tell a known purpose the queen does not keep
from a typo.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from shared_schema.base import WireModel

FINE_TUNE = "fine-tune"
# What OpenAI's upload takes (the SDK's ``FilePurpose``), and what it makes itself.
OPENAI_PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
FILE_ID_PREFIX = "file-"


class FileObject(WireModel):
    """A stored file, as ``client.files.create`` / ``.retrieve`` / ``.list`` read it."""

    id: str
    object: Literal["file"] = "file"
    bytes: int = Field(ge=0)
    created_at: int = Field(ge=0)  # Unix seconds
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None  # the queen keeps a file until it is deleted
    status_details: str | None = None


class FileDeleted(WireModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class FileList(WireModel):
    """One page of ``GET /v1/files`` (a cursor page: the SDK asks for the next one with
    ``after=last_id`` while ``has_more``)."""

    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False
