"""One job's mailbox on the queen: the frames a worker sends for it, awaited with a deadline.

``JobHandle`` is fed by the worker's link (``swarm.link``) and drained by the HTTP side. It is a
deque plus one waiter future and one timer, which costs far less per frame than a queue wrapped
in ``asyncio.wait_for``. It names its worker by key, not by object: the worker's connection may
be held by whatever edge the registry was given (``swarm.worker.Connection``), and ``cancel``
reaches it through the callable the dispatcher hands in.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from shared_schema import Chunk, JobError, Result
from shared_schema.answers import LOGPROB_BYTE_WEIGHT, LOGPROB_ENTRY_WEIGHT, LogprobLimits
from shared_schema.images import IMAGE_ORDER, result_chars_bound
from shared_schema.protocol import TrainReport

# The id prefix of embeddings jobs (``http.openai``); every other job is a chat completion. The
# link checks an answer's shape by it.
EMBEDDINGS_JOB = "embd-"
IMAGES_JOB = "img-"  # image jobs (issue 38)

CancelSender = Callable[[str, str], Awaitable[None]]

# --- how much a worker may send for one job -----------------------------------------------------
#
# A job's answer is bounded by its ``max_tokens``, so what the worker may send for it is too: the
# link charges every chunk frame's length (characters of the whole frame, which ``len`` gives in
# O(1): the content and everything around it, all of which the queen keeps and relays) against
# the job's budget, and a frame past it fails the job. Since every chunk waiting in the handle's
# deque was charged, the budget also bounds the deque when the client reads slowly.
#
# The allowance per token is generous for an honest worker. The longest token pieces of the
# vocabularies llama.cpp loads are runs of whitespace or code of a few dozen bytes; 128 bytes is
# past every one. A byte of content takes at most 6 characters in the frame (a control character
# escaped as ``\u0001``; other text is sent unescaped), and an honest chunk frame's own JSON (type,
# ids, object, created, the worker's model name, choice, delta, finish reason) is a few hundred
# characters: 6 * 128 + 1280 = 2048 characters per token. A checkpoint (a plain answer's text, one
# every second) holds at least a token, so it fits the same allowance.
TOKEN_PIECE_BYTES = 128
FRAME_CHARS_PER_TOKEN = 6 * TOKEN_PIECE_BYTES + 1280
# Past the tokens: the role chunk, the finish chunk, the usage chunk and a worker's own extras.
BUDGET_SLACK_CHARS = 64 * 1024
# No single chunk frame may be larger than this (nor than the job's whole budget): an honest
# chunk holds a token, a checkpoint a second of tokens.
MAX_CHUNK_CHARS = 1024 * 1024
# For a request that names no limit and a handle made without one (tests): the queen's default.
DEFAULT_MAX_TOKENS = 4096
# The code of the retryable ``JobError`` a job gets when its worker sent more than its budget.
ANSWER_TOO_LARGE = "answer_too_large"


def completion_limit(openai_req: Mapping[str, Any], default_max_tokens: int) -> int:
    """The most tokens an answer to ``openai_req`` may have: its ``max_completion_tokens`` or
    ``max_tokens`` (as the worker reads them), else ``default_max_tokens``."""
    asked = openai_req.get("max_completion_tokens") or openai_req.get("max_tokens")
    if isinstance(asked, int) and not isinstance(asked, bool) and asked > 0:
        return asked
    return default_max_tokens


# With ``logprobs``, each token also carries an entry for itself and one per ``top_logprobs``:
# its piece (escaped, as above), its bytes as a JSON list (up to 4 characters a byte) and the
# number, 6 * 128 + 4 * 128 + 64 characters; and what the queen keeps of it once decoded, which
# the link charges too (``answers.answer_check``'s weight): an object, and a pointer a byte.
LOGPROB_ENTRY_CHARS = (6 * TOKEN_PIECE_BYTES + 4 * TOKEN_PIECE_BYTES + 64
                       + LOGPROB_ENTRY_WEIGHT + LOGPROB_BYTE_WEIGHT * TOKEN_PIECE_BYTES)


@dataclass(frozen=True, slots=True)
class AnswerBudget:
    """What a worker may send for one job: ``chars`` of frames (with the weight of the log
    probabilities they carry), and the log probabilities themselves (``logprobs``)."""

    chars: int
    logprobs: LogprobLimits


def logprob_limits(openai_req: Mapping[str, Any]) -> LogprobLimits:
    """The log probabilities an answer to ``openai_req`` may carry: none unless it asked
    (``logprobs``), then ``top_logprobs`` alternatives a token, and per choice, past its text's
    bytes, the tokens of its longest stop string (generated, never delivered) and the end."""
    if not openai_req.get("logprobs"):
        return LogprobLimits(None, 0)
    top = openai_req.get("top_logprobs")
    stop = openai_req.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    stop_bytes = max((len(item.encode("utf-8", "surrogatepass")) for item in stops
                      if isinstance(item, str)), default=0)
    return LogprobLimits(top if isinstance(top, int) and not isinstance(top, bool) and top > 0
                         else 0, stop_bytes + 1)


def choices_in(openai_req: Mapping[str, Any]) -> int:
    """How many answers one job makes: ``n``, times the prompts of a text completion."""
    n = openai_req.get("n")
    prompt = openai_req.get("prompt")
    if n is None and prompt is None:  # a chat request with one choice: most of them
        return 1
    choices = n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        choices *= len(prompt)
    return choices


def answer_budget(openai_req: Mapping[str, Any], default_max_tokens: int = DEFAULT_MAX_TOKENS
                  ) -> AnswerBudget:
    """What a worker may send for one job of ``openai_req``: the characters of chunk frames,
    per token of every choice the frame and its log probabilities if asked, and the log
    probabilities' limits."""
    logprobs = logprob_limits(openai_req)
    if openai_req.get("type") == IMAGE_ORDER:  # issue 38: images, bounded by their pixels
        return AnswerBudget(result_chars_bound(dict(openai_req)), logprobs)
    per_token = FRAME_CHARS_PER_TOKEN
    if logprobs.top is not None:
        per_token += LOGPROB_ENTRY_CHARS * (1 + logprobs.top)
    tokens = completion_limit(openai_req, default_max_tokens) * choices_in(openai_req)
    return AnswerBudget(tokens * per_token + BUDGET_SLACK_CHARS * choices_in(openai_req),
                        logprobs)


# Who shares a model group's answer (issue 19): (worker key, layers held), the head first.
Shares = tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class Credit:
    """Whom one attempt of a job is credited to: the worker's earnings key (None: not paid)
    and, when it served as a model group's head, the group's shares as they were when it was
    given the job (a group that ends or re-forms later does not change who did the work)."""

    key: str | None
    shares: Shares = ()


@dataclass(frozen=True, slots=True)
class Part:
    """What one worker did for one request. A request that failed over mid-answer has one part
    per worker; the developer pays for their sum once, and each worker is credited its own. A
    group head's part carries its group's ``shares`` (``billing.shares.split_parts``)."""

    worker_key: str | None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    completed: bool = True  # the worker ended the answer (counts as a job for its record)
    shares: Shares = ()


@dataclass(frozen=True, slots=True)
class WorkerLost:
    """Fed to a job when its worker disconnects, is replaced, or misses its heartbeats."""

    reason: str


# A training job's progress (``TrainReport``, issue 37) comes between its start and its end.
JobEvent = Chunk | Result | JobError | WorkerLost | TrainReport


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


async def _no_cancel(job_id: str, reason: str) -> None:
    """For a handle made without a connection (tests): there is no worker to tell."""


class Mailbox:
    """A job's events in arrival order, awaited with a deadline: a deque plus one waiter future
    and one timer. ``JobHandle`` is one; so is a job served by another replica
    (``cluster.remote.RemoteJob``)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[JobEvent] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, event: JobEvent) -> None:
        self._items.append(event)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next(self, deadline: float) -> JobEvent:
        """The next event, or ``TimeoutError`` once the loop clock passes ``deadline``."""
        if self._items:
            return self._items.popleft()
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiter = waiter
        timer = loop.call_at(deadline, _wake, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
        if self._items:
            return self._items.popleft()
        raise TimeoutError

    def take_ready(self) -> list[JobEvent]:
        """Every event already waiting, without blocking (to batch writes to the client)."""
        items = list(self._items)
        self._items.clear()
        return items


class JobHandle(Mailbox):
    """A job leased to one worker, from the job frame until its end (the whole stream).

    ``worker_key`` and ``worker_id`` (the public id) name the worker for the registry, the stats
    and the logs (``replica`` names the replica that holds it, for a job on another replica);
    ``cancel`` sends the job's cancel through whatever connection holds it.

    ``budget`` is the characters of frames the worker may send for the job (``answer_budget``):
    the link takes each chunk's length, and the weight of the log probabilities it carries, from
    ``room`` and fails the job once a chunk would take more than is left, or more than
    ``chunk_cap``; a whole answer (a result) may be as large as the budget. Every event in the
    deque was charged, and so was every log-probability entry the answer keeps, so neither
    holds more than it. ``logprobs``: what log probabilities the answer may carry at all.
    """

    __slots__ = (
        "_cancel",
        "budget",
        "cancelling",
        "chunk_cap",
        "finished",
        "first_at",
        "group",
        "id",
        "load",
        "logprobs",
        "model",
        "on_end",
        "replica",
        "room",
        "shares",
        "started_at",
        "worker_id",
        "worker_key",
    )

    def __init__(
        self,
        job_id: str,
        model: str,
        worker_key: str,
        started_at: float,
        *,
        worker_id: str = "",
        cancel: CancelSender = _no_cancel,
        budget: AnswerBudget | None = None,
        replica: str | None = None,
    ) -> None:
        self.id = job_id
        self.replica = replica  # the replica serving it, for a job on another replica
        self.model = model
        self.worker_key = worker_key
        self.worker_id = worker_id or worker_key
        self.started_at = started_at
        self.finished = False
        self.cancelling = False
        self.first_at: float | None = None
        self.on_end: Callable[[JobHandle], None] | None = None
        if budget is None:
            budget = answer_budget({})
        self.budget = budget.chars
        self.logprobs = budget.logprobs
        self.room = self.budget  # what is left of the budget (the link takes from it)
        self.chunk_cap = min(self.budget, MAX_CHUNK_CHARS)
        # How many jobs its worker ran when it was leased, itself included (speed records
        # are kept per load: ``stats/load.py``); 1 until the dispatcher says.
        self.load = 1
        self.group = ""  # the model group its worker headed when given the job, if any
        self.shares: Shares = ()  # that group's shares then (``Credit``)
        self._cancel = cancel
        super().__init__()

    def __repr__(self) -> str:
        return f"<JobHandle {self.id} on {self.worker_id}{' finished' if self.finished else ''}>"

    def feed(self, event: JobEvent) -> None:
        if not isinstance(event, Chunk | TrainReport):
            self.finished = True
            if self.on_end is not None:
                self.on_end(self)
        self.put(event)

    async def cancel(self, reason: str) -> None:
        """Tell the worker to stop this job (a legacy worker's connection sends nothing)."""
        await self._cancel(self.id, reason)
