"""A real S3-compatible server for the tests: moto's ``moto_server`` (``moto[server]``, in the
dev extras) as its own process on a free loopback port, answering S3's HTTP API. Its state
lives in that process only, so each test starts with no buckets."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from botocore.config import Config

from tests.support.processes import Proc, base_env, free_port

ACCESS_KEY = "apiary-test-access"
SECRET_KEY = "apiary-test-secret"  # moto_server takes any credentials
REGION = "us-east-1"


class S3Server:
    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        self.proc = Proc([sys.executable, "-m", "moto.server", "--host", "127.0.0.1", "--port",
                          str(self.port)], workdir / f"moto-{self.port}.log", base_env(workdir))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> S3Server:
        self.proc.start()
        deadline = time.monotonic() + timeout_s
        while not self._answers():
            if not self.proc.alive():
                raise RuntimeError(f"moto_server exited: {self.proc.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"moto_server on port {self.port} did not answer")
            time.sleep(0.05)
        return self

    def _answers(self) -> bool:
        try:
            return httpx.get(self.url, timeout=1, trust_env=False).status_code < 500
        except httpx.HTTPError:
            return False

    def client(self) -> Any:
        """A boto3 S3 client of the test's own, to look into the buckets behind the queen."""
        return boto3.session.Session().client(
            "s3", endpoint_url=self.url, region_name=REGION, aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY, config=Config(s3={"addressing_style": "path"}))

    def stop(self) -> None:
        self.proc.stop()


@pytest.fixture
def s3_server(tmp_path: Path) -> Iterator[S3Server]:
    server = S3Server(tmp_path / "s3").start()
    try:
        yield server
    finally:
        server.stop()
