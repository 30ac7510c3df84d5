"""A worker streaming 16 MiB chunks, against a real queen over real sockets: its job fails
cleanly (retryable, so an honest worker answers it), the worker is told it sent a bad frame, and
the queen does not keep the chunks."""

from __future__ import annotations

import asyncio
import logging

import pytest

from queen_server.swarm.jobs import ANSWER_TOO_LARGE
from shared_schema import Chunk, Job
from tests.support.queen import running_queen
from tests.support.workers import ECHO_MODEL, ScriptedWorker

MIB = 1024 * 1024
CHUNK_CONTENT = 16 * MIB - 4096  # the frame stays just under the queen's 16 MiB frame limit


class BigChunkWorker(ScriptedWorker):
    """Answers every job with chunks of almost 16 MiB each, ignores the queen's cancels, and
    records the errors it is sent (``errors``, ``told``)."""

    def __init__(self, *args, chunks: int = 3, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.chunks = chunks
        self.answer_cancels = False

    async def _run(self, job: Job) -> None:
        content = "a" * CHUNK_CONTENT
        for seq in range(self.chunks):
            await self._send(Chunk(id=job.id, seq=seq, data={"choices": [
                {"index": 0, "delta": {"content": content}, "finish_reason": None}]}))


@pytest.mark.asyncio
async def test_a_worker_sending_16_mib_chunks_fails_its_job_and_an_honest_worker_answers(
        tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="queen_server.swarm.link")
    async with running_queen(tmp_path, queue_timeout_s=10.0, total_timeout_s=30.0) as queen:
        flooder = await BigChunkWorker(queen.ws_url).start()
        # ranked below the flooder (its model is not loaded), so the flooder gets the job first
        honest = await ScriptedWorker(queen.ws_url, loaded=False).start()
        try:
            await queen.wait_until(lambda: len(queen.state.registry) == 2)
            client = queen.client(timeout=60)
            async with asyncio.timeout(30):
                answer = await client.chat.completions.create(
                    model=ECHO_MODEL, messages=[{"role": "user", "content": "hello there"}],
                    max_tokens=16)
                await flooder.told.wait()
            # the flooder's job failed, retryable: it was retried on the honest worker
            assert flooder.jobs
            assert answer.choices[0].message.content == "echo: hello there"
            assert honest.jobs
            [error] = flooder.errors[:1]
            assert error.code == ANSWER_TOO_LARGE
            assert error.id == flooder.jobs[0].id
            assert any("bad frame (answer_too_large)" in record.getMessage()
                       for record in caplog.records)
            assert not flooder.closed.is_set()  # one bad frame does not end the session
            # and the flooder is told to stop that job, so its slot does not stay busy
            async with asyncio.timeout(10):
                await flooder.cancelled.wait()
            assert [(c.id, c.reason) for c in flooder.cancels] == [
                (flooder.jobs[0].id, ANSWER_TOO_LARGE)]
        finally:
            await flooder.stop()
            await honest.stop()


@pytest.mark.asyncio
async def test_the_queen_does_not_hold_the_chunks_of_a_failed_job(tmp_path):
    """With no other worker the client gets a proper error; meanwhile the flooder keeps sending
    16 MiB chunks for its failed job, answered as an unknown job's and dropped (the sans-I/O tests
check that a failed chunk never reaches the job's mailbox)."""
    async with running_queen(tmp_path, total_timeout_s=30.0) as queen:
        flooder = await BigChunkWorker(queen.ws_url, chunks=4).start()
        try:
            await queen.wait_until(lambda: len(queen.state.registry) == 1)
            client = queen.client(timeout=60)
            with pytest.raises(Exception) as failed:  # noqa: PT011 (the SDK's own classes)
                async with asyncio.timeout(60):
                    await client.chat.completions.create(
                        model=ECHO_MODEL, messages=[{"role": "user", "content": "hi"}],
                        max_tokens=16)
            # every chunk after the first is an unknown job's frame: wait for them all
            async with asyncio.timeout(60):
                while len(flooder.errors) < flooder.chunks:
                    flooder.told.clear()
                    if len(flooder.errors) < flooder.chunks:  # none came since the check
                        await flooder.told.wait()
            assert getattr(failed.value, "status_code", None) in {502, 503}
            assert ANSWER_TOO_LARGE in str(failed.value) or "worker" in str(failed.value)
            assert [e.code for e in flooder.errors] == [ANSWER_TOO_LARGE] + ["unknown_job"] * (
                flooder.chunks - 1)
            # the failed job's handle is gone: no lease holds its chunks
            assert not queen.state.registry.is_leased(flooder.jobs[0].id)
        finally:
            await flooder.stop()
