"""A llama.cpp context in a sandboxed engine child, behind ``LlamaContext``'s own interface
(``stream``, ``usage``, ``score``, ``embed``, ``busy``, ``alive``, ``close``), so the pool and a
group's head serve through it unchanged.

``SandboxedContexts`` is the pool's context factory: each context (and each group head) is one
child, confined by ``policy.policy_for`` to its model's files and its share of memory. When a
child ends mid-job, the job raises ``EngineCrashed`` (retryable: the queen fails the answer
over), ``alive`` turns false, the pool drops the context and the next job gets a new child;
``on_crash`` listeners hear what happened in plain words (the app tells its owner).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from desktop_worker.engine.adapters import check_adapter_file
from desktop_worker.engine.scores import Score, ScoreRequest
from desktop_worker.errors import (
    EngineCrashed,
    MemberShort,
    ModelLoadError,
    UnsupportedRequest,
)
from desktop_worker.sandbox.policy import policy_for
from desktop_worker.sandbox.process import EngineProcess
from shared_schema.engine_ipc import (
    Chunk,
    Done,
    Embed,
    Embedded,
    Failed,
    HeadLoaded,
    Load,
    LoadAdapter,
    Loaded,
    Scored,
    ScoreJob,
    Stream,
)
from shared_schema.fitting import LoadPlan, memory_cost_mb

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often a waiting job looks at its cancel event

CrashListener = Callable[[str, str], None]  # (the model's name, what happened)


def raise_failure(failed: Failed, *, loading: str | None = None) -> None:
    """A child's ``error`` reply as the worker's own error; ``loading``: the model's name,
    when the reply answers its load."""
    if failed.code == "member_short" and failed.endpoint:
        raise MemberShort(failed.endpoint, failed.message)
    if failed.code == "unsupported":
        raise UnsupportedRequest(failed.message)
    if failed.code == "invalid_model":
        raise ModelLoadError(f"the model file of {loading or 'this model'} was refused before "
                             f"llama.cpp opened it: {failed.message}")
    if loading is not None or failed.code == "load_failed":
        raise ModelLoadError(f"llama.cpp could not load {loading or 'the model'}: "
                             f"{failed.message}")
    raise EngineCrashed(failed.message, reason=failed.message)


class SandboxedContext:
    """One model (or one group head) loaded in its own engine child, running up to ``slots``
    jobs at once (the child's batch, issue 36): each job's thread sends its command and waits
    on its own queue; one reader thread takes the child's replies and hands each to its job."""

    def __init__(self, name: str, process: EngineProcess, load: Load, *,
                 ready_timeout_s: float | None = None,
                 on_crash: Sequence[CrashListener] = ()) -> None:
        self.name = name
        self.embedding = load.embedding
        self.process = process
        self.on_crash = list(on_crash)
        self._crashed: EngineCrashed | None = None
        self._jobs: dict[int, queue.SimpleQueue[Any]] = {}
        self._lock = threading.Lock()  # job numbers, the job table and commands' order
        self._local = threading.local()  # each job thread's last usage
        self._last_usage: dict[str, int] = {}
        self._closing = False
        self.head_report: HeadLoaded | None = None
        process.start()
        try:
            process.send(process.link.load(load))
            reply = process.wait_for(ready_timeout_s)
        except EngineCrashed as exc:
            process.close()
            raise ModelLoadError(f"llama.cpp could not load {name}: {exc.reason}") from exc
        if reply is None:
            process.close()
            raise ModelLoadError(f"the engine did not load {name} within "
                                 f"{ready_timeout_s:.0f} s")
        if isinstance(reply, Failed):
            process.close()
            raise_failure(reply, loading=name)
        assert isinstance(reply, Loaded)
        self.n_ctx = reply.n_ctx
        self.slots = reply.slots
        self.head_report = reply.head
        self.gpu_devices = reply.gpu_devices
        if load.n_gpu_layers != 0 and reply.gpu_devices == []:
            log.warning("the engine found no GPU for %s (its GPU driver did not start: see the "
                        "engine's lines above), so all of it runs on the CPU, slower than "
                        "planned", name)
        self.busy = threading.BoundedSemaphore(self.slots)  # the pool's share of the slots
        self._reader = threading.Thread(target=self._read, name=f"engine-replies {name}",
                                        daemon=True)
        self._reader.start()

    @property
    def jobs_at_once(self) -> int:
        """The permits ``busy`` holds: the pool waits for all of them before closing it."""
        return self.slots

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def alive(self) -> bool:
        """False once the child ended: the pool then drops this context for a new one."""
        return self._crashed is None and self.process.alive

    # --- the replies ----------------------------------------------------------------------

    def _read(self) -> None:
        """Every reply to its job's queue, until the child ends (then every job hears it)."""
        while True:
            try:
                reply = self.process.wait_for(None)
            except (EngineCrashed, OSError, ValueError) as exc:  # ValueError: a closed socket
                self._ended(exc)
                return
            job = getattr(reply, "job", None)
            with self._lock:
                waiting = self._jobs.get(job) if job is not None else None
            if waiting is not None:
                waiting.put(reply)

    def _ended(self, exc: Exception) -> None:
        """The child's socket ended: closed by the worker, or the child is gone."""
        if self._closing:
            closed = EngineCrashed("the engine was closed", reason="it was closed")
            with self._lock:
                waiting = list(self._jobs.values())
            for replies in waiting:
                replies.put(closed)
            return
        self._lost(exc if isinstance(exc, EngineCrashed) else self.process.crashed(str(exc)))

    def _lost(self, exc: EngineCrashed) -> None:
        with self._lock:
            if self._crashed is not None:
                return
            self._crashed = exc
            waiting = list(self._jobs.values())
        for replies in waiting:
            replies.put(exc)
        log.error("the engine for %s ended: %s", self.name, exc.reason)
        for listener in list(self.on_crash):
            try:
                listener(self.name, exc.reason)
            except Exception:  # a broken listener must not hide the crash
                log.exception("an engine crash listener failed")

    def _begin(self, command: Callable[[int], bytes]) -> tuple[int, queue.SimpleQueue[Any]]:
        """A new job: its number, its queue, and its command sent."""
        replies: queue.SimpleQueue[Any] = queue.SimpleQueue()
        with self._lock:
            if self._crashed is not None:
                raise self._crashed
            job = self.process.link.next_job()
            self._jobs[job] = replies
            data = command(job)
        try:
            self.process.send(data)
        except EngineCrashed as exc:
            self._end(job)
            self._lost(exc)
            raise
        return job, replies

    def _end(self, job: int) -> None:
        with self._lock:
            self._jobs.pop(job, None)

    def _next(self, job: int, replies: queue.SimpleQueue[Any],
              cancel: threading.Event | None) -> Any:
        """The job's next reply, telling the child to stop it when ``cancel`` is set."""
        while True:
            if cancel is not None and cancel.is_set():
                with self._lock:
                    stop = self.process.link.cancel(job)
                if stop is not None:
                    try:
                        self.process.send(stop)
                    except EngineCrashed as exc:
                        self._lost(exc)
            try:
                reply = replies.get(timeout=POLL_S if cancel is not None else None)
            except queue.Empty:
                continue
            if isinstance(reply, EngineCrashed):
                raise reply
            return reply

    def _broke(self, what: str) -> EngineCrashed:
        """A reply that passed the protocol's checks but not this command's: the child is
        stopped, as if it had crashed."""
        self.process.kill()
        crash = EngineCrashed(f"the engine sent {what}", reason=f"it sent {what}")
        self._lost(crash)
        return crash

    # --- the jobs -------------------------------------------------------------------------

    def stream(self, kind: str, request: dict[str, Any], cancel: threading.Event,
               continuation: str | None = None,
               scope: str | None = None) -> Iterator[dict[str, Any]]:
        """``LlamaContext.stream`` in the child: chat.completion.chunk dicts as they come;
        ``usage()`` in the same thread then gives the job's counts."""
        self._local.usage = {}
        job, replies = self._begin(lambda job: self.process.link.stream(Stream(
            job=job, kind="chat" if kind == "chat" else "completion", request=request,
            continuation=continuation, scope=scope)))
        try:
            while True:
                reply = self._next(job, replies, cancel)
                if isinstance(reply, Chunk):
                    yield reply.data
                elif isinstance(reply, Done):
                    self._local.usage = self._last_usage = reply.usage()
                    return
                else:
                    raise_failure(reply)
        finally:
            self._end(job)

    def usage(self) -> dict[str, int]:
        """The usage of this thread's last stream (a thread that ran none: the last stream's
        to end, which is the only one where jobs run one at a time)."""
        usage = getattr(self._local, "usage", None)
        return usage if usage is not None else self._last_usage

    def score(self, job: ScoreRequest, cancel: threading.Event) -> Score | None:
        if job.kind not in ("chat", "completions"):
            raise UnsupportedRequest(f"a score job's kind is {job.kind!r}")
        number, replies = self._begin(lambda number: self.process.link.score(ScoreJob(
            job=number, kind=job.kind, request=job.request,  # type: ignore[arg-type]
            answer=job.answer)))
        try:
            reply = self._next(number, replies, cancel)
        finally:
            self._end(number)
        if isinstance(reply, Failed):
            raise_failure(reply)
        assert isinstance(reply, Scored)
        if reply.data is None:
            return None
        try:
            return Score.from_data(reply.data)
        except ValueError as exc:
            raise self._broke(str(exc)) from exc

    def embed(self, inputs: list[str] | list[list[int]]) -> tuple[list[list[float]], int]:
        if not self.embedding:
            raise UnsupportedRequest("this context was not loaded for embeddings")
        job, replies = self._begin(lambda job: self.process.link.embed(
            Embed(job=job, inputs=inputs)))
        try:
            reply = self._next(job, replies, None)
        finally:
            self._end(job)
        if isinstance(reply, Failed):
            raise_failure(reply)
        assert isinstance(reply, Embedded)
        if len(reply.vectors) != len(inputs):
            raise self._broke(f"{len(reply.vectors)} vectors for {len(inputs)} inputs")
        return reply.vectors, reply.tokens

    def close(self) -> None:
        self._closing = True
        self.process.close()


@dataclass
class SandboxedContexts:
    """The pool's context factory: every context in its own confined engine child.
    ``extra_read``: more paths a child may read (tests); ``memory_limits``: a child's data
    memory limited to its model's cost plus the runtime's allowance (``policy``)."""

    memory_limits: bool = True
    extra_read: tuple[str, ...] = ()
    load_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        self.on_crash: list[CrashListener] = []
        self._told: set[str] = set()  # what the sandbox lacks, logged once per worker run

    def _tell(self, context: SandboxedContext) -> None:
        confinement = context.process.confinement
        if confinement is None:
            return
        if "confinement" not in self._told:
            self._told.add("confinement")
            log.info("engine children are confined: seccomp %s, Landlock ABI %s (files %s, "
                     "TCP ports %s, signals %s), data memory limit %s MB, GPU devices %d",
                     confinement.seccomp, confinement.landlock_abi, confinement.filesystem,
                     confinement.tcp_ports, confinement.signals, confinement.memory_limit_mb,
                     len(context.process.policy.device_paths))
        for note in confinement.notes:
            if note not in self._told:
                self._told.add(note)
                log.warning("the engine's sandbox is incomplete here: %s", note)

    batched = True  # its contexts serve ``slots`` sequences in one batch (``ModelPool``)

    def __call__(self, model: Any, plan: LoadPlan, n_threads: int | None,
                 embedding: bool, slots: int = 1) -> SandboxedContext:
        files = [str(path) for path in getattr(model, "paths", None) or (model.path,)]
        adapter = getattr(model, "adapter", None)  # a fine-tuned model (``pool.AdaptedModel``)
        if adapter is not None:  # refused here, before a child starts (and again in it)
            check_adapter_file(Path(adapter.path), Path(model.path))
        slots = 1 if embedding else slots
        cost = memory_cost_mb(model.info, model.size_bytes, plan.n_ctx,
                              slots + 1 if slots > 1 else 1)
        policy = policy_for("context", model_files=files,
                            memory_mb=cost if self.memory_limits else None,
                            extra_read=self.extra_read, gpus=plan.n_gpu_layers != 0,
                            adapter_files=[str(adapter.path)] if adapter else ())
        process = EngineProcess("context", policy, label=f"engine {model.name}")
        load = Load(name=model.name, model_path=str(model.path), n_ctx=plan.n_ctx,
                    n_gpu_layers=plan.n_gpu_layers, n_threads=n_threads, embedding=embedding,
                    slots=slots, adapter=LoadAdapter(path=str(adapter.path), scale=adapter.scale)
                    if adapter else None)
        context = SandboxedContext(model.name, process, load,
                                   ready_timeout_s=self.load_timeout_s, on_crash=self.on_crash)
        self._tell(context)
        return context

