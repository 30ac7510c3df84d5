"""The worker's side of protocol v1 as a sans-I/O state machine: frames and events in, actions out.

It never touches a socket or a clock. The websockets adapter (``client.py``) feeds it what
arrives and carries out what it returns, which keeps every protocol decision unit-testable.

States: ``AWAITING_CHALLENGE`` -> (challenge: send hello) -> ``AWAITING_WELCOME`` -> (welcome)
``READY`` -> (jobs, cancels, pings) ... -> ``CLOSED`` (refused, or the connection ended).

The hello is signed for ``origin``, the origin of the URL this worker dialled, which the
adapter gives the machine; nothing the queen sends can change it (a hostile queen relaying
another queen's challenge gets a signature that queen refuses).

A streamed job's chunks go out one frame at a time: ``chunk`` returns a ``Send`` only when no
frame of that job is being sent, and the chunks made meanwhile wait in the job's ``Coalescer``
until the adapter reports the frame sent (``chunk_sent``), then go as one joined frame (when
the queen's welcome says it reads ``Chunk.tokens``). A result or error sends whatever still
waits first, so nothing is lost or reordered.

Every frame is JSON text but one kind: a model group's relayed data (issue 19) travels as
binary frames (``shared_schema.groups.relay_frame``), read only once welcomed (``RelayData``);
a binary frame that is not one is logged and ignored, like a bad text frame.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from desktop_worker.link.coalesce import DEFAULT_MAX_CHARS, DEFAULT_MAX_TOKENS, Coalescer
from shared_schema import (
    Cancel,
    Challenge,
    Chunk,
    Demand,
    Fetch,
    FetchFailed,
    GroupClose,
    GroupEnd,
    GroupFailed,
    GroupLead,
    GroupMemberReady,
    GroupOpen,
    GroupReady,
    GroupServe,
    Hello,
    Job,
    JobError,
    Ping,
    Pong,
    ProtocolError,
    Refused,
    Result,
    Status,
    TrainReport,
    Usage,
    Welcome,
    decode,
    encode,
)
from shared_schema.groups import MAX_RELAY_PAYLOAD, parse_relay_frame, relay_frame

log = logging.getLogger(__name__)

# Refusals that no retry can fix: stop reconnecting and tell the owner. ``wrong_origin``: the
# queen answers to another origin than the one dialled (its operator must set its public URL,
# or the owner must dial the URL the queen names).
FATAL_REFUSALS = frozenset({"protocol_version", "bad_signature", "invalid_ln_url",
                            "wrong_origin"})

# Builds the hello for a challenge: ``(nonce, origin) -> Hello``, signed for both.
HelloFor = Callable[[str, str], Hello]


class State(enum.Enum):
    AWAITING_CHALLENGE = "awaiting challenge"
    AWAITING_WELCOME = "awaiting welcome"
    READY = "ready"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class Send:
    """A frame to send: text (a JSON message) or binary (a relayed data frame)."""

    frame: str | bytes


@dataclass(frozen=True, slots=True)
class StartJob:
    job: Job


@dataclass(frozen=True, slots=True)
class CancelJob:
    job_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class FetchModel:
    """The queen asks this worker to download, check and load a model (issue 17)."""

    fetch: Fetch


@dataclass(frozen=True, slots=True)
class GroupCommand:
    """The queen makes this worker a member or the head of a model group, ends one, or opens
    or closes a relayed channel of one (issue 19); the worker answers with
    ``Link.group_report`` (and ``Link.relay_data`` for a channel's bytes)."""

    message: GroupServe | GroupLead | GroupEnd | GroupOpen | GroupClose


@dataclass(frozen=True, slots=True)
class RelayData:
    """Bytes on a relayed channel of a model group (issue 19): from the queen, the action a
    binary frame becomes; to it, what ``Link.relay_data`` frames."""

    channel: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class DemandReceived:
    """What developers ask the queen for (in the welcome, and every ``interval_s``)."""

    demand: Demand


@dataclass(frozen=True, slots=True)
class Welcomed:
    """The queen took this worker. ``welcome`` is its frame as sent: ``worker_id``, and whether
    this queen pays its workers (``pays_workers``, ``payout_threshold_msat``; both None from
    an older queen that does not say)."""

    welcome: Welcome

    @property
    def pays_workers(self) -> bool | None:
        return self.welcome.pays_workers

    @property
    def payout_threshold_msat(self) -> int | None:
        return self.welcome.payout_threshold_msat


@dataclass(frozen=True, slots=True)
class RefusedByQueen:
    code: str
    reason: str
    fatal: bool


@dataclass(frozen=True, slots=True)
class Close:
    code: int
    reason: str


Action = (Send | StartJob | CancelJob | FetchModel | GroupCommand | RelayData | DemandReceived
          | Welcomed | RefusedByQueen | Close)
GroupUplink = GroupMemberReady | GroupReady | GroupFailed | GroupOpen | GroupClose


class Link:
    """One connection's protocol state. Make a new one for every connection."""

    def __init__(self, hello_for: HelloFor, max_jobs: int, origin: str, *,
                 join_tokens: int = DEFAULT_MAX_TOKENS,
                 join_chars: int = DEFAULT_MAX_CHARS) -> None:
        """``join_tokens``: the most chunks this worker joins into one frame (1: none), before
        the queen's own cap; ``join_chars``: the most content characters in a joined frame."""
        self._hello_for = hello_for
        self.origin = origin  # queen_origin() of the URL dialled
        self.max_jobs = max_jobs
        self.state = State.AWAITING_CHALLENGE
        self.active: set[str] = set()
        self._seq: dict[str, int] = {}
        self._outbox: dict[str, Coalescer] = {}  # streamed jobs' chunks waiting to go
        self._sending: set[str] = set()  # jobs with a chunk frame being sent now
        self.join_tokens = join_tokens
        self.join_chars = join_chars
        self.welcome: Welcome | None = None

    @property
    def chunk_tokens(self) -> int:
        """The most chunks one frame joins on this connection: 1 (none) until a queen that
        reads ``Chunk.tokens`` welcomes this worker."""
        welcome = self.welcome
        if welcome is None or welcome.chunk_tokens is None:
            return 1
        return max(1, min(self.join_tokens, welcome.chunk_tokens))

    # --- frames from the queen ----------------------------------------------------------------

    def receive(self, frame: str | bytes) -> list[Action]:
        if isinstance(frame, bytes | bytearray | memoryview):
            return self._binary(bytes(frame))
        try:
            message = decode(frame)
        except ProtocolError as exc:
            log.warning("ignored a bad frame from the queen (%s): %s", exc.code, exc.message)
            return []
        if self.state is State.AWAITING_CHALLENGE:
            if isinstance(message, Challenge):
                self.state = State.AWAITING_WELCOME
                return [Send(encode(self._hello_for(message.nonce, self.origin)))]
            return self._protocol_violation(f"expected a challenge, got {message.type}")
        if self.state is State.AWAITING_WELCOME:
            if isinstance(message, Welcome):
                self.state = State.READY
                self.welcome = message
                actions: list[Action] = [Welcomed(message)]
                if message.demand is not None:
                    actions.append(DemandReceived(message.demand))
                return actions
            if isinstance(message, Refused):
                self.state = State.CLOSED
                return [RefusedByQueen(message.code, message.reason,
                                       message.code in FATAL_REFUSALS)]
            return self._protocol_violation(f"expected a welcome, got {message.type}")
        if self.state is State.READY:
            return self._ready(message)
        return []

    def _binary(self, frame: bytes) -> list[Action]:
        """A binary frame: a relayed data frame of a model group, and only once welcomed."""
        if self.state is not State.READY:
            log.warning("ignored a binary frame from the queen in state %s", self.state.value)
            return []
        try:
            channel, payload = parse_relay_frame(frame)
        except ProtocolError as exc:
            log.warning("ignored a bad binary frame from the queen (%s): %s", exc.code,
                        exc.message)
            return []
        return [RelayData(channel, bytes(payload))]

    def _ready(self, message: Any) -> list[Action]:
        if isinstance(message, Job):
            if message.id in self.active:
                log.warning("the queen sent job %s twice; ignored", message.id)
                return []
            if len(self.active) >= self.max_jobs:
                return [Send(encode(JobError(id=message.id, code="busy", retryable=True,
                                             message="every job slot is taken")))]
            self.active.add(message.id)
            self._seq[message.id] = 0
            return [StartJob(message)]
        if isinstance(message, Cancel):
            if message.id in self.active:
                return [CancelJob(message.id, message.reason)]
            return []
        if isinstance(message, Fetch):
            return [FetchModel(message)]
        if isinstance(message, GroupServe | GroupLead | GroupEnd | GroupOpen | GroupClose):
            return [GroupCommand(message)]
        if isinstance(message, Demand):
            return [DemandReceived(message)]
        if isinstance(message, Ping):
            return [Send(encode(Pong(ts=message.ts)))]
        if isinstance(message, Pong):
            return []
        log.warning("ignored an unexpected %s from the queen", message.type)
        return []

    def _protocol_violation(self, what: str) -> list[Action]:
        log.warning("protocol violation by the queen: %s", what)
        self.state = State.CLOSED
        return [Close(1002, what)]

    # --- events from the jobs -----------------------------------------------------------------

    def chunk(self, job_id: str, data: dict[str, Any]) -> list[Action]:
        """A chunk the job made: a ``Send`` of it now, or nothing while a frame of this job is
        being sent (the chunk waits, maybe joined with others, for ``chunk_sent``). The adapter
        that gets a ``Send`` here must call ``chunk_sent`` once it is sent."""
        if job_id not in self.active or self.state is not State.READY:
            return []
        outbox = self._outbox.get(job_id)
        if outbox is None:
            outbox = self._outbox[job_id] = Coalescer(self.chunk_tokens, self.join_chars)
        outbox.add(data)
        if job_id in self._sending:
            return []
        self._sending.add(job_id)
        return self._next_chunk(job_id, outbox)

    def chunk_sent(self, job_id: str) -> list[Action]:
        """The job's last chunk frame is sent: a ``Send`` of what waited meanwhile (one frame,
        joined when it can be; call this again once it is sent), or nothing (the job's next
        chunk goes out at once)."""
        outbox = self._outbox.get(job_id)
        if (job_id not in self._sending or outbox is None or not outbox
                or self.state is not State.READY):
            self._sending.discard(job_id)
            return []
        return self._next_chunk(job_id, outbox)

    def _next_chunk(self, job_id: str, outbox: Coalescer) -> list[Action]:
        frame = outbox.next_frame()
        if frame is None:
            self._sending.discard(job_id)
            return []
        return [Send(self._chunk_frame(job_id, *frame))]

    def _chunk_frame(self, job_id: str, data: dict[str, Any], tokens: int) -> str:
        seq = self._seq[job_id]
        self._seq[job_id] = seq + 1
        return encode(Chunk(id=job_id, seq=seq, data=data, tokens=tokens))

    def result(self, job_id: str, data: dict[str, Any], usage: Usage) -> list[Action]:
        return self._end(job_id, Result(id=job_id, data=data, usage=usage))

    def error(self, job_id: str, code: str, message: str, retryable: bool) -> list[Action]:
        return self._end(job_id, JobError(id=job_id, code=code, message=message,
                                          retryable=retryable))

    def _end(self, job_id: str, message: Result | JobError) -> list[Action]:
        """The job's last frame, after every chunk still waiting (in order)."""
        if job_id not in self.active:
            return []
        self.active.discard(job_id)
        self._sending.discard(job_id)
        outbox = self._outbox.pop(job_id, None)
        actions: list[Action] = []
        if self.state is State.READY and outbox is not None:
            actions = [Send(self._chunk_frame(job_id, *frame)) for frame in outbox.drain()]
        self._seq.pop(job_id, None)
        if self.state is not State.READY:
            return []
        actions.append(Send(encode(message)))
        return actions

    def train_report(self, report: TrainReport) -> list[Action]:
        """A training job's progress (issue 37): sent while the job is this connection's."""
        if report.id not in self.active or self.state is not State.READY:
            return []
        return [Send(encode(report))]

    def fetch_failed(self, failure: FetchFailed) -> list[Action]:
        if self.state is not State.READY:
            return []
        return [Send(encode(failure))]

    def group_report(self, message: GroupUplink) -> list[Action]:
        """This worker's answer about its part of a group, or a relayed channel's open or
        close (nothing unless connected)."""
        if self.state is not State.READY:
            return []
        return [Send(encode(message))]

    def relay_data(self, channel: int, payload: bytes) -> list[Action]:
        """Bytes for relayed channel ``channel``: binary frames of at most
        ``MAX_RELAY_PAYLOAD`` bytes each (nothing unless connected, nothing for no bytes)."""
        if self.state is not State.READY:
            return []
        view = memoryview(payload)
        return [Send(relay_frame(channel, bytes(view[start:start + MAX_RELAY_PAYLOAD])))
                for start in range(0, len(view), MAX_RELAY_PAYLOAD)]

    def status(self, status: Status) -> list[Action]:
        if self.state is not State.READY:
            return []
        return [Send(encode(status))]

    # --- the connection -----------------------------------------------------------------------

    def connection_lost(self) -> list[Action]:
        """The socket is gone: every job in flight is cancelled (the queen retries elsewhere)."""
        self.state = State.CLOSED
        actions: list[Action] = [CancelJob(job_id, "connection lost") for job_id in self.active]
        self.active.clear()
        self._seq.clear()
        self._outbox.clear()
        self._sending.clear()
        return actions
