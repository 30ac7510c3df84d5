"""``link_probe``: "Test connection" against servers that are not a working queen (a web
server, a websocket without the Apiary subprotocol, a queen of another protocol version, a
refusal, silence), and connection errors in plain words. On the default asyncio loop: no Qt."""

from __future__ import annotations

import contextlib
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import InvalidMessage, InvalidStatus
from websockets.http11 import Response

from desktop_worker.hardware import HardwareReport, NullGpuDetector, detect_hardware
from desktop_worker.link_probe import explain_connect_error, probe_queen
from desktop_worker.service import WorkerService
from desktop_worker.settings import WorkerSettings
from shared_schema import SUBPROTOCOL, decode, encode
from shared_schema.protocol import Challenge, Refused
from tests.support.config_home import config_home  # noqa: F401 (autouse)
from tests.support.queen import running_queen

NONCE = "ab" * 16


def no_gpus(models_dir: Path) -> HardwareReport:
    return detect_hardware(models_dir, nvidia=NullGpuDetector(), opencl=NullGpuDetector())


@contextlib.asynccontextmanager
async def stub_server(handler: Callable[[ServerConnection], Awaitable[None]],
                      **kwargs: Any) -> AsyncIterator[str]:
    async with serve(handler, "127.0.0.1", 0, **kwargs) as server:
        port = server.sockets[0].getsockname()[1]
        yield f"ws://127.0.0.1:{port}/worker"


async def hello_factory(tmp_path, _unused=None) -> Callable[[], Awaitable[Any]]:
    settings = WorkerSettings(models_dir=tmp_path / "models", key_path=tmp_path / "key.pem",
                              key_store="file")
    return WorkerService(settings, detector=no_gpus).hello_factory


async def test_a_web_server_that_is_not_a_queen(tmp_path):
    hello = await hello_factory(tmp_path)
    async with running_queen(tmp_path) as queen:  # its HTTP side, at a path with no websocket
        outcome = await probe_queen(f"ws://127.0.0.1:{queen.port}/v1/models", hello)
    assert not outcome.ok
    assert outcome.kind == "not_a_queen"
    assert "answered HTTP" in outcome.message
    assert "not an Apiary queen" in outcome.message


async def test_a_websocket_without_the_apiary_subprotocol(tmp_path):
    async def echo(ws: ServerConnection) -> None:
        await ws.wait_closed()

    hello = await hello_factory(tmp_path)
    async with stub_server(echo) as url:
        outcome = await probe_queen(url, hello)
    assert outcome.kind == "not_a_queen"
    assert SUBPROTOCOL in outcome.message


@pytest.mark.parametrize(("protocol", "words"), [
    (99, "update Apiary"),
    (0, "the queen is older than this app"),
])
async def test_a_queen_of_another_protocol_version(tmp_path, protocol, words):
    async def old_or_new(ws: ServerConnection) -> None:
        challenge = Challenge(nonce=NONCE).model_dump()
        challenge["protocol"] = protocol
        await ws.send(encode(Challenge.model_validate(challenge)))
        await ws.wait_closed()

    hello = await hello_factory(tmp_path)
    async with stub_server(old_or_new, subprotocols=[SUBPROTOCOL]) as url:
        outcome = await probe_queen(url, hello)
    assert outcome.kind == "version"
    assert words in outcome.message


async def test_a_refusal_gives_the_queens_reason(tmp_path):
    hellos: list[Any] = []

    async def refusing(ws: ServerConnection) -> None:
        await ws.send(encode(Challenge(nonce=NONCE)))
        hellos.append(decode(await ws.recv()))
        await ws.send(encode(Refused(code="banned", reason="this key is banned here")))
        await ws.close(1008)

    hello = await hello_factory(tmp_path)
    async with stub_server(refusing, subprotocols=[SUBPROTOCOL]) as url:
        outcome = await probe_queen(url, hello)
    assert outcome.kind == "rejected"
    assert outcome.message == "the queen refused this worker: this key is banned here"
    assert hellos
    assert hellos[0].type == "hello"


async def test_a_queen_that_never_answers_times_out(tmp_path):
    async def silent(ws: ServerConnection) -> None:
        await ws.wait_closed()

    hello = await hello_factory(tmp_path)
    async with stub_server(silent, subprotocols=[SUBPROTOCOL]) as url:
        outcome = await probe_queen(url, hello, timeout_s=0.5)
    assert outcome.kind == "timeout"
    assert "no answer from 127.0.0.1" in outcome.message


def test_connection_errors_in_plain_words():
    url = "wss://queen.example/worker"
    dns = socket.gaierror(-2, "Name or service not known")
    assert explain_connect_error(dns, url) == (
        "dns", "the name queen.example could not be found (DNS): check the address and this "
               "computer's internet connection")
    cert = ssl.SSLCertVerificationError(1, "certificate verify failed")
    cert.verify_message = "self-signed certificate"
    kind, words = explain_connect_error(cert, url)
    assert kind == "tls"
    assert "the certificate of queen.example could not be checked (self-signed certificate)" \
        in words
    plain = ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number")
    assert "does the queen serve https?" in explain_connect_error(plain, url)[1]
    refused = ConnectionRefusedError(111, "Connect call failed")
    assert explain_connect_error(refused, "ws://127.0.0.1:9/worker") == (
        "refused", "connection refused: nothing is listening at 127.0.0.1:9")
    status = InvalidStatus(Response(404, "Not Found", Headers()))
    assert explain_connect_error(status, url)[0] == "not_a_queen"
    assert explain_connect_error(InvalidMessage("bad"), url)[0] == "not_a_queen"
    assert explain_connect_error(TimeoutError(), url)[0] == "timeout"
    assert explain_connect_error(None, url) == ("closed", "the connection to the queen was lost")
    for exc in (dns, cert, refused):
        assert "Errno" not in explain_connect_error(exc, url)[1]
