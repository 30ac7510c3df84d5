"""An engine child: ``python -m desktop_worker.engine_child`` (the frozen app: ``apiary-worker
--engine-child``), started by ``sandbox/process.py`` with one end of a socket pair in
``APIARY_ENGINE_FD`` (or, on Windows, a one-time address and token to dial back).

It reads the worker's ``start`` message, confines itself (``confine.py``) while it has one
thread and before it imports llama.cpp or reads a model or peer byte, says hello with what
holds, then serves its role until told to stop or its socket closes:

- ``context``: one llama.cpp context of one model: ``stream``, ``score`` and ``embed``;
- ``head``: a model group's head (issue 19): the members' RPC servers (through the worker's
  dialers on 127.0.0.1) as devices, the model loaded with the queen's layers, then ``stream``;
- ``member``: llama.cpp's RPC server on 127.0.0.1 (reached only through the worker's gate);
- ``probe``: llama.cpp's build and devices, for the hello and the queen's group planning.

A ``cancel`` may arrive while a job runs, so a reader thread takes the worker's messages and
the main thread runs the jobs and writes every reply.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import sys
import threading
from typing import Any

from desktop_worker.sandbox.confine import confine
from desktop_worker.sandbox.ipc import ChildLink, frame
from desktop_worker.sandbox.process import (
    ADDRESS_VARIABLE,
    FD_VARIABLE,
    TOKEN_VARIABLE,
)
from shared_schema.engine_ipc import (
    ENGINE_IPC_VERSION,
    DeviceInfo,
    Done,
    Embed,
    Embedded,
    Failed,
    Hello,
    ListDevices,
    Load,
    Loaded,
    Probed,
    Scored,
    ScoreJob,
    Serve,
    Start,
    Stop,
    Stream,
)

log = logging.getLogger("desktop_worker.engine.child")

READ_BYTES = 1 << 20


class Channel:
    """The child's socket: whole messages in (``ChildLink``), replies out."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.link = ChildLink()
        self._pending: list[Any] = []

    def read(self) -> Any | None:
        """The next message from the worker; None once the socket closed."""
        while not self._pending:
            data = self.sock.recv(READ_BYTES)
            if not data:
                return None
            self._pending.extend(self.link.receive(data))
        return self._pending.pop(0)

    def send(self, message: Any) -> None:
        self.sock.sendall(ChildLink.reply(message))

    def send_chunk(self, data: dict[str, Any]) -> None:
        """A chunk without a pydantic round trip: it is the hot path (one per token)."""
        import orjson

        self.sock.sendall(frame(orjson.dumps({"type": "chunk", "data": data})))


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")  # an abort says why, without gdb
    sock = _connect()
    if sock is None:
        print("the engine child is started by the worker, not by hand", file=sys.stderr)  # noqa: T201
        return 2
    channel = Channel(sock)
    start = channel.read()
    if not isinstance(start, Start) or start.version != ENGINE_IPC_VERSION:
        return 2
    confinement = confine(start.policy, start.role)
    channel.send(Hello(version=ENGINE_IPC_VERSION, pid=os.getpid(), confinement=confinement))
    if start.role == "member":
        return serve_member(channel)
    if start.role == "probe":
        return serve_probe(channel)
    return serve_engine(channel, start.role)


def _connect() -> socket.socket | None:
    """The socket to the worker: the inherited end of a socket pair, or (the "tcp" transport)
    a connection to the worker's one-time listener, proven with its one-time token."""
    fd = os.environ.pop(FD_VARIABLE, None)
    address = os.environ.pop(ADDRESS_VARIABLE, None)
    token = os.environ.pop(TOKEN_VARIABLE, None)
    try:
        if fd is not None:
            return socket.socket(fileno=int(fd))
        if address is not None and token is not None:
            host, _, port = address.rpartition(":")
            sock = socket.create_connection((host, int(port)), timeout=30)
            sock.sendall(bytes.fromhex(token))
            sock.settimeout(None)
            return sock
    except (OSError, ValueError):
        return None
    return None


# --- context and head ----------------------------------------------------------------------------


def _load(message: Load) -> tuple[Any, Loaded, Any]:
    """The loaded context, the reply, and what must stay alive as long as it does."""
    from desktop_worker.engine.llama_model import LlamaContext, check_before_load
    from shared_schema.fitting import LoadPlan

    check_before_load(message.model_path)
    if message.head is not None:
        from desktop_worker.groups.head import HeadConfig
        from desktop_worker.groups.head_load import load_head

        head = message.head
        context, report, keep = load_head(HeadConfig(
            name=message.name, model_path=message.model_path, n_ctx=message.n_ctx,
            n_layer=head.n_layer, endpoints=tuple(head.endpoints), cpu_layers=head.cpu_layers,
            device_layers=tuple(head.device_layers), n_threads=message.n_threads,
            output_on_cpu=head.output_on_cpu))
        return context, Loaded(n_ctx=message.n_ctx, head=report.wire()), keep
    plan = LoadPlan(n_ctx=message.n_ctx, n_gpu_layers=message.n_gpu_layers,
                    offloaded_layers=max(0, message.n_gpu_layers), vram_needed_mb=0,
                    reason="the worker's plan")
    from pathlib import Path

    context = LlamaContext(message.name, Path(message.model_path), plan,
                           n_threads=message.n_threads, embedding=message.embedding)
    return context, Loaded(n_ctx=context.llama.n_ctx()), None


def _failure(exc: BaseException) -> Failed:
    from desktop_worker.errors import (
        InvalidModelFile,
        MemberShort,
        ModelLoadError,
        UnsupportedRequest,
    )

    message = str(exc)[:4000] or type(exc).__name__
    if isinstance(exc, MemberShort):
        return Failed(code="member_short", message=message, endpoint=exc.endpoint[:64])
    if isinstance(exc, InvalidModelFile):
        return Failed(code="invalid_model", message=message)
    if isinstance(exc, UnsupportedRequest):
        return Failed(code="unsupported", message=message)
    if isinstance(exc, ModelLoadError):
        return Failed(code="load_failed", message=message)
    return Failed(code="engine_error", message=f"{type(exc).__name__}: {message}")


def serve_engine(channel: Channel, role: str) -> int:
    load = channel.read()
    if not isinstance(load, Load):
        return 2
    try:
        context, loaded, keep = _load(load)
    except Exception as exc:  # every reason a load failed goes to the worker, then we end
        channel.send(_failure(exc))
        return 1
    channel.send(loaded)
    jobs: queue.Queue[Any] = queue.Queue()
    cancel = threading.Event()

    def read() -> None:
        while True:
            try:
                message = channel.read()
            except (OSError, ValueError):
                message = None
            if message is None or isinstance(message, Stop):
                jobs.put(None)
                return
            if message.type == "cancel":
                cancel.set()
            else:
                jobs.put(message)

    threading.Thread(target=read, name="engine-ipc", daemon=True).start()
    while (job := jobs.get()) is not None:
        cancel.clear()
        try:
            _run(channel, context, job, cancel)
        except Exception as exc:
            channel.send(_failure(exc))
    context.close()
    del keep
    return 0


def _run(channel: Channel, context: Any, job: Any, cancel: threading.Event) -> None:
    if isinstance(job, Stream):
        for chunk in context.stream(job.kind, job.request, cancel, job.continuation):
            channel.send_chunk(chunk)
        usage = context.usage()
        channel.send(Done(prompt_tokens=int(usage.get("prompt_tokens", 0)),
                          completion_tokens=int(usage.get("completion_tokens", 0)),
                          total_tokens=int(usage.get("total_tokens", 0))))
    elif isinstance(job, ScoreJob):
        from desktop_worker.engine.scores import ScoreRequest

        score = context.score(ScoreRequest(job.kind, job.request, job.answer), cancel)
        channel.send(Scored(data=score.data() if score is not None else None))
    elif isinstance(job, Embed):
        vectors, tokens = context.embed(job.inputs)
        channel.send(Embedded(vectors=vectors, tokens=tokens))
    else:
        raise ValueError(f"a {job.type!r} message is not a job")


# --- member and probe ----------------------------------------------------------------------------


def serve_member(channel: Channel) -> int:
    serve = channel.read()
    if not isinstance(serve, Serve):
        return 2
    from desktop_worker.groups.rpc_backend import serve_member as run_server

    run_server(serve.endpoint, serve.n_threads, serve.devices, serve.gpus)  # never returns
    return 1


def serve_probe(channel: Channel) -> int:
    from desktop_worker.groups.rpc_backend import LlamaRpc

    rpc = LlamaRpc()
    while (message := channel.read()) is not None:
        if not isinstance(message, ListDevices):
            return 0 if isinstance(message, Stop) else 2
        probe = rpc.probe()
        devices: list[DeviceInfo] = []
        if probe.available:
            try:
                devices = [DeviceInfo(name=d.name[:128], description=d.description[:256],
                                      type=int(d.type), free_bytes=d.free_bytes,
                                      total_bytes=d.total_bytes) for d in rpc.devices()][:64]
            except Exception as exc:  # a device type this ggml adds, a driver error
                channel.send(Failed(code="engine_error", message=str(exc)[:4000]))
                continue
        channel.send(Probed(available=probe.available, build=probe.build,
                            reason=probe.reason[:4000], devices=devices))
    return 0


if __name__ == "__main__":
    sys.exit(main())
