"""Training jobs (issue 37): the queen's ``TrainOrder`` run on this worker, end to end.

A training job is a ``Job`` whose ``openai_url`` is ``shared_schema.training.TRAIN_URL``;
``JobRunner`` hands it to ``TrainingJobs.run`` when the owner opted in (``WorkerSettings.train``)
and refuses it otherwise. A run, in a job folder of its own under ``work_dir`` (removed at the
end, whatever happens):

1. reads the order (``read_order``: a bad one names its field, not retryable);
2. downloads the training rows, and when it resumes the checkpoint, from the queen's origin (the
   one the job's connection reached, ``JobSink.origin``; a transfer's path is joined to it and
   must stay on it, ``transfer_url``) with the order's bearer token, streamed to a file,
   stopped past the named size and checked against the named sha256 (``Transfers``), each
   refused up front when it would not fit in what the owner's disk quota and headroom leave
   (``room_bytes``, counting what the folder holds already);
3. reads the rows (``read_rows``: OpenAI's chat rows, at most the order's count, an error naming
   the line) and trains in the sandboxed train child (``SandboxedTrainer``), reporting progress
   every ``progress_every_steps`` steps (``ReportPacer``, pure), each checkpoint once it is
   uploaded (``PUT upload/checkpoint-NNNNNNNN.gguf``, then deleted here), and the final
   adapter (``PUT upload/adapter.gguf``) as the job's ``TrainResultData``.

A run past the order's ``max_trained_tokens`` stops there and fails (not retryable: the queen
pays no more). Failures are ``TrainJobFailed`` with the ``JobError``'s code: transfers and the
disk retryable, the order and the data not, a crashed train child retryable; a cancel is
``TrainingCancelled``, which the runner answers as it answers any cancelled job.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import shutil
import tempfile
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
from pydantic import ValidationError

from desktop_worker.engine.training import TrainCheckpoint, TrainProgress, TrainSpec
from desktop_worker.errors import (
    EngineCrashed,
    TrainingCancelled,
    TrainingError,
    TrainingUnsupported,
    TrainJobFailed,
)
from desktop_worker.sandbox.training import SandboxedTrainer
from shared_schema import TrainReport, Usage
from shared_schema.training import (
    ADAPTER_NAME,
    TrainOrder,
    TrainResultData,
    Transfer,
    Uploaded,
    checkpoint_name,
)

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
MAX_LINE_BYTES = 4 << 20  # one training row; the queen's own line limit is far below
ROLES = frozenset({"system", "developer", "user", "assistant"})
DATA_NAME = "training.jsonl"
RESUME_NAME = "resume.gguf"
MAX_LOSS = 1e6  # TrainReport's bound

# What the folder of a run holds already -> the bytes it may still write.
RoomBytes = Callable[[int], int]


class TrainSink(Protocol):
    """What a training job needs of the link: the origin its files are on, its reports."""

    @property
    def origin(self) -> str: ...

    async def train_report(self, job_id: str, report: TrainReport) -> None: ...


# --- the order and its data (pure) --------------------------------------------------------------


def read_order(raw: Any) -> TrainOrder:
    """The job's ``openai_req`` as a ``TrainOrder``; ``TrainJobFailed`` (``invalid_request``,
    not retryable) naming the first bad field."""
    try:
        return TrainOrder.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"]) or "order"
        raise TrainJobFailed("invalid_request", f"the training order's {where} is invalid: "
                             f"{first['msg']}", retryable=False) from exc


def transfer_url(origin: str, path: str) -> str:
    """``path`` on the queen's ``origin``; ``TrainJobFailed`` (not retryable) for a path that
    would leave it (``//host``, a full URL, a backslash, a space or control character): the
    order's bearer token goes to the queen and nowhere else."""
    bad = (not path.startswith("/") or path.startswith("//") or "\\" in path
           or any(ord(c) < 0x21 or c == "\x7f" for c in path))
    url = origin.rstrip("/") + path
    if not bad:
        try:
            joined, home = httpx.URL(url), httpx.URL(origin)
        except httpx.InvalidURL:
            bad = True
        else:
            bad = (joined.scheme, joined.host, joined.port) != (home.scheme, home.host,
                                                                 home.port)
    if bad:
        raise TrainJobFailed("invalid_request", f"the training order names {path[:200]!r}, "
                             "which is not a path on the queen's origin", retryable=False)
    return url


def check_row(row: Any) -> str | None:
    """Why ``row`` is not an OpenAI chat fine-tuning row; None when it is one."""
    if not isinstance(row, dict):
        return "is not a JSON object"
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        return "has no 'messages' list"
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            return f"message {index} has no role among {sorted(ROLES)}"
        if not isinstance(message.get("content"), str):
            return f"message {index} has no text content"
    if not any(message["role"] == "assistant" for message in messages):
        return "has no assistant message to learn"
    return None


def read_rows(path: Path, max_rows: int) -> list[dict[str, Any]]:
    """The training file's rows (blank lines skipped); ``TrainJobFailed``
    (``invalid_training_file``, not retryable) naming the first bad line, or for more rows
    than the order says."""
    rows: list[dict[str, Any]] = []
    with path.open("rb") as reader:
        for number, line in enumerate(reader, start=1):
            problem: str | None = None
            if len(line) > MAX_LINE_BYTES:
                problem = f"is longer than {MAX_LINE_BYTES:,} bytes"
            elif not line.strip():
                continue
            else:
                try:
                    row = json.loads(line)
                except ValueError:
                    problem = "is not valid JSON"
                else:
                    problem = check_row(row)
            if problem is None and len(rows) >= max_rows:
                problem = f"is more than the {max_rows} examples the order names"
            if problem is not None:
                raise TrainJobFailed("invalid_training_file",
                                     f"line {number} of the training file {problem}",
                                     retryable=False)
            rows.append(row)
    if not rows:
        raise TrainJobFailed("invalid_training_file", "the training file has no rows",
                             retryable=False)
    return rows


@dataclass(slots=True)
class ReportPacer:
    """Which steps are reported: every ``every`` steps and the last, each with the mean loss
    of the steps since the last report. Fed every step the trainer reports."""

    job_id: str
    every: int
    last: TrainProgress | None = None
    _losses: list[float] | None = None

    def step(self, progress: TrainProgress) -> TrainReport | None:
        """The report due after ``progress``, or None."""
        self.last = progress
        losses = self._losses = (self._losses or []) + [progress.loss]
        if progress.step % self.every and progress.step != progress.total_steps:
            return None
        self._losses = None
        return self.report(progress.step, sum(losses) / len(losses), progress.trained_tokens)

    def report(self, step: int, loss: float, trained_tokens: int,
               checkpoint: Uploaded | None = None) -> TrainReport:
        last = self.last
        return TrainReport(id=self.job_id, step=step,
                           total_steps=max(1, last.total_steps if last else step),
                           epoch=max(1, last.epoch if last else 1),
                           loss=min(max(loss, 0.0), MAX_LOSS), trained_tokens=trained_tokens,
                           checkpoint=checkpoint)


# --- the queen's files --------------------------------------------------------------------------


def _transfer_failed(what: str, problem: object) -> TrainJobFailed:
    return TrainJobFailed("transfer_failed", f"{what}: {problem}", retryable=True)


def transfer_client() -> httpx.AsyncClient:
    """A client for a job's files on the queen's origin: no redirects followed (the bearer
    token goes to the queen and nowhere else)."""
    return httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=15.0), follow_redirects=False)


class Transfers:
    """A job's files on the queen's origin, with its bearer token (no redirects followed)."""

    def __init__(self, client: httpx.AsyncClient, origin: str, token: str) -> None:
        self.client = client
        self.origin = origin
        self.headers = {"Authorization": f"Bearer {token}"}

    async def download(self, what: str, transfer: Transfer, dest: Path,
                       cancel: threading.Event) -> None:
        """``transfer`` into ``dest``: stopped past its size, checked against its sha256
        (a file that differs is deleted; ``TrainJobFailed`` retryable)."""
        url = transfer_url(self.origin, transfer.url)
        digest = hashlib.sha256()
        got = 0
        try:
            async with self.client.stream("GET", url, headers=self.headers) as response:
                if response.status_code != 200:
                    raise _transfer_failed(f"the queen answered {what} with HTTP "
                                           f"{response.status_code}", transfer.url)
                with dest.open("wb") as writer:
                    async for chunk in response.aiter_raw(CHUNK_BYTES):
                        if cancel.is_set():
                            raise TrainingCancelled("cancelled while downloading " + what)
                        got += len(chunk)
                        if got > transfer.size_bytes:
                            raise _transfer_failed(f"{what} is larger than its "
                                                   f"{transfer.size_bytes:,} bytes", "stopped")
                        digest.update(chunk)
                        writer.write(chunk)
        except httpx.HTTPError as exc:
            await asyncio.to_thread(dest.unlink, missing_ok=True)
            raise _transfer_failed(f"{what} could not be downloaded", exc) from exc
        except BaseException:
            await asyncio.to_thread(dest.unlink, missing_ok=True)
            raise
        if got != transfer.size_bytes or digest.hexdigest() != transfer.sha256:
            await asyncio.to_thread(dest.unlink, missing_ok=True)
            raise _transfer_failed(f"{what} is not the file the order names",
                                   f"{got:,} bytes, sha256 {digest.hexdigest()}")

    async def upload(self, upload: str, name: str, path: Path) -> Uploaded:
        """PUT ``path`` as ``upload/name``; what was sent (name, sha256, size)."""
        url = transfer_url(self.origin, upload.rstrip("/") + "/" + name)
        size = (await asyncio.to_thread(path.stat)).st_size
        digest = hashlib.sha256()

        async def body() -> AsyncIterator[bytes]:
            with path.open("rb") as reader:
                while chunk := reader.read(CHUNK_BYTES):
                    digest.update(chunk)
                    yield chunk

        headers = {**self.headers, "Content-Type": "application/octet-stream",
                   "Content-Length": str(size)}
        try:
            response = await self.client.put(url, content=body(), headers=headers)
        except httpx.HTTPError as exc:
            raise _transfer_failed(f"{name} could not be uploaded", exc) from exc
        if not 200 <= response.status_code < 300:
            raise _transfer_failed(f"the queen answered the upload of {name} with HTTP "
                                   f"{response.status_code}", response.text[:200])
        return Uploaded(name=name, sha256=digest.hexdigest(), size_bytes=size)


# --- the run ------------------------------------------------------------------------------------


def folder_bytes(folder: Path) -> int:
    total = 0
    for entry in folder.iterdir():
        with contextlib.suppress(OSError):
            total += entry.lstat().st_size
    return total


class StoreRoom(Protocol):
    quota_bytes: int | None

    @property
    def used_bytes(self) -> int: ...

    @property
    def disk(self) -> Any: ...  # store.disk.DiskGuard: room_bytes()


def store_room(store: StoreRoom) -> RoomBytes:
    """``RoomBytes`` within the model store's disk headroom and quota: a job's folder counts
    against the quota as models do (the disk's free space counts it already)."""

    def room(held_bytes: int) -> int:
        left = int(store.disk.room_bytes())
        if store.quota_bytes is not None:
            left = min(left, store.quota_bytes - store.used_bytes - held_bytes)
        return max(left, 0)

    return room


class TrainingJobs:
    """Runs training jobs: a folder under ``work_dir`` each, the base model from
    ``base_path(name)``, the sandboxed ``trainer``, files over ``client`` (a fresh
    ``httpx.AsyncClient`` per job when None)."""

    def __init__(self, trainer: SandboxedTrainer, work_dir: Path,
                 base_path: Callable[[str], Path], *, room_bytes: RoomBytes | None = None,
                 client: Callable[[], httpx.AsyncClient] | None = None) -> None:
        self.trainer = trainer
        self.work_dir = work_dir
        self.base_path = base_path
        self.room_bytes = room_bytes
        self.client = client or transfer_client

    async def run(self, job_id: str, order: TrainOrder, sink: TrainSink,
                  cancel: threading.Event) -> tuple[TrainResultData, Usage]:
        """Run ``order`` (``read_order``) to its adapter: the ``Result``'s data and usage (the
        tokens trained, from the first step on when it resumed, as its reports count them)."""
        transfer_url(sink.origin, order.data.url)  # every path checked before any request
        transfer_url(sink.origin, order.upload)
        if order.resume is not None:
            transfer_url(sink.origin, order.resume.url)
        folder = Path(await asyncio.to_thread(self._make_folder, job_id))
        try:
            async with self.client() as client:
                transfers = Transfers(client, sink.origin, order.token)
                return await self._run(job_id, order, transfers, folder, sink, cancel)
        finally:
            await asyncio.to_thread(shutil.rmtree, folder, ignore_errors=True)

    def _make_folder(self, job_id: str) -> str:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        return tempfile.mkdtemp(prefix=_safe(job_id) + "-", dir=self.work_dir)

    async def _run(self, job_id: str, order: TrainOrder, transfers: Transfers, folder: Path,
                   sink: TrainSink, cancel: threading.Event) -> tuple[TrainResultData, Usage]:
        data = folder / DATA_NAME
        await self._check_room(folder, order.data.size_bytes, "the training file")
        await transfers.download("the training file", order.data, data, cancel)
        rows = await asyncio.to_thread(read_rows, data, order.examples)
        resume: Path | None = None
        if order.resume is not None:
            resume = folder / RESUME_NAME
            await self._check_room(folder, order.resume.size_bytes, "the checkpoint")
            await transfers.download("the checkpoint", order.resume, resume, cancel)
        spec = TrainSpec(
            base_path=self.base_path(order.model), examples=rows, n_epochs=order.n_epochs,
            batch_size=order.batch_size, learning_rate=order.learning_rate, seed=order.seed,
            rank=order.rank, n_ctx=order.n_ctx, progress_every_steps=1,  # paced here
            checkpoint_every_steps=order.checkpoint_every_steps, resume_from=resume,
            resume_step=order.resume.step if order.resume is not None else 0)
        pacer = ReportPacer(job_id, order.progress_every_steps)
        over: list[int] = []  # the tokens trained when the order's bound was passed

        async def on_event(event: TrainProgress | TrainCheckpoint) -> None:
            if over:  # the run is stopping past the bound: nothing past it is reported
                return
            if isinstance(event, TrainProgress):
                report = pacer.step(event)
                if event.trained_tokens > order.max_trained_tokens and not over:
                    over.append(event.trained_tokens)
                    cancel.set()  # stop between two steps
                    report = report or pacer.report(event.step, event.loss,
                                                    event.trained_tokens)
                if report is not None:
                    await sink.train_report(job_id, report)
                return
            if cancel.is_set():
                return
            await self._check_room(folder, 0, "the checkpoint")
            sent = await transfers.upload(order.upload, checkpoint_name(event.step), event.path)
            await asyncio.to_thread(event.path.unlink, missing_ok=True)
            await sink.train_report(job_id, pacer.report(
                event.step, event.loss, event.trained_tokens, checkpoint=sent))

        try:
            result = await self.trainer.train(spec, folder, cancel, on_event)
        except TrainingCancelled:
            if over:
                raise TrainJobFailed(
                    "max_trained_tokens", f"the run trained {over[0]:,} tokens, past the "
                    f"order's bound of {order.max_trained_tokens:,}; stopped",
                    retryable=False) from None
            raise
        except TrainingUnsupported as exc:
            raise TrainJobFailed("training_unsupported", str(exc), retryable=True) from exc
        except EngineCrashed as exc:
            raise TrainJobFailed("engine_error", f"the train engine ended: {exc}",
                                 retryable=True) from exc
        except TrainingError as exc:
            raise TrainJobFailed("training_failed", str(exc), retryable=False) from exc
        adapter = await transfers.upload(order.upload, ADAPTER_NAME, result.adapter_path)
        done = TrainResultData(adapter=adapter, steps=result.steps,
                               loss=min(max(result.loss, 0.0), MAX_LOSS))
        return done, Usage(prompt_tokens=result.trained_tokens, completion_tokens=0,
                           total_tokens=result.trained_tokens)

    async def _check_room(self, folder: Path, size_bytes: int, what: str) -> None:
        """Refuse ``size_bytes`` more (0: whatever was just written) past what the quota
        and the disk's headroom leave the job's folder."""
        if self.room_bytes is None:
            return
        held = await asyncio.to_thread(folder_bytes, folder)
        room = await asyncio.to_thread(self.room_bytes, held)
        if size_bytes > room or room <= 0:
            raise TrainJobFailed(
                "insufficient_disk", f"{what} ({size_bytes:,} bytes) does not fit in what the "
                f"disk quota and headroom leave ({room:,} bytes, the job's folder holding "
                f"{held:,})", retryable=True)


def _safe(job_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", job_id)[:64] or "job"
