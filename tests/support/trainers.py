"""A scripted worker that trains (issue 37): given a training job, it reads its data (and the
checkpoint it resumes from) over HTTP with the order's token, sends ``TrainReport`` frames,
uploads a checkpoint and an adapter (bytes that look like a GGUF: the queen does not parse
adapters yet) and ends with a ``Result``, as the contract in ``shared_schema.training`` says.

Behaviours: ``honest``; ``gated`` (waits for ``release`` after its checkpoint, then goes on);
``die_mid`` (drops its connection after its checkpoint); ``lie_backwards`` (its tokens go back
after the checkpoint); ``lie_over_bound`` (claims more tokens than the order's bound);
``phantom_checkpoint`` (reports a checkpoint it never uploaded); ``silent`` (reads its data,
then says nothing).

``AdapterServer`` serves fine-tuned models (the ``lora`` capability): it records each job's
``Job.adapter``, GETs the adapter from the queen with its token and checks its sha256 and size
(a failed fetch is a non-retryable job error), then answers as an echo worker.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import httpx

from shared_schema import Job, JobError, Result, Usage
from shared_schema.audits import SCORE_URL, ScoreData, ScoreJob
from shared_schema.capabilities import LORA, SCORE, TRAIN
from shared_schema.protocol import TrainReport
from shared_schema.training import (
    ADAPTER_NAME,
    TRAIN_URL,
    AdapterRef,
    TrainOrder,
    TrainResultData,
    Uploaded,
    checkpoint_name,
)
from tests.support.workers import ScriptedWorker

TOTAL_STEPS = 4
TOKENS_PER_STEP = 100
CHECKPOINT_STEP = 2


def gguf_bytes(tag: str, size: int = 4096) -> bytes:
    """Bytes that start like a GGUF file (magic, version 3), distinct per ``tag``."""
    body = hashlib.sha256(tag.encode()).digest() * (size // 32 + 1)
    return b"GGUF\x03\x00\x00\x00" + body[: size - 8]


class ScriptedTrainer(ScriptedWorker):
    def __init__(self, ws_url: str, *, behaviour: str = "honest", **kwargs: Any) -> None:
        kwargs.setdefault("capabilities", [TRAIN])
        super().__init__(ws_url, behaviour=behaviour, **kwargs)
        self.http_url = ws_url.replace("ws://", "http://", 1).rsplit("/worker", 1)[0]
        self.orders: list[TrainOrder] = []
        self.data: list[bytes] = []  # the training data each order's GET answered
        self.resumed: list[bytes] = []  # the checkpoints it resumed from
        self.uploads: dict[str, bytes] = {}
        self.reported = asyncio.Event()  # its checkpoint's report was sent

    async def _run(self, job: Job) -> None:
        if job.openai_url != TRAIN_URL:
            await super()._run(job)
            return
        order = TrainOrder.model_validate(job.openai_req)
        self.orders.append(order)
        auth = {"Authorization": f"Bearer {order.token}"}
        async with httpx.AsyncClient(base_url=self.http_url, headers=auth, timeout=10,
                                     trust_env=False) as http:
            self.data.append(await self._get(http, order.data.url, order.data.sha256))
            step, tokens = 0, 0
            if order.resume is not None:
                self.resumed.append(await self._get(http, order.resume.url,
                                                    order.resume.sha256))
                step, tokens = order.resume.step, order.resume.trained_tokens
            if self.behaviour == "silent":
                return
            while step < TOTAL_STEPS:
                step += 1
                tokens += TOKENS_PER_STEP
                checkpoint = None
                if step == CHECKPOINT_STEP:
                    checkpoint = await self._put(http, order, checkpoint_name(step),
                                                 gguf_bytes(f"{order.job}-{step}"))
                    if self.behaviour == "phantom_checkpoint":
                        checkpoint = Uploaded(name=checkpoint_name(step), sha256="0" * 64,
                                              size_bytes=123)
                claimed = tokens
                if self.behaviour == "lie_backwards" and step > CHECKPOINT_STEP:
                    claimed = 1
                if self.behaviour == "lie_over_bound":
                    claimed = order.max_trained_tokens + 1
                await self._send(TrainReport(id=job.id, step=step, total_steps=TOTAL_STEPS,
                                             epoch=1, loss=2.0 / step, trained_tokens=claimed,
                                             checkpoint=checkpoint))
                if step == CHECKPOINT_STEP:
                    self.reported.set()
                    if self.behaviour == "die_mid":
                        assert self._ws is not None
                        await self._ws.close()
                        return
                    if self.behaviour == "gated":
                        await self.release.wait()
            adapter = await self._put(http, order, ADAPTER_NAME, gguf_bytes(f"{order.job}-a"))
        result = TrainResultData(adapter=adapter, steps=TOTAL_STEPS, loss=0.5)
        await self._send(Result(id=job.id, data=result.model_dump(mode="json"),
                                usage=Usage(prompt_tokens=tokens, completion_tokens=0,
                                            total_tokens=tokens)))

    async def _get(self, http: httpx.AsyncClient, url: str, sha256: str) -> bytes:
        answer = await http.get(url)
        answer.raise_for_status()
        assert hashlib.sha256(answer.content).hexdigest() == sha256
        return answer.content

    async def _put(self, http: httpx.AsyncClient, order: TrainOrder, name: str,
                   data: bytes) -> Uploaded:
        answer = await http.put(f"{order.upload}/{name}", content=data)
        answer.raise_for_status()
        self.uploads[name] = data
        return Uploaded(name=name, sha256=hashlib.sha256(data).hexdigest(),
                        size_bytes=len(data))


class AdapterServer(ScriptedWorker):
    """A worker with ``lora`` that holds the base: it fetches each job's adapter, then echoes."""

    def __init__(self, ws_url: str, **kwargs: Any) -> None:
        kwargs.setdefault("capabilities", [LORA])
        super().__init__(ws_url, **kwargs)
        self.http_url = ws_url.replace("ws://", "http://", 1).rsplit("/worker", 1)[0]
        self.adapters: list[AdapterRef] = []  # each job's Job.adapter, in order
        self.fetched: dict[str, bytes] = {}  # adapter bytes by sha256, as the queen sent them

    async def _run(self, job: Job) -> None:
        if await self._adapter_fetched(job):
            await super()._run(job)

    async def _adapter_fetched(self, job: Job) -> bool:
        """Record and fetch the job's adapter (if any); False after a failed fetch (the job's
        error is sent)."""
        ref = job.adapter
        if ref is None:
            return True
        self.adapters.append(ref)
        async with httpx.AsyncClient(base_url=self.http_url, timeout=10,
                                     trust_env=False) as http:
            answer = await http.get(ref.file.url,
                                    headers={"Authorization": f"Bearer {ref.token}"})
        data = answer.content
        if (answer.status_code != 200 or len(data) != ref.file.size_bytes
                or hashlib.sha256(data).hexdigest() != ref.file.sha256):
            await self._send(JobError(id=job.id, code="adapter_unavailable", retryable=False,
                                      message=f"adapter fetch: {answer.status_code}"))
            return False
        self.fetched[ref.file.sha256] = data
        return True


async def fetch_adapter(http_url: str, ref: AdapterRef) -> tuple[int, bytes]:
    """GET a job's adapter from the queen with its token: the status and the bytes."""
    async with httpx.AsyncClient(base_url=http_url, timeout=10, trust_env=False) as http:
        answer = await http.get(ref.file.url, headers={"Authorization": f"Bearer {ref.token}"})
    return answer.status_code, answer.content


class ScoreScript:
    """How a scripted worker answers ``score`` jobs (issue 37's held-out check): every answer
    token at ``base_logprob`` without an adapter and ``adapter_logprob`` with one (which it
    GETs and checks first), one token per word; it records each job's ``ScoreJob`` and whether
    ``Job.adapter`` was set. ``vanish``: it drops its connection at its first score job;
    ``uneven``: it counts one token more with the adapter (scores that cannot be honest)."""

    def __init__(self, base_logprob: float = -2.0, adapter_logprob: float = -1.0,
                 behaviour: str = "honest") -> None:
        self.base_logprob = base_logprob
        self.adapter_logprob = adapter_logprob
        self.behaviour = behaviour
        self.scored: list[tuple[bool, ScoreJob]] = []
        self.fetched: list[bytes] = []

    async def answer(self, worker: ScriptedWorker, http_url: str, job: Job) -> None:
        if self.behaviour == "vanish":
            assert worker._ws is not None
            await worker._ws.close()
            return
        request = ScoreJob.model_validate(job.openai_req)
        self.scored.append((job.adapter is not None, request))
        logprob = self.base_logprob
        tokens = max(1, len(request.answer.split()))
        if job.adapter is not None:
            status, data = await fetch_adapter(http_url, job.adapter)
            if status != 200 or hashlib.sha256(data).hexdigest() != job.adapter.file.sha256:
                await worker._send(JobError(id=job.id, code="adapter_unavailable",
                                            retryable=False, message=f"adapter: {status}"))
                return
            self.fetched.append(data)
            logprob = self.adapter_logprob
            tokens += self.behaviour == "uneven"
        data = ScoreData(prompt_tokens=7, answer_tokens=tokens, logprobs=[logprob] * tokens,
                         argmax=[True] * tokens, best_logprobs=[logprob] * tokens,
                         temperature=0.0)
        await worker._send(Result(id=job.id, data=data.model_dump(mode="json"),
                                  usage=Usage(prompt_tokens=7 + tokens, completion_tokens=0,
                                              total_tokens=7 + tokens)))


class ScriptedScorer(ScriptedWorker):
    """A worker with ``lora`` and ``score`` that holds the base: it answers score jobs as its
    ``ScoreScript`` says (and echoes anything else)."""

    def __init__(self, ws_url: str, script: ScoreScript | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("capabilities", [LORA, SCORE])
        super().__init__(ws_url, **kwargs)
        self.http_url = ws_url.replace("ws://", "http://", 1).rsplit("/worker", 1)[0]
        self.script = script or ScoreScript()

    async def _run(self, job: Job) -> None:
        if job.openai_url == SCORE_URL:
            await self.script.answer(self, self.http_url, job)
        else:
            await super()._run(job)


class ScoringTrainer(ScriptedTrainer):
    """A trainer that also scores (``train``, ``lora`` and ``score``), as its ``ScoreScript``
    says: the only scorer there is, or one the check should pass over."""

    def __init__(self, ws_url: str, script: ScoreScript | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("capabilities", [TRAIN, LORA, SCORE])
        super().__init__(ws_url, **kwargs)
        self.script = script or ScoreScript()

    async def _run(self, job: Job) -> None:
        if job.openai_url == SCORE_URL:
            await self.script.answer(self, self.http_url, job)
        else:
            await super()._run(job)
