"""Test helpers for the gate and the dialer (issue 19): a fake llama.cpp RPC server on
127.0.0.1 that answers each length-prefixed message, and a client for it.

The fake counts every connection it accepts, so a test can prove that a refused head never
reached the RPC port at all, and signals each connection's end, so a test waits on events,
not on sleeps."""

from __future__ import annotations

import asyncio
import contextlib
import struct

REPLY_PREFIX = b"re:"
_LENGTH = struct.Struct(">I")


class FakeRpcServer:
    """Answers each message ``<u32 length><payload>`` with ``<u32 length>re:<payload>``."""

    def __init__(self) -> None:
        self.accepts = 0
        self.closed = 0
        self.received = bytearray()
        self._server: asyncio.Server | None = None
        self._changed = asyncio.Condition()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._server.wait_closed()

    async def wait_closed(self, count: int, timeout_s: float = 5.0) -> None:
        """Waits until ``count`` connections have ended on the RPC side."""
        async with asyncio.timeout(timeout_s), self._changed:
            await self._changed.wait_for(lambda: self.closed >= count)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepts += 1
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            while True:
                header = await reader.readexactly(_LENGTH.size)
                payload = await reader.readexactly(_LENGTH.unpack(header)[0])
                self.received += header + payload
                answer = REPLY_PREFIX + payload
                writer.write(_LENGTH.pack(len(answer)) + answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # a cancel comes from ``stop()``; 3.11 would log a cancelled handler
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            self._tasks.discard(task)
            async with self._changed:
                self.closed += 1
                self._changed.notify_all()


def frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


async def exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes
) -> bytes:
    """Sends one message and returns the fake server's answer's payload."""
    writer.write(frame(payload))
    await writer.drain()
    async with asyncio.timeout(5):
        header = await reader.readexactly(_LENGTH.size)
        return await reader.readexactly(_LENGTH.unpack(header)[0])


async def read_to_end(reader: asyncio.StreamReader, timeout_s: float = 5.0) -> bytes:
    """Everything until the other side closes (the close is the event waited on)."""
    async with asyncio.timeout(timeout_s):
        return await reader.read()
