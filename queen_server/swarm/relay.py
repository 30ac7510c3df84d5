"""Turning a job's frames into the answer the client asked for, across the workers that serve it.

``Delivered`` keeps the books of one answer as its frames arrive: the text so far, the tokens each
worker delivered, and the continuation a twin worker goes on from when a worker is lost mid-answer
(``hand_over``). ``collect`` gathers a whole answer, and ``assemble_chat`` turns it into the
client's JSON; the streamed answer's SSE body is the HTTP edge's (``queen_server.http.sse``), on
the same books. The shapes themselves are built in ``shared_schema.answers``.

Only the standard library, ``shared_schema`` and the queen's errors here: this is the swarm's core.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Coroutine
from typing import Any, TypeVar

from queen_server.errors import ApiError, InvalidRequest, WorkerFailed
from queen_server.swarm.dispatch import Dispatcher
from queen_server.swarm.jobs import Credit, Part, WorkerLost
from queen_server.swarm.metering import UNBOUNDED, Meter, content_text, counted, utf8_bytes
from queen_server.swarm.runs import JobRun, can_fail_over
from shared_schema import Chunk, JobError, Result, Usage
from shared_schema.answers import CHAT_ANSWER, STOP, AnswerStamp, message_choice

T = TypeVar("T")


def failure(event: JobError | WorkerLost) -> ApiError:
    """The client's error for a job that failed (the worker gave up, or was lost). A worker
    that refused the request as invalid (a schema its grammar cannot express, a token id past
    its vocabulary) gives the client a 400 with its reason."""
    if isinstance(event, WorkerLost):
        return WorkerFailed(f"the worker was lost mid-answer: {event.reason}", code="worker_lost")
    if event.code == "invalid_request":
        return InvalidRequest(f"the worker refused the request: {event.message[:2000]}",
                              code="invalid_request")
    return WorkerFailed(f"the worker failed: {event.message}", code=event.code or "worker_error")


MAX_CHOICE_TEXTS = 128  # choices whose own text is kept (the queen caps n far below)


class Delivered:
    """What one answer has given the client so far, across the workers that served it.

    When a worker is lost mid-answer its part is closed (the tokens it delivered) and the text so
    far becomes the continuation for the next worker, whose chunks then carry only new text.

    Every part's tokens are bounded by the ``Meter``: a worker's count (its usage, its
    checkpoints) is believed only up to what the text it delivered could hold, so the parts
    (what is charged and credited) and the usage (what the client is told and the speed records
    use) never rest on a worker's word alone.
    """

    __slots__ = ("_by_choice", "_part_start", "_text", "carried", "carried_logprobs",
                 "choice_finish", "continuing", "finish_reason", "logprobs", "meter",
                 "part_starts", "parts", "saw_chunk", "serving", "single", "started", "tokens")

    def __init__(self, meter: Meter = UNBOUNDED) -> None:
        self.meter = meter
        self._text: list[str] = []
        self._part_start = 0  # where the current worker's text begins in ``_text``
        self.carried = ""  # the text handed to the worker serving now, as its continuation
        self.tokens = 0  # tokens the current worker's chunks claim (``Chunk.tokens``; bounded
        # by the bytes they delivered wherever they are used)
        self.parts: list[Part] = []  # closed parts of workers that were lost
        self.continuing = False
        self.saw_chunk = False
        self.single = True  # only choice 0 seen: a continuation is well defined
        self.finish_reason: str | None = None
        self.started = False  # a worker has the job (it has read the prompt, or is reading it)
        self.serving = Credit(None)  # whom that worker's part is credited to
        # The log probabilities of the text so far, when the answer carries them (a plain
        # answer's checkpoints do): a twin's whole answer only has those of its own text.
        self.logprobs: list[Any] | None = None
        self.carried_logprobs: list[Any] | None = None  # those of ``carried``
        # Each choice's own text and end (issue 39: the audits score each choice; ``_text``
        # interleaves them as they arrive), and where each worker's text begins in the text
        # (characters; the first at 0): a failover's parts, each audited on its own span.
        self._by_choice: dict[int, list[str]] = {}
        self.choice_finish: dict[int, str] = {}
        self.part_starts: list[int] = [0]

    @property
    def text(self) -> str:
        return "".join(self._text)

    def choice_texts(self) -> dict[int, str]:
        """Each choice's text as streamed, by index (its own pieces, not interleaved)."""
        if not self._by_choice:  # one choice (nearly every answer): no second copy kept
            return {0: self.text} if self._text else {}
        return {index: "".join(pieces) for index, pieces in self._by_choice.items()}

    def sent(self, credit: Credit) -> None:
        """A worker was given the job (``Dispatcher.start``'s ``sent``)."""
        self.started, self.serving = True, credit

    @property
    def delivered_tokens(self) -> int:
        """Tokens delivered so far: the closed parts, and the current worker's claim bounded by
        the bytes it delivered (a twin's ``max_tokens`` is the request's less these)."""
        current = min(self.tokens, self._part_bytes())
        return sum(part.completion_tokens for part in self.parts) + current

    def take(self, data: dict[str, Any], tokens: int = 1) -> dict[str, Any] | None:
        """Note one chunk that claims ``tokens`` (``Chunk.tokens``: a worker's joined frame);
        returns it to forward (without a repeated role), or None to drop."""
        self.saw_chunk = True
        keep = not self.continuing
        for choice in data.get("choices") or ():
            index = choice.get("index", 0)
            if index:
                self.single = False
            delta = choice.get("delta") or {}
            content = delta.get("content")
            if content:
                self._text.append(content)
                if isinstance(index, int) and 0 < index < MAX_CHOICE_TEXTS:
                    if not self._by_choice:  # until now the text was choice 0's alone
                        self._by_choice[0] = self._text[:-1]
                    self._by_choice.setdefault(index, []).append(content)
                elif index == 0 and self._by_choice:
                    self._by_choice[0].append(content)
                self.tokens += _tokens_in(data, tokens)
                keep = True
                logprobs = choice.get("logprobs")
                if logprobs and isinstance(logprobs.get("content"), list):
                    if self.logprobs is None:
                        self.logprobs = []
                    self.logprobs.extend(logprobs["content"])
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                if isinstance(index, int) and 0 <= index < MAX_CHOICE_TEXTS:
                    self.choice_finish[index] = str(choice["finish_reason"])
                keep = True
            if self.continuing and "role" in delta:
                choice["delta"] = {k: v for k, v in delta.items() if k != "role"}
        return data if keep or data.get("usage") is not None else None

    def _part_bytes(self) -> int:
        """Bytes of the text the current worker has delivered."""
        return utf8_bytes("".join(self._text[self._part_start:]))

    def lost(self, credit: Credit) -> None:
        """The current worker failed: close its part and continue from the text so far."""
        self.parts.append(Part(credit.key, 0, min(self.tokens, self._part_bytes()),
                               completed=False, shares=credit.shares))
        self.tokens = 0
        self._part_start = len(self._text)
        self.continuing = True
        self.carried = self.text
        self.part_starts.append(len(self.carried))
        self.carried_logprobs = None if self.logprobs is None else list(self.logprobs)

    def done(
        self, credit: Credit, usage: Usage, final_text: str | None = None
    ) -> tuple[list[Part], Usage]:
        """The answer ended on the worker ``credit`` names: every worker's part, and the
        answer's usage, as the queen bills them (``Meter.bill``: the worker's claim, bounded).

        ``final_text`` is what the last worker delivered in its result (a whole answer); None
        when it delivered its text in chunks. The last worker read the continuation as prompt;
        the developer pays for the original prompt once (credited to the first worker), which is
        the last worker's prompt less the tokens delivered before it."""
        delivered = self._part_bytes() if final_text is None else utf8_bytes(final_text)
        if not self.parts:
            billed = self.meter.bill(usage, delivered)
            return [Part(credit.key, billed.prompt_tokens, billed.completion_tokens,
                         shares=credit.shares)], billed
        before = sum(part.completion_tokens for part in self.parts)
        first = self.parts[0]
        last = min(usage.completion_tokens, self.meter.completion_bound(delivered))
        parts = [
            Part(first.worker_key,
                 min(max(0, usage.prompt_tokens - before), self.meter.prompt_bound),
                 first.completion_tokens, completed=False, shares=first.shares),
            *self.parts[1:],
            Part(credit.key, 0, last, shares=credit.shares),
        ]
        prompt = parts[0].prompt_tokens
        completion = sum(part.completion_tokens for part in parts)
        return parts, counted(prompt, completion)

    def last_worker_usage(
        self, claimed: Usage, parts: list[Part], billed: Usage | None = None
    ) -> Usage:
        """What the worker that ended the answer did, as its speed record counts it: its
        billed part, with the prompt it read (the continuation too, after a failover).
        ``billed``: the answer's billed usage, which it is when one worker served it all."""
        if billed is not None and len(parts) == 1:
            return billed
        completion = parts[-1].completion_tokens
        before = sum(part.completion_tokens for part in parts[:-1])
        prompt = min(claimed.prompt_tokens, self.meter.prompt_bound + before)
        return counted(prompt, completion)

    def broken(self, credit: Credit, *, client_left: bool = False) -> list[Part]:
        """The parts of an answer that ended early (client gone, no twin, timeout): the tokens
        each worker delivered. A client that left also pays the prompt the swarm read for it
        (no usage came, so the hold's estimate, within the bound), credited to the first worker;
        an answer the swarm failed to finish charges no prompt."""
        parts = [*self.parts, Part(credit.key, 0, min(self.tokens, self._part_bytes()),
                                   completed=False, shares=credit.shares)]
        if client_left:
            first = parts[0]
            parts[0] = Part(first.worker_key, self.meter.prompt_estimate,
                            first.completion_tokens, completed=False, shares=first.shares)
        return [part for part in parts if part.completion_tokens or part.prompt_tokens]


def message_text(data: dict[str, Any]) -> str | None:
    """The text a whole answer delivers (every choice's message), or None if it has none."""
    choices = data.get("choices")
    if not choices:
        return None
    return "".join(content_text((choice.get("message") or {}).get("content"))
                   for choice in choices if isinstance(choice, dict))


def _tokens_in(data: dict[str, Any], tokens: int) -> int:
    """Tokens in one chunk's content: what the frame claims (one, or the chunks a worker
    joined), or what a plain answer's checkpoint counts."""
    usage = data.get("usage")
    if usage is not None and isinstance(usage, dict) and isinstance(
            usage.get("completion_tokens"), int):
        return max(1, usage["completion_tokens"])
    return tokens


async def hand_over(run: JobRun, answer: Delivered, dispatcher: Dispatcher) -> JobRun:
    """The worker of ``run`` failed mid-answer: close its part, end its lease, and go on with
    the answer on a twin (``Dispatcher.fail_over``, which raises when there is none)."""
    answer.lost(run.credit)
    await run.finish("continuing on another worker")
    return await dispatcher.fail_over(run, answer.text, answer.delivered_tokens)


class Collected:
    """A whole answer gathered from its frames (possibly from more than one worker)."""

    __slots__ = ("answer", "parts", "result", "usage")

    def __init__(self, result: Result, answer: Delivered, parts: list[Part], usage: Usage) -> None:
        self.result = result
        self.answer = answer
        self.parts = parts
        self.usage = usage


def assemble_chat(ctx: AnswerStamp, collected: Collected) -> dict[str, Any]:
    """The whole answer of a chat completion, from the worker's answer or the chunks."""
    result = collected.result
    if result.data.get("choices") and not collected.answer.continuing:
        answer = ctx.stamp(dict(result.data), CHAT_ANSWER)
    else:
        delivered = collected.answer
        text = delivered.text
        finish_reason = delivered.finish_reason
        logprobs = delivered.logprobs
        if result.data.get("choices"):  # the last worker's whole part, after a failover
            text = delivered.carried
            logprobs = delivered.carried_logprobs
            for choice in result.data["choices"]:
                text += (choice.get("message") or {}).get("content") or ""
                finish_reason = choice.get("finish_reason") or finish_reason
                last = choice.get("logprobs")
                if last and isinstance(last.get("content"), list):
                    logprobs = [*(logprobs or []), *last["content"]]
        choice = message_choice(text, finish_reason or STOP)
        if logprobs is not None:
            choice["logprobs"] = {"content": logprobs}
        answer = ctx.answer([choice])
    answer["usage"] = collected.usage.model_dump()
    return answer


async def collect(run: JobRun, dispatcher: Dispatcher, meter: Meter,
                  answer: Delivered | None = None) -> Collected:
    """Every chunk of a job and its result, continuing on a twin worker if the worker is lost
    mid-answer. Ends every lease it holds. Raises the job's failure as an ``ApiError``.
    The usage is billed through ``meter`` (``Delivered``): required, so that no caller bills
    a worker's claim by forgetting it (tests of the books alone pass ``UNBOUNDED``). A caller
    that passes its own ``answer`` can bill what the swarm did if the client leaves."""
    answer = answer if answer is not None else Delivered(meter)
    current: JobRun | None = run
    event = run.first
    try:
        while True:
            answer.started, answer.serving = True, run.credit
            if isinstance(event, Result):
                parts, usage = answer.done(run.credit, event.usage,
                                           message_text(event.data))
                dispatcher.record_result(
                    run.handle, answer.last_worker_usage(event.usage, parts, usage),
                    streamed=False)
                return Collected(event, answer, parts, usage)
            if isinstance(event, Chunk):
                answer.take(event.data, event.tokens)
            else:
                error = failure(event)
                run.record_failure(error.code or "worker_error")
                if not (can_fail_over(event) and answer.single):
                    raise error
                current = None
                run = await hand_over(run, answer, dispatcher)
                current = run
                event = run.first
                continue
            event = await run.next()
    finally:
        if current is not None:
            await run_to_end(current.finish())


async def run_to_end(cleanup: Coroutine[Any, Any, T]) -> T:
    """Await ``cleanup`` to its end even if this task is cancelled meanwhile, then raise the
    cancellation, if one came; the cleanup's own result or error otherwise.

    A lease must end (and the worker hear ``cancel``) even when the client's disconnect cancels
    the request mid-cleanup. The cleanup runs as its own task, so a cancellation of this one
    does not reach it, and this task waits on a future of its own (``asyncio.shield`` would let
    the cancellation through at once, with the cleanup still running). However many
    cancellations arrive meanwhile, the first is raised once the cleanup has finished, as it
    came, so ``asyncio.timeout`` and ``Task.uncancel`` still read it as theirs. A cleanup that
    fails as well is kept as the cancellation's cause.
    """
    loop = asyncio.get_running_loop()
    task = loop.create_task(cleanup)
    cancelled: asyncio.CancelledError | None = None
    while not task.done():
        waiter: asyncio.Future[None] = loop.create_future()
        task.add_done_callback(functools.partial(_wake, waiter))
        try:
            await waiter
        except asyncio.CancelledError as exc:  # only this task's: the waiter is ours alone
            cancelled = cancelled or exc
    if cancelled is not None:
        if not task.cancelled() and task.exception() is not None:
            raise cancelled from task.exception()
        raise cancelled
    return task.result()


def _wake(waiter: asyncio.Future[None], _task: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_result(None)
