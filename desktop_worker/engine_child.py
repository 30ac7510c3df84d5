"""An engine child: ``python -m desktop_worker.engine_child`` (the frozen app: ``apiary-worker
--engine-child``), started by ``sandbox/process.py`` with one end of a socket pair in
``APIARY_ENGINE_FD`` (or, on Windows, a one-time address and token to dial back).

It reads the worker's ``start`` message, confines itself (``confine.py``) while it has one
thread and before it imports llama.cpp or reads a model or peer byte, says hello with what
holds, then serves its role until told to stop or its socket closes:

- ``context``: one model: its streams side by side in one batch (``engine.batch``, issue 36),
  ``score`` and ``embed`` between the batch's steps;
- ``head``: a model group's head (issue 19): the members' RPC servers (through the worker's
  dialers on 127.0.0.1) as devices, the model loaded with the queen's layers, then ``stream``;
- ``member``: llama.cpp's RPC server on 127.0.0.1 (reached only through the worker's gate);
- ``probe``: llama.cpp's build and devices, for the hello and the queen's group planning;
- ``train``: one LoRA training run (issue 37, ``engine.training``) on the base model's file,
  in its scratch folder: progress, checkpoints and the adapter, until done or cancelled;
- ``image``: one diffusion model in stable-diffusion.cpp (issue 38, ``engine.diffusion``):
  its ``render`` jobs one at a time, each image encoded as its order says.

A ``cancel`` or a new job may arrive while jobs run, so a reader thread takes the worker's
messages and the main thread runs the jobs and writes every reply.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import sys
import threading
from typing import Any

import orjson

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
    ImageLoaded,
    ListDevices,
    Load,
    Loaded,
    LoadImage,
    Probed,
    Render,
    Rendered,
    Scored,
    ScoreJob,
    Serve,
    Start,
    Stop,
    Stream,
    Train,
    TrainCheckpointed,
    Trained,
    TrainStep,
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

    def send_all(self, frames: list[bytes]) -> None:
        """Several framed messages in one write (a step's events: one system call, not one a
        stream)."""
        if frames:
            self.sock.sendall(b"".join(frames))

    @staticmethod
    def chunk(job: int, data: dict[str, Any]) -> bytes:
        """A chunk's frame without a pydantic round trip: it is the hot path (one per token)."""
        return frame(orjson.dumps({"type": "chunk", "job": job, "data": data}))


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
    if start.role == "train":
        return serve_train(channel, start.policy.scratch or os.getcwd())
    if start.role == "image":
        return serve_image(channel)
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

    adapter = message.adapter
    if adapter is not None and message.head is not None:
        from desktop_worker.errors import UnsupportedRequest

        raise UnsupportedRequest("a model group's head serves no LoRA adapter")
    check_before_load(message.model_path, adapter.path if adapter else None)
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
                           n_threads=message.n_threads, embedding=message.embedding,
                           slots=message.slots, adapter=Path(adapter.path) if adapter else None,
                           adapter_scale=adapter.scale if adapter else 1.0)
    from desktop_worker.engine.devices import gpu_device_names

    return context, Loaded(n_ctx=context.llama.n_ctx(), slots=context.slots,
                           gpu_devices=gpu_device_names()), None


def _failure(exc: BaseException, job: int | None = None) -> Failed:
    from pydantic import ValidationError

    from desktop_worker.errors import (
        GenerationCancelled,
        InvalidModelFile,
        MemberShort,
        ModelLoadError,
        TrainingCancelled,
        TrainingUnsupported,
        UnsupportedRequest,
    )

    message = str(exc)[:4000] or type(exc).__name__
    if isinstance(exc, TrainingCancelled | GenerationCancelled):
        return Failed(job=job, code="cancelled", message=message)
    if isinstance(exc, ValidationError):  # an image order the child's own check refused
        return Failed(job=job, code="unsupported", message=message)
    if isinstance(exc, TrainingUnsupported):
        return Failed(job=job, code="training_unsupported", message=message)
    if isinstance(exc, MemberShort):
        return Failed(job=job, code="member_short", message=message,
                      endpoint=exc.endpoint[:64])
    if isinstance(exc, InvalidModelFile):
        return Failed(job=job, code="invalid_model", message=message)
    if isinstance(exc, UnsupportedRequest):
        return Failed(job=job, code="unsupported", message=message)
    if isinstance(exc, ModelLoadError):
        return Failed(job=job, code="load_failed", message=message)
    return Failed(job=job, code="engine_error",
                  message=f"{type(exc).__name__}: {message}"[:4000])


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
    server = _Server(channel, context)
    threading.Thread(target=server.read, name="engine-ipc", daemon=True).start()
    server.run()
    context.close()
    del keep
    return 0


class _Server:
    """A loaded model's jobs: streams run side by side in its batch engine (issue 36), one
    step at a time; scores and embeddings run between steps (a score waits for an idle batch
    when the engine shares the model's own context). A reader thread takes the worker's
    messages, so a cancel reaches a running score at once."""

    def __init__(self, channel: Channel, context: Any) -> None:
        self.channel = channel
        self.context = context
        self.engine = getattr(context, "engine", None)
        self.shared = getattr(context, "_batch_ctx", None) is None
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.cancels: dict[int, threading.Event] = {}  # running or queued scores
        self.lock = threading.Lock()
        self.deferred: list[Any] = []  # scores waiting for the shared context

    def read(self) -> None:
        while True:
            try:
                message = self.channel.read()
            except (OSError, ValueError):
                message = None
            if message is None or isinstance(message, Stop):
                self.inbox.put(None)
                return
            if message.type == "cancel":
                with self.lock:
                    event = self.cancels.get(message.job)
                if event is not None:
                    event.set()
            elif message.type == "score":
                with self.lock:
                    self.cancels[message.job] = threading.Event()
            self.inbox.put(message)

    @property
    def generating(self) -> bool:
        return self.engine is not None and self.engine.busy

    def run(self) -> None:
        while True:
            if self.deferred and not self.generating:
                self._score(self.deferred.pop(0))
                continue
            messages: list[Any] = []
            try:
                messages.append(self.inbox.get(block=not self.generating))
                while True:
                    messages.append(self.inbox.get_nowait())
            except queue.Empty:
                pass
            for message in messages:
                if message is None:
                    return
                self._handle(message)
            if self.generating:
                try:
                    events = self.context.step()
                except Exception as exc:  # the whole step failed: every job in it does
                    events = self.engine.abort(exc)
                self._send(events)

    def _handle(self, message: Any) -> None:
        job = getattr(message, "job", None)
        try:
            if isinstance(message, Stream):
                self.context.submit(message.job, message.kind, message.request,
                                    message.continuation, message.scope)
            elif message.type == "cancel":
                if self.engine is not None:
                    self._send(self.engine.cancel(message.job))
            elif isinstance(message, ScoreJob):
                if self.shared and self.generating:
                    self.deferred.append(message)
                else:
                    self._score(message)
            elif isinstance(message, Embed):
                vectors, tokens = self.context.embed(message.inputs)
                self.channel.send(Embedded(job=message.job, vectors=vectors, tokens=tokens))
            else:
                raise ValueError(f"a {message.type!r} message is not a job")
        except Exception as exc:
            self.channel.send(_failure(exc, job))

    def _score(self, message: ScoreJob) -> None:
        from desktop_worker.engine.scores import ScoreRequest

        with self.lock:
            cancel = self.cancels.get(message.job) or threading.Event()
        try:
            score = self.context.score(ScoreRequest(message.kind, message.request,
                                                    message.answer), cancel)
            self.channel.send(Scored(job=message.job,
                                     data=score.data() if score is not None else None))
        except Exception as exc:
            self.channel.send(_failure(exc, message.job))
        finally:
            with self.lock:
                self.cancels.pop(message.job, None)

    def _send(self, events: list[Any]) -> None:
        """A step's events, in order, in one write."""
        frames: list[bytes] = []
        for event in events:
            if event.kind == "chunk":
                frames.append(Channel.chunk(event.job, event.data))
            elif event.kind == "done":
                usage = event.data or {}
                frames.append(ChildLink.reply(Done(
                    job=event.job, prompt_tokens=int(usage.get("prompt_tokens", 0)),
                    completion_tokens=int(usage.get("completion_tokens", 0)),
                    total_tokens=int(usage.get("total_tokens", 0)))))
            else:
                frames.append(ChildLink.reply(_failure(event.error, event.job)))
        self.channel.send_all(frames)


# --- train ---------------------------------------------------------------------------------------


def serve_train(channel: Channel, scratch: str) -> int:
    """One training run; a reader thread turns a ``cancel`` (or the worker's going away) into
    the run's cancel event, which the trainer reads between steps."""
    from pathlib import Path

    train = channel.read()
    if not isinstance(train, Train):
        return 0 if train is None or isinstance(train, Stop) else 2
    cancel = threading.Event()

    def read() -> None:
        while True:
            try:
                message = channel.read()
            except (OSError, ValueError):
                message = None
            if message is None or isinstance(message, Stop) or message.type == "cancel":
                cancel.set()
            if message is None or isinstance(message, Stop):
                return

    threading.Thread(target=read, name="train-ipc", daemon=True).start()
    from desktop_worker.engine.llama_model import check_before_load
    from desktop_worker.engine.train_run import LoraTrainer
    from desktop_worker.engine.training import (
        EXAMPLES_NAME,
        TrainProgress,
        TrainSpec,
        read_examples,
    )

    folder = Path(scratch)

    def emit(event: Any) -> None:
        if isinstance(event, TrainProgress):
            channel.send(TrainStep(job=train.job, step=event.step, total_steps=event.total_steps,
                                   epoch=event.epoch, loss=event.loss,
                                   trained_tokens=event.trained_tokens))
        else:
            channel.send(TrainCheckpointed(job=train.job, step=event.step,
                                           trained_tokens=event.trained_tokens, loss=event.loss))

    try:
        check_before_load(train.base_path)
        spec = TrainSpec(
            base_path=Path(train.base_path), examples=read_examples(folder / EXAMPLES_NAME),
            n_epochs=train.n_epochs, batch_size=train.batch_size,
            learning_rate=train.learning_rate, seed=train.seed, rank=train.rank,
            n_ctx=train.n_ctx, progress_every_steps=train.progress_every_steps,
            checkpoint_every_steps=train.checkpoint_every_steps,
            resume_from=Path(train.resume_from) if train.resume_from else None,
            resume_step=train.resume_step)
        result = LoraTrainer(spec, folder, threads=train.n_threads or os.cpu_count() or 1,
                             cancel=cancel, emit=emit, gpu_layers=train.n_gpu_layers).run()
    except Exception as exc:  # every reason the run failed goes to the worker, then we end
        channel.send(_failure(exc, train.job))
        return 1
    channel.send(Trained(job=train.job, steps=result.steps,
                         trained_tokens=result.trained_tokens, loss=result.loss))
    return 0


# --- image ---------------------------------------------------------------------------------------


def serve_image(channel: Channel) -> int:
    """One diffusion model's render jobs, one at a time. A reader thread files each ``render``
    and turns a ``cancel`` into that job's event (read before each image of the order)."""
    import time
    from pathlib import Path

    load = channel.read()
    if not isinstance(load, LoadImage):
        return 0 if load is None or isinstance(load, Stop) else 2
    try:
        from desktop_worker.engine.diffusion import DiffusionModel

        model = DiffusionModel(Path(load.model_path),
                               taesd_path=Path(load.taesd_path) if load.taesd_path else None,
                               n_threads=load.n_threads or os.cpu_count() or 1)
    except Exception as exc:  # every reason a load failed goes to the worker, then we end
        channel.send(_failure(exc))
        return 1
    channel.send(ImageLoaded(family=model.shape.family))
    from shared_schema.images import ImageOrder

    jobs: queue.Queue[Render | None] = queue.Queue()
    events: dict[int, threading.Event] = {}
    lock = threading.Lock()

    def event_of(job: int) -> threading.Event:
        with lock:
            return events.setdefault(job, threading.Event())

    def read() -> None:
        while True:
            try:
                message = channel.read()
            except (OSError, ValueError):
                message = None
            if message is None or isinstance(message, Stop):
                for event in list(events.values()):
                    event.set()
                jobs.put(None)
                return
            if isinstance(message, Render):
                jobs.put(message)
            elif message.type == "cancel":
                event_of(message.job).set()

    threading.Thread(target=read, name="image-ipc", daemon=True).start()
    while (job := jobs.get()) is not None:
        cancelled = event_of(job.job)
        try:
            started = time.perf_counter()
            order = ImageOrder.model_validate(job.order)
            images = model.render(order, cancelled)
            channel.send(Rendered(job=job.job,
                                  images=[image.model_dump(mode="json") for image in images],
                                  render_s=round(time.perf_counter() - started, 3)))
        except Exception as exc:  # the job fails; the model stays loaded for the next
            channel.send(_failure(exc, job.job))
        with lock:
            events.pop(job.job, None)
    model.close()
    return 0


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
