"""A group member's RPC server: this worker's devices, served to one head through llama.cpp's
RPC backend, in an engine child the worker supervises (``sandbox/``, role ``member``).

The server is llama.cpp's own (``ggml_backend_rpc_start_server``). It has no authentication
and has had remote-code-execution bugs, so it is bound to **127.0.0.1 only** and reached from
outside through the member's gate (``groups.gate``), which lets in only the head the queen
named. Its child is confined like every engine child (no files but its libraries, no process,
no socket but listening on its one port, never dialling out; its data memory at most its share
plus the runtime's allowance), so a head that breaks in reaches nothing of the volunteer's. It
runs in a child process also because it never returns and a crash in it must not take the
worker down; if it dies while the group lives it is started again on the same port (a few
times, with a pause that doubles), and stopped when the group ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable

from desktop_worker.errors import GroupError, SandboxError
from desktop_worker.groups.gate import LOOPBACK
from desktop_worker.sandbox.policy import policy_for
from desktop_worker.sandbox.process import EngineProcess, describe_exit
from shared_schema.engine_ipc import Serve

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 60.0  # importing llama_cpp in a fresh process, then binding
MAX_RESTARTS = 5
FIRST_PAUSE_S = 0.5


def start_member(endpoint: str, n_threads: int, count: int | None = None, gpus: bool = True,
                 memory_mb: int | None = None) -> EngineProcess:
    """A confined engine child running ``rpc_backend.serve_member`` until stopped; its data
    memory at most ``memory_mb`` (its share) plus the runtime's allowance. Blocking: it waits
    for the child's hello."""
    port = int(endpoint.rpartition(":")[2])
    policy = policy_for("member", memory_mb=memory_mb, bind_ports=[port], gpus=gpus)
    process = EngineProcess("member", policy, label=f"group member {endpoint}")
    try:
        process.start()
        process.send(process.link.serve(Serve(endpoint=endpoint, n_threads=max(1, n_threads),
                                              devices=count, gpus=gpus)))
    except Exception:
        process.close()
        raise
    return process


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


async def wait_listening(port: int, alive: Callable[[], bool], timeout_s: float) -> None:
    """Until something accepts on 127.0.0.1:``port`` (the server answers a closed connection
    by waiting for the next), or the process ends (``alive`` turns false), or ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    pause = 0.02
    while True:
        if not alive():
            raise GroupError(f"the RPC server process ended before listening on "
                             f"{LOOPBACK}:{port}")
        try:
            _, writer = await asyncio.open_connection(LOOPBACK, port)
        except OSError:
            if loop.time() > deadline:
                raise GroupError(f"the RPC server did not listen on {LOOPBACK}:{port} "
                                 f"within {timeout_s:.0f} s") from None
            await asyncio.sleep(pause)  # polling a port that has no event to wait on
            pause = min(pause * 2, 0.5)
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return


class MemberServer:
    """The supervised RPC server of one group membership."""

    def __init__(self, *, n_threads: int = 1, port: int | None = None,
                 max_restarts: int = MAX_RESTARTS, ready_timeout_s: float = READY_TIMEOUT_S,
                 devices: int | None = None, gpus: bool = True,
                 memory_mb: int | None = None) -> None:
        self.n_threads = n_threads
        self.memory_mb = memory_mb  # its share (the queen's grant): the child's data limit
        self.devices = devices  # serve the first this many devices; None: all
        self.gpus = gpus  # its GPUs, else its CPU (``rpc.group_devices``)
        self.port = port or free_port()
        self.max_restarts = max_restarts
        self.ready_timeout_s = ready_timeout_s
        self.restarts = 0
        self.failed: str | None = None  # why it was given up, once it is
        self._process: EngineProcess | None = None
        self._watch: asyncio.Task[None] | None = None
        self._stopping = False
        self.restarted = asyncio.Event()  # set each time a restarted server listens again
        self.gave_up = asyncio.Event()  # set once ``failed`` says why it was given up

    @property
    def endpoint(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    async def start(self) -> None:
        await self._spawn()
        self._watch = asyncio.create_task(self._supervise(), name=f"rpc-member-{self.port}")

    async def _spawn(self) -> None:
        starting = asyncio.ensure_future(asyncio.to_thread(
            start_member, self.endpoint, self.n_threads, self.devices, self.gpus,
            self.memory_mb))
        try:
            process = await asyncio.shield(starting)
        except SandboxError as exc:
            raise GroupError(f"the RPC server could not start: {exc}") from exc
        except asyncio.CancelledError:
            # The group ended while the child started (its thread cannot be stopped): wait
            # for it, then stop it, so no server outlives its group.
            with contextlib.suppress(Exception):
                started = await starting
                await asyncio.to_thread(started.close, timeout_s=0)
            raise
        self._process = process
        try:
            await wait_listening(self.port, lambda: process.alive, self.ready_timeout_s)
        except GroupError:
            await asyncio.to_thread(process.close)
            raise
        log.info("RPC server for a group listening on %s (pid %s)", self.endpoint, process.pid)

    async def _supervise(self) -> None:
        pause = FIRST_PAUSE_S
        while True:
            process = self._process
            assert process is not None
            code = await asyncio.to_thread(process.wait)
            if self._stopping:
                return
            await asyncio.to_thread(process.close)
            if self.restarts >= self.max_restarts:
                self.failed = (f"the RPC server died {self.restarts + 1} times "
                               f"(last: {describe_exit(code)})")
                log.error("group member on %s given up: %s", self.endpoint, self.failed)
                self.gave_up.set()
                return
            self.restarts += 1
            log.warning("the RPC server on %s died (%s); starting it again (%d/%d)",
                        self.endpoint, describe_exit(code), self.restarts, self.max_restarts)
            await asyncio.sleep(pause)  # a pause between restarts, not a wait for an event
            pause *= 2
            try:
                await self._spawn()
                self.restarted.set()
            except GroupError as exc:
                log.warning("restarting the RPC server failed: %s", exc)

    async def stop(self) -> None:
        self._stopping = True
        process = self._process
        if process is not None:
            await asyncio.to_thread(process.close, timeout_s=0)
        if self._watch is not None:
            await self._watch
