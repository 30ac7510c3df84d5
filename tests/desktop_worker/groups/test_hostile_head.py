"""A hostile head against a real member (issue 34): a scripted client speaking llama.cpp's real
RPC protocol through a real gate, on real sockets, to a real llama.cpp RPC server started the
way a member starts it (``MemberServer``). Every attack is refused by the gate, which ends the
connection and says why; the server never sees the command, stays up (same process, no
restart) and serves an honest client next. With the gate's guard off, the same kind of command
crashes the server, and only its child process ends."""

from __future__ import annotations

import asyncio
import random
import struct
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from desktop_worker.errors import RpcRefused
from desktop_worker.groups.dialer import HeadDialer, RelayedDialer
from desktop_worker.groups.gate import MemberGate
from desktop_worker.groups.head import GroupHead, HeadConfig
from desktop_worker.groups.member import MemberServer
from desktop_worker.groups.relay import RelayTable
from desktop_worker.groups.rpc_guard import GuardPolicy
from shared_schema import GroupClose, GroupOpen
from tests.desktop_worker.groups.relay_support import Switchboard
from tests.desktop_worker.groups.roles_support import ASK  # what ``one_process_text`` answers
from tests.desktop_worker.groups.rpc_script import (
    I32,
    OP,
    ScriptedHead,
    alloc,
    command,
    copy_tensor,
    get_tensor,
    graph,
    honest_round_trip,
    init_tensor,
    recompute,
    set_tensor,
    tensor,
)
from tests.support.one_process import REAL, text_of
from tests.support.rpc import needs_rpc

pytestmark = needs_rpc

GROUP, HEAD, TOKEN = "0123456789abcdef", "head-1", b"k" * 32
SHARE_MB = 128  # room for 20 of SmolLM2's layers, their KV cache and compute buffer
MB = 1024 * 1024


@dataclass
class Member:
    server: MemberServer
    gate: MemberGate
    refusals: list[RpcRefused] = field(default_factory=list)
    refused: asyncio.Event = field(default_factory=asyncio.Event)

    def heard(self, exc: RpcRefused) -> None:
        self.refusals.append(exc)
        self.refused.set()

    async def head(self) -> ScriptedHead:
        return await ScriptedHead.connect(self.gate.address, group=GROUP, head=HEAD,
                                          token=TOKEN)

    async def still_serving(self, pid: int | None) -> None:
        """The same server process, never restarted, answers an honest client."""
        assert self.server.pid == pid
        assert self.server.restarts == 0
        honest = await self.head()
        try:
            assert await honest_round_trip(honest)
        finally:
            await honest.close()


@pytest.fixture
async def member() -> AsyncIterator[Member]:
    server = MemberServer(n_threads=1)
    await server.start()
    made = Member(server, MemberGate(GROUP, HEAD, TOKEN, server.port,
                                     guard=GuardPolicy.from_mb([SHARE_MB])))
    made.gate.on_refused = made.heard
    await made.gate.start()
    yield made
    await made.gate.stop()
    await made.server.stop()


# --- the attacks: each gets a head past HELLO ---------------------------------------------------

Attack = Callable[[ScriptedHead], Awaitable[None]]


async def attack_through(head: ScriptedHead, attack: Attack) -> None:
    """HELLO, the attack, and the gate (or the crashed server) ends the connection."""
    try:
        assert await head.hello() == (7, 0, 0)
        await attack(head)
        assert await head.closed()
    finally:
        await head.close()


async def over_allocate(head: ScriptedHead) -> None:
    await head.send(alloc((SHARE_MB + 1) * MB))


async def over_allocate_in_two(head: ScriptedHead) -> None:
    await head.buffer(SHARE_MB // 2 * MB)
    await head.send(alloc((SHARE_MB // 2 + 1) * MB))


async def tensor_outside_its_buffer(head: ScriptedHead) -> None:
    handle, base = await head.buffer(4096)
    await head.send(init_tensor(tensor(1, buffer=handle, data=base + 4096 - 16, ne=(16,))))


async def set_out_of_range(head: ScriptedHead) -> None:
    handle, base = await head.buffer(4096)
    # 16 floats, and 4 KiB written "into" them: the rest of the buffer and beyond
    await head.send(set_tensor(tensor(1, buffer=handle, data=base, ne=(16,)), bytes(4096)))


async def get_out_of_range(head: ScriptedHead) -> None:
    handle, base = await head.buffer(4096)
    await head.send(get_tensor(tensor(1, buffer=handle, data=base, ne=(16,)), 0, 1 << 20))


async def copy_out_of_range(head: ScriptedHead) -> None:
    handle, base = await head.buffer(4096)
    src = tensor(1, buffer=handle, data=base, ne=(512,))
    dst = tensor(2, buffer=handle, data=base + 3072, ne=(16,))
    await head.send(copy_tensor(src, dst))


async def forbidden_op(head: ScriptedHead) -> None:
    handle, base = await head.buffer(4096)
    x = tensor(1, buffer=handle, data=base, ne=(4,))
    custom = tensor(2, buffer=handle, data=base + 64, ne=(4,), op=OP["CUSTOM"], src=(1,),
                    op_params=(0x4141, 0x4141))  # where GGML_OP_CUSTOM keeps its function
    await head.send(graph([2], [x, custom]))


async def huge_graph(head: ScriptedHead) -> None:
    await head.buffer(4096)
    await head.send(bytes((10,)) + struct.pack("<Q", 1 << 36))  # 64 GiB "graph" follows


async def wrong_shape(head: ScriptedHead) -> None:
    handle, base = await head.buffer(4096)
    rows = tensor(1, buffer=handle, data=base, ne=(8, 4))
    ids = tensor(2, type_=I32, buffer=handle, data=base + 128, ne=(3,))
    out = tensor(3, buffer=handle, data=base + 256, ne=(4, 3), op=OP["GET_ROWS"], src=(1, 2))
    await head.send(graph([3], [rows, ids, out]))


async def recompute_freed(head: ScriptedHead) -> None:
    await head.buffer(4096)
    await head.send(recompute())


async def garbage(head: ScriptedHead) -> None:
    await head.buffer(4096)
    await head.send(random.Random(34).randbytes(4096))


ATTACKS: dict[str, tuple[Attack, str]] = {
    "over_allocation": (over_allocate, "over_share"),
    "over_allocation_in_two": (over_allocate_in_two, "over_share"),
    "tensor_outside_its_buffer": (tensor_outside_its_buffer, "out_of_bounds"),
    "set_out_of_range": (set_out_of_range, "out_of_bounds"),
    "get_out_of_range": (get_out_of_range, "out_of_bounds"),
    "copy_out_of_range": (copy_out_of_range, "out_of_bounds"),
    "ggml_op_custom": (forbidden_op, "forbidden_op"),
    "huge_graph": (huge_graph, "graph_too_large"),
    "wrong_shape": (wrong_shape, "bad_shape"),
    "recompute_without_graph": (recompute_freed, "no_graph"),
    "garbage": (garbage, ""),
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", list(ATTACKS))
async def test_each_attack_is_refused_and_the_server_serves_the_next_head(
        member: Member, name: str) -> None:
    attack, code = ATTACKS[name]
    pid = member.server.pid
    await attack_through(await member.head(), attack)
    async with asyncio.timeout(10):
        await member.refused.wait()
    [refusal] = member.refusals
    assert refusal.by == "head"
    if code:
        assert refusal.code == code, refusal
    assert member.gate.refused[f"rpc_{refusal.code}"] == 1
    await member.still_serving(pid)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("first", "code"), [
    (command(14, b""), "bad_version"),  # protocol 3's HELLO, without transport caps
    (command(14, b"\x01" + bytes(23)), "transport"),  # an RDMA upgrade past the gate
    (random.Random(7).randbytes(64), ""),
])
async def test_a_head_of_another_protocol_is_refused_at_hello(
        member: Member, first: bytes, code: str) -> None:
    pid = member.server.pid
    head = await member.head()
    try:
        await head.send(first)
        assert await head.closed()
    finally:
        await head.close()
    async with asyncio.timeout(10):
        await member.refused.wait()
    if code:
        assert member.refusals[0].code == code
    await member.still_serving(pid)


@pytest.mark.timeout(90)
async def test_a_refused_head_over_the_relay_is_refused_the_same_way(member: Member) -> None:
    """The relayed route: the head's bytes come through the queen's channels and the gate
    serves them with ``serve_stream``; the same guard refuses them."""
    board = Switchboard()
    head_table, member_table = RelayTable(), RelayTable()
    tasks: set[asyncio.Task[None]] = set()

    def to_member(message: GroupOpen | GroupClose) -> None:
        if isinstance(message, GroupClose):
            member_table.remote_close(message.group, message.channel, message.reason)
            return
        channel = member_table.open(message.group, message.channel, board.sender("member-1"),
                                    side="member")
        tasks.add(asyncio.ensure_future(member.gate.serve_stream(channel, channel, "relay")))

    def to_head(message: GroupClose) -> None:
        head_table.remote_close(message.group, message.channel, message.reason)

    board.attach(HEAD, to_head, head_table.deliver)
    board.attach("member-1", to_member, member_table.deliver)
    dialer = RelayedDialer(GROUP, HEAD, TOKEN, "member-1", head_table, board.sender(HEAD))
    await dialer.start()
    pid = member.server.pid
    try:
        host, port = dialer.endpoint.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        await attack_through(ScriptedHead(reader, writer), over_allocate)
        async with asyncio.timeout(10):
            await member.refused.wait()
        assert member.refusals[0].code == "over_share"
        reader, writer = await asyncio.open_connection(host, int(port))
        honest = ScriptedHead(reader, writer)
        assert await honest_round_trip(honest)  # through the relay, after the attack
        await honest.close()
        assert member.server.pid == pid
        assert member.server.restarts == 0
    finally:
        await dialer.stop()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.timeout(90)
async def test_without_the_guard_a_crashing_command_ends_only_the_servers_child() -> None:
    """The same out-of-bounds tensor, with the gate's guard off: llama.cpp's server aborts
    (``GGML_ASSERT`` in ``deserialize_tensor``); the worker, this process, goes on, and the
    member's supervisor starts the server again."""
    server = MemberServer(n_threads=1)
    await server.start()
    gate = MemberGate(GROUP, HEAD, TOKEN, server.port)  # no guard: raw bytes
    await gate.start()
    try:
        pid = server.pid
        head = await ScriptedHead.connect(gate.address, group=GROUP, head=HEAD, token=TOKEN)
        await attack_through(head, tensor_outside_its_buffer)
        async with asyncio.timeout(30):
            await server.restarted.wait()
        assert server.restarts == 1
        assert server.pid != pid
        honest = await ScriptedHead.connect(gate.address, group=GROUP, head=HEAD, token=TOKEN)
        assert await honest_round_trip(honest)
        await honest.close()
    finally:
        await gate.stop()
        await server.stop()


@pytest.mark.timeout(240)
async def test_after_the_attacks_a_real_head_loads_smollm2_through_the_gate(
        member: Member, one_process_text: str) -> None:
    """llama.cpp's own client, through the guarded gate of a member that was just attacked,
    loads the model (20 of its 30 layers on the member) and answers as one process does."""
    for attack in (over_allocate, forbidden_op, set_out_of_range):
        await attack_through(await member.head(), attack)
    async with asyncio.timeout(10):
        while len(member.refusals) < 3:
            member.refused.clear()
            await member.refused.wait()
    dialer = HeadDialer(GROUP, HEAD, TOKEN, *member.gate.address)
    await dialer.start()
    config = HeadConfig(name="smol", model_path=str(REAL), n_ctx=512, n_layer=30,
                        endpoints=(dialer.endpoint,), cpu_layers=10, device_layers=(20,),
                        n_threads=1, output_on_cpu=True)
    head_process = GroupHead(config)
    try:
        await asyncio.to_thread(head_process.start)
        chunks = await asyncio.to_thread(
            lambda: list(head_process.stream("chat", ASK, threading.Event())))
        assert text_of(chunks) == one_process_text
        assert len(member.refusals) == 3  # the honest head was refused nothing
        assert member.gate.stats().bytes_to_member > 20 * MB // 2  # its layers went through
    finally:
        await asyncio.to_thread(head_process.close)
        await dialer.stop()
