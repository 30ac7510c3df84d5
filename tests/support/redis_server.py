"""A real ``redis-server`` (Debian's package) on a free loopback port, for the tests of the
queen's cluster pieces. It runs with no persistence, so a restart is an empty Redis, as after a
crash; ``restart`` keeps the port, so clients reconnect to the same URL."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from queen_server.cluster.seal import BusSeal
from tests.support.processes import free_port

REDIS_SERVER = shutil.which("redis-server")


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    def __init__(self, workdir: Path, port: int | None = None) -> None:
        if REDIS_SERVER is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.port = port or free_port()
        self.workdir = workdir
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = (self.workdir / f"redis-{self.port}.log").open("ab")
        self.popen = subprocess.Popen(
            [str(REDIS_SERVER), "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout_s
        while not _answers(self.port):
            if self.popen.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.popen.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server on port {self.port} did not answer")
            time.sleep(0.02)
        return self

    def stop(self, kill: bool = False) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        if kill:
            self.popen.kill()
        else:
            self.popen.terminate()
        self.popen.wait(timeout=10)

    def restart(self) -> None:
        """Kill it and start an empty one on the same port."""
        self.stop(kill=True)
        self.start()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh, empty ``redis-server`` for one test; skipped where none is installed (CI
    installs it: ``.ci/packages.sh``)."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop(kill=True)


def bus_seal() -> BusSeal:
    """The seal of the tests' replicas (``APIARY_CLUSTER_SECRET``, set in ``tests/conftest.py``),
    for a ``RedisBus`` made by hand."""
    return BusSeal(os.environ.get("APIARY_CLUSTER_SECRET", "apiary-tests-cluster-secret"))
