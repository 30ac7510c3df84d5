"""The websockets adapter around the link state machine: connect, feed frames in, carry actions
out, reconnect with backoff, and shut down gracefully (finish or cancel jobs, close with 1001).

A worker may know several URLs of one queen (its replicas, issue 18): each attempt that ends
moves on to the next (``backoff.QueenRotation``), failed ones hop at once until every URL has
failed, and a session that had been welcomed is retried within about a second, so a worker
whose replica was killed is back on another within seconds.

The hello is signed for the origin of the URL the connection actually reached (the configured
one, or where the queen's redirect led: websockets follows them), never one the queen names.

``retry_now`` cuts the wait before the next attempt short (the app's "Retry now", issue 35): the
backoff's sleep waits on that event as well as on ``stop``. The backoff itself goes on as it
was, so an owner's retry that fails does not reset the wait."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from desktop_worker.errors import HandshakeRefusedError, LinkError
from desktop_worker.jobs import JobRunner
from desktop_worker.link.backoff import Backoff, QueenRotation
from desktop_worker.link.machine import (
    Action,
    CancelJob,
    Close,
    DemandReceived,
    FetchModel,
    GroupCommand,
    GroupUplink,
    HelloFor,
    Link,
    RefusedByQueen,
    RelayData,
    Send,
    StartJob,
    State,
    Welcomed,
)
from desktop_worker.settings import DEFAULT_MAX_FRAME_BYTES
from shared_schema import (
    SUBPROTOCOL,
    Demand,
    Fetch,
    FetchFailed,
    GroupClose,
    GroupEnd,
    GroupFailed,
    GroupLead,
    GroupOpen,
    GroupServe,
    InvalidQueenUrl,
    Status,
    TrainReport,
    Usage,
    Welcome,
    queen_origin,
)

log = logging.getLogger(__name__)

CLOSE_GOING_AWAY = 1001
# A status asked for at once (``send_status_now``) still waits this long after the last one.
MIN_STATUS_GAP_S = 0.5


class _Sink:
    """Where a job's output goes: through the machine, onto this connection.

    A chunk is handed to the machine and not waited on: its frame is sent by a task of its own
    (``_pump``) while the engine goes on, and the chunks made during that send go out joined in
    the next frame (``Link.chunk_sent``). The job's end waits for the pump, so it comes last."""

    def __init__(self, client: LinkClient, link: Link) -> None:
        self.client = client
        self.link = link
        self._pump: asyncio.Task[None] | None = None

    async def chunk(self, job_id: str, data: dict[str, Any]) -> None:
        actions = self.link.chunk(job_id, data)
        if actions:
            self._pump = asyncio.create_task(self._send_chunks(job_id, actions))

    async def _send_chunks(self, job_id: str, actions: list[Action]) -> None:
        while actions:
            await self.client._act(self.link, actions)
            actions = self.link.chunk_sent(job_id)

    async def _sent(self) -> None:
        """Wait for the chunk frame being sent (the job's end must follow it)."""
        pump = self._pump
        if pump is not None:
            await asyncio.wait([pump])
            if not pump.cancelled() and pump.exception() is not None:
                log.warning("sending a chunk failed: %s", pump.exception())

    @property
    def origin(self) -> str:
        """The queen's origin this connection reached (a training job's files are there)."""
        return self.link.origin

    async def train_report(self, job_id: str, report: TrainReport) -> None:
        await self._sent()
        await self.client._act(self.link, self.link.train_report(report))

    async def result(self, job_id: str, data: dict[str, Any], usage: Usage) -> None:
        await self._sent()
        await self.client._act(self.link, self.link.result(job_id, data, usage))

    async def error(self, job_id: str, code: str, message: str, retryable: bool) -> None:
        await self._sent()
        await self.client._act(self.link, self.link.error(job_id, code, message, retryable))


# Reports a fetch that failed back to the queen (a no-op once the connection is gone).
FetchReport = Callable[[FetchFailed], Awaitable[None]]
# Sends a worker-to-queen group frame on the session that carried the command (issue 19): an
# answer, a relayed channel's open or close, or its bytes (``RelayData``, sent as binary
# frames). A no-op once that connection is gone.
GroupReport = Callable[[GroupUplink | RelayData], Awaitable[None]]
GroupCommandMessage = GroupServe | GroupLead | GroupEnd | GroupOpen | GroupClose
GroupHandler = Callable[[GroupCommandMessage, GroupReport], None]
# Takes a relayed channel's bytes from the queen; awaited, so a full channel holds the read loop
# (and TCP pushes back through the queen to the sender).
RelayHandler = Callable[[int, bytes], Awaitable[None]]


class LinkClient:
    """Keeps one worker connected to its queen until ``stop`` is set."""

    def __init__(
        self,
        url: str | Sequence[str],
        hello_for: Callable[[], Awaitable[tuple[HelloFor, int]]],
        runner: JobRunner,
        *,
        status: Callable[[], Awaitable[Status | None]] | None = None,
        status_interval_s: float = 30.0,
        shutdown_grace_s: float = 10.0,
        backoff: Backoff | None = None,
        on_state: Callable[[str, str], None] | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        on_welcome: Callable[[Welcome], None] | None = None,
        on_demand: Callable[[Demand], None] | None = None,
        on_fetch: Callable[[Fetch, FetchReport], None] | None = None,
        on_group: GroupHandler | None = None,
        on_relay: RelayHandler | None = None,
        on_session_end: Callable[[], None] | None = None,
    ) -> None:
        """``on_welcome`` is called with each session's welcome (also kept as ``welcome``):
        the worker's id, and whether the queen pays its workers. ``on_demand`` gets each demand
        message (also kept as ``demand``); ``on_fetch`` each fetch command, with the way to
        report its failure (without one, fetches are refused as ``not_allowed``). ``on_group``
        gets each group command with the way to answer it (without one, or while paused, a
        ``group_serve``/``group_lead`` is answered ``group_failed`` ``not_allowed``/``paused``
        at once, a ``group_open`` with ``group_close``, and a ``group_end`` or ``group_close`` is
        ignored); ``on_relay`` gets each relayed data frame's channel and bytes, awaited (without
        one they are dropped); ``on_session_end`` is called when a welcomed session ends (a
        group, and every relayed channel, does not outlive the session that formed it).

        ``url`` is the queen's worker URL, or a list of them (replicas), tried in turn; ``url``
        is then the one being dialled or served."""
        self.urls = [url] if isinstance(url, str) else list(url)
        if not self.urls:
            raise LinkError("no queen URL to connect to")
        self.url = self.urls[0]
        self.hello_for = hello_for
        self.runner = runner
        self.status = status
        self.status_interval_s = status_interval_s
        self.shutdown_grace_s = shutdown_grace_s
        self.backoff = backoff or Backoff()
        self.on_state = on_state
        self.max_frame_bytes = max_frame_bytes
        self.on_welcome = on_welcome
        self.on_demand = on_demand
        self.on_fetch = on_fetch
        self.on_group = on_group
        self.on_relay = on_relay
        self.on_session_end = on_session_end
        self.demand: Demand | None = None  # the last one the queen sent
        # Why the owner paused this worker (None: not paused): no new jobs, said in the status.
        self.paused: str | None = None
        self._link: Link | None = None
        self._max_jobs = 0
        self._status_now = asyncio.Event()
        self._retry_now = asyncio.Event()  # the owner's "Retry now": end the wait at once
        self.state = "stopped"
        self.welcome: Welcome | None = None  # the last session's
        self._ws: ClientConnection | None = None
        self._session_up = False  # the current attempt was welcomed
        # Why the last attempt ended (None: the session ended without an error), for the app.
        self.last_error: BaseException | None = None

    def _set_state(self, state: str, detail: str = "") -> None:
        self.state = state
        if self.on_state is not None:
            self.on_state(state, detail)

    async def run(self, stop: asyncio.Event) -> None:
        """Connect, serve, and reconnect until ``stop``; raises on a fatal refusal."""
        for url in self.urls:
            _origin_of(url)  # a URL that names no queen is the owner's to fix: fail now
        rotation = QueenRotation(self.urls, self.backoff)
        while not stop.is_set():
            self.url = rotation.current
            self._set_state("connecting", self.url)
            started = time.monotonic()
            self.last_error = None
            self._session_up = False
            try:
                await self._connect_and_serve(stop)
            except HandshakeRefusedError as exc:
                self._set_state("refused", str(exc))
                raise
            except InvalidURI as exc:
                raise LinkError(f"the queen URL {self.url!r} is not a websocket URL") from exc
            except (OSError, InvalidHandshake, ConnectionClosed, TimeoutError) as exc:
                self.last_error = exc
                log.warning("cannot reach the queen at %s: %s", self.url, exc or type(exc).__name__)
            if stop.is_set():
                break
            delay = rotation.after_attempt(welcomed=self._session_up,
                                           session_s=time.monotonic() - started)
            self._retry_now.clear()
            self._set_state("disconnected", f"reconnecting in {delay:.1f} s")
            log.info("reconnecting to the queen in %.1f s (%s)", delay, rotation.current)
            await self._wait_to_retry(stop, delay)
        self._set_state("stopped")

    def retry_now(self) -> bool:
        """Dial again at once instead of waiting out the backoff. True when a wait was cut
        short; False when the link is not waiting to reconnect (connecting, connected,
        stopped), where there is nothing to cut."""
        if self.state != "disconnected":
            return False
        log.info("retrying the queen now (asked by the owner)")
        self._retry_now.set()
        return True

    async def _wait_to_retry(self, stop: asyncio.Event, delay_s: float) -> None:
        """Sleep ``delay_s``, or less: until ``stop`` or ``retry_now``."""
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._retry_now.wait())]
        try:
            await asyncio.wait(waits, timeout=delay_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    async def _connect_and_serve(self, stop: asyncio.Event) -> None:
        hello_for, max_jobs = await self.hello_for()
        connecting = connect(
            self.url,
            subprotocols=[SUBPROTOCOL],
            compression=None,
            # websockets reads a frame's length before its payload, so an oversized frame is
            # refused (close 1009, then a reconnect) without being buffered.
            max_size=self.max_frame_bytes,
            open_timeout=15,
            ping_interval=20,
            ping_timeout=20,
            close_timeout=5,
        )
        async with connecting as ws:
            # ``connecting.uri`` is the URL this socket reached, after any redirect.
            link = Link(hello_for, 0 if self.paused else max_jobs, _origin_of(connecting.uri))
            self._ws = ws
            self._link = link
            self._max_jobs = max_jobs
            shutdown = asyncio.create_task(self._shutdown_on(stop, link, ws))
            status: asyncio.Task[None] | None = None
            try:
                async for frame in ws:
                    await self._act(link, link.receive(frame))
                    if status is None and link.welcome is not None and self.status:
                        status = asyncio.create_task(self._status_loop(link))
            finally:
                shutdown.cancel()
                if status is not None:
                    status.cancel()
                for action in link.connection_lost():
                    if isinstance(action, CancelJob):
                        self.runner.cancel(action.job_id)
                self._ws = None
                self._link = None
                code = ws.close_code
                if not stop.is_set() and link.welcome is not None:
                    log.warning("lost the queen at %s (close code %s)", self.url, code)
                if link.welcome is not None and self.on_session_end is not None:
                    self.on_session_end()

    async def _act(self, link: Link, actions: list[Action]) -> None:
        ws = self._ws
        for action in actions:
            if isinstance(action, Send):
                if ws is not None:
                    with contextlib.suppress(ConnectionClosed):
                        await ws.send(action.frame)
            elif isinstance(action, StartJob):
                self.runner.start(action.job, _Sink(self, link))
            elif isinstance(action, CancelJob):
                self.runner.cancel(action.job_id)
            elif isinstance(action, FetchModel):
                await self._fetch(link, action.fetch)
            elif isinstance(action, GroupCommand):
                await self._group(link, action.message)
            elif isinstance(action, RelayData):
                if self.on_relay is not None:
                    await self.on_relay(action.channel, action.payload)
            elif isinstance(action, DemandReceived):
                self.demand = action.demand
                if self.on_demand is not None:
                    self.on_demand(action.demand)
            elif isinstance(action, Welcomed):
                self.welcome = action.welcome
                self._session_up = True
                self._set_state("connected", f"worker id {action.welcome.worker_id}")
                log.info("connected to the queen at %s as worker %s (%s)", self.url,
                         action.welcome.worker_id, _pay_note(action))
                if self.on_welcome is not None:
                    self.on_welcome(action.welcome)
            elif isinstance(action, RefusedByQueen):
                if action.fatal:
                    raise HandshakeRefusedError(action.code, action.reason)
                log.warning("the queen refused this worker (%s): %s", action.code, action.reason)
            elif isinstance(action, Close) and ws is not None:
                await ws.close(action.code, action.reason)

    async def _fetch(self, link: Link, fetch: Fetch) -> None:
        async def report(failure: FetchFailed) -> None:
            if self._link is link:
                await self._act(link, link.fetch_failed(failure))

        refused = self.on_fetch is None or (fetch.group and self.on_group is None)
        if refused or self.paused:
            code = "paused" if self.paused else "not_allowed"
            why = (f"paused: {self.paused}" if self.paused
                   else "this worker takes no fetches" if self.on_fetch is None
                   else "this worker does not lead model groups")
            await report(FetchFailed(name=fetch.name, code=code, message=why))
            return
        self.on_fetch(fetch, report)

    async def _group(self, link: Link, message: GroupCommandMessage) -> None:
        async def report(answer: GroupUplink | RelayData) -> None:
            if self._link is not link:
                return
            if isinstance(answer, RelayData):
                await self._act(link, link.relay_data(answer.channel, answer.payload))
            else:
                await self._act(link, link.group_report(answer))

        if isinstance(message, GroupEnd | GroupClose):
            if self.on_group is not None:  # for no group of ours: the handler's to drop
                self.on_group(message, report)
            return
        if isinstance(message, GroupOpen) and self.on_group is None:
            await report(GroupClose(group=message.group, channel=message.channel,
                                    reason="this worker does not join model groups"))
            return
        if isinstance(message, GroupOpen):  # paused or not: the handler knows its channels
            self.on_group(message, report)
            return
        if self.on_group is None or self.paused:
            code = "paused" if self.paused else "not_allowed"
            why = (f"paused: {self.paused}" if self.paused
                   else "this worker does not join model groups")
            await report(GroupFailed(group=message.group, code=code, message=why))
            return
        self.on_group(message, report)

    def send_status_now(self) -> None:
        """Send a status as soon as possible (a download's progress, a model now loaded, a
        pause), rather than at the next interval."""
        self._status_now.set()

    def set_paused(self, reason: str | None) -> None:
        """Pause (take no new jobs: the queen gets a retryable ``busy``, and the status says
        why) or resume (``None``). Jobs in flight are the caller's to finish or hand back."""
        self.paused = reason
        link = self._link
        if link is not None and link.state is not State.CLOSED:
            link.max_jobs = 0 if reason else self._max_jobs
        self.send_status_now()

    async def _shutdown_on(self, stop: asyncio.Event, link: Link, ws: ClientConnection) -> None:
        await stop.wait()
        link.max_jobs = 0  # take no new jobs; the queen gets a retryable "busy"
        await self.runner.drain(self.shutdown_grace_s)
        await ws.close(CLOSE_GOING_AWAY, "the worker is shutting down")

    async def _status_loop(self, link: Link) -> None:
        assert self.status is not None
        last: Status | None = None
        while True:
            status = await self.status()
            if status is not None and _differs(status, last):
                await self._act(link, link.status(status))
                last = status
            self._status_now.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._status_now.wait(), self.status_interval_s)
            await asyncio.sleep(MIN_STATUS_GAP_S)  # a burst of changes goes out as one status


def _origin_of(url: str) -> str:
    try:
        return queen_origin(url)
    except InvalidQueenUrl as exc:
        raise LinkError(str(exc)) from exc


def _pay_note(welcomed: Welcomed) -> str:
    if welcomed.pays_workers is None:
        return "the queen does not say whether it pays workers"
    if not welcomed.pays_workers:
        return "this queen does not pay its workers"
    threshold = welcomed.payout_threshold_msat
    return "it pays workers" + (f", from {threshold // 1000} sats" if threshold else "")


def _differs(status: Status, last: Status | None) -> bool:
    if last is None:
        return True
    keys = {"models", "max_jobs", "vram_free_mb", "disk_space", "downloads", "paused",
            "model_room_mb"}
    return status.model_dump(include=keys) != last.model_dump(include=keys)
