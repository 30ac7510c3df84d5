"""The engine protocol's core, without I/O (``shared_schema.engine_ipc`` has its messages).

``FrameDecoder`` cuts a byte stream into length-prefixed frames, each at most ``max_bytes``.
``EngineLink`` is the worker's side of one engine child as a state machine: the worker asks it
for the bytes of each command (``start``, ``load``, ``stream`` ...), feeds it whatever the
socket gave (``receive``), and gets the child's messages back, each checked against what was
asked: once a model is loaded, several jobs may be in flight (the child's batch), and each
reply must answer one of them as its kind allows. A message out of turn or for no job in
flight, a malformed or oversized frame, or another protocol version is an
``EngineProtocolError``: the worker then ends the child, as it would a crashed one.
``ChildLink`` is the child's side: frames in, commands out, replies encoded.

The adapters are ``sandbox/process.py`` (the worker's, blocking, in the pool's threads) and
``engine_child.py`` (the child's).
"""

from __future__ import annotations

import enum
from typing import Any

from desktop_worker.errors import EngineProtocolError
from shared_schema.engine_ipc import (
    ENGINE_IPC_VERSION,
    HEADER_BYTES,
    MAX_FROM_CHILD_BYTES,
    MAX_TO_CHILD_BYTES,
    Cancel,
    Chunk,
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
    Role,
    SandboxPolicy,
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
    decode_from_child,
    decode_to_child,
    encode,
)
from shared_schema.errors import ProtocolError


def frame(payload: bytes) -> bytes:
    """A message's payload with its length prefix."""
    return len(payload).to_bytes(HEADER_BYTES, "big") + payload


class FrameTooLarge(ProtocolError):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__("frame_too_large", f"a frame of {size} bytes, over the {limit} allowed")


class FrameDecoder:
    """Length-prefixed frames out of a stream of bytes. A length past ``max_bytes`` raises
    ``FrameTooLarge`` before any of its body is kept."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._buffer = bytearray()
        self._need: int | None = None  # the body length of the frame being read

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        frames: list[bytes] = []
        while True:
            if self._need is None:
                if len(self._buffer) < HEADER_BYTES:
                    return frames
                size = int.from_bytes(self._buffer[:HEADER_BYTES], "big")
                if size > self.max_bytes:
                    raise FrameTooLarge(size, self.max_bytes)
                del self._buffer[:HEADER_BYTES]
                self._need = size
            if len(self._buffer) < self._need:
                return frames
            frames.append(bytes(self._buffer[:self._need]))
            del self._buffer[:self._need]
            self._need = None


class State(enum.Enum):
    NEW = "new"  # nothing sent yet
    STARTING = "starting"  # start sent, waiting for the hello
    IDLE = "idle"  # confined, nothing loaded (or a probe, or a member serving)
    LOADING = "loading"
    READY = "ready"  # a model loaded: up to ``slots`` jobs in flight
    PROBING = "probing"
    SERVING = "serving"  # a member: its RPC server runs until the child ends
    CLOSED = "closed"


# What each waiting state accepts, and where each message leads (jobs' replies: ``_JOB_REPLIES``).
_REPLIES: dict[State, dict[type, State]] = {
    State.STARTING: {Hello: State.IDLE},
    State.LOADING: {Loaded: State.READY, ImageLoaded: State.READY, Failed: State.CLOSED},
    State.PROBING: {Probed: State.IDLE, Failed: State.IDLE},
}

# A job's kind, and the replies that answer it: (goes on, ends it).
_JOB_REPLIES: dict[str, tuple[tuple[type, ...], tuple[type, ...]]] = {
    "stream": ((Chunk,), (Done, Failed)),
    "score": ((), (Scored, Failed)),
    "embed": ((), (Embedded, Failed)),
    "train": ((TrainStep, TrainCheckpointed), (Trained, Failed)),
    "render": ((), (Rendered, Failed)),
}


class EngineLink:
    """The worker's side of one engine child. Once loaded, it may run up to ``slots`` jobs at
    once (the child's batch, issue 36); each command gets a new job number (``next_job``),
    and every reply must answer a job in flight, in a way its kind allows."""

    def __init__(self, role: Role, *, max_frame_bytes: int = MAX_FROM_CHILD_BYTES) -> None:
        self.role = role
        self.state = State.NEW
        self.hello: Hello | None = None
        self.slots = 1
        self._frames = FrameDecoder(max_frame_bytes)
        self._jobs: dict[int, str] = {}  # in flight: job -> kind
        self._cancelled: set[int] = set()
        self._last_job = 0

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    def next_job(self) -> int:
        self._last_job += 1
        return self._last_job

    # --- commands --------------------------------------------------------------------------

    def _send(self, message: Any, expect: set[State], then: State) -> bytes:
        if self.state not in expect:
            raise EngineProtocolError(f"cannot send {message.type!r} to an engine child that "
                                      f"is {self.state.value}")
        self.state = then
        return frame(encode(message))

    def _job(self, message: Stream | ScoreJob | Embed | Train | Render, kind: str) -> bytes:
        if self.state is not State.READY:
            raise EngineProtocolError(f"cannot send {message.type!r} to an engine child that "
                                      f"is {self.state.value}")
        if message.job in self._jobs or message.job > self._last_job:
            raise EngineProtocolError(f"job {message.job} is not a new job of this link")
        if len(self._jobs) >= self.slots:
            raise EngineProtocolError(f"the engine child runs {self.slots} jobs at once")
        self._jobs[message.job] = kind
        return frame(encode(message))

    def start(self, policy: SandboxPolicy) -> bytes:
        return self._send(Start(version=ENGINE_IPC_VERSION, role=self.role, policy=policy),
                          {State.NEW}, State.STARTING)

    def load(self, message: Load) -> bytes:
        if self.role not in ("context", "head"):
            raise EngineProtocolError(f"a {self.role} child loads no model")
        return self._send(message, {State.IDLE}, State.LOADING)

    def load_image(self, message: LoadImage) -> bytes:
        """An image child's model (issue 38); it renders one order at a time."""
        if self.role != "image":
            raise EngineProtocolError(f"a {self.role} child loads no diffusion model")
        return self._send(message, {State.IDLE}, State.LOADING)

    def render(self, message: Render) -> bytes:
        if self.role != "image":
            raise EngineProtocolError(f"a {self.role} child renders no image")
        return self._job(message, "render")

    def stream(self, message: Stream) -> bytes:
        return self._job(message, "stream")

    def cancel(self, job: int) -> bytes | None:
        """The cancel frame, once per job in flight that can be stopped; None otherwise."""
        if (self._jobs.get(job) not in ("stream", "score", "train", "render")
                or job in self._cancelled):
            return None
        self._cancelled.add(job)
        return frame(encode(Cancel(job=job)))

    def score(self, message: ScoreJob) -> bytes:
        return self._job(message, "score")

    def embed(self, message: Embed) -> bytes:
        return self._job(message, "embed")

    def train(self, message: Train) -> bytes:
        """A train child's one job: it runs in the READY state like a model's jobs."""
        if self.role != "train":
            raise EngineProtocolError(f"a {self.role} child trains nothing")
        if self.state is State.IDLE and not self._jobs:
            self.state = State.READY
        return self._job(message, "train")

    def serve(self, message: Serve) -> bytes:
        if self.role != "member":
            raise EngineProtocolError(f"a {self.role} child serves no RPC server")
        return self._send(message, {State.IDLE}, State.SERVING)

    def devices(self) -> bytes:
        if self.role != "probe":
            raise EngineProtocolError(f"a {self.role} child lists no devices")
        return self._send(ListDevices(), {State.IDLE}, State.PROBING)

    def stop(self) -> bytes:
        self.state = State.CLOSED
        return frame(encode(Stop()))

    # --- the child's messages ---------------------------------------------------------------

    def receive(self, data: bytes) -> list[Any]:
        """The child's messages in ``data`` (and what earlier calls left), each checked against
        the commands in flight."""
        try:
            payloads = self._frames.feed(data)
        except ProtocolError as exc:
            self.state = State.CLOSED
            raise EngineProtocolError(f"the engine sent {exc.message}") from exc
        return [self._accept(payload) for payload in payloads]

    def _broken(self, why: str) -> EngineProtocolError:
        self.state = State.CLOSED
        return EngineProtocolError(f"the engine sent {why}")

    def _accept(self, payload: bytes) -> Any:
        try:
            message = decode_from_child(payload)
        except ProtocolError as exc:
            self.state = State.CLOSED
            raise EngineProtocolError(f"the engine sent {exc.message}") from exc
        if self.state is State.READY:
            return self._job_reply(message)
        allowed = _REPLIES.get(self.state, {})
        then = allowed.get(type(message))
        if then is None or getattr(message, "job", None) is not None:
            raise self._broken(f"{message.type!r} out of turn (while {self.state.value})")
        if isinstance(message, Hello):
            if message.version != ENGINE_IPC_VERSION:
                self.state = State.CLOSED
                raise EngineProtocolError(f"the engine speaks protocol {message.version}, not "
                                          f"{ENGINE_IPC_VERSION}: reinstall the worker")
            self.hello = message
        if isinstance(message, Loaded | ImageLoaded) and (
                (self.role == "image") != isinstance(message, ImageLoaded)):
            raise self._broken(f"{message.type!r} from a {self.role} child")
        if isinstance(message, Loaded):
            self.slots = message.slots
        self.state = then
        return message

    def _job_reply(self, message: Any) -> Any:
        job = getattr(message, "job", None)
        kind = self._jobs.get(job) if isinstance(job, int) else None
        if kind is None:
            raise self._broken(f"{message.type!r} for no job in flight ({job})")
        goes_on, ends = _JOB_REPLIES[kind]
        if isinstance(message, ends):
            del self._jobs[job]
            self._cancelled.discard(job)
        elif not isinstance(message, goes_on):
            raise self._broken(f"{message.type!r} in answer to a {kind} job")
        return message


class ChildLink:
    """The child's side: the worker's commands out of the socket's bytes, replies encoded."""

    def __init__(self) -> None:
        self._frames = FrameDecoder(MAX_TO_CHILD_BYTES)

    def receive(self, data: bytes) -> list[Any]:
        return [decode_to_child(payload) for payload in self._frames.feed(data)]

    @staticmethod
    def reply(message: Any) -> bytes:
        return frame(encode(message))
