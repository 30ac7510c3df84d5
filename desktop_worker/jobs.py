"""Running the queen's jobs on the engine: chat and text completions (streamed or whole),
embeddings, re-scoring audits (``score`` jobs, see ``engine.scoring``) and, when the owner
opted in, training jobs (``TRAIN_URL``, see ``training_jobs``; refused as ``unsupported``
otherwise).

A chat, completions or score job with ``Job.adapter`` runs on a fine-tuned model (issue 37):
``adapter_problem`` (pure) refuses what does not add up (its request's model is not the
adapter's ``ft:`` name, a kind that takes no adapter, a base not held, a base served through
a model group's head), then ``FineTunedModels.serve`` makes the adapter local and registers
the name with the pool for the job's length, and the job runs under its ``ft:`` name.

``JobRunner`` is widget-free and socket-free: it reports through a ``JobSink`` (the link) and
through ``on_started`` / ``on_finished`` callbacks (the CLI's log line, the app's jobs table).
The answers it sends are shaped by ``shared_schema.answers``, as the queen reads them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from desktop_worker.adapter_cache import FineTunedModels
from desktop_worker.engine.pool import ModelPool
from desktop_worker.engine.scores import read_score_request
from desktop_worker.errors import (
    AdapterFailed,
    EngineError,
    GenerationCancelled,
    InvalidAdapter,
    ModelStoreError,
    TrainingCancelled,
    TrainJobFailed,
    UnsupportedRequest,
    WorkerError,
)
from desktop_worker.image_jobs import ImageJobs, ImageModelMissing
from desktop_worker.training_jobs import TrainingJobs, read_order
from shared_schema import Job, TrainReport, Usage
from shared_schema.answers import answer_from_chunks, checkpoint_chunk, embedding_list
from shared_schema.audits import SCORE_URL
from shared_schema.images import IMAGES_URL
from shared_schema.training import TRAIN_URL

log = logging.getLogger(__name__)


class JobSink(Protocol):
    """Where a job's frames go: the connection it came on. ``origin``: that connection's queen
    origin (a training job's files are there); ``train_report``: a training job's progress."""

    @property
    def origin(self) -> str: ...

    async def chunk(self, job_id: str, data: dict[str, Any]) -> None: ...
    async def train_report(self, job_id: str, report: TrainReport) -> None: ...
    async def result(self, job_id: str, data: dict[str, Any], usage: Usage) -> None: ...
    async def error(self, job_id: str, code: str, message: str, retryable: bool) -> None: ...


@dataclass(frozen=True, slots=True)
class JobRecord:
    """One finished job, as the owner sees it."""

    job_id: str
    model: str
    kind: str
    prompt_tokens: int
    completion_tokens: int
    seconds: float
    outcome: str

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class JobProgress:
    """A training job's progress as its report went to the queen, for the owner's Jobs tab."""

    job_id: str
    model: str
    step: int
    total_steps: int
    epoch: int
    loss: float
    trained_tokens: int


class _ReportingSink:
    """A job's sink that also tells ``listeners`` of each training report it sends."""

    def __init__(self, sink: JobSink, model: str,
                 listeners: list[Callable[[JobProgress], None]]) -> None:
        self._sink = sink
        self._model = model
        self._listeners = listeners

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sink, name)

    async def train_report(self, job_id: str, report: TrainReport) -> None:
        await self._sink.train_report(job_id, report)
        progress = JobProgress(job_id, self._model, report.step, report.total_steps,
                               report.epoch, report.loss, report.trained_tokens)
        for listener in list(self._listeners):
            listener(progress)


class JobRunner:
    """Runs jobs on the engine. A plain (non-streamed) answer is sent whole at its end, with a
    checkpoint of its text every ``checkpoint_s`` while it is generated, so that a lost worker's
    answer can be continued elsewhere without one frame per token. ``training``: how training
    jobs run (None: the owner did not opt in, and they are refused as ``unsupported``);
    ``fine_tuned``: how jobs with an adapter get it (None: refused as ``unsupported``);
    ``grouped(name)``: whether ``name`` is served through a model group's head (which loads
    no adapter)."""

    def __init__(
        self, pool: ModelPool, has_model: Callable[[str], bool], *, checkpoint_s: float = 1.0,
        training: TrainingJobs | None = None, fine_tuned: FineTunedModels | None = None,
        grouped: Callable[[str], bool] = lambda _name: False, images: ImageJobs | None = None,
    ) -> None:
        self.pool = pool
        self.has_model = has_model
        self.checkpoint_s = checkpoint_s
        self.training = training
        self.fine_tuned = fine_tuned
        self.grouped = grouped
        self.images = images  # image jobs (issue 38); None: the owner did not opt in
        self._trains: set[str] = set()  # the training jobs among those running
        self.on_started: list[Callable[[Job], None]] = []
        self.on_finished: list[Callable[[JobRecord], None]] = []
        self.on_progress: list[Callable[[JobProgress], None]] = []  # training jobs' reports
        self._running: dict[str, tuple[asyncio.Task[None], threading.Event]] = {}
        self._handed_back: dict[str, str] = {}  # job id -> why (a pause)

    @property
    def active(self) -> int:
        return len(self._running)

    def start(self, job: Job, sink: JobSink) -> None:
        cancel = threading.Event()
        task = asyncio.create_task(self._run(job, sink, cancel), name=f"job {job.id}")
        self._running[job.id] = (task, cancel)
        if job.openai_url == TRAIN_URL:
            self._trains.add(job.id)
        task.add_done_callback(lambda _t: self._forget(job.id))
        for callback in self.on_started:
            callback(job)

    def _forget(self, job_id: str) -> None:
        self._running.pop(job_id, None)
        self._trains.discard(job_id)

    def cancel(self, job_id: str) -> None:
        entry = self._running.get(job_id)
        if entry is not None:
            entry[1].set()

    async def hand_back(self, timeout_s: float, reason: str) -> None:
        """Let the jobs in flight finish for up to ``timeout_s``; stop the rest with a
        retryable ``paused`` error, so that the queen continues each answer on another worker
        (its failover path) rather than failing it. A training job is handed back at once:
        it would not end within a grace, and the queen resumes it from its last checkpoint."""
        tasks = [task for task, _ in self._running.values()]
        if not tasks:
            return
        for job_id in list(self._trains):
            self._handed_back[job_id] = reason
            self.cancel(job_id)
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for job_id in list(self._running):
            self._handed_back[job_id] = reason
            self.cancel(job_id)
        if pending:
            await asyncio.wait(pending, timeout=5)

    async def drain(self, timeout_s: float) -> None:
        """Let the jobs in flight finish for up to ``timeout_s``, then cancel the rest."""
        tasks = [task for task, _ in self._running.values()]
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for job_id in list(self._running):
            self.cancel(job_id)
        if pending:
            await asyncio.wait(pending, timeout=5)

    async def _run(self, job: Job, sink: JobSink, cancel: threading.Event) -> None:
        request = job.openai_req
        model = str(request.get("model", ""))
        kind = job_kind(job.openai_url)
        started = time.perf_counter()
        usage = Usage(prompt_tokens=0, total_tokens=0)
        outcome = "ok"
        try:
            if kind == "train" and self.training is None:
                raise _JobFailure("unsupported", "this worker does not take training jobs "
                                  "(its owner has not opted in)", retryable=False)
            if kind == "image" and self.images is None:
                raise _JobFailure("unsupported", "this worker does not render images (its "
                                  "owner has not opted in)", retryable=False)
            if job.adapter is not None:
                problem = adapter_problem(job, kind, self.has_model, self.grouped,
                                          serves=self.fine_tuned is not None)
                if problem is not None:
                    code, message, retryable = problem
                    raise _JobFailure(code, message, retryable=retryable)
                assert self.fine_tuned is not None
                async with self.fine_tuned.serve(job.adapter, sink.origin):
                    usage = await self._serve(job, kind, model, sink, cancel)
            else:
                if kind not in ("train", "image") and not self.has_model(model):
                    raise _JobFailure("model_not_available",
                                      f"this worker does not hold {model}", retryable=True)
                usage = await self._serve(job, kind, model, sink, cancel)
        except ImageModelMissing as exc:
            outcome = "model_not_available"
            await sink.error(job.id, "model_not_available", str(exc), True)
        except (_JobFailure, TrainJobFailed, AdapterFailed) as failure:
            outcome = failure.code
            await sink.error(job.id, failure.code, str(failure), failure.retryable)
        except UnsupportedRequest as exc:
            outcome = "invalid_request"
            await sink.error(job.id, "invalid_request", str(exc), False)
        except InvalidAdapter as exc:  # the engine child's own check, right before its load
            outcome = "invalid_adapter"
            await sink.error(job.id, "invalid_adapter", str(exc), False)
        except (EngineError, ModelStoreError) as exc:
            outcome = "engine_error"
            log.error("job %s failed: %s", job.id, exc)
            await sink.error(job.id, "engine_error", str(exc), True)
        except WorkerError as exc:
            outcome = "worker_error"
            await sink.error(job.id, "worker_error", str(exc), True)
        except Exception as exc:  # never let one job take the worker down
            outcome = "internal_error"
            log.exception("job %s crashed", job.id)
            with contextlib.suppress(Exception):
                await sink.error(job.id, "internal_error", f"{type(exc).__name__}: {exc}", True)
        record = JobRecord(job.id, model, kind, usage.prompt_tokens, usage.completion_tokens,
                           time.perf_counter() - started, outcome)
        log.info("job %s %s %s: %d prompt + %d completion tokens, %.1f tokens/s, %.2f s, %s",
                 job.id, kind, model, record.prompt_tokens, record.completion_tokens,
                 record.tokens_per_s, record.seconds, outcome)
        self._forget(job.id)  # ``active`` already counts it out for the callbacks
        self._handed_back.pop(job.id, None)
        for callback in self.on_finished:
            callback(record)

    async def _serve(self, job: Job, kind: str, model: str, sink: JobSink,
                     cancel: threading.Event) -> Usage:
        if kind == "train":
            return await self._train(job, sink, cancel)
        if kind == "image":
            return await self._image(job, sink, cancel)
        if kind == "embeddings":
            return await self._embeddings(job, model, sink)
        if kind == "score":
            return await self._score(job, model, sink, cancel)
        usage = await self._generate(job, kind, model, sink, cancel)
        if cancel.is_set():
            raise self._stopped(job.id)
        return usage

    async def _generate(
        self, job: Job, kind: str, model: str, sink: JobSink, cancel: threading.Event
    ) -> Usage:
        stream = bool(job.openai_req.get("stream"))
        collected: list[dict[str, Any]] = []
        unsaved: list[str] = []  # a plain answer's text (choice 0) since its last checkpoint
        unsaved_logprobs: list[Any] = []
        with_logprobs = bool(job.openai_req.get("logprobs"))
        saved_at = time.monotonic()

        async def on_chunk(chunk: dict[str, Any]) -> None:
            nonlocal saved_at
            if stream:
                await sink.chunk(job.id, chunk)
                return
            collected.append(chunk)
            for choice in chunk.get("choices") or ():
                if choice.get("index", 0) != 0:
                    continue
                if (choice.get("delta") or {}).get("content"):
                    unsaved.append(choice["delta"]["content"])
                entries = (choice.get("logprobs") or {}).get("content")
                if entries:
                    unsaved_logprobs.extend(entries)
            if unsaved and time.monotonic() - saved_at >= self.checkpoint_s:
                saved_at = time.monotonic()
                await sink.chunk(job.id, checkpoint_chunk(
                    unsaved, list(unsaved_logprobs) if with_logprobs else None))
                unsaved.clear()
                unsaved_logprobs.clear()

        # The queen's hash of the caller: cached prefixes are reused within it only (issue 36).
        scope = job.cache_scope
        if kind == "completions":
            counts = await self.pool.complete(model, job.openai_req, cancel, on_chunk,
                                              scope=scope)
        else:
            counts = await self.pool.chat(model, job.openai_req, cancel, on_chunk,
                                          continuation=job.continuation, scope=scope)
        usage = Usage(**counts)
        if not cancel.is_set():
            await sink.result(job.id, {} if stream else answer_from_chunks(collected), usage)
        return usage

    def _stopped(self, job_id: str) -> _JobFailure:
        why = self._handed_back.get(job_id)
        if why is not None:
            return _JobFailure("paused", f"the worker paused ({why}); continue elsewhere",
                               retryable=True)
        return _JobFailure("cancelled", "cancelled by the queen", retryable=False)

    async def _score(self, job: Job, model: str, sink: JobSink,
                     cancel: threading.Event) -> Usage:
        """A re-scoring audit (issue 16): the delivered answer's per-token scores, no text."""
        score = await self.pool.score(model, read_score_request(job.openai_req), cancel)
        if score is None:
            raise self._stopped(job.id)
        usage = Usage(**score.usage())
        await sink.result(job.id, score.data(), usage)
        return usage

    async def _train(self, job: Job, sink: JobSink, cancel: threading.Event) -> Usage:
        """A training job (issue 37): its reports go out as it trains, its ``Result`` at the
        end; a cancel (or a pause) ends it as any job's."""
        assert self.training is not None
        order = read_order(job.openai_req)  # a bad order names its field, before all else
        if not self.has_model(order.model):
            raise _JobFailure("model_not_available", f"this worker does not hold {order.model}",
                              retryable=True)
        try:
            reporting = _ReportingSink(sink, order.model, self.on_progress)
            data, usage = await self.training.run(job.id, order, reporting, cancel)
        except TrainingCancelled:
            raise self._stopped(job.id) from None
        if cancel.is_set():  # cancelled after its last step: nothing was delivered
            raise self._stopped(job.id)
        await sink.result(job.id, data.model_dump(mode="json"), usage)
        return usage

    async def _image(self, job: Job, sink: JobSink, cancel: threading.Event) -> Usage:
        """An image job (issue 38): rendered whole, then its ``Result``; a cancel stops it
        before its next image."""
        assert self.images is not None
        try:
            data, usage = await self.images.run(job.id, job.openai_req, cancel)
        except GenerationCancelled:
            raise self._stopped(job.id) from None
        if cancel.is_set():
            raise self._stopped(job.id)
        await sink.result(job.id, data, usage)
        return usage

    async def _embeddings(self, job: Job, model: str, sink: JobSink) -> Usage:
        inputs = embedding_inputs(job.openai_req.get("input"))
        vectors, tokens = await self.pool.embed(model, inputs)
        usage = Usage(prompt_tokens=tokens, total_tokens=tokens)
        await sink.result(job.id, embedding_list(model, vectors), usage)
        return usage


def job_kind(openai_url: str) -> str:
    """"score" (a re-scoring audit), "train" (a training job), "image" (issue 38),
    "embeddings", "completions" (raw prompts) or "chat", from a job's path."""
    if openai_url == TRAIN_URL:
        return "train"
    if openai_url == IMAGES_URL:
        return "image"
    if openai_url == SCORE_URL:
        return "score"
    if openai_url.endswith("/embeddings"):
        return "embeddings"
    if openai_url.endswith("/completions") and not openai_url.endswith("/chat/completions"):
        return "completions"
    return "chat"


ADAPTED_KINDS = frozenset({"chat", "completions", "score"})


def adapter_problem(job: Job, kind: str, has_model: Callable[[str], bool],
                    grouped: Callable[[str], bool], *, serves: bool
                    ) -> tuple[str, str, bool] | None:
    """Why a job with ``Job.adapter`` cannot run here, as ``(code, message, retryable)``;
    None when it can. ``serves``: whether this worker serves fine-tuned models at all."""
    adapter = job.adapter
    assert adapter is not None
    model = str(job.openai_req.get("model", ""))
    if model != adapter.name:
        return ("invalid_request", f"the job's model {model[:200]!r} is not its adapter's "
                f"{adapter.name!r}: the queen and the job disagree", False)
    if kind not in ADAPTED_KINDS:
        return ("invalid_request", f"a {kind} job takes no fine-tuned model ({adapter.name})",
                False)
    if not serves:
        return ("unsupported", "this worker does not serve fine-tuned models", True)
    if not has_model(adapter.base):
        return ("model_not_available", f"this worker does not hold {adapter.base}", True)
    if grouped(adapter.base):
        return ("unsupported", f"this worker serves {adapter.base} through a model group's "
                f"head, which loads no LoRA adapter, so it cannot serve {adapter.name}", True)
    return None


def embedding_inputs(raw: Any) -> list[str] | list[list[int]]:
    """An embeddings job's inputs: texts, or token-id lists (one list of ids is one input)."""
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list) and raw:
        if all(isinstance(item, str) for item in raw):
            return raw
        if all(_is_token(item) for item in raw):
            return [raw]
        if all(isinstance(item, list) and item and all(_is_token(t) for t in item)
               for item in raw):
            return raw
    raise UnsupportedRequest("embeddings input must be a string, a list of strings, a list of "
                             "token ids or a list of token-id lists")


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class _JobFailure(Exception):
    def __init__(self, code: str, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.code = code
        self.retryable = retryable
