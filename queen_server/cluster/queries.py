"""Reports across replicas: one replica asks, every other answers with its own part.

``/stats``, ``/worker/stats`` and the admin pages describe the whole swarm, but each replica
knows only the workers connected to it. ``Queries.ask`` broadcasts a ``ClusterQuery`` on one
channel that every replica reads; each other replica runs its ``answer(what, arg)`` (the
report's local part, from ``queen_server.reports``) and sends a ``ClusterAnswer`` to the
asker's answer channel. The asker knows how many replicas to wait for from the broadcast
itself (the bus counts the receivers, the asker among them), so it needs no directory read,
and waits at most ``timeout_s``: a slow or dead replica's part is left out, never waited on.

The caller merges the parts (``queen_server.stats.merge``) and caches the result
(``queen_server.replicas``), so a page polled by many browsers costs the other replicas one
answer a second, whatever the number of viewers.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from queen_server.cluster.bus import Bus, BusGap, Subscription
from queen_server.cluster.errors import BusUnavailable
from queen_server.cluster.remote import DEFAULT_NAMESPACE
from shared_schema import ProtocolError
from shared_schema.cluster import ClusterAnswer, ClusterQuery, Query, decode_cluster, encode_cluster

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 1.0
MAX_ANSWERING = 8  # queries answered at once; more wait (they are cached by their askers)

Answerer = Callable[[Query, str | None], Awaitable[Any]]


def query_channel(namespace: str = DEFAULT_NAMESPACE) -> str:
    return f"{namespace}:queries"


def answer_channel(replica_id: str, namespace: str = DEFAULT_NAMESPACE) -> str:
    return f"{namespace}:answers:{replica_id}"


class _Asking:
    __slots__ = ("answers", "done", "expected", "failed")

    def __init__(self) -> None:
        self.answers: dict[str, Any] = {}
        self.failed = 0  # replicas that answered with an error
        self.expected: int | None = None  # known once the broadcast says how many heard it
        self.done = asyncio.Event()

    def check(self) -> None:
        if self.expected is not None and len(self.answers) + self.failed >= self.expected:
            self.done.set()


class Queries:
    """This replica's end of the reports: it answers others' queries and asks its own."""

    def __init__(self, bus: Bus, replica_id: str, answer: Answerer, *,
                 namespace: str = DEFAULT_NAMESPACE,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.bus = bus
        self.replica_id = replica_id
        self.answer = answer
        self.timeout_s = timeout_s
        self.channel = query_channel(namespace)
        self.reply_to = answer_channel(replica_id, namespace)
        self._asking: dict[str, _Asking] = {}
        self._ids = itertools.count()
        self._subs: list[Subscription] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._answering: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(MAX_ANSWERING)

    async def start(self) -> Queries:
        queries = await self.bus.subscribe(self.channel)
        answers = await self.bus.subscribe(self.reply_to)
        self._subs = [queries, answers]
        self._tasks = [asyncio.create_task(self._read_queries(queries), name="queries-reader"),
                       asyncio.create_task(self._read_answers(answers), name="answers-reader")]
        return self

    async def ask(self, what: Query, arg: str | None = None) -> dict[str, Any]:
        """Every other live replica's part, by replica id (those that answered in time; a
        replica that failed to answer is left out). ``BusUnavailable`` when the bus is down."""
        query_id = f"{self.replica_id}.{next(self._ids)}"
        asking = self._asking[query_id] = _Asking()
        try:
            receivers = await self.bus.publish(self.channel, encode_cluster(ClusterQuery(
                id=query_id, origin=self.replica_id, reply_to=self.reply_to, what=what,
                arg=arg)))
            asking.expected = max(0, receivers - 1)  # the broadcast reached this replica too
            asking.check()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.timeout_s):
                    await asking.done.wait()
            if len(asking.answers) + asking.failed < asking.expected:
                log.info("query %s: %d of %d replicas answered in %.1f s", what,
                         len(asking.answers), asking.expected, self.timeout_s)
            return dict(asking.answers)
        finally:
            self._asking.pop(query_id, None)

    async def _read_queries(self, sub: Subscription) -> None:
        async for item in sub:
            if isinstance(item, BusGap):
                continue  # a lost query: its asker's timeout covers it
            message = self._decode(item, ClusterQuery)
            if message is None or message.origin == self.replica_id:
                continue
            task = asyncio.create_task(self._answer(message), name=f"answer-{message.id}")
            self._answering.add(task)
            task.add_done_callback(self._answering.discard)

    async def _answer(self, query: ClusterQuery) -> None:
        async with self._slots:
            try:
                data = await self.answer(query.what, query.arg)
                reply = ClusterAnswer(id=query.id, replica=self.replica_id, data=data)
            except Exception as exc:  # a part that failed is reported, not waited on
                log.exception("answering query %s (%s) failed", query.id, query.what)
                reply = ClusterAnswer(id=query.id, replica=self.replica_id, error=str(exc))
            try:
                await self.bus.publish(query.reply_to, encode_cluster(reply))
            except BusUnavailable as exc:
                log.info("answer to query %s not sent: %s", query.id, exc)

    async def _read_answers(self, sub: Subscription) -> None:
        async for item in sub:
            if isinstance(item, BusGap):
                continue
            message = self._decode(item, ClusterAnswer)
            if message is None:
                continue
            asking = self._asking.get(message.id)
            if asking is None:
                continue  # too late: the asker went on without it
            if message.error is not None:
                log.warning("replica %s could not answer query %s: %s", message.replica,
                            message.id, message.error)
                asking.failed += 1
            else:
                asking.answers[message.replica] = message.data
            asking.check()

    def _decode(self, item: bytes, kind: type[Any]) -> Any:
        try:
            message = decode_cluster(item)
        except ProtocolError as exc:
            log.warning("bad message on the query channels dropped: %s", exc.message)
            return None
        return message if isinstance(message, kind) else None

    async def close(self) -> None:
        for sub in self._subs:
            sub.close()
        tasks = [*self._tasks, *self._answering]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
