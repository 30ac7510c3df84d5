"""A group's head: a child process that adds the members' RPC servers as devices, loads the
model with the queen's layer counts per device, and generates like any context.

It is a child process because llama.cpp aborts the process on any RPC failure (a member that
went away mid-token): the worker survives it, sees the pipe close, and fails the job over
(``GroupLost``). ``GroupHead`` is the worker's handle; its ``stream`` has ``LlamaContext``'s
shape, so a group serves through the same code as one model.

The pipe carries tuples: parent to child ``("stream", kind, request, continuation)``,
``("cancel",)``, ``("stop",)``; child to parent ``("ready", report)`` once, then per job
``("chunk", dict)``..., ending ``("done", usage)`` or ``("error", kind, message)``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import queue
import re
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnProcess
from pathlib import Path
from typing import Any

from desktop_worker.errors import GroupError, GroupLost, MemberShort, UnsupportedRequest
from desktop_worker.groups.layout import load_layout
from desktop_worker.groups.rpc import quiet_aborts

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0  # uploading a big share of weights over a LAN takes minutes
POLL_S = 0.05  # how often a waiting stream looks at its cancel event


@dataclass(frozen=True, slots=True)
class HeadConfig:
    """What the head loads: ``endpoints`` are the members' servers as the head reaches them
    (its dialers' 127.0.0.1 ports), in the plan's order; ``device_layers`` the blocks per
    device (the members' devices in that order, then the head's own GPUs); ``cpu_layers`` the
    first blocks, on the head's CPU. ``output_on_cpu``: the output matrix stays in the head's
    RAM (a head without a GPU of its own; ``layout``)."""

    name: str
    model_path: str
    n_ctx: int
    n_layer: int
    endpoints: tuple[str, ...]
    cpu_layers: int
    device_layers: tuple[int, ...]
    n_threads: int | None = None
    output_on_cpu: bool = False


@dataclass(frozen=True, slots=True)
class HeadReport:
    """What the head loaded where, from llama.cpp's own log: bytes of weights per buffer
    (``CPU_Mapped``, ``RPC0[127.0.0.1:port]``, ...) and the layer range per device."""

    buffers: dict[str, int] = field(default_factory=dict)
    device_ranges: tuple[tuple[int, int], ...] = ()
    devices: tuple[str, ...] = ()
    load_s: float = 0.0


_BUFFER = re.compile(r"load_tensors:\s+(\S.*?) model buffer size =\s+([\d.]+) MiB")
# llama.cpp's "unable to allocate RPC0[127.0.0.1:port] buffer" (weights) and ggml-alloc's
# "failed to allocate RPC0[...] buffer of size N" (compute buffers): a member that was given
# more than it could hold.
_SHORT = re.compile(r"(?:unable|failed) to allocate RPC\d*\[([^\]\s]+)\] buffer")


class _LoadLog:
    """llama.cpp's log, read while the head loads: the model buffer per device."""

    def __init__(self) -> None:
        self.buffers: dict[str, int] = {}
        self.short: str | None = None  # the endpoint of a server that could not allocate
        self._partial = ""

    def __call__(self, level: int, text: bytes, _user: Any) -> None:
        line = self._partial + text.decode("utf-8", errors="replace")
        if not line.endswith("\n"):
            self._partial = line
            return
        self._partial = ""
        match = _BUFFER.search(line)
        if match:
            self.buffers[match.group(1)] = int(float(match.group(2)) * 1024 * 1024)
        short = _SHORT.search(line)
        if short and self.short is None:
            self.short = short.group(1)
        if level in (3, 4):  # GGML_LOG_LEVEL_WARN, _ERROR (ggml.h of the vendored build)
            log.warning("llama.cpp: %s", line.strip())


def run_head(config: HeadConfig, conn: Connection) -> None:
    """The child process."""
    logging.basicConfig(level=logging.INFO)
    quiet_aborts()
    try:
        context, report, keep = _load(config)
    except Exception as exc:  # the parent gets every reason a load failed, then we exit
        conn.send(("error", type(exc).__name__, str(exc), getattr(exc, "endpoint", None)))
        return
    conn.send(("ready", report))
    jobs: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
    cancel = threading.Event()

    def read() -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                jobs.put(None)
                return
            if message[0] == "cancel":
                cancel.set()
            elif message[0] == "stop":
                jobs.put(None)
                return
            else:
                jobs.put(message)

    threading.Thread(target=read, name="head-pipe", daemon=True).start()
    while (job := jobs.get()) is not None:
        _, kind, request, continuation = job
        cancel.clear()
        try:
            for chunk in context.stream(kind, request, cancel, continuation):
                conn.send(("chunk", chunk))
            conn.send(("done", context.usage()))
        except UnsupportedRequest as exc:
            conn.send(("error", "UnsupportedRequest", str(exc)))
    context.close()
    del keep


def _load(config: HeadConfig) -> tuple[Any, HeadReport, Any]:
    """The loaded context, what went where, and the log callback (which must outlive every
    call llama.cpp makes to it)."""
    import llama_cpp

    from desktop_worker.engine.llama_model import LlamaContext
    from desktop_worker.groups.rpc import LlamaRpc
    from shared_schema.fitting import LoadPlan

    layout = load_layout(config.n_layer, config.cpu_layers, config.device_layers,
                         output_on_cpu=config.output_on_cpu)
    rpc = LlamaRpc()
    names: list[str] = []
    for endpoint in config.endpoints:
        names += [device.name for device in rpc.add_server(endpoint)]
    loader_log = _LoadLog()
    callback = llama_cpp.llama_log_callback(loader_log)
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    started = time.monotonic()
    plan = LoadPlan(n_ctx=config.n_ctx, n_gpu_layers=layout.n_gpu_layers,
                    offloaded_layers=sum(config.device_layers), vram_needed_mb=0,
                    reason="a group's head: layers per device from the queen's plan")
    buft = rpc.cpu_buffer_type() if layout.cpu_tensors else 0
    with tensor_overrides(layout.cpu_tensors, buft) as overrides:
        try:
            context = LlamaContext(config.name, Path(config.model_path), plan,
                                   n_threads=config.n_threads, tensor_split=layout.tensor_split)
        except Exception as exc:
            if loader_log.short is None:
                raise
            raise MemberShort(loader_log.short, f"the RPC server at {loader_log.short} could "
                              f"not allocate the layers it was given: {exc}") from exc
    report = HeadReport(buffers=dict(loader_log.buffers), device_ranges=layout.device_ranges,
                        devices=tuple(names), load_s=time.monotonic() - started)
    for buffer, size in report.buffers.items():
        log.info("group %s: %s holds %.1f MiB of weights", config.name, buffer,
                 size / (1024 * 1024))
    return context, report, (callback, overrides)


class _Override(ctypes.Structure):
    """``struct llama_model_tensor_buft_override`` (llama.h of the vendored build)."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


@contextmanager
def tensor_overrides(patterns: Sequence[str], buft: int) -> Iterator[Any]:
    """While a model loads, put the tensors whose names match ``patterns`` in the buffer type
    ``buft`` (llama.cpp's ``tensor_buft_overrides``); yields what must stay alive as long as
    the model does.

    llama-cpp-python's ``Llama`` has no argument for it (its ``llama_model_params`` declares
    the field, "unused"), so for the load, ``llama_model_default_params`` (which ``Llama``
    calls first) is wrapped to fill it in. Only in a head's own process, one load at a time."""
    if not patterns:
        yield None
        return
    import llama_cpp.llama_cpp as bindings

    table = (_Override * (len(patterns) + 1))()  # NULL-terminated
    for entry, pattern in zip(table, patterns, strict=False):
        entry.pattern = pattern.encode()
        entry.buft = buft
    original = bindings.llama_model_default_params

    def with_overrides() -> Any:
        params = original()
        params.tensor_buft_overrides = ctypes.cast(table, ctypes.c_void_p).value
        return params

    bindings.llama_model_default_params = with_overrides
    try:
        yield table
    finally:
        bindings.llama_model_default_params = original


class GroupHead:
    """The worker's handle on a head process. Blocking, like ``LlamaContext``: its methods
    run in worker threads, one stream at a time."""

    def __init__(self, config: HeadConfig, *, ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        self.config = config
        self.name = config.name
        self.ready_timeout_s = ready_timeout_s
        self.report: HeadReport | None = None
        self._usage: dict[str, int] = {}
        self._context = multiprocessing.get_context("spawn")
        self._conn: Connection | None = None
        self._process: SpawnProcess | None = None
        self.busy = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def alive(self) -> bool:
        """False once the process ended: the pool then drops this context for a new one."""
        return (self._conn is not None and self._process is not None
                and self._process.is_alive())

    def start(self) -> HeadReport:
        """Start the process and wait until the model is loaded (or it failed)."""
        parent, child = self._context.Pipe()
        process = self._context.Process(target=run_head, args=(self.config, child),
                                        name=f"apiary-group-head-{self.name}", daemon=True)
        process.start()
        child.close()
        self._conn, self._process = parent, process
        if not parent.poll(self.ready_timeout_s):
            self.close()
            raise GroupError(f"the group's head did not load {self.name} within "
                             f"{self.ready_timeout_s:.0f} s")
        message = self._receive()
        if message[0] != "ready":
            self.close()
            why = f"the group's head could not load {self.name}: {message[2]}"
            if len(message) > 3 and message[3]:
                raise MemberShort(message[3], why)
            raise GroupError(why)
        self.report = message[1]
        return message[1]

    def _receive(self) -> tuple[Any, ...]:
        assert self._conn is not None
        assert self._process is not None
        try:
            return self._conn.recv()
        except (EOFError, OSError) as exc:
            self._process.join(5)
            raise GroupLost(f"the group's head process ended (exit code "
                            f"{self._process.exitcode}): a member is gone or the head "
                            f"crashed") from exc

    def stream(self, kind: str, request: dict[str, Any], cancel: threading.Event,
               continuation: str | None = None) -> Iterator[dict[str, Any]]:
        """``LlamaContext.stream`` through the head process; raises ``GroupLost`` when the
        process ends mid-answer."""
        if self._conn is None:
            raise GroupError("the group's head is not running")
        conn = self._conn
        self._usage = {}
        try:
            conn.send(("stream", kind, request, continuation))
        except OSError as exc:
            raise GroupLost("the group's head process is gone") from exc
        told = False
        while True:
            if cancel.is_set() and not told:
                conn.send(("cancel",))
                told = True
            if not conn.poll(POLL_S):
                if self._process is not None and not self._process.is_alive():
                    self._receive()  # raises GroupLost, unless a last message is buffered
                continue
            message = self._receive()
            if message[0] == "chunk":
                yield message[1]
            elif message[0] == "done":
                self._usage = message[1]
                return
            else:
                raise UnsupportedRequest(message[2])

    def usage(self) -> dict[str, int]:
        return self._usage

    def score(self, *_args: Any, **_kwargs: Any) -> None:
        raise UnsupportedRequest("a model group does not score answers")

    def embed(self, *_args: Any, **_kwargs: Any) -> None:
        raise UnsupportedRequest("a model group does not embed")

    def close(self) -> None:
        conn, process = self._conn, self._process
        self._conn = None
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.send(("stop",))
            conn.close()
        if process is not None:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(5)
