"""A training attempt's files, as its worker reads and writes them (issue 37): the training
file's bytes, the checkpoint it resumes from, and its uploads (checkpoints and the adapter).

Each transfer names its attempt by wire id and proves it with the attempt's token
(``orders.transfer_token``), honoured only while that attempt is its job's current one and
running: another attempt's token, a token of a job that ended, or none at all is refused the
same way. An upload is counted and hashed by the queen as it arrives, spooled to a temporary
file (memory up to a MiB), refused past the attempt's bound before anything is kept, then put
in the blob store and recorded: what the runner later compares with the worker's claims.
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from queen_server.errors import InvalidRequest
from queen_server.files.blobs import chunks, discard
from queen_server.finetune.checks import HoldOut
from queen_server.finetune.errors import (
    AdapterRefused,
    BadUploadName,
    NoCheckpoint,
    TransferRefused,
    UploadTooLarge,
)
from queen_server.finetune.heldout import held_of, served, split_of
from queen_server.finetune.models import JOB_ID, WORKER_KEY, adapter_token_matches, model_of
from queen_server.finetune.orders import token_matches
from shared_schema.training import ADAPTER_NAME, UPLOAD_NAME, parse_train_job_id

if TYPE_CHECKING:
    from queen_server.files.service import Files
    from queen_server.finetune.store import JobStore

log = logging.getLogger(__name__)

CHECKPOINT_NAME = re.compile(r"^checkpoint-\d{8}\.gguf$")
SPOOL_BYTES = 1 << 20


def upload_name(name: str) -> str:
    """``name`` if a training attempt may upload it; else ``BadUploadName``."""
    if not re.fullmatch(UPLOAD_NAME, name) or not (
            name == ADAPTER_NAME or CHECKPOINT_NAME.fullmatch(name)):
        raise BadUploadName(name)
    return name


def blob_name(job_id: str, attempt: int, name: str) -> str:
    """Where an upload's bytes go: a new place for each (a kept checkpoint's bytes never
    change under its hash, whatever the worker sends again)."""
    return f"fine-tuning/{job_id}/{attempt}/{secrets.token_hex(8)}-{name}"


def checking(row: Any) -> tuple[str | None, int]:
    """The adapter of a job whose held-out check runs (still ``running``, its adapter
    recorded in its row by the runner): its sha256 and size; (None, 0) for any other."""
    if (row is None or row.status != "running" or not row.adapter_sha256
            or row.adapter_size_bytes is None):
        return None, 0
    return row.adapter_sha256, int(row.adapter_size_bytes)


@dataclass(frozen=True, slots=True)
class Outgoing:
    """Bytes for the worker: their size, hash and the stream."""

    size_bytes: int
    sha256: str
    body: AsyncIterator[bytes]


@dataclass(frozen=True, slots=True)
class Received:
    name: str
    sha256: str
    size_bytes: int


class Transfers:
    def __init__(self, store: JobStore, files: Files, holdout: HoldOut) -> None:
        self.store = store
        self.files = files
        self.holdout = holdout  # the examples a job holds back (``checks``): never served
        self.secret: bytes | None = None  # read from the database at the start (shared)

    async def authorize(self, wire_id: str, authorization: str | None) -> tuple[Any, int]:
        """The job row and attempt a valid token opens; ``TransferRefused`` otherwise."""
        parsed = parse_train_job_id(wire_id)
        scheme, _, token = (authorization or "").partition(" ")
        if parsed is None or self.secret is None or scheme.lower() != "bearer" or not token:
            raise TransferRefused()
        job_id, attempt = parsed
        row = await self.store.attempt_row(job_id)
        if (row is None or row.status != "running" or row.attempt != attempt
                or not row.worker_key
                or not token_matches(self.secret, wire_id, row.worker_key, token.strip())):
            raise TransferRefused()
        return row, attempt

    async def data(self, wire_id: str, authorization: str | None) -> Outgoing:
        row, _ = await self.authorize(wire_id, authorization)
        record = await self.files.get(row.owner, row.training_file)
        held = held_of(row, record, self.holdout)
        if not held:
            reader = await self.files.blobs.open(record.location)
            return Outgoing(record.bytes, record.sha256, chunks(reader))
        split = await split_of(self.files, record, held)
        return Outgoing(split.size_bytes, split.sha256, served(self.files, record.location,
                                                              held))

    async def resume(self, wire_id: str, authorization: str | None) -> Outgoing:
        row, _ = await self.authorize(wire_id, authorization)
        checkpoint = await self.store.last_checkpoint(row.id)
        if checkpoint is None or checkpoint.sha256 is None:
            raise NoCheckpoint("This job has no checkpoint to resume from.", param=None)
        reader = await self.files.blobs.open(checkpoint.location)
        return Outgoing(checkpoint.size_bytes, checkpoint.sha256, chunks(reader))

    async def upload(self, wire_id: str, authorization: str | None, name: str,
                     body: AsyncIterator[bytes], declared_bytes: int | None) -> Received:
        """Receive one upload whole (hashed and counted here), keep it and record it."""
        upload_name(name)
        row, attempt = await self.authorize(wire_id, authorization)
        limit = row.upload_limit_bytes or 0
        if declared_bytes is not None and declared_bytes > limit:
            raise self._too_large(limit)
        digest = hashlib.sha256()
        size = 0
        with tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES) as spool:
            async for piece in body:
                size += len(piece)
                if size > limit:
                    raise self._too_large(limit)
                digest.update(piece)
                spool.write(piece)
            if size == 0:
                raise InvalidRequest("An upload cannot be empty.", param="body",
                                     code="empty_upload")
            spool.seek(0)
            location = await self.files.blobs.put(blob_name(row.id, attempt, name), spool)
        try:
            await self.store.add_upload(row.id, attempt, name, digest.hexdigest(), size,
                                        location)
        except BaseException:
            await discard(self.files.blobs, location)
            raise
        log.info("training attempt %s uploaded %s: %d bytes", wire_id, name, size)
        return Received(name, digest.hexdigest(), size)

    async def adapter(self, job_id: str, worker_key: str,
                      authorization: str | None) -> Outgoing:
        """A fine-tuned model's adapter, for the worker a job for it was given to (the token of
        its ``AdapterRef``), while the model is served: read from the job's row, so a model
        deleted on any replica is refused at once."""
        scheme, _, token = (authorization or "").partition(" ")
        if (self.secret is None or scheme.lower() != "bearer" or not token
                or not JOB_ID.fullmatch(job_id) or not WORKER_KEY.fullmatch(worker_key)):
            raise AdapterRefused()
        row = await self.store.attempt_row(job_id)
        model = model_of(row) if row is not None else None
        sha256, size = ((model.sha256, model.size_bytes) if model is not None
                        else checking(row))
        if (sha256 is None or not row.adapter_location
                or not adapter_token_matches(self.secret, job_id, sha256, worker_key,
                                             token.strip())):
            raise AdapterRefused()
        reader = await self.files.blobs.open(row.adapter_location)
        return Outgoing(size, sha256, chunks(reader))

    @staticmethod
    def _too_large(limit: int) -> UploadTooLarge:
        return UploadTooLarge(f"The upload is over this training job's limit of {limit} bytes.",
                              param="body")
