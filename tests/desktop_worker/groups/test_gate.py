"""The member's gate and the head's dialer over real sockets on 127.0.0.1 (issue 19): bytes go
through unchanged and are counted, and every head the queen did not name is refused before a
single byte reaches the RPC port."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator

import pytest

from desktop_worker.errors import GroupCredentialsError, GroupLinkError, GroupLinkRefused
from desktop_worker.groups import handshake
from desktop_worker.groups.dialer import HeadDialer
from desktop_worker.groups.gate import LinkStats, MemberGate, set_nodelay
from tests.desktop_worker.groups.gate_fakes import (
    REPLY_PREFIX,
    FakeRpcServer,
    exchange,
    frame,
    read_to_end,
)

TOKEN = b"t" * 32
GROUP = "grp-1"
HEAD = "w_head"


@pytest.fixture
async def gate(rpc: FakeRpcServer) -> AsyncIterator[MemberGate]:
    member_gate = MemberGate(GROUP, HEAD, TOKEN, rpc.port, handshake_timeout_s=2.0)
    await member_gate.start()
    yield member_gate
    await member_gate.stop()


async def started_dialer(gate: MemberGate, **overrides: object) -> HeadDialer:
    arguments: dict[str, object] = {"group": GROUP, "head": HEAD, "token": TOKEN}
    arguments.update(overrides)
    host, port = gate.address
    dialer = HeadDialer(
        arguments["group"], arguments["head"], arguments["token"], host, port,  # type: ignore[arg-type]
        connect_timeout_s=2.0,
    )
    await dialer.start()
    return dialer


async def open_endpoint(dialer: HeadDialer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = dialer.endpoint.rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def raw_connection(
    gate: MemberGate,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    """A plain TCP connection to the gate, and the challenge line it opened with."""
    reader, writer = await asyncio.open_connection(*gate.address)
    async with asyncio.timeout(5):
        challenge = await reader.readline()
    return reader, writer, challenge


# --- through the dialer ------------------------------------------------------------------------


async def test_bytes_round_trip_unchanged_and_are_counted(
    rpc: FakeRpcServer, gate: MemberGate
) -> None:
    dialer = await started_dialer(gate)
    try:
        assert dialer.endpoint.startswith("127.0.0.1:")
        reader, writer = await open_endpoint(dialer)
        payloads = [bytes([i]) * (i * 37 + 1) for i in range(10)]
        for payload in payloads:
            assert await exchange(reader, writer, payload) == REPLY_PREFIX + payload
        sent = sum(4 + len(p) for p in payloads)
        answered = sum(4 + len(REPLY_PREFIX) + len(p) for p in payloads)
        expected = LinkStats(connections=1, bytes_to_member=sent, bytes_to_head=answered,
                             round_trips=10)
        assert gate.stats() == expected
        assert dialer.stats() == expected
        assert bytes(rpc.received) == b"".join(frame(p) for p in payloads)
        writer.close()
        await rpc.wait_closed(1)
        assert gate.stats() == expected  # folded into the totals once closed
        assert dialer.last_error is None
    finally:
        await dialer.stop()


async def test_a_large_message_and_several_connections(
    rpc: FakeRpcServer, gate: MemberGate
) -> None:
    dialer = await started_dialer(gate)
    try:
        big = bytes(range(256)) * 8192  # 2 MiB
        connections = [await open_endpoint(dialer) for _ in range(3)]
        answers = await asyncio.gather(*(exchange(r, w, big) for r, w in connections))
        assert all(answer == REPLY_PREFIX + big for answer in answers)
        assert rpc.accepts == 3
        stats = gate.stats()
        assert stats.connections == 3
        assert stats.round_trips == 3
        assert stats.bytes_to_member == 3 * (4 + len(big))
        for _reader, writer in connections:
            writer.close()
            await writer.wait_closed()
    finally:
        await dialer.stop()


async def test_check_proves_the_path_before_llama_cpp_uses_it(gate: MemberGate) -> None:
    dialer = await started_dialer(gate)
    wrong = await started_dialer(gate, token=b"w" * 32)
    try:
        await dialer.check()
        with pytest.raises(GroupLinkRefused) as refused:
            await wrong.check()
        assert refused.value.reason == "bad_mac"
    finally:
        await dialer.stop()
        await wrong.stop()


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"token": b"w" * 32}, "bad_mac"),
        ({"group": "grp-2"}, "wrong_group"),
        ({"head": "w_member2"}, "wrong_head"),
    ],
)
async def test_a_dialer_the_queen_did_not_name_is_refused(
    rpc: FakeRpcServer, gate: MemberGate, overrides: dict[str, object], reason: str
) -> None:
    dialer = await started_dialer(gate, **overrides)
    try:
        reader, writer = await open_endpoint(dialer)
        writer.write(frame(b"load tensors please"))
        assert await read_to_end(reader) == b""  # llama.cpp's side is closed
        assert dialer.last_error is not None
        assert reason in dialer.last_error
        assert gate.refused[reason] == 1
        assert rpc.accepts == 0
        assert gate.stats() == LinkStats()
        writer.close()
    finally:
        await dialer.stop()


async def test_the_right_token_for_another_group_is_refused(rpc: FakeRpcServer) -> None:
    """Two groups share a member's machine; one group's head cannot reach the other's RPC."""
    other = MemberGate("grp-2", HEAD, b"o" * 32, rpc.port)
    mine = MemberGate(GROUP, HEAD, TOKEN, rpc.port)
    await other.start()
    await mine.start()
    try:
        host, port = other.address
        dialer = HeadDialer(GROUP, HEAD, TOKEN, host, port)
        with pytest.raises(GroupLinkRefused, match="wrong_group"):
            await dialer.check()
        assert rpc.accepts == 0
    finally:
        await other.stop()
        await mine.stop()


async def test_an_unreachable_rpc_server_is_named(rpc: FakeRpcServer) -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    dead_port = probe.getsockname()[1]
    probe.close()
    gate = MemberGate(GROUP, HEAD, TOKEN, dead_port)
    await gate.start()
    try:
        host, port = gate.address
        with pytest.raises(GroupLinkRefused, match="unavailable"):
            await HeadDialer(GROUP, HEAD, TOKEN, host, port).check()
        assert gate.refused["unavailable"] == 1
    finally:
        await gate.stop()


async def test_an_unreachable_gate_is_a_clear_error() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    dead_port = probe.getsockname()[1]
    probe.close()
    dialer = HeadDialer(GROUP, HEAD, TOKEN, "127.0.0.1", dead_port)
    with pytest.raises(GroupLinkError, match="cannot be reached"):
        await dialer.check()


# --- hostile raw connections ---------------------------------------------------------------------


async def test_a_connection_without_the_token_gets_no_and_is_closed(
    rpc: FakeRpcServer, gate: MemberGate
) -> None:
    reader, writer, challenge = await raw_connection(gate)
    assert challenge.startswith(b"APIARY-RPC/1 ")
    guess = {"group": GROUP, "head": HEAD, "mac": "00" * 32}
    writer.write(json.dumps(guess).encode() + b"\n")
    assert await read_to_end(reader) == b"NO bad_mac\n"
    assert rpc.accepts == 0
    assert gate.refused["bad_mac"] == 1
    writer.close()


async def test_rpc_bytes_sent_straight_away_reach_nothing(
    rpc: FakeRpcServer, gate: MemberGate
) -> None:
    """A client that speaks RPC at once (a misconfigured llama.cpp) is refused as a bad line."""
    reader, writer, _challenge = await raw_connection(gate)
    writer.write(frame(b"\x00" * 40) + b"\n")
    assert (await read_to_end(reader)).startswith(b"NO bad_line")
    assert rpc.accepts == 0
    writer.close()


async def test_a_replayed_answer_is_refused(rpc: FakeRpcServer, gate: MemberGate) -> None:
    reader, writer, challenge = await raw_connection(gate)
    answer_line = handshake.answer(TOKEN, GROUP, HEAD, challenge)
    writer.write(answer_line)
    async with asyncio.timeout(5):
        assert await reader.readline() == b"OK\n"
    assert await exchange(reader, writer, b"ping") == REPLY_PREFIX + b"ping"
    writer.close()

    reader2, writer2, challenge2 = await raw_connection(gate)
    assert challenge2 != challenge
    writer2.write(answer_line)
    assert await read_to_end(reader2) == b"NO bad_mac\n"
    assert rpc.accepts == 1  # only the honest connection
    writer2.close()


async def test_bytes_sent_right_after_the_answer_are_piped_not_lost(
    rpc: FakeRpcServer, gate: MemberGate
) -> None:
    reader, writer, challenge = await raw_connection(gate)
    writer.write(handshake.answer(TOKEN, GROUP, HEAD, challenge) + frame(b"eager"))
    async with asyncio.timeout(5):
        assert await reader.readline() == b"OK\n"
        header = await reader.readexactly(4)
        assert await reader.readexactly(int.from_bytes(header, "big")) == REPLY_PREFIX + b"eager"
    writer.close()


async def test_an_over_long_line_is_refused_without_buffering_it(
    rpc: FakeRpcServer, gate: MemberGate
) -> None:
    reader, writer, _challenge = await raw_connection(gate)
    writer.write(b"{" + b"a" * 100_000)
    assert (await read_to_end(reader)).startswith(b"NO bad_line\n")
    assert gate.refused["bad_line"] == 1
    assert rpc.accepts == 0
    writer.close()


@pytest.mark.parametrize(
    "line",
    [b"not json at all\n", b"\x00\xff\x10garbage\n", b"[]\n", b'{"group": "grp-1"}\n'],
)
async def test_garbage_answers_are_refused(
    rpc: FakeRpcServer, gate: MemberGate, line: bytes
) -> None:
    reader, writer, _challenge = await raw_connection(gate)
    writer.write(line)
    assert await read_to_end(reader) == b"NO bad_line\n"
    assert rpc.accepts == 0
    writer.close()


async def test_a_slow_client_times_out(rpc: FakeRpcServer) -> None:
    gate = MemberGate(GROUP, HEAD, TOKEN, rpc.port, handshake_timeout_s=0.3)
    await gate.start()
    try:
        reader, writer, _challenge = await raw_connection(gate)
        writer.write(b'{"group": "grp-1", "he')  # ... and nothing more
        assert await read_to_end(reader) == b"NO timeout\n"
        assert gate.refused["timeout"] == 1
        assert rpc.accepts == 0
        writer.close()
    finally:
        await gate.stop()


async def test_handshakes_past_the_limit_are_busy(rpc: FakeRpcServer) -> None:
    gate = MemberGate(GROUP, HEAD, TOKEN, rpc.port, max_pending=1)
    await gate.start()
    try:
        _r1, first, _c1 = await raw_connection(gate)  # holds the only handshake slot
        reader, second = await asyncio.open_connection(*gate.address)
        assert await read_to_end(reader) == b"NO busy\n"
        assert gate.refused["busy"] == 1
        first.close()
        second.close()
    finally:
        await gate.stop()


async def test_a_client_that_leaves_is_counted_as_closed(gate: MemberGate) -> None:
    _reader, writer, _challenge = await raw_connection(gate)
    handlers = list(gate._tasks)  # the gate's handler for this connection, waiting for a line
    assert len(handlers) == 1
    writer.close()
    async with asyncio.timeout(5):
        await asyncio.gather(*handlers)
    assert gate.refused["closed"] == 1


# --- where it listens, and stopping ------------------------------------------------------------


async def test_the_gate_listens_on_loopback_unless_told_otherwise(rpc: FakeRpcServer) -> None:
    gate = MemberGate(GROUP, HEAD, TOKEN, rpc.port)
    await gate.start()
    try:
        host, port = gate.address
        assert host == "127.0.0.1"
        assert port > 0
        assert gate._server is not None
        assert [s.getsockname()[0] for s in gate._server.sockets] == ["127.0.0.1"]
    finally:
        await gate.stop()


async def test_passing_a_host_is_what_changes_it(rpc: FakeRpcServer) -> None:
    try:
        probe = socket.socket()
        probe.bind(("127.0.0.2", 0))
        probe.close()
    except OSError:
        pytest.skip("127.0.0.2 cannot be bound here")
    gate = MemberGate(GROUP, HEAD, TOKEN, rpc.port, host="127.0.0.2")
    await gate.start()
    try:
        host, port = gate.address
        assert host == "127.0.0.2"
        await HeadDialer(GROUP, HEAD, TOKEN, host, port).check()
    finally:
        await gate.stop()


async def test_stop_closes_live_piped_connections_on_both_sides(
    rpc: FakeRpcServer, gate: MemberGate
) -> None:
    dialer = await started_dialer(gate)
    try:
        reader, writer = await open_endpoint(dialer)
        assert await exchange(reader, writer, b"hello") == REPLY_PREFIX + b"hello"
        gate_address = gate.address
        await gate.stop()
        assert await read_to_end(reader) == b""  # the head side sees EOF
        await rpc.wait_closed(1)  # and so does the RPC server
        with pytest.raises(RuntimeError, match="not started"):
            _ = gate.address
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection(*gate_address)
        writer.close()
    finally:
        await dialer.stop()


async def test_dialer_stop_closes_both_ends(rpc: FakeRpcServer, gate: MemberGate) -> None:
    dialer = await started_dialer(gate)
    reader, writer = await open_endpoint(dialer)
    assert await exchange(reader, writer, b"hello") == REPLY_PREFIX + b"hello"
    await dialer.stop()
    assert await read_to_end(reader) == b""
    await rpc.wait_closed(1)
    writer.close()


# --- construction ------------------------------------------------------------------------------


def test_a_short_token_is_refused_when_the_gate_or_dialer_is_made() -> None:
    with pytest.raises(GroupCredentialsError, match="32 bytes"):
        MemberGate(GROUP, HEAD, b"short", 1)
    with pytest.raises(GroupCredentialsError, match="32 bytes"):
        HeadDialer(GROUP, HEAD, b"short", "127.0.0.1", 1)
    with pytest.raises(GroupCredentialsError, match="name"):
        HeadDialer("a|b", HEAD, TOKEN, "127.0.0.1", 1)


def test_set_nodelay_turns_it_on() -> None:
    class Writer:
        def __init__(self, sock: socket.socket) -> None:
            self.sock = sock

        def get_extra_info(self, name: str) -> object:
            return self.sock if name == "socket" else None

    with socket.socket() as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)
        set_nodelay(Writer(sock))
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    set_nodelay(object())  # a relay's writer without a socket is left alone


async def test_stopping_with_live_connections_logs_no_error(
    rpc: FakeRpcServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Cancelled handlers must end quietly (Python 3.11's stream callback would log them)."""
    gate = MemberGate(GROUP, HEAD, TOKEN, rpc.port)
    await gate.start()
    dialer = await started_dialer(gate)
    reader, writer = await open_endpoint(dialer)
    assert await exchange(reader, writer, b"hello") == REPLY_PREFIX + b"hello"
    _r, waiting, _challenge = await raw_connection(gate)  # one still in its handshake
    with caplog.at_level(logging.ERROR):
        await dialer.stop()
        await gate.stop()
        for _ in range(5):  # let the done-callbacks asyncio scheduled run
            await asyncio.sleep(0)
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    for stream in (writer, waiting):
        stream.close()
        await stream.wait_closed()
