"""A hostile "queen" on 127.0.0.1 that announces an enormous frame: the worker's link must refuse
it from its header (close code 1009) without waiting to buffer it, and reconnect later.

The server is raw asyncio, so that it can write a frame header claiming gigabytes and then send
almost nothing: a client that tried to read the whole frame would hang here, not fail."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import struct
from collections.abc import AsyncIterator, Callable

import pytest

from desktop_worker.jobs import JobRunner
from desktop_worker.link.backoff import Backoff
from desktop_worker.link.client import LinkClient
from desktop_worker.settings import DEFAULT_MAX_FRAME_BYTES, WorkerSettings
from shared_schema import SUBPROTOCOL, Hello

WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
CLOSE_OPCODE = 0x8
CLOSE_MESSAGE_TOO_BIG = 1009
CLAIMED_BYTES = 8 << 30  # 8 GiB announced; 1 KiB sent


class HostileQueen:
    """Accepts each websocket handshake, announces a ``claimed``-byte text frame, and records
    the close code the client answers with (None when it sent no close frame)."""

    def __init__(self, claimed: int) -> None:
        self.claimed = claimed
        self.connections = 0
        self.closes: asyncio.Queue[int | None] = asyncio.Queue()
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return f"ws://127.0.0.1:{port}/worker"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            request = await reader.readuntil(b"\r\n\r\n")
            headers = dict(line.split(": ", 1) for line in
                           request.decode("latin-1").split("\r\n")[1:] if ": " in line)
            key = {name.lower(): value for name, value in headers.items()}["sec-websocket-key"]
            accept = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
            writer.write(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                          f"Connection: Upgrade\r\nSec-WebSocket-Accept: {accept}\r\n"
                          f"Sec-WebSocket-Protocol: {SUBPROTOCOL}\r\n\r\n").encode())
            writer.write(bytes([0x81, 127]) + struct.pack("!Q", self.claimed) + b"x" * 1024)
            await writer.drain()
            self.closes.put_nowait(await read_close_code(reader))
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closes.put_nowait(None)
        finally:
            writer.close()


async def read_close_code(reader: asyncio.StreamReader) -> int | None:
    """The code of the client's next frame if it is a close frame (client frames are masked)."""
    head = await reader.readexactly(2)
    length = head[1] & 0x7F
    if length == 126:
        length = struct.unpack("!H", await reader.readexactly(2))[0]
    elif length == 127:
        length = struct.unpack("!Q", await reader.readexactly(8))[0]
    mask = await reader.readexactly(4) if head[1] & 0x80 else b"\0\0\0\0"
    payload = bytes(b ^ mask[i % 4] for i, b in enumerate(await reader.readexactly(length)))
    if head[0] & 0x0F != CLOSE_OPCODE or len(payload) < 2:
        return None
    return struct.unpack("!H", payload[:2])[0]


@pytest.fixture
async def hostile_queen() -> AsyncIterator[HostileQueen]:
    queen = HostileQueen(CLAIMED_BYTES)
    queen.server = await asyncio.start_server(queen.handle, "127.0.0.1", 0)
    async with queen.server:
        yield queen


def _no_hello() -> Callable[[str, str], Hello]:
    def hello_for(nonce: str, origin: str) -> Hello:
        raise AssertionError("the hostile queen never sends a challenge")
    return hello_for


async def test_an_oversized_frame_closes_with_1009_and_the_worker_reconnects(
        hostile_queen: HostileQueen) -> None:
    async def hello_factory() -> tuple[Callable[[str, str], Hello], int]:
        return _no_hello(), 1

    states: list[tuple[str, str]] = []
    runner = JobRunner(object(), has_model=lambda _name: False)  # type: ignore[arg-type]
    link = LinkClient(hostile_queen.url, hello_factory, runner, shutdown_grace_s=0.1,
                      backoff=Backoff(base_s=0.01, cap_s=0.05),
                      on_state=lambda state, detail: states.append((state, detail)),
                      max_frame_bytes=1024 * 1024)
    stop = asyncio.Event()
    running = asyncio.create_task(link.run(stop))
    async with asyncio.timeout(10):
        first = await hostile_queen.closes.get()
        second = await hostile_queen.closes.get()  # it came back after the first refusal
    assert (first, second) == (CLOSE_MESSAGE_TOO_BIG, CLOSE_MESSAGE_TOO_BIG)
    assert not running.done()  # refusing a frame did not end the worker's link
    stop.set()
    async with asyncio.timeout(10):
        await running
    assert hostile_queen.connections >= 2
    assert any(state == "disconnected" and "reconnecting" in detail for state, detail in states)
    assert states[-1][0] == "stopped"


def test_the_frame_limit_is_a_setting_with_a_sane_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert WorkerSettings().max_frame_bytes == DEFAULT_MAX_FRAME_BYTES == 16 * 1024 * 1024
    monkeypatch.setenv("APIARY_MAX_FRAME_BYTES", str(2 * 1024 * 1024))
    assert WorkerSettings().max_frame_bytes == 2 * 1024 * 1024
    assert LinkClient("ws://127.0.0.1:1/worker", None, None).max_frame_bytes == (  # type: ignore[arg-type]
        DEFAULT_MAX_FRAME_BYTES)
