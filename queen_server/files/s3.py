"""``S3Blobs``: the queen's stored bytes in an S3-compatible bucket (AWS S3, MinIO, Ceph,
Garage, moto's server), through boto3. Its calls block, so each runs in a thread; boto3's
client is thread-safe, and one is made per store. The bucket must exist: the operator makes it
(and its access policy) once.

Set ``APIARY_FILES_S3_BUCKET`` to use it; ``APIARY_FILES_S3_URL`` is the endpoint of a
non-AWS store (unset: AWS), ``APIARY_FILES_S3_ACCESS_KEY`` and ``APIARY_FILES_S3_SECRET_KEY``
the credentials (unset: boto3's own chain: environment, profile, instance role).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, BinaryIO, NoReturn

import boto3
from boto3.exceptions import Boto3Error
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from queen_server.files.blobs import Reader, check_name
from queen_server.files.errors import FileStorageError

log = logging.getLogger(__name__)

S3 = "s3://"


class S3Blobs:
    def __init__(self, bucket: str, *, endpoint_url: str | None = None,
                 region: str = "us-east-1", access_key: str | None = None,
                 secret_key: str | None = None, timeout_s: float = 30.0) -> None:
        self.bucket = bucket
        self.endpoint_url = endpoint_url
        # Another store than AWS is reached by path (http://host:9000/bucket/key): its buckets
        # are seldom in its DNS.
        config = Config(connect_timeout=min(timeout_s, 10.0), read_timeout=timeout_s,
                        retries={"max_attempts": 3, "mode": "standard"},
                        s3={"addressing_style": "path" if endpoint_url else "auto"})
        self._client: Any = boto3.session.Session().client(
            "s3", endpoint_url=endpoint_url, region_name=region, aws_access_key_id=access_key,
            aws_secret_access_key=secret_key, config=config)

    def describe(self) -> str:
        return f"the S3 bucket {self.bucket}" + (f" at {self.endpoint_url}"
                                                 if self.endpoint_url else "")

    def _key(self, location: str) -> str:
        prefix = f"{S3}{self.bucket}/"
        if not location.startswith(prefix):
            raise FileStorageError(f"This file is kept at {location.split('/', 1)[0]}…, and this "
                                   f"queen now keeps files in {self.describe()}.")
        return check_name(location.removeprefix(prefix))

    async def put(self, name: str, source: BinaryIO) -> str:
        key = check_name(name)
        try:
            await asyncio.to_thread(self._client.upload_fileobj, source, self.bucket, key)
        except (Boto3Error, BotoCoreError, ClientError) as exc:
            self._fail("store the file", exc)
        return f"{S3}{self.bucket}/{key}"

    async def open(self, location: str) -> Reader:
        key = self._key(location)
        try:
            answer = await asyncio.to_thread(self._client.get_object, Bucket=self.bucket, Key=key)
        except (BotoCoreError, ClientError) as exc:
            self._fail("read the file", exc)
        body: Reader = answer["Body"]
        return body

    async def delete(self, location: str) -> None:
        key = self._key(location)
        try:
            await asyncio.to_thread(self._client.delete_object, Bucket=self.bucket, Key=key)
        except (BotoCoreError, ClientError) as exc:
            self._fail("delete the file", exc)

    def _fail(self, doing: str, exc: Exception) -> NoReturn:
        """A boto3 error as the client sees it: what failed and S3's code, never a credential."""
        if isinstance(exc, ClientError):
            code = exc.response.get("Error", {}).get("Code", "error")
            why = f"S3 answered {code}"
        else:
            why = type(exc).__name__
        log.warning("S3 could not %s in %s: %s", doing, self.describe(), exc)
        raise FileStorageError(f"The queen could not {doing} in its storage ({why}).") from exc
