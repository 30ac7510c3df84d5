"""One real handshake with a queen, to tell the owner in plain words whether it works.

``probe_queen`` connects as the worker would (websocket, subprotocol ``apiary.v1``), takes the
challenge, sends the same signed hello a Start sends (from the caller's ``hello_for``, e.g.
``WorkerService.hello_factory``), waits for ``welcome`` or ``refused``, then closes. It never
raises for a failure: it returns a ``ProbeResult`` whose message says what went wrong as an
owner can act on it. ``explain_connect_error`` is the pure part that turns a connection error
into those words; the app uses it for the header's reason while reconnecting too.

It drives the link's own state machine (``link/machine.py``), so what it checks is what the
worker really does, and it stays in step when the hello changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from websockets.asyncio.client import connect
from websockets.exceptions import (
    ConnectionClosed,
    InvalidHandshake,
    InvalidMessage,
    InvalidStatus,
    InvalidURI,
)

from desktop_worker.link.machine import Close, Link, RefusedByQueen, Send, Welcomed
from desktop_worker.queen_url import describe
from shared_schema import (
    PROTOCOL_VERSION,
    SUBPROTOCOL,
    Challenge,
    Hello,
    ProtocolError,
    Welcome,
    decode,
    queen_origin,
)

log = logging.getLogger(__name__)

# What ``WorkerService.hello_factory`` is: the hello builder (nonce, origin) and max jobs.
HelloFactory = Callable[[], Awaitable[tuple[Callable[[str, str], Hello], int]]]
NOT_A_QUEEN = "this is not an Apiary queen's worker address"


@dataclass(frozen=True)
class ProbeResult:
    """``ok`` with the queen's name for this worker, or the reason in the owner's words.
    ``kind`` names the failure for code and tests: refused, dns, tls, timeout, not_a_queen,
    version, rejected (by the queen), closed, error."""

    ok: bool
    message: str
    kind: str = "ok"
    worker_id: str | None = None


def explain_connect_error(exc: BaseException | None, url: str) -> tuple[str, str]:
    """(kind, plain words) for an error met while connecting to ``url``."""
    where = describe(url)
    host = where.rsplit(":", 1)[0].strip("[]")
    if exc is None:
        return "closed", "the connection to the queen was lost"
    if isinstance(exc, ssl.SSLCertVerificationError):
        detail = exc.verify_message or exc.reason or "not trusted"
        return "tls", (f"the certificate of {host} could not be checked ({detail}): the address "
                       "may be wrong, or the queen's certificate is self-signed or expired")
    if isinstance(exc, ssl.SSLError):
        hint = " (does the queen serve https? try http:// or ws://)" \
            if "WRONG_VERSION_NUMBER" in str(exc).upper() else ""
        return "tls", f"the secure connection (TLS) to {where} failed{hint}"
    if isinstance(exc, socket.gaierror):
        return "dns", (f"the name {host} could not be found (DNS): check the address and this "
                       "computer's internet connection")
    if isinstance(exc, ConnectionRefusedError):
        return "refused", f"connection refused: nothing is listening at {where}"
    if isinstance(exc, InvalidStatus):
        status = exc.response.status_code
        return "not_a_queen", (f"{where} answered HTTP {status} but no websocket: {NOT_A_QUEEN} "
                               "(a queen's is https://host or wss://host/worker)")
    if isinstance(exc, InvalidMessage):
        return "not_a_queen", f"{where} did not answer as a web server: {NOT_A_QUEEN}"
    if isinstance(exc, InvalidHandshake):
        return "not_a_queen", f"{where} refused the websocket handshake ({exc}): {NOT_A_QUEEN}"
    if isinstance(exc, TimeoutError):
        return "timeout", f"no answer from {where} in time (a firewall, or the queen is down)"
    if isinstance(exc, ConnectionClosed):
        code = exc.rcvd.code if exc.rcvd is not None else None
        reason = exc.rcvd.reason if exc.rcvd is not None else ""
        said = f" ({code}: {reason})" if reason else (f" (code {code})" if code else "")
        return "closed", f"the queen closed the connection{said}"
    if isinstance(exc, OSError):
        words = exc.strerror or str(exc) or type(exc).__name__
        return "error", f"cannot reach {where}: {words}"
    return "error", f"cannot reach {where}: {exc or type(exc).__name__}"


async def probe_queen(url: str, hello_for: HelloFactory, *, timeout_s: float = 10.0) -> ProbeResult:
    """Connect to ``url``, do the whole hello, and close. Never raises (but on cancellation)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await _handshake(url, hello_for)
    except TimeoutError as exc:
        kind, message = explain_connect_error(exc, url)
        return ProbeResult(False, message, kind)
    except (InvalidURI, ValueError):  # ValueError: shared_schema's InvalidQueenUrl
        return ProbeResult(False, f"{url!r} is not a websocket address", "error")
    except (OSError, InvalidHandshake, ConnectionClosed) as exc:
        kind, message = explain_connect_error(exc, url)
        return ProbeResult(False, message, kind)
    except Exception as exc:  # the owner gets a message, never a crash
        log.exception("testing the connection to %s failed unexpectedly", url)
        return ProbeResult(False, f"the test failed: {type(exc).__name__}: {exc}", "error")


async def _handshake(url: str, hello_for: HelloFactory) -> ProbeResult:
    hello, max_jobs = await hello_for()
    connecting = connect(url, subprotocols=[SUBPROTOCOL], compression=None, open_timeout=None,
                         max_size=1 << 20, close_timeout=2)
    async with connecting as ws:
        # Signed for the URL this socket reached, as the link client does.
        link = Link(hello, max_jobs, queen_origin(connecting.uri))
        if ws.subprotocol != SUBPROTOCOL:
            return ProbeResult(False, f"{describe(url)} speaks websocket but not the Apiary "
                               f"worker protocol ({SUBPROTOCOL}): {NOT_A_QUEEN}", "not_a_queen")
        try:
            async for frame in ws:
                result = _version_problem(frame)
                if result is not None:
                    return result
                for action in link.receive(frame):
                    if isinstance(action, Send):
                        await ws.send(action.frame)
                    elif isinstance(action, Welcomed):
                        return ProbeResult(True, "connected: the queen welcomed this worker "
                                           f"(worker id {action.welcome.worker_id})"
                                           + _pay_note(action.welcome), "ok",
                                           action.welcome.worker_id)
                    elif isinstance(action, RefusedByQueen):
                        return _refusal(action)
                    elif isinstance(action, Close):
                        return ProbeResult(False, f"{describe(url)} did not follow the Apiary "
                                           f"protocol ({action.reason}): {NOT_A_QUEEN}",
                                           "not_a_queen")
        finally:
            with contextlib.suppress(Exception):
                await ws.close()
        code = ws.close_code
        reason = ws.close_reason or "no reason given"
        return ProbeResult(False, f"the queen closed the connection before welcoming this worker "
                           f"({code}: {reason})", "closed")


def _version_problem(frame: str | bytes) -> ProbeResult | None:
    """A challenge from a queen of another protocol version, in words."""
    try:
        message = decode(frame)
    except ProtocolError:
        return None
    if isinstance(message, Challenge) and message.protocol != PROTOCOL_VERSION:
        newer = message.protocol > PROTOCOL_VERSION
        return ProbeResult(False, f"the queen speaks protocol {message.protocol} and this app "
                           f"speaks {PROTOCOL_VERSION}: "
                           + ("update Apiary to join it" if newer
                              else "the queen is older than this app; ask its operator to "
                              "update it"), "version")
    return None


def _pay_note(welcome: Welcome) -> str:
    pays = getattr(welcome, "pays_workers", None)  # None: a queen that does not say
    return "; note: this queen does not pay its workers" if pays is False else ""


def _refusal(action: RefusedByQueen) -> ProbeResult:
    if action.code == "protocol_version":
        return ProbeResult(False, f"the queen does not speak this app's protocol version: "
                           f"{action.reason} (update Apiary, or ask the queen's operator)",
                           "version")
    return ProbeResult(False, f"the queen refused this worker: {action.reason}", "rejected")
