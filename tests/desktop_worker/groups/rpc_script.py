"""A scripted llama.cpp RPC client for the gate's tests (issue 34): the bytes of protocol 7.0.0's
commands and tensors, built by hand as a hostile head would, and ``ScriptedHead``, which
speaks them to a real member's gate over a real socket.

Everything follows ``ggml-rpc.cpp``: a command is ``cmd (1 byte) | size (u64) | payload``, a
reply ``size (u64) | payload``, a tensor ``rpc_tensor`` (``rpc_wire.TENSOR``)."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Sequence

from desktop_worker.groups.gate import authenticate_member, close_quietly
from desktop_worker.groups.rpc_wire import GGML_OPS, TENSOR, TYPES, Command

OP = {name: i for i, name in enumerate(GGML_OPS)}
F32, F16, I32, Q4_0 = 0, 1, 26, 2


def command(cmd: int, payload: bytes = b"") -> bytes:
    return bytes((cmd,)) + struct.pack("<Q", len(payload)) + payload


def tensor(tid: int, *, type_: int = F32, buffer: int = 0, data: int = 0,
           ne: Sequence[int] = (1, 1, 1, 1), nb: Sequence[int] | None = None, op: int = 0,
           op_params: Sequence[int] = (), src: Sequence[int] = (), view_src: int = 0,
           view_offs: int = 0, flags: int = 0, name: bytes = b"t") -> bytes:
    """One ``rpc_tensor``; ``nb`` packed from ``ne`` unless given."""
    ne = tuple(ne) + (1,) * (4 - len(ne))
    if nb is None:
        info = TYPES.get(type_, TYPES[F32])
        first = info.size
        nb = [first, first * ne[0] // info.block]
        nb += [nb[1] * ne[1], nb[1] * ne[1] * ne[2]]
    params = tuple(op_params) + (0,) * (16 - len(op_params))
    sources = tuple(src) + (0,) * (10 - len(src))
    return TENSOR.pack(tid, type_, buffer, *ne, *nb, op, *params, flags, *sources, view_src,
                       view_offs, data, name.ljust(64, b"\0")[:64], 0)


def hello(caps: bytes = bytes(24)) -> bytes:
    return command(Command.HELLO, caps)


def device_count() -> bytes:
    return command(Command.DEVICE_COUNT)


def alloc(size: int, device: int = 0) -> bytes:
    return command(Command.ALLOC_BUFFER, struct.pack("<IQ", device, size))


def get_base(handle: int) -> bytes:
    return command(Command.BUFFER_GET_BASE, struct.pack("<Q", handle))


def free(handle: int) -> bytes:
    return command(Command.FREE_BUFFER, struct.pack("<Q", handle))


def set_tensor(t: bytes, data: bytes, offset: int = 0, flag: int = 0) -> bytes:
    return command(Command.SET_TENSOR, t + bytes((flag,)) + struct.pack("<Q", offset) + data)


def get_tensor(t: bytes, offset: int, size: int) -> bytes:
    return command(Command.GET_TENSOR, t + struct.pack("<QQ", offset, size))


def copy_tensor(src: bytes, dst: bytes) -> bytes:
    return command(Command.COPY_TENSOR, src + dst)


def init_tensor(t: bytes) -> bytes:
    return command(Command.INIT_TENSOR, t)


def graph(nodes: Sequence[int], tensors: Sequence[bytes], device: int = 0) -> bytes:
    body = struct.pack(f"<II{len(nodes)}Q", device, len(nodes), *nodes)
    return command(Command.GRAPH_COMPUTE, body + struct.pack("<I", len(tensors))
                   + b"".join(tensors))


def recompute(device: int = 0) -> bytes:
    return command(Command.GRAPH_RECOMPUTE, struct.pack("<I", device))


def reply(payload: bytes) -> bytes:
    """A member's reply, as its server sends one."""
    return struct.pack("<Q", len(payload)) + payload


class ScriptedHead:
    """A head that is no llama.cpp: it passes the gate's handshake with the link's token and
    then sends whatever bytes its test writes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(cls, address: tuple[str, int], *, group: str, head: str,
                      token: bytes) -> ScriptedHead:
        reader, writer = await asyncio.open_connection(*address)
        await authenticate_member(reader, writer, group=group, head=head, token=token,
                                  timeout_s=5.0)
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def reply(self, timeout_s: float = 10.0) -> bytes:
        async with asyncio.timeout(timeout_s):
            size = struct.unpack("<Q", await self.reader.readexactly(8))[0]
            return await self.reader.readexactly(size)

    async def ask(self, data: bytes) -> bytes:
        await self.send(data)
        return await self.reply()

    async def hello(self) -> tuple[int, int, int]:
        answer = await self.ask(hello())
        return answer[0], answer[1], answer[2]

    async def buffer(self, size: int, device: int = 0) -> tuple[int, int]:
        """A new buffer's handle and base address."""
        handle, _size = struct.unpack("<QQ", await self.ask(alloc(size, device)))
        assert handle, "the server could not allocate the buffer"
        base = struct.unpack("<Q", await self.ask(get_base(handle)))[0]
        return handle, base

    async def closed(self, timeout_s: float = 10.0) -> bool:
        """Whether the other side ended the connection (reads to EOF)."""
        try:
            async with asyncio.timeout(timeout_s):
                while await self.reader.read(65536):
                    pass
        except (ConnectionError, OSError):
            pass
        return True

    async def close(self) -> None:
        await close_quietly(self.writer)


async def honest_round_trip(head: ScriptedHead) -> bytes:
    """What an honest client does with a member: a buffer, 64 floats in, the same out."""
    assert await head.hello() == (7, 0, 0)
    assert struct.unpack("<I", await head.ask(device_count()))[0] >= 1
    handle, base = await head.buffer(4096)
    t = tensor(1, buffer=handle, data=base, ne=(64,))
    values = struct.pack("<64f", *range(64))
    await head.send(set_tensor(t, values))
    back = await head.ask(get_tensor(t, 0, len(values)))
    await head.send(free(handle))
    return back if back == values else b""
