"""A group's head and members over llama.cpp's real RPC backend, on loopback, with the real
SmolLM2: the same greedy text as one process, each member holding the share the plan gave it
(from llama.cpp's own load log), and a member killed mid-answer ending the stream with
``GroupLost`` within seconds while the worker process carries on."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from typing import Any

import pytest

from desktop_worker.errors import GroupLost, MemberShort
from desktop_worker.groups.head import GroupHead, HeadConfig
from desktop_worker.groups.member import MemberServer, free_port, wait_listening
from tests.support.one_process import ASK, REAL, text_of
from tests.support.one_process import one_process_text as reference_text
from tests.support.rpc import needs_rpc

N_LAYER = 30  # SmolLM2-135M's block count

pytestmark = needs_rpc


@pytest.fixture(scope="module")
def one_process_text() -> str:
    return reference_text()


async def start_members(count: int) -> list[MemberServer]:
    members = [MemberServer(n_threads=1) for _ in range(count)]
    await asyncio.gather(*(member.start() for member in members))
    return members


async def stop_all(members: list[MemberServer], head: GroupHead | None = None) -> None:
    if head is not None:
        await asyncio.to_thread(head.close)
    await asyncio.gather(*(member.stop() for member in members))


def config(members: list[MemberServer], cpu_layers: int, device_layers: tuple[int, ...],
           *, output_on_cpu: bool = False) -> HeadConfig:
    return HeadConfig(name="smol", model_path=str(REAL), n_ctx=512, n_layer=N_LAYER,
                      endpoints=tuple(m.endpoint for m in members), cpu_layers=cpu_layers,
                      device_layers=device_layers, n_threads=1, output_on_cpu=output_on_cpu)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("cpu_layers", "device_layers"), [(10, (20,)), (12, (9, 9)),
                                                            (6, (8, 8, 8))])
async def test_a_group_writes_what_one_process_writes(one_process_text, cpu_layers,
                                                      device_layers) -> None:
    members = await start_members(len(device_layers))
    head = GroupHead(config(members, cpu_layers, device_layers))
    try:
        report = await asyncio.to_thread(head.start)
        chunks = await asyncio.to_thread(
            lambda: list(head.stream("chat", ASK, threading.Event())))
    finally:
        await stop_all(members, head)
    assert text_of(chunks) == one_process_text
    assert head.usage()["completion_tokens"] > 0
    # llama.cpp's own log: a model buffer on every member's server, none empty
    remote = {name: size for name, size in report.buffers.items() if name.startswith("RPC")}
    assert len(remote) == len(members), report.buffers
    for member in members:
        assert any(member.endpoint in name for name in remote), (member.endpoint, remote)
    assert all(size > 0 for size in remote.values())
    assert report.device_ranges[0][0] == cpu_layers


@pytest.mark.timeout(180)
async def test_shares_follow_the_plan() -> None:
    """Twice the layers on the second member: about twice its weights (the output layer,
    which the last device also holds, aside)."""
    members = await start_members(2)
    head = GroupHead(config(members, 0, (10, 20)))
    try:
        report = await asyncio.to_thread(head.start)
    finally:
        await stop_all(members, head)
    first, second = (next(size for name, size in report.buffers.items()
                          if member.endpoint in name) for member in members)
    assert report.device_ranges == ((0, 10), (10, 30))
    assert 1.6 < second / first < 3.5, report.buffers


@pytest.mark.timeout(240)
async def test_a_ram_only_head_keeps_the_output_matrix_and_gets_no_logits(
        one_process_text) -> None:
    """With ``output_on_cpu`` the last member holds only its layers (as much as the first, for
    as many layers), the answer is one process's, and what the last member sends back per
    token is the hidden state (576 floats), not the logits (49,152 floats): counted on a
    byte-counting pipe in front of its server."""
    members = await start_members(2)
    taps = [await ByteTap.start(member.port) for member in members]
    sizes: dict[bool, tuple[int, int]] = {}
    back: dict[bool, float] = {}
    try:
        for on_cpu in (False, True):
            head = GroupHead(HeadConfig(
                name="smol", model_path=str(REAL), n_ctx=512, n_layer=N_LAYER,
                endpoints=tuple(tap.endpoint for tap in taps), cpu_layers=10,
                device_layers=(10, 10), n_threads=1, output_on_cpu=on_cpu))
            try:
                report = await asyncio.to_thread(head.start)
                before = taps[1].to_head
                chunks = await asyncio.to_thread(
                    lambda h=head: list(h.stream("chat", ASK, threading.Event())))
                tokens = head.usage()["completion_tokens"]
            finally:
                await asyncio.to_thread(head.close)
            assert text_of(chunks) == one_process_text
            sizes[on_cpu] = tuple(  # type: ignore[assignment]
                next(size for name, size in report.buffers.items() if tap.endpoint in name)
                for tap in taps)
            back[on_cpu] = (taps[1].to_head - before) / tokens
    finally:
        await asyncio.gather(*(tap.stop() for tap in taps), return_exceptions=True)
        await stop_all(members)
    first, last = sizes[True]
    assert abs(last - first) < 0.1 * first, sizes  # no output matrix on the last member
    assert sizes[False][1] - last > 20 * 1024 * 1024, sizes  # SmolLM2's is 28.7 MiB
    assert back[False] > 49_152 * 4  # every token's logits, as float32
    assert back[True] < 16 * 1024, back  # the hidden state and the replies


class ByteTap:
    """A loopback pipe before an RPC server that counts the bytes it sends back."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.to_head = 0
        self.writers: set[asyncio.StreamWriter] = set()
        self.server: asyncio.Server | None = None

    @classmethod
    async def start(cls, target: int) -> ByteTap:
        tap = cls(target)
        tap.server = await asyncio.start_server(tap._serve, "127.0.0.1", 0)
        return tap

    @property
    def endpoint(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        self.writers |= {writer, up_writer}

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter,
                       counted: bool) -> None:
            try:
                while data := await source.read(65536):
                    if counted:
                        self.to_head += len(data)
                    sink.write(data)
                    await sink.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                sink.close()

        await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, True))

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.close()
        await self.server.wait_closed()


def serve_short(endpoint: str, spare_mb: int) -> None:
    """A member's RPC server (the real one) in a process that can take only ``spare_mb`` more
    memory: a member that claimed more than it has."""
    import resource

    from desktop_worker.groups.rpc import quiet_aborts
    from desktop_worker.groups.rpc_backend import LlamaRpc

    quiet_aborts()
    rpc = LlamaRpc()
    devices = rpc.served_devices()  # llama.cpp loaded before the limit
    with open("/proc/self/status") as status:
        vm_kb = next(int(line.split()[1]) for line in status if line.startswith("VmSize"))
    limit = vm_kb * 1024 + spare_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    rpc.serve(endpoint, devices, 1)


@pytest.mark.timeout(180)
async def test_a_member_short_of_memory_is_named_by_its_endpoint() -> None:
    """The member given 25 layers (about 60 MiB) can allocate 24 MiB: llama.cpp's load fails
    with "unable to allocate RPC0[endpoint] buffer", and the head says which server it was, so
    the worker can name that member to the queen (``GroupFailed.member``)."""
    import multiprocessing

    honest = await start_members(1)
    port = free_port()
    short = multiprocessing.get_context("spawn").Process(
        target=serve_short, args=(f"127.0.0.1:{port}", 24), daemon=True)
    short.start()
    try:
        await wait_listening(port, short.is_alive, 60)
        head = GroupHead(HeadConfig(
            name="smol", model_path=str(REAL), n_ctx=512, n_layer=N_LAYER,
            endpoints=(honest[0].endpoint, f"127.0.0.1:{port}"), cpu_layers=1,
            device_layers=(4, 25), n_threads=1, output_on_cpu=True))
        with pytest.raises(MemberShort) as failed:
            await asyncio.to_thread(head.start)
    finally:
        short.kill()
        short.join(10)
        await stop_all(honest)
    assert failed.value.endpoint == f"127.0.0.1:{port}"
    assert "could not allocate" in str(failed.value)


@pytest.mark.timeout(180)
async def test_a_member_killed_mid_answer_ends_the_stream_with_group_lost() -> None:
    members = await start_members(2)
    for member in members:
        member.max_restarts = 0  # this test watches the loss, not the restart
    head = GroupHead(config(members, 10, (10, 10)))
    long_ask = {**ASK, "max_tokens": 400}
    first_chunk = threading.Event()
    seen: list[dict[str, Any]] = []

    def consume() -> None:
        for chunk in head.stream("chat", long_ask, threading.Event()):
            seen.append(chunk)
            first_chunk.set()

    try:
        await asyncio.to_thread(head.start)
        consumer = asyncio.create_task(asyncio.to_thread(consume))
        assert await asyncio.to_thread(first_chunk.wait, 60)
        os.kill(members[1].pid, signal.SIGKILL)
        async with asyncio.timeout(20):
            with pytest.raises(GroupLost):
                await consumer
    finally:
        await stop_all(members, head)
    assert seen  # text was delivered before the loss: the failover replays it


@pytest.mark.timeout(120)
async def test_a_dead_member_server_is_started_again_on_its_port() -> None:
    member = MemberServer(n_threads=1)
    await member.start()
    try:
        first_pid, port = member.pid, member.port
        os.kill(first_pid, signal.SIGKILL)
        async with asyncio.timeout(60):
            await member.restarted.wait()
        assert member.pid != first_pid
        assert member.restarts == 1
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()
        assert member.port == port
        assert member.failed is None
    finally:
        await member.stop()


async def test_the_member_server_listens_on_loopback_only() -> None:
    member = MemberServer(n_threads=1)
    await member.start()
    try:
        listening = listening_addresses(member.pid)
    finally:
        await member.stop()
    assert listening, "the server's socket was not found"
    assert all(host == "127.0.0.1" for host, _ in listening), listening


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """The TCP sockets ``pid`` listens on, from /proc (Linux)."""
    import psutil

    return [(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN]
