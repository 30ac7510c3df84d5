"""The ``/worker`` websocket: the handshake, the read loop and the heartbeat of one worker.

This is the I/O edge for workers. Deciding what a frame means happens in ``sessions``; this
module only moves frames, enforces limits and keeps the registry true to who is connected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from typing import TYPE_CHECKING

from pydantic import ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from queen_server.errors import HandshakeRefused
from queen_server.identity import new_nonce, public_id, verify_hello
from queen_server.payouts.lightning import InvalidPayoutAddress, parse_payout_address
from queen_server.swarm.sessions import UNKNOWN_JOB, LegacySession, WorkerSession
from shared_schema import (
    PROTOCOL_VERSION,
    SUBPROTOCOL,
    Challenge,
    Hello,
    JobError,
    LegacyRegistration,
    Ping,
    Pong,
    ProtocolError,
    Refused,
    Status,
    Welcome,
    encode,
    loads_object,
    looks_like_registration,
)
from shared_schema.protocol import CLOSE_HEARTBEAT, CLOSE_POLICY, CLOSE_REPLACED, CLOSE_TOO_BIG

if TYPE_CHECKING:
    from queen_server.runtime import QueenState

log = logging.getLogger(__name__)


class Disconnected(Exception):
    pass


class WebSocketTransport:
    """Adapts a Starlette websocket to the sessions' ``Transport``."""

    def __init__(self, websocket: WebSocket) -> None:
        self.websocket = websocket

    async def send_text(self, data: str) -> None:
        await self.websocket.send({"type": "websocket.send", "text": data})

    async def close(self, code: int, reason: str) -> None:
        if self.websocket.application_state != WebSocketState.DISCONNECTED:
            await self.websocket.close(code, reason[:120])


async def _receive_text(websocket: WebSocket) -> str:
    message = await websocket.receive()
    if message["type"] == "websocket.disconnect":
        raise Disconnected(message.get("code", 1000))
    text = message.get("text")
    if text is None:
        raise ProtocolError("binary_frame", "binary frames are not part of the protocol")
    return text


async def worker_endpoint(websocket: WebSocket) -> None:
    state: QueenState = websocket.app.state.queen
    v1 = SUBPROTOCOL in websocket.scope.get("subprotocols", ())
    await websocket.accept(subprotocol=SUBPROTOCOL if v1 else None)
    transport = WebSocketTransport(websocket)
    try:
        session = await _handshake(websocket, transport, state, v1=v1)
    except HandshakeRefused as refusal:
        log.warning("refused a worker from %s: %s", _peer(websocket), refusal.reason)
        with contextlib.suppress(Exception):
            await transport.send_text(encode(Refused(code=refusal.code, reason=refusal.reason)))
            await transport.close(refusal.close_code, refusal.reason)
        return
    except (Disconnected, WebSocketDisconnect):
        return

    if state.db is not None and not session.legacy:
        await state.db.record_worker(
            session.key, session.public_id, session.ln_url, session.worker_version
        )
    heartbeat = None
    reason = "disconnected"
    try:
        if not session.legacy:
            # Welcome first, then register: a job must never reach a worker before its welcome.
            await transport.send_text(
                encode(
                    Welcome(
                        session_id=session.session_id,
                        worker_id=session.public_id,
                        heartbeat_interval_s=state.settings.heartbeat_interval_s,
                    )
                )
            )
        older = state.registry.add(session)
        state.stats.connected(session.key, session.public_id, session.worker_version)
        if older is not None:
            with contextlib.suppress(Exception):
                await older.transport.close(CLOSE_REPLACED, "replaced by a newer session")
        log.info(
            "worker %s joined (%s, %d job slots, models: %s)",
            session.public_id,
            "legacy" if session.legacy else f"v{PROTOCOL_VERSION} {session.worker_version}",
            session.max_jobs,
            ", ".join(sorted(session.cached)) or "none",
        )
        if not session.legacy:
            heartbeat = asyncio.create_task(_heartbeat(session, state))
        reason = await _read_loop(websocket, session, state)
    except (Disconnected, WebSocketDisconnect, OSError) as exc:
        reason = f"connection lost ({type(exc).__name__})"
    finally:
        if heartbeat is not None:
            heartbeat.cancel()
        if state.registry.remove(session, reason) or state.registry.get(session.key) is None:
            state.stats.disconnected(session.key)
        with contextlib.suppress(Exception):
            await transport.close(CLOSE_POLICY if reason.startswith("too many") else 1000, reason)


async def _handshake(
    websocket: WebSocket, transport: WebSocketTransport, state: QueenState, *, v1: bool
) -> WorkerSession:
    """A v1 worker gets a challenge and must answer with a signed hello; a legacy worker (no
    subprotocol) speaks first, with its bare registration."""
    settings = state.settings
    nonce = new_nonce()
    if v1:
        await transport.send_text(encode(Challenge(nonce=nonce)))
    try:
        async with asyncio.timeout(settings.hello_timeout_s):
            frame = await _receive_text(websocket)
    except TimeoutError:
        raise HandshakeRefused("hello_timeout", "no hello arrived in time") from None
    except ProtocolError as exc:
        raise HandshakeRefused(exc.code, exc.message) from exc
    if len(frame) > settings.max_hello_bytes:
        raise HandshakeRefused(
            "frame_too_large",
            f"the hello is {len(frame)} bytes; the limit is {settings.max_hello_bytes}",
            CLOSE_TOO_BIG,
        )
    try:
        body = loads_object(frame)
    except ProtocolError as exc:
        raise HandshakeRefused(exc.code, exc.message) from exc
    loop_now = asyncio.get_running_loop().time()
    session_id = secrets.token_hex(8)
    if not v1:
        if not looks_like_registration(body):
            raise HandshakeRefused(
                "unexpected_message",
                f"a worker that does not offer the {SUBPROTOCOL!r} subprotocol must start with "
                "the original registration message",
            )
        try:
            registration = LegacyRegistration.model_validate(body, extra="ignore")
        except ValidationError as exc:
            raise HandshakeRefused("invalid_message", _first_error(exc)) from exc
        key = f"legacy-{session_id}"
        return LegacySession(
            key=key,
            public_id=key,
            session_id=session_id,
            transport=transport,
            max_jobs=1,
            ln_url=registration.ln_url,
            gpus=[gpu.name for gpu in registration.nv_gpus] or
                 [gpu.name for gpu in registration.cl_gpus],
            vram_mb=registration.vram,
            now=loop_now,
        )
    if body.get("type") != "hello":
        raise HandshakeRefused("unexpected_message", "the first frame must be a hello")
    if body.get("protocol") != PROTOCOL_VERSION:
        raise HandshakeRefused(
            "protocol_version",
            f"protocol {body.get('protocol')!r} is not supported; this queen speaks "
            f"{PROTOCOL_VERSION}",
        )
    try:
        hello = Hello.model_validate(body, extra="ignore")
    except ValidationError as exc:
        raise HandshakeRefused("invalid_message", _first_error(exc)) from exc
    verify_hello(hello, nonce)
    try:
        parse_payout_address(hello.ln_url, insecure_hosts=settings.lnurl_insecure_hosts)
    except InvalidPayoutAddress as exc:
        raise HandshakeRefused("invalid_ln_url", f"the payout address {hello.ln_url!r} is not "
                               f"valid: {exc.message}") from exc
    return WorkerSession(
        key=hello.pubkey,
        public_id=public_id(hello.pubkey),
        session_id=session_id,
        transport=transport,
        max_jobs=hello.max_jobs,
        models=hello.models,
        capabilities=hello.capabilities,
        worker_version=hello.worker_version,
        ln_url=hello.ln_url,
        gpus=[gpu.name for gpu in hello.nv_gpus] or [gpu.name for gpu in hello.cl_gpus],
        vram_mb=hello.vram,
        now=loop_now,
    )


async def _read_loop(websocket: WebSocket, session: WorkerSession, state: QueenState) -> str:
    """Read frames until the worker goes; returns why it went.

    Every bad frame is answered with an ``error`` message (its ``code`` says what was wrong,
    its ``id`` names the job the frame named, if any) and counted; ``max_bad_frames`` of them
    close the session. A frame for a job not in flight is answered but not counted, since an
    honest worker's frame can cross a cancel.
    """
    loop = asyncio.get_running_loop()
    max_bad = state.settings.max_bad_frames
    receive = websocket.receive
    while True:
        message = await receive()
        if message["type"] == "websocket.disconnect":
            return f"disconnected (code {message.get('code', 1005)})"
        session.last_seen = loop.time()
        text = message.get("text")
        try:
            if text is None:
                raise ProtocolError("binary_frame", "binary frames are not part of the protocol")
            other = session.route(text)
            if other is None or isinstance(other, Pong):
                continue
            if isinstance(other, Status):
                _apply_status(session, other, state)
            elif isinstance(other, Ping):
                await session.transport.send_text(encode(Pong(ts=other.ts)))
            else:
                raise ProtocolError(
                    "unexpected_message",
                    f"a {other.type} is not expected from a worker after its welcome",
                )
        except ProtocolError as exc:
            if exc.code != UNKNOWN_JOB:
                session.bad_frames += 1
            log.warning("worker %s sent a bad frame (%s): %s", session.public_id, exc.code,
                        exc.message[:200])
            if session.bad_frames >= max_bad:
                return f"too many bad frames ({session.bad_frames})"
            if not session.legacy:  # a legacy worker would take any frame for a request
                await session.transport.send_text(encode(JobError(
                    id=_job_id(text), code=exc.code, message=exc.message[:500])))


def _job_id(frame: str | None) -> str:
    """The job id a bad frame names, if it is a JSON object with a string ``id``; else ""."""
    if frame is None:
        return ""
    try:
        body = loads_object(frame)
    except ProtocolError:
        return ""
    job_id = body.get("id")
    return job_id[:128] if isinstance(job_id, str) else ""


def _apply_status(session: WorkerSession, status: Status, state: QueenState) -> None:
    if status.max_jobs is not None:
        session.max_jobs = status.max_jobs
    if status.models is not None:
        session.set_models(status.models)
        state.registry.models_changed(session)


async def _heartbeat(session: WorkerSession, state: QueenState) -> None:
    """Ping every interval; a worker silent for ``heartbeat_misses`` intervals is dropped."""
    loop = asyncio.get_running_loop()
    interval = state.settings.heartbeat_interval_s
    timeout = state.settings.heartbeat_timeout_s
    while True:
        await asyncio.sleep(interval)
        if loop.time() - session.last_seen > timeout:
            state.registry.remove(session, "missed heartbeats")
            with contextlib.suppress(Exception):
                await session.transport.close(CLOSE_HEARTBEAT, "missed heartbeats")
            return
        try:
            await session.transport.send_text(encode(Ping(ts=loop.time())))
        except Exception:
            return


def _first_error(exc: ValidationError) -> str:
    first = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in first["loc"]) or "hello"
    return f"{where}: {first['msg']}"


def _peer(websocket: WebSocket) -> str:
    client = websocket.client
    return f"{client.host}:{client.port}" if client else "unknown"
