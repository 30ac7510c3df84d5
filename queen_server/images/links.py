"""The images of ``url`` answers (issue 38), kept for a limited time.

Each image is put in the files' storage (the queen's folder, or the S3 bucket every replica
reads) and recorded in ``image_links`` with its expiry. Its link names only an unguessable token
(32 random bytes) and the format's extension: whoever has the link may fetch the image until it
expires, as with OpenAI's own image URLs, and no one can list or guess another. Expired images
are answered 404 at once and deleted by the sweep, every ``image_sweep_interval_s``, on every
replica (deleting twice is harmless).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import re
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import delete, insert, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from queen_server.files.blobs import BlobStore
from queen_server.files.errors import FileStorageError
from queen_server.images.delivery import MEDIA_TYPES
from queen_server.storage.tables import ImageLinkRow

log = logging.getLogger(__name__)

LINK_PREFIX = "/v1/images/files/"
_LINK_NAME = re.compile(r"^([A-Za-z0-9_-]{43})\.(png|jpeg|webp)$")
SWEEP_BATCH = 500


@dataclass(frozen=True, slots=True)
class KeptImage:
    media_type: str
    data: bytes


class ImageLinks:
    def __init__(self, engine: AsyncEngine, blobs: BlobStore, ttl_s: float,
                 sweep_interval_s: float) -> None:
        self.engine = engine
        self.blobs = blobs
        self.ttl_s = ttl_s
        self.sweep_interval_s = sweep_interval_s
        self._task: asyncio.Task[None] | None = None

    async def keep(self, data: bytes, output_format: str) -> str:
        """Keep one image; its link's path (``LINK_PREFIX`` + token + extension)."""
        token = secrets.token_urlsafe(32)
        location = await self.blobs.put(f"images/{token}.{output_format}", io.BytesIO(data))
        now = datetime.now(UTC)
        try:
            async with self.engine.begin() as conn:
                await conn.execute(insert(ImageLinkRow).values(
                    token=token, location=location, output_format=output_format,
                    size_bytes=len(data), created_at=now,
                    expires_at=now + timedelta(seconds=self.ttl_s)))
        except BaseException:
            with contextlib.suppress(FileStorageError):
                await self.blobs.delete(location)
            raise
        return f"{LINK_PREFIX}{token}.{output_format}"

    async def open(self, name: str) -> KeptImage | None:
        """The image a link's last segment names, or None: no such link, or expired."""
        found = _LINK_NAME.fullmatch(name)
        if found is None:
            return None
        token, output_format = found.groups()
        async with self.engine.connect() as conn:
            row = (await conn.execute(select(ImageLinkRow).where(
                ImageLinkRow.token == token))).first()
        if (row is None or row.output_format != output_format
                or _aware(row.expires_at) <= datetime.now(UTC)):
            return None
        reader = await self.blobs.open(row.location)
        try:
            data = await asyncio.to_thread(reader.read)
        finally:
            await asyncio.to_thread(reader.close)
        return KeptImage(MEDIA_TYPES[output_format], data)

    async def sweep(self) -> int:
        """Delete expired images (their bytes, then their rows); how many went."""
        now = datetime.now(UTC)
        async with self.engine.connect() as conn:
            rows = (await conn.execute(
                select(ImageLinkRow.token, ImageLinkRow.location)
                .where(ImageLinkRow.expires_at <= now).limit(SWEEP_BATCH))).all()
        gone = []
        for token, location in rows:
            try:
                await self.blobs.delete(location)
            except FileStorageError as exc:
                log.warning("an expired image's bytes at %s stay: %s", location, exc.message)
                continue
            gone.append(token)
        if gone:
            async with self.engine.begin() as conn:
                await conn.execute(delete(ImageLinkRow).where(ImageLinkRow.token.in_(gone)))
        return len(gone)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._sweeping(), name="image link sweep")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _sweeping(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            try:
                swept = await self.sweep()
            except (SQLAlchemyError, OSError) as exc:
                log.warning("sweeping expired images failed: %s", exc)
                continue
            if swept:
                log.info("deleted %d expired images", swept)


def _aware(moment: datetime) -> datetime:
    """SQLite hands timestamps back without their zone: they were written in UTC."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
