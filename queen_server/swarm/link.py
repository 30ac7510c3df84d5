"""The queen's side of one worker connection as a sans-I/O state machine: frames in, actions out.

It never touches a socket: the websocket edge (``http/worker_ws.py``) feeds it what arrives (and
the clock, for heartbeats) and carries out what it returns, so every protocol decision, the
handshake included, is testable without one. It mirrors the worker's own machine
(``desktop_worker/link/machine.py``).

States: ``AWAITING_HELLO`` -> (a signed hello: ``Admit``) ``READY`` -> ... ``CLOSED``; a
connection without the v1 subprotocol is a legacy worker: its bare registration admits it to
``LEGACY`` (unless the ``legacy_workers`` setting is ``"off"``). A refused handshake, too many
bad frames or missed heartbeats end in ``CLOSED``.

Once admitted, job frames go straight to their job's ``JobHandle`` (feeding a mailbox is no
I/O), among the leases the registry holds for this worker (``registered``); a job frame for any
other job is answered ``unknown_job`` and not counted, since an honest worker's frame can cross a
cancel. Each job frame is charged against its job's budget (``JobHandle.budget``, tied to the
job's ``max_tokens``): a frame past it fails the job (retryable, ``answer_too_large``) and is a
bad frame, so a worker cannot make the queen hold more than an honest answer's worth per job.
Log probabilities are held to the job's limits (``JobHandle.logprobs``: none unless asked, no
more than a frame's text can carry, bounded alternatives and token strings) and their weight
once decoded is charged too (``answers.answer_check``).
Every other bad frame is answered with a typed ``error`` and counted; ``max_bad_frames``
of them close the connection. Writing to the worker is encoding too: ``job_frame`` and
``cancel_frame`` give the text the edge sends.

The handshake's checks that need cryptography or the payout rules come in through ``Gate``, so
that the swarm imports neither. The gate is made for one connection: it knows the origins that
connection may be signed for (``identity.RequestOrigins``), since a hello names the queen it
is for, and a hello of another protocol version is refused before any signature is checked
(an older worker signs in a form this queen no longer accepts: it is told to upgrade).
"""

from __future__ import annotations

import enum
import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

from queen_server.errors import HandshakeRefused
from queen_server.swarm.jobs import ANSWER_TOO_LARGE, EMBEDDINGS_JOB, JobHandle
from queen_server.swarm.worker import NO_LEASES, Worker
from shared_schema import (
    PROTOCOL_VERSION,
    SUBPROTOCOL,
    Cancel,
    Challenge,
    Chunk,
    Demand,
    FetchFailed,
    GroupClose,
    GroupFailed,
    GroupMemberReady,
    GroupOpen,
    GroupReady,
    Hello,
    Job,
    JobError,
    LegacyRequest,
    Message,
    ModelDescriptor,
    Ping,
    Pong,
    ProtocolError,
    Refused,
    Result,
    Status,
    Welcome,
    decode,
    encode,
    loads_object,
    looks_like_registration,
)
from shared_schema.answers import answer_check
from shared_schema.groups import parse_relay_frame
from shared_schema.parsing import legacy_usage, parse_hello, parse_registration
from shared_schema.protocol import (
    CLOSE_HEARTBEAT,
    CLOSE_POLICY,
    CLOSE_TOO_BIG,
    MAX_CHUNK_TOKENS,
    TrainReport,
)
from shared_schema.training import AdapterRef, parse_train_job_id

log = logging.getLogger(__name__)

# The ``ProtocolError`` code for a job frame naming a job that is not in flight on the worker.
# It is answered but not counted as a bad frame: an honest worker's frame can cross a cancel.
UNKNOWN_JOB = "unknown_job"
# The frames that carry a job's answer (a tuple: ``isinstance`` allocates nothing for it).
JOB_FRAMES = (Chunk, Result, JobError)


class State(enum.Enum):
    AWAITING_HELLO = "awaiting hello"
    READY = "ready"
    LEGACY = "ready (legacy)"
    CLOSED = "closed"


_READY = State.READY  # read on every frame


class LinkSettings(Protocol):
    """The link's knobs (``QueenSettings`` has them all)."""

    @property
    def heartbeat_interval_s(self) -> float: ...
    @property
    def heartbeat_timeout_s(self) -> float: ...
    @property
    def max_hello_bytes(self) -> int: ...
    @property
    def max_bad_frames(self) -> int: ...
    @property
    def legacy_workers(self) -> str:
        """``"on"``, ``"unbilled"`` or ``"off"`` (refused at the handshake)."""
        ...


class Gate(Protocol):
    """The handshake's checks that need what the swarm does not import (``identity.HelloGate``)."""

    @property
    def origins(self) -> Sequence[str]:
        """The origins this connection's hello may be signed for (for refusals)."""
        ...

    def hello_signed(self, hello: Hello, nonce: str) -> bool:
        """Whether the hello is signed by its own key over this connection's nonce, for one of
        ``origins``."""
        ...

    def signed_for_elsewhere(self, hello: Hello, nonce: str) -> str | None:
        """For a hello ``hello_signed`` refused: the origin it is signed for, if the gate can
        tell (the one the connection's Host header names), else None."""
        ...

    def public_id(self, pubkey: str) -> str:
        """The worker's short public id."""
        ...

    def payout_problem(self, ln_url: str | None) -> str | None:
        """Why the hello's payout address is not valid, or None."""
        ...


# --- actions ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Send:
    """Send this text frame to the worker."""

    frame: str


@dataclass(frozen=True, slots=True)
class Refuse:
    """The handshake is refused: send ``frame`` (a ``refused`` message), then close."""

    code: str
    reason: str
    close_code: int
    frame: str


@dataclass(frozen=True, slots=True)
class Admit:
    """The handshake succeeded. In this order: record the worker, send ``welcome`` (none for a
    legacy worker), then register it (a job must never reach a worker before its welcome) and
    call ``registered`` with its leases."""

    worker: Worker
    welcome: str | None


@dataclass(frozen=True, slots=True)
class StatusChanged:
    """The worker's status changed its job slots or its holdings (``Registry.apply_status``);
    ``status`` is the whole message (downloads, room for models, a pause)."""

    max_jobs: int | None
    models: list[ModelDescriptor] | None
    status: Status | None = None


@dataclass(frozen=True, slots=True)
class FetchRefused:
    """The worker could not fetch a model the queen placed on it (``placement``)."""

    failure: FetchFailed


@dataclass(frozen=True, slots=True)
class GroupReport:
    """The worker's word on a model group it was asked into (issue 19)."""

    message: GroupMemberReady | GroupReady | GroupFailed | GroupOpen | GroupClose


@dataclass(frozen=True, slots=True)
class RelayIn:
    """A relayed data frame of a model group's channel (issue 19): ``frame`` is forwarded
    unchanged to the channel's other end, if the worker has that channel open."""

    channel: int
    frame: bytes


@dataclass(frozen=True, slots=True)
class Close:
    """End the session: take the worker out of the registry and close with ``code``."""

    code: int
    reason: str


Action = Send | Refuse | Admit | StatusChanged | FetchRefused | GroupReport | RelayIn | Close
NOTHING: tuple[Action, ...] = ()


class QueenLink:
    """One worker connection's protocol state. Make a new one for every connection."""

    def __init__(
        self,
        settings: LinkSettings,
        gate: Gate,
        *,
        v1: bool,
        now: float = 0.0,
        nonce: str | None = None,
        clock: Callable[[], float] = time.time,
        pays_workers: bool = False,
        payout_threshold_msat: int | None = None,
        demand: Demand | None = None,
    ) -> None:
        """``pays_workers`` and ``payout_threshold_msat`` go into the welcome, so the worker
        can tell its owner whether this queen pays (billing on) and from what balance."""
        self.settings = settings
        self.gate = gate
        self.v1 = v1
        self.pays_workers = pays_workers
        self.payout_threshold_msat = payout_threshold_msat if pays_workers else None
        self.demand = demand  # what developers ask for, told in the welcome
        self.state = State.AWAITING_HELLO
        self.nonce = nonce or secrets.token_hex(32)
        self.last_seen = now  # the loop time of the last frame (for heartbeats)
        self._opened_at = now  # the challenge goes out now: the hello measures a round trip
        self._ping_ts: float | None = None  # the last ping's stamp, until its pong
        self.bad_frames = 0
        self.worker: Worker | None = None
        self._jobs: Mapping[str, JobHandle] = NO_LEASES
        self._clock = clock  # wall time, for the worker's ``connected_at``
        self._who = "(handshake)"

    def __repr__(self) -> str:
        return f"<QueenLink {self._who} {self.state.value}>"

    @property
    def legacy(self) -> bool:
        return not self.v1

    # --- the connection -----------------------------------------------------------------------

    def opened(self) -> Sequence[Action]:
        """The connection was accepted: a v1 worker is challenged; a legacy one speaks first."""
        if self.v1:
            return [Send(encode(Challenge(nonce=self.nonce)))]
        return NOTHING

    def hello_timeout(self) -> Sequence[Action]:
        """No first frame arrived in time."""
        if self.state is not State.AWAITING_HELLO:
            return NOTHING
        return self._refuse(HandshakeRefused("hello_timeout", "no hello arrived in time"))

    def registered(self, leases: Mapping[str, JobHandle]) -> None:
        """The registry took the admitted worker: ``leases`` is its live lease table, where job
        frames find their jobs (``Registry.leases_of``)."""
        self._jobs = leases

    def tick(self, now: float) -> Sequence[Action]:
        """A heartbeat interval passed: ping, or close a v1 worker silent for too long."""
        if self.state is not State.READY:
            return NOTHING
        if now - self.last_seen > self.settings.heartbeat_timeout_s:
            self.state = State.CLOSED
            return [Close(CLOSE_HEARTBEAT, "missed heartbeats")]
        self._ping_ts = now
        return [Send(encode(Ping(ts=now)))]

    # --- frames from the worker ---------------------------------------------------------------

    def receive(self, frame: str | None, now: float) -> Sequence[Action]:
        """One text frame from the worker (``None`` for a binary one: see ``receive_bytes``),
        at loop time ``now``.

        The hot path: a job frame of a v1 worker is fed to its job and nothing is returned."""
        self.last_seen = now
        if self.state is not _READY:
            return self._receive_other(frame)
        try:
            if frame is None:
                raise ProtocolError("binary_frame", "binary frames are not part of the protocol")
            message = decode(frame)
            if isinstance(message, JOB_FRAMES):
                handle = self._jobs.get(message.id)
                if handle is None or handle.finished:
                    raise ProtocolError(
                        UNKNOWN_JOB,
                        f"job {message.id[:64]!r} is not in flight on this worker; its "
                        f"{message.type} was dropped",
                    )
                embeddings = message.id.startswith(EMBEDDINGS_JOB)
                size = len(frame)
                if type(message) is Chunk:
                    if size > handle.room or size > handle.chunk_cap:
                        _too_large(handle, message.type, size)
                    handle.room -= size
                elif size > handle.budget and type(message) is Result and not embeddings:
                    _too_large(handle, message.type, size)
                problem, weight = answer_check(message, embeddings=embeddings,
                                               logprobs=handle.logprobs)
                if problem is not None:
                    # The job fails (retryable: another worker may answer it); the worker is told.
                    handle.feed(JobError(id=message.id, code="invalid_answer", retryable=True,
                                         message=f"the worker's {message.type} was malformed: "
                                                 f"{problem}"))
                    raise ProtocolError("invalid_message", f"{message.type}.data: {problem}")
                if weight:  # log probabilities, which the answer keeps: charged as well
                    _charge_kept(handle, message, size, weight)
                handle.feed(message)
                return NOTHING
            if type(message) is TrainReport:
                self._train_report(message, len(frame))
                return NOTHING
            return self._control(message)
        except ProtocolError as exc:
            return self._bad_frame(exc, frame)

    def _train_report(self, message: TrainReport, size: int) -> None:
        """A training job's progress (issue 37), fed to its handle for the queen's runner,
        charged against the job's budget as a chunk is. Raises ``ProtocolError`` for a report
        of a job not in flight here, or of a job that is no training job."""
        handle = self._jobs.get(message.id)
        if handle is None or handle.finished:
            raise ProtocolError(UNKNOWN_JOB, f"job {message.id[:64]!r} is not in flight on this "
                                             "worker; its train_report was dropped")
        if parse_train_job_id(message.id) is None:
            raise ProtocolError("unexpected_message",
                                f"job {message.id[:64]!r} is no training job: a train_report "
                                "is not expected for it")
        if size > handle.room or size > handle.chunk_cap:
            _too_large(handle, message.type, size)
        handle.room -= size
        handle.feed(message)

    def receive_bytes(self, frame: bytes, now: float) -> Sequence[Action]:
        """One binary frame: after the welcome, a model group's relayed data frame (its header
        checked here, its payload never read); anything else is a bad frame."""
        if self.state is not _READY:
            return self.receive(None, now)
        self.last_seen = now
        try:
            channel, _payload = parse_relay_frame(frame)
        except ProtocolError as exc:
            return self._bad_frame(exc, None)
        return [RelayIn(channel, frame)]

    def rejected(self, exc: ProtocolError) -> Sequence[Action]:
        """A frame the edge found bad after the link passed it on (a relayed frame from a
        worker in no relayed group): answered and counted like any bad frame."""
        return self._bad_frame(exc, None)

    def _control(self, message: Message) -> Sequence[Action]:
        """A v1 message that is not a job frame."""
        if isinstance(message, Pong):
            # Only the pong of the ping just sent measures anything (a stamp it made up would
            # not match: the worker can delay its answer, never hasten it).
            if message.ts == self._ping_ts and self.worker is not None:
                self.worker.note_rtt(self.last_seen - message.ts)
                self._ping_ts = None
            return NOTHING
        if isinstance(message, Ping):
            return [Send(encode(Pong(ts=message.ts)))]
        if isinstance(message, Status):
            return [StatusChanged(message.max_jobs, message.models, message)]
        if isinstance(message, FetchFailed):
            return [FetchRefused(message)]
        if isinstance(message, GroupMemberReady | GroupReady | GroupFailed | GroupOpen
                      | GroupClose):
            return [GroupReport(message)]
        raise ProtocolError(
            "unexpected_message",
            f"a {message.type} is not expected from a worker after its welcome",
        )

    def _receive_other(self, frame: str | None) -> Sequence[Action]:
        if self.state is State.LEGACY:
            try:
                return self._legacy_answer(frame)
            except ProtocolError as exc:
                return self._bad_frame(exc, frame)
        if self.state is State.AWAITING_HELLO:
            try:
                return self._hello(frame)
            except HandshakeRefused as refusal:
                return self._refuse(refusal)
        return NOTHING  # closed: the edge is hanging up

    def _bad_frame(self, exc: ProtocolError, frame: str | None) -> Sequence[Action]:
        """Answer a bad frame with a typed error (not to a legacy worker, which would take any
        frame for a request), and close once there were ``max_bad_frames``."""
        if exc.code != UNKNOWN_JOB:
            self.bad_frames += 1
        log.warning("worker %s sent a bad frame (%s): %s", self._who, exc.code, exc.message[:200])
        if self.bad_frames >= self.settings.max_bad_frames:
            self.state = State.CLOSED
            return [Close(CLOSE_POLICY, f"too many bad frames ({self.bad_frames})")]
        if self.legacy:
            return NOTHING
        job_id = _job_id(frame)
        sends = [Send(encode(JobError(id=job_id, code=exc.code, message=exc.message[:500])))]
        if exc.code == ANSWER_TOO_LARGE:  # the job failed here: the worker must stop it too,
            sends.append(Send(encode(Cancel(id=job_id, reason=ANSWER_TOO_LARGE))))  # or its
        return sends  # slot stays busy with an answer nobody will read

    # --- the handshake ------------------------------------------------------------------------

    def _hello(self, frame: str | None) -> Sequence[Action]:
        """The first frame: a v1 worker's signed hello, or a legacy worker's registration.
        Raises ``HandshakeRefused``."""
        if frame is None:
            raise HandshakeRefused("binary_frame", "binary frames are not part of the protocol")
        limit = self.settings.max_hello_bytes
        if len(frame) > limit:
            raise HandshakeRefused(
                "frame_too_large", f"the hello is {len(frame)} bytes; the limit is {limit}",
                CLOSE_TOO_BIG,
            )
        try:
            body = loads_object(frame)
            worker = self._v1_worker(body) if self.v1 else self._legacy_worker(body)
            if self.v1:  # challenge out, hello in: one round trip and the worker's signing
                worker.note_rtt(self.last_seen - self._opened_at)
        except ProtocolError as exc:
            raise HandshakeRefused(exc.code, exc.message) from exc
        self.worker = worker
        self._who = worker.public_id
        if not self.v1:
            self.state = State.LEGACY
            return [Admit(worker, None)]
        self.state = State.READY
        welcome = Welcome(session_id=worker.session_id, worker_id=worker.public_id,
                          heartbeat_interval_s=self.settings.heartbeat_interval_s,
                          pays_workers=self.pays_workers,
                          payout_threshold_msat=self.payout_threshold_msat,
                          demand=self.demand, chunk_tokens=MAX_CHUNK_TOKENS)
        return [Admit(worker, encode(welcome))]

    def _v1_worker(self, body: dict[str, Any]) -> Worker:
        if body.get("type") != "hello":
            raise HandshakeRefused("unexpected_message", "the first frame must be a hello")
        if body.get("protocol") != PROTOCOL_VERSION:
            raise HandshakeRefused("protocol_version", _version_refusal(body.get("protocol")))
        hello = parse_hello(body)
        if not self.gate.hello_signed(hello, self.nonce):
            signed_for = self.gate.signed_for_elsewhere(hello, self.nonce)
            if signed_for is not None:
                # An honest worker that dialled a name this queen does not know as its own.
                raise HandshakeRefused(
                    "wrong_origin",
                    f"this hello was signed for {signed_for}; this queen is "
                    f"{' or '.join(self.gate.origins) or 'not told its own URL'}; set "
                    "APIARY_PUBLIC_URL if the queen sits behind a proxy",
                )
            raise HandshakeRefused("bad_signature", "the hello's signature does not verify")
        problem = self.gate.payout_problem(hello.ln_url)
        if problem is not None:
            raise HandshakeRefused("invalid_ln_url", f"the payout address {hello.ln_url!r} is "
                                   f"not valid: {problem}")
        worker = Worker(
            key=hello.pubkey,
            public_id=self.gate.public_id(hello.pubkey),
            session_id=secrets.token_hex(8),
            max_jobs=hello.max_jobs,
            models=hello.models,
            capabilities=hello.capabilities,
            worker_version=hello.worker_version,
            ln_url=hello.ln_url,
            gpus=[gpu.name for gpu in hello.nv_gpus] or [gpu.name for gpu in hello.cl_gpus],
            vram_mb=hello.vram,
            connected_at=self._clock(),
        )
        worker.note_hello(hello)
        return worker

    def _legacy_worker(self, body: dict[str, Any]) -> Worker:
        if not looks_like_registration(body):
            raise HandshakeRefused(
                "unexpected_message",
                f"a worker that does not offer the {SUBPROTOCOL!r} subprotocol must start with "
                "the original registration message",
            )
        if self.settings.legacy_workers == "off":
            # The refusal frame is sent all the same: a workerbee takes it for a request, fails
            # to read it and logs it, reason included, before the close reaches it.
            raise HandshakeRefused(
                "legacy_disabled",
                "this queen takes no legacy workers; run a worker that speaks protocol "
                f"{PROTOCOL_VERSION} (subprotocol {SUBPROTOCOL!r})",
                CLOSE_POLICY,
            )
        registration = parse_registration(body)
        session_id = secrets.token_hex(8)
        key = f"legacy-{session_id}"
        # Its capabilities, models and key are unverified claims: a legacy worker gets none of
        # them (it ranks in the lowest tier, fetches on demand, and is credited nothing).
        return Worker(
            key=key,
            public_id=key,
            session_id=session_id,
            legacy=True,
            worker_version=registration.worker_version or "",
            ln_url=registration.ln_url,
            gpus=registration.gpu_names,
            vram_mb=registration.vram_mb,
            connected_at=self._clock(),
        )

    def _refuse(self, refusal: HandshakeRefused) -> Sequence[Action]:
        self.state = State.CLOSED
        frame = encode(Refused(code=refusal.code, reason=refusal.reason))
        return [Refuse(refusal.code, refusal.reason, refusal.close_code, frame)]

    # --- a legacy worker's answers ------------------------------------------------------------

    def _legacy_answer(self, frame: str | None) -> Sequence[Action]:
        """A legacy worker's bare answer, to the one job it has in flight. Raises
        ``ProtocolError`` for a frame that is not an answer."""
        if frame is None:
            raise ProtocolError("binary_frame", "binary frames are not part of the protocol")
        body = loads_object(frame)
        handle = next(iter(self._jobs.values()), None)
        if handle is None or handle.finished:
            log.warning("legacy worker %s answered with no job in flight; dropped", self._who)
            return NOTHING
        if "error" in body:
            detail = body["error"] if isinstance(body["error"], dict) else {}
            handle.feed(
                JobError(
                    id=handle.id,
                    code=str(detail.get("code") or "worker_error"),
                    message=str(detail.get("message") or body["error"])[:2000],
                    retryable=True,
                )
            )
            return NOTHING
        if not isinstance(body.get("choices") or body.get("data"), list):
            raise ProtocolError("invalid_message", "legacy answer has neither choices nor data")
        embeddings = handle.id.startswith(EMBEDDINGS_JOB)
        if len(frame) > handle.budget and not embeddings:
            _too_large(handle, "answer", len(frame))
        result = Result(id=handle.id, data=body, usage=legacy_usage(body))
        problem, weight = answer_check(result, embeddings=embeddings, logprobs=handle.logprobs)
        if problem is not None:
            handle.feed(JobError(id=handle.id, code="invalid_answer", retryable=True,
                                 message=f"the legacy worker's answer was malformed: {problem}"))
            raise ProtocolError("invalid_message", f"answer: {problem}")
        if weight:
            _charge_kept(handle, result, len(frame), weight)
        handle.feed(result)
        return NOTHING

    # --- frames to the worker -----------------------------------------------------------------

    def job_frame(
        self,
        job_id: str,
        openai_url: str,
        openai_req: dict[str, Any],
        continuation: str | None = None,
        cache_scope: str | None = None,
        adapter: AdapterRef | None = None,
    ) -> str:
        """The frame that gives the worker a job. A legacy worker gets a bare, non-streaming
        request, and never a continuation (it lacks the ``continue`` capability) nor a cache
        scope (it caches nothing across jobs that the queen knows of) nor an adapter (it lacks
        ``lora``)."""
        if self.legacy:
            return encode(LegacyRequest(openai_url=openai_url,
                                        openai_req={**openai_req, "stream": False}))
        return encode(Job(id=job_id, openai_url=openai_url, openai_req=openai_req,
                          continuation=continuation, cache_scope=cache_scope,
                          adapter=adapter))

    def cancel_frame(self, job_id: str, reason: str) -> str | None:
        """The frame that cancels a job; None for a legacy worker, which cannot be cancelled
        (its answer is dropped when it arrives)."""
        if self.legacy:
            return None
        return encode(Cancel(id=job_id, reason=reason))


def _version_refusal(version: object) -> str:
    """Why a hello of another protocol version is refused, in words for the worker's owner."""
    if isinstance(version, int) and not isinstance(version, bool) and version < PROTOCOL_VERSION:
        return (f"this worker speaks protocol {version}; this queen needs protocol "
                f"{PROTOCOL_VERSION} (hellos now name the queen they are signed for): upgrade "
                "your worker")
    return (f"protocol {str(version)[:40]!r} is not supported; this queen speaks "
            f"{PROTOCOL_VERSION}: upgrade the queen, or run a worker of protocol "
            f"{PROTOCOL_VERSION}")


def _too_large(handle: JobHandle, kind: str, size: int) -> NoReturn:
    """A frame of ``size`` characters is past what is left of its job's budget (or past the cap
    on one chunk): the job fails, retryable (another worker may answer it within its budget),
    and the frame is a bad one. Raises the ``ProtocolError`` the worker is answered with."""
    message = (f"the worker's {kind} of {size} characters is past the job's limit (budget "
               f"{handle.budget}, {max(handle.room, 0)} left, at most {handle.chunk_cap} per "
               "chunk)")
    handle.feed(JobError(id=handle.id, code=ANSWER_TOO_LARGE, retryable=True, message=message))
    raise ProtocolError(ANSWER_TOO_LARGE, message)


def _charge_kept(handle: JobHandle, message: Chunk | Result, size: int, weight: int) -> None:
    """Charge the ``weight`` of the log probabilities a frame of ``size`` characters carries:
    a chunk's from what is left of the job's budget (its length was taken already), a whole
    answer's with its length against the whole budget. Past it: ``_too_large``."""
    if type(message) is Chunk:
        if weight > handle.room:
            _too_large(handle, f"{message.type}'s log probabilities", weight)
        handle.room -= weight
    elif size + weight > handle.budget:
        _too_large(handle, f"{message.type} with its log probabilities", size + weight)


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
