"""``Files``: the Files API's work, between the HTTP edge and the two stores. An upload is
checked whole (``validation``) and hashed in one pass before anything is kept; its bytes go to
the blob store (``blobs``: a folder or an S3 bucket), then its record to the database
(``records``); a record that fails takes its bytes back out. Every read names the owner, so a
caller only ever reaches its own files: another's id answers as if there were none.

An owner is a string the HTTP edge derives from the caller (``key:<id>``, ``dev:<sha256>``,
``open``); this module does not know how."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import string
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, BinaryIO

from queen_server.errors import InvalidRequest
from queen_server.files.blobs import BlobStore, LocalBlobs, chunks, discard
from queen_server.files.errors import FileNotFound, FileStorageError, shown_id
from queen_server.files.records import FilePage, FileRecord, FileRecords, Order, UnknownCursor
from queen_server.files.validation import (
    FileLimits,
    TrainingFileCheck,
    TrainingFileSummary,
    check_purpose,
)
from shared_schema.files import FILE_ID_PREFIX

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from queen_server.settings import QueenSettings

log = logging.getLogger(__name__)

_ID_ALPHABET = string.ascii_letters + string.digits
ID_CHARS = 24  # about 143 bits: ids are unguessable, though ownership is what guards a file


def new_file_id() -> str:
    return FILE_ID_PREFIX + "".join(secrets.choice(_ID_ALPHABET) for _ in range(ID_CHARS))


def blob_name(file_id: str) -> str:
    return f"files/{file_id}"


@dataclass(frozen=True, slots=True)
class Scan:
    summary: TrainingFileSummary
    sha256: str


def scan(source: BinaryIO, limits: FileLimits) -> Scan:
    """Check a training file and hash it in one pass over its lines (blocking: run it in a
    thread); leaves ``source`` at its end."""
    check = TrainingFileCheck(limits)
    digest = hashlib.sha256()
    for line in source:
        digest.update(line)
        check.feed(line)
    return Scan(check.finish(), digest.hexdigest())


class Files:
    def __init__(self, records: FileRecords, blobs: BlobStore, limits: FileLimits) -> None:
        self.records = records
        self.blobs = blobs
        self.limits = limits

    async def create(self, owner: str, filename: str, purpose: str,
                     source: BinaryIO) -> FileRecord:
        """Check, store and record an upload; on any refusal or failure nothing is kept."""
        check_purpose(purpose)
        source.seek(0)
        scanned = await asyncio.to_thread(scan, source, self.limits)
        source.seek(0)
        file_id = new_file_id()
        location = await self.blobs.put(blob_name(file_id), source)
        record = FileRecord(file_id, owner, filename, purpose, scanned.summary.bytes,
                            scanned.summary.examples, scanned.sha256, location,
                            datetime.now(UTC))
        try:
            await self.records.add(record)
        except BaseException:
            await discard(self.blobs, location)
            raise
        log.info("stored %s for %s: %d bytes, %d examples", file_id, owner, record.bytes,
                 record.examples)
        return record

    async def get(self, owner: str, file_id: str) -> FileRecord:
        record = await self.records.get(owner, file_id)
        if record is None:
            raise FileNotFound(file_id)
        return record

    async def page(self, owner: str, *, purpose: str | None, limit: int, order: Order,
                   after: str | None) -> FilePage:
        try:
            return await self.records.page(owner, purpose=purpose, limit=limit, order=order,
                                           after=after)
        except UnknownCursor:
            raise InvalidRequest(f"Invalid value for 'after': no file {shown_id(after or '')} "
                                 "of yours to list after.", param="after") from None

    async def content(self, owner: str, file_id: str) -> tuple[FileRecord, AsyncIterator[bytes]]:
        """The file's record and its bytes, opened (so a missing blob is an error before any
        byte is answered)."""
        record = await self.get(owner, file_id)
        reader = await self.blobs.open(record.location)
        return record, chunks(reader)

    async def delete(self, owner: str, file_id: str) -> FileRecord:
        """Mark the file deleted, then remove its bytes (a failure there is logged: the file is
        gone for its owner either way)."""
        record = await self.records.mark_deleted(owner, file_id)
        if record is None:
            raise FileNotFound(file_id)
        try:
            await self.blobs.delete(record.location)
        except FileStorageError as exc:
            log.warning("%s is deleted, but its bytes at %s stay: %s", file_id,
                        record.location, exc.message)
        return record


def make_blobs(settings: QueenSettings) -> BlobStore:
    """The store the settings name: the S3 bucket when ``files_s3_bucket`` is set, else the
    folder ``files_dir``."""
    if settings.files_s3_bucket is None:
        return LocalBlobs(settings.files_dir)
    # boto3 is loaded only by a queen that stores in S3 (it takes a while to import).
    from queen_server.files.s3 import S3Blobs

    secret = settings.files_s3_secret_key
    return S3Blobs(settings.files_s3_bucket, endpoint_url=settings.files_s3_url,
                   region=settings.files_s3_region, access_key=settings.files_s3_access_key,
                   secret_key=secret.get_secret_value() if secret is not None else None)


def make_files(settings: QueenSettings, engine: AsyncEngine) -> Files:
    """The Files API as the settings configure it, its records in ``engine``'s database."""
    if settings.redis_url and settings.files_s3_bucket is None:
        log.warning("files are kept in %s, which the other replicas cannot read unless it is a "
                    "shared folder: set APIARY_FILES_S3_BUCKET", settings.files_dir)
    return Files(FileRecords(engine), make_blobs(settings),
                 FileLimits(settings.files_max_bytes, settings.files_max_examples))
