"""Where the queen keeps the bytes of what it stores: a folder on its own disk (``LocalBlobs``,
the default) or an S3-compatible bucket (``files/s3.py``'s ``S3Blobs``). One job: bytes in
under a name, back out by the location ``put`` answered, and gone. What they are (an upload, its
owner, its checks) is the records' and the service's.

A name is a relative path of safe segments (``files/file-abc``), so no name reaches outside the
store. A location says which store holds the bytes (``local:files/file-abc``,
``s3://bucket/files/file-abc``): a store refuses a location that is not its own, so a queen
whose operator moved from one to the other says so instead of serving nothing.

The calls block (disk, boto3), so each runs in a thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO, Protocol

from queen_server.files.errors import FileStorageError

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}(/[A-Za-z0-9][A-Za-z0-9._-]{0,199}){0,7}")
LOCAL = "local:"


class Reader(Protocol):
    """What ``open`` answers: a local file, or boto3's ``StreamingBody``."""

    def read(self, size: int = ..., /) -> bytes: ...

    def close(self) -> None: ...


class BlobStore(Protocol):
    def describe(self) -> str:
        """Where the bytes go, for the log (never a secret)."""
        ...

    async def put(self, name: str, source: BinaryIO) -> str:
        """Store ``source`` (read from where it stands to its end) under ``name``; answers
        the location to keep."""
        ...

    async def open(self, location: str) -> Reader:
        """The bytes at ``location``, to read; ``FileStorageError`` if they are not there."""
        ...

    async def delete(self, location: str) -> None:
        """Remove the bytes at ``location``; nothing there is no error."""
        ...


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name) or ".." in name.split("/"):
        raise ValueError(f"not a safe storage name: {name!r}")
    return name


async def chunks(reader: Reader, size: int = CHUNK_BYTES) -> AsyncIterator[bytes]:
    """The reader's bytes, a chunk at a time, each read in a thread; closed at the end (or when
    the consumer stops early)."""
    try:
        while data := await asyncio.to_thread(reader.read, size):
            yield data
    finally:
        await asyncio.to_thread(reader.close)


class LocalBlobs:
    """Bytes as files under ``root`` (``APIARY_FILES_DIR``), made on the first ``put``. A
    ``put`` writes a temporary file beside the target and renames it, so a crash never leaves
    half a file under a name."""

    def __init__(self, root: Path) -> None:
        self.root = root.expanduser()

    def describe(self) -> str:
        return f"the folder {self.root}"

    def _path(self, location: str) -> Path:
        if not location.startswith(LOCAL):
            raise FileStorageError(f"This file is kept at {location.split('/', 1)[0]}…, and this "
                                   "queen now keeps files in a local folder (APIARY_FILES_DIR).")
        return self.root / check_name(location.removeprefix(LOCAL))

    async def put(self, name: str, source: BinaryIO) -> str:
        location = LOCAL + check_name(name)
        target = self._path(location)

        def write() -> None:
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{target.name}.{secrets.token_hex(4)}.part")
            try:
                with partial.open("wb") as out:
                    shutil.copyfileobj(source, out, CHUNK_BYTES)
                    out.flush()
                    os.fsync(out.fileno())
                partial.replace(target)
            except BaseException:
                partial.unlink(missing_ok=True)
                raise

        try:
            await asyncio.to_thread(write)
        except OSError as exc:
            raise FileStorageError(f"The queen could not write the file to its folder: "
                                   f"{exc.strerror or exc}.") from exc
        return location

    async def open(self, location: str) -> Reader:
        path = self._path(location)
        try:
            return await asyncio.to_thread(path.open, "rb")
        except FileNotFoundError as exc:
            raise FileStorageError("The file's bytes are missing from the queen's folder.") from exc
        except OSError as exc:
            raise FileStorageError(f"The queen could not read the file: "
                                   f"{exc.strerror or exc}.") from exc

    async def delete(self, location: str) -> None:
        path = self._path(location)
        try:
            await asyncio.to_thread(path.unlink, missing_ok=True)
        except OSError as exc:
            raise FileStorageError(f"The queen could not delete the file's bytes: "
                                   f"{exc.strerror or exc}.") from exc


async def discard(blobs: BlobStore, location: str) -> None:
    """Remove bytes no record points to (an upload whose record failed), logging a failure
    rather than hiding the error that caused it."""
    try:
        await blobs.delete(location)
    except FileStorageError as exc:
        log.warning("could not remove the orphaned upload %s: %s", location, exc.message)
