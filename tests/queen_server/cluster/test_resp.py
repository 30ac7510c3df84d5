"""The bus's own Redis connection (``cluster.resp``), against real ``redis-server`` processes:
coalesced publishes in order, passwords, a Unix socket, a restart, and a server that answers
out of step."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from queen_server.cluster.bus import RedisBus
from queen_server.cluster.errors import BusUnavailable
from queen_server.cluster.resp import Publisher, RespConnection, pack
from tests.support.processes import free_port
from tests.support.redis_server import REDIS_SERVER, RedisServer, bus_seal

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")


@contextlib.contextmanager
def redis_process(tmp_path: Path, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """A redis-server with extra arguments (a password, a Unix socket), ready when yielded."""
    port = free_port()
    proc = subprocess.Popen([str(REDIS_SERVER), "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", str(tmp_path), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    proc.port = port  # type: ignore[attr-defined]
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


async def opened(url: str) -> RespConnection:
    """Connect, retrying while the server starts (a real process takes a moment)."""
    for _ in range(200):
        try:
            return await RespConnection.open(url, timeout_s=1.0)
        except OSError:
            await asyncio.sleep(0.02)
    return await RespConnection.open(url, timeout_s=1.0)


async def assert_carried(url: str, message: bytes) -> None:
    """Two buses on ``url`` (two replicas): one's message reaches the other's subscriber."""
    a = await RedisBus(url, seal=bus_seal()).start()
    b = await RedisBus(url, seal=bus_seal()).start()
    try:
        sub = await a.subscribe("ch")
        assert await b.publish("ch", message) == 1
        assert await sub.get(timeout=5) == message
    finally:
        await a.close()
        await b.close()


def test_pack_writes_the_redis_protocol() -> None:
    assert pack("PUBLISH", "ch", b"a\r\nb") == (
        b"*3\r\n$7\r\nPUBLISH\r\n$2\r\nch\r\n$4\r\na\r\nb\r\n")
    assert pack("SELECT", 3) == b"*2\r\n$6\r\nSELECT\r\n$1\r\n3\r\n"


async def test_publishes_of_many_jobs_are_coalesced_and_each_channel_keeps_its_order(
        redis_server: RedisServer) -> None:
    reader = await RedisBus(redis_server.url, seal=bus_seal()).start()
    writer = await RedisBus(redis_server.url, seal=bus_seal()).start()
    try:
        channels = [f"job-{n}" for n in range(20)]
        subs = [await reader.subscribe(channel) for channel in channels]

        async def job(channel: str) -> list[int]:
            counts = []
            for k in range(25):
                counts += await writer.publish_many(channel, [b"%d" % (2 * k),
                                                              b"%d" % (2 * k + 1)])
            return counts

        counts = await asyncio.gather(*(job(channel) for channel in channels))
        assert all(c == [1] * 50 for c in counts)
        for sub in subs:
            got = [await sub.get(timeout=5) for _ in range(50)]
            assert got == [b"%d" % k for k in range(50)]
        # 500 publishes from 20 jobs at once went out in far fewer writes.
        assert writer._publisher.writes < 250
    finally:
        await reader.close()
        await writer.close()


async def test_a_password_is_sent_and_a_wrong_one_refused_without_showing_it(
        tmp_path: Path) -> None:
    with redis_process(tmp_path, "--requirepass", "s3cret-pass") as proc:
        url = f"redis://:s3cret-pass@127.0.0.1:{proc.port}/0"  # type: ignore[attr-defined]
        connection = await opened(url)
        assert await connection.send([pack("PING")])[0] == b"PONG"
        connection.close()
        publisher = Publisher(url)
        assert await publisher.publish("ch", [b"x"]) == [0]
        await publisher.close()
        bad = f"redis://:wrong-pass@127.0.0.1:{proc.port}/0"  # type: ignore[attr-defined]
        with pytest.raises(ConnectionError, match="refused the credentials") as caught:
            await RespConnection.open(bad)
        assert "wrong-pass" not in str(caught.value)
        with pytest.raises(BusUnavailable):
            await RedisBus(bad, seal=bus_seal()).start()


async def test_a_bus_over_a_unix_socket(tmp_path: Path) -> None:
    socket = tmp_path / "redis.sock"
    with redis_process(tmp_path, "--unixsocket", str(socket), "--unixsocketperm", "700"):
        url = f"unix://{socket}"
        (await opened(url)).close()
        await assert_carried(url, b"over the socket")


async def test_a_publish_after_redis_restarted_goes_out_on_a_fresh_connection(
        redis_server: RedisServer) -> None:
    bus = await RedisBus(redis_server.url, seal=bus_seal()).start()
    try:
        assert await bus.publish("ch", b"before") == 0
        await asyncio.to_thread(redis_server.restart)
        assert await bus.publish("ch", b"after") == 0  # the dead connection failed once
    finally:
        await bus.close()


@pytest.fixture
async def out_of_step_server() -> AsyncIterator[str]:
    """A server speaking the Redis protocol that answers every command twice."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while await reader.read(65536):
                writer.write(b":1\r\n:1\r\n")
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    yield f"redis://127.0.0.1:{port}/0"
    server.close()


async def test_a_reply_nobody_asked_for_drops_the_connection_and_fails_loudly(
        out_of_step_server: str) -> None:
    publisher = Publisher(out_of_step_server)
    try:
        assert await publisher.publish("ch", [b"x"]) == [1]
        first = publisher._connection
        assert first is not None
        # The extra reply broke the stream: the connection is dropped, not trusted again.
        reason = await asyncio.wait_for(first.wait_closed(), 5)
        assert "no command asked for" in str(reason)
        assert await publisher.publish("ch", [b"y"]) == [1]  # a fresh one
    finally:
        await publisher.close()
    with pytest.raises(ConnectionError):
        await publisher.publish("ch", [b"z"])


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (the operator's own CA)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return key, cert


async def test_a_bus_over_tls_trusting_the_operators_ca(
        tmp_path: Path, certificate: tuple[Path, Path]) -> None:
    """``rediss://`` with redis-py's own TLS options (here ``ssl_ca_certs``): the same URL
    both clients read. A server whose certificate is not trusted is refused."""
    key, cert = certificate
    tls_port = free_port()
    with redis_process(tmp_path, "--tls-port", str(tls_port), "--tls-cert-file", str(cert),
                       "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
                       "--tls-auth-clients", "no"):
        url = f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={cert}"
        (await opened(url)).close()
        await assert_carried(url, b"sealed, over TLS")
        with pytest.raises(ssl.SSLError):  # the system's CAs do not know this certificate
            await RespConnection.open(f"rediss://127.0.0.1:{tls_port}/0")
        # redis-py's way to say "encrypt, but check nothing" is honoured the same way.
        unchecked = await RespConnection.open(
            f"rediss://127.0.0.1:{tls_port}/0?ssl_cert_reqs=none")
        assert await unchecked.send([pack("PING")])[0] == b"PONG"
        unchecked.close()


async def test_publish_soon_calls_back_in_order_and_a_failing_callback_breaks_nothing(
        redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    """The relay's path: no await per message; each ``done`` is called once, in the order the
    publishes were asked, and a callback that raises is logged without hurting the others or
    the connection."""
    publisher = Publisher(redis_server.url)
    try:
        got: list[tuple[int, object]] = []
        finished = asyncio.get_running_loop().create_future()

        def done(n: int, result: object) -> None:
            got.append((n, result))
            if n == 2:
                raise RuntimeError("a buggy callback")
            if n == 99:
                finished.set_result(None)

        for n in range(100):
            publisher.publish_soon("ch", [b"%d" % n] * (1 + n % 3), lambda r, n=n: done(n, r))
        await asyncio.wait_for(finished, 5)
        assert [n for n, _ in got] == list(range(100))
        assert all(result == [0] * (1 + n % 3) for n, result in got)
        assert publisher.writes < 100  # what was asked in one round went out together
        assert "a buggy callback" in caplog.text
        assert await publisher.publish("ch", [b"after"]) == [0]  # the connection is fine
    finally:
        await publisher.close()


async def test_publish_soon_with_redis_down_calls_back_with_the_error() -> None:
    publisher = Publisher(f"redis://127.0.0.1:{free_port()}/0", timeout_s=1.0)
    try:
        failed = asyncio.get_running_loop().create_future()
        publisher.publish_soon("ch", [b"x"], failed.set_result)
        assert isinstance(await asyncio.wait_for(failed, 5), OSError)
        with pytest.raises(OSError, match=r"refused|failed"):  # the awaited form raises it
            await publisher.publish("ch", [b"y"])
    finally:
        await publisher.close()
    with pytest.raises(ConnectionError, match="closed"):
        publisher.publish_soon("ch", [b"z"], lambda result: None)
