"""The ``/worker`` websocket: the Starlette adapter around the queen's link machine.

What a frame means, the handshake included, is decided in ``swarm.link``; this module only moves
text between the socket and the machine, carries out the machine's actions, times the hello and
the heartbeats, and keeps the registry, the stats and the database true to who is connected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from queen_server import reports
from queen_server.identity import HelloGate, origins_of
from queen_server.swarm.link import (
    Admit,
    Close,
    FetchRefused,
    GroupReport,
    QueenLink,
    Refuse,
    RelayIn,
    Send,
    StatusChanged,
)
from queen_server.swarm.worker import Worker
from shared_schema import PROTOCOL_VERSION, SUBPROTOCOL, GroupClose, GroupOpen
from shared_schema.protocol import CLOSE_REPLACED
from shared_schema.training import AdapterRef

if TYPE_CHECKING:
    from queen_server.runtime import QueenState

log = logging.getLogger(__name__)


class Disconnected(Exception):
    pass


class WorkerSocket:
    """One worker's websocket as the swarm's ``Connection``: the link encodes, this sends.

    A worker is registered (routable) before its welcome is sent, so a request that arrives
    while the welcome is on its way finds it instead of a 404; every frame for it but the
    welcome waits for ``welcomed`` (set once the welcome is sent; an awaited set event does not
    suspend), so none reaches the worker before its welcome."""

    __slots__ = ("link", "websocket", "welcomed")

    def __init__(self, websocket: WebSocket, link: QueenLink) -> None:
        self.websocket = websocket
        self.link = link
        self.welcomed = asyncio.Event()

    async def send_text(self, frame: str) -> None:
        await self.welcomed.wait()
        await self.send_now(frame)

    async def send_now(self, frame: str) -> None:
        """Send at once: the handshake's frames (challenge, refusal) and the welcome."""
        await self.websocket.send({"type": "websocket.send", "text": frame})

    async def send_welcome(self, frame: str | None) -> None:
        """The welcome (None: a legacy worker gets none), then every frame waiting for it."""
        if frame is not None:
            await self.send_now(frame)
        self.welcomed.set()

    async def send_job(
        self,
        job_id: str,
        openai_url: str,
        openai_req: dict[str, Any],
        continuation: str | None = None,
        cache_scope: str | None = None,
        adapter: AdapterRef | None = None,
    ) -> None:
        await self.send_text(self.link.job_frame(job_id, openai_url, openai_req, continuation,
                                                 cache_scope, adapter))

    async def send_cancel(self, job_id: str, reason: str) -> None:
        frame = self.link.cancel_frame(job_id, reason)
        if frame is not None:
            await self.send_text(frame)

    async def send_frame(self, frame: str) -> None:
        await self.send_text(frame)

    async def send_bytes(self, frame: bytes) -> None:
        await self.welcomed.wait()
        await self.websocket.send({"type": "websocket.send", "bytes": frame})

    async def close(self, code: int, reason: str) -> None:
        if self.websocket.application_state != WebSocketState.DISCONNECTED:
            await self.websocket.close(code, reason[:120])


async def worker_endpoint(websocket: WebSocket) -> None:
    state: QueenState = websocket.app.state.queen
    settings = state.settings
    loop = asyncio.get_running_loop()
    v1 = SUBPROTOCOL in websocket.scope.get("subprotocols", ())
    await websocket.accept(subprotocol=SUBPROTOCOL if v1 else None)
    # The hello must be signed for one of this queen's origins; the Host header's origin only
    # explains a refusal (or, bound to a wildcard with no public URL, is the origin).
    gate = HelloGate(settings.lnurl_insecure_hosts,
                     origins_of(websocket.app).for_scope(websocket.scope))
    terms = reports.worker_terms(state)
    pays = bool(terms["pays"])
    link = QueenLink(settings, gate, v1=v1, now=loop.time(), clock=time.time,
                     pays_workers=pays,
                     payout_threshold_msat=int(terms["payout_threshold_sats"]) * 1000,
                     demand=state.placement.demand)
    socket = WorkerSocket(websocket, link)
    try:
        admit = await _handshake(websocket, socket, settings.hello_timeout_s)
    except (Disconnected, WebSocketDisconnect):
        return
    if admit is None:
        return
    worker = admit.worker
    worker.peer_host = websocket.client.host if websocket.client else None

    if state.db is not None and not worker.legacy:
        await state.db.record_worker(worker.key, worker.public_id, worker.ln_url,
                                     worker.worker_version)
    await state.audits.joined(worker)  # a flagged worker is registered out of routing
    heartbeat = None
    reason, close_code = "disconnected", 1000
    try:
        # Registered first, so a request arriving now finds it; its frames wait for the welcome.
        older = state.registry.add(worker, socket)
        await socket.send_welcome(admit.welcome)
        state.catalog.prefetch(sorted(worker.cached))  # price its models by the queen's reading
        link.registered(state.registry.leases_of(worker.key))
        state.stats.connected(worker.key, worker.public_id, worker.worker_version)
        if older is not None:
            with contextlib.suppress(Exception):
                await older.close(CLOSE_REPLACED, "replaced by a newer session")
        log.info(
            "worker %s joined (%s, %d job slots, models: %s)",
            worker.public_id,
            "legacy" if worker.legacy else f"v{PROTOCOL_VERSION} {worker.worker_version}",
            worker.max_jobs,
            ", ".join(sorted(worker.cached)) or "none",
        )
        if not worker.legacy:
            heartbeat = asyncio.create_task(_heartbeat(socket, worker, state))
        reason, close_code = await _read_loop(websocket, socket, worker, state)
    except (Disconnected, WebSocketDisconnect, OSError) as exc:
        reason = f"connection lost ({type(exc).__name__})"
    finally:
        socket.welcomed.set()  # a frame still waiting for a welcome that never went: it fails
        if heartbeat is not None:
            heartbeat.cancel()
        state.placement.left(worker)
        state.groups.left(worker)
        if state.registry.remove(worker, reason) or state.registry.get(worker.key) is None:
            state.stats.disconnected(worker.key)
        with contextlib.suppress(Exception):
            await socket.close(close_code, reason)


async def _handshake(
    websocket: WebSocket, socket: WorkerSocket, timeout_s: float
) -> Admit | None:
    """Challenge a v1 worker, wait ``timeout_s`` for its first frame, and carry out the link's
    verdict: the admission, or None once a refusal was sent."""
    link = socket.link
    for action in link.opened():
        if isinstance(action, Send):
            await socket.send_now(action.frame)
    try:
        async with asyncio.timeout(timeout_s):
            message = await websocket.receive()
    except TimeoutError:
        actions = link.hello_timeout()
    else:
        if message["type"] == "websocket.disconnect":
            raise Disconnected(message.get("code", 1000))
        actions = link.receive(message.get("text"), asyncio.get_running_loop().time())
    for action in actions:
        if isinstance(action, Admit):
            return action
        if isinstance(action, Refuse):
            log.warning("refused a worker from %s: %s", _peer(websocket), action.reason)
            with contextlib.suppress(Exception):
                await socket.send_now(action.frame)
                await socket.close(action.close_code, action.reason)
    return None


async def _read_loop(
    websocket: WebSocket, socket: WorkerSocket, worker: Worker, state: QueenState
) -> tuple[str, int]:
    """Feed frames to the link until the worker goes or the link closes; returns why, and the
    close code to end with."""
    loop = asyncio.get_running_loop()
    receive = websocket.receive
    link_receive = socket.link.receive
    groups = state.groups
    while True:
        message = await receive()
        if message["type"] == "websocket.disconnect":
            return f"disconnected (code {message.get('code', 1005)})", 1000
        text = message.get("text")
        if text is None and (data := message.get("bytes")) is not None:
            actions = socket.link.receive_bytes(data, loop.time())
        else:
            actions = link_receive(text, loop.time())
        if not actions:
            continue
        for action in actions:
            if isinstance(action, RelayIn):
                await groups.relay.forward(worker, action.channel, action.frame)
            elif isinstance(action, Send):
                await socket.send_text(action.frame)
            elif isinstance(action, StatusChanged):
                state.registry.apply_status(worker, max_jobs=action.max_jobs,
                                            models=action.models, status=action.status)
                if action.models is not None:
                    state.catalog.prefetch(sorted(worker.cached))
                state.placement.on_status(worker)
            elif isinstance(action, FetchRefused):
                state.placement.fetch_failed(worker, action.failure)
            elif isinstance(action, GroupReport):
                if isinstance(action.message, GroupOpen | GroupClose):
                    await groups.on_channel(worker, action.message)
                else:
                    groups.on_report(worker, action.message)
            elif isinstance(action, Close):
                return action.reason, action.code


async def _heartbeat(socket: WorkerSocket, worker: Worker, state: QueenState) -> None:
    """Every interval, the link pings, or drops a worker silent for ``heartbeat_misses`` of
    them."""
    loop = asyncio.get_running_loop()
    interval = state.settings.heartbeat_interval_s
    while True:
        await asyncio.sleep(interval)
        for action in socket.link.tick(loop.time()):
            if isinstance(action, Close):
                state.registry.remove(worker, action.reason)
                with contextlib.suppress(Exception):
                    await socket.close(action.code, action.reason)
                return
            if isinstance(action, Send):
                try:
                    await socket.send_text(action.frame)
                except Exception:
                    return


def _peer(websocket: WebSocket) -> str:
    client = websocket.client
    return f"{client.host}:{client.port}" if client else "unknown"

