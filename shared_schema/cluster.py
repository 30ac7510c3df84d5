"""What queen replicas say to each other over the cluster bus (issue 18, "Many queens").

A request that reaches replica B but is best served by a worker held by replica A travels as a
``ClusterJob`` on A's job channel. A answers on B's reply channel with ``ClusterEvent``s, each
carrying one per-job sequence number and one frame: the worker's own protocol frame (``Chunk``,
``Result``, ``JobError``, relayed as the worker sent it) or one of the replica-level frames
below (``Accepted``: A has the job; ``Assigned``: which of A's workers runs it; ``KeepAlive``:
still working, nothing to send; ``Lost``: A lost the worker or the job). B cancels with a
``ClusterCancel`` on A's job channel, and once the job is over sends A its ``ClusterOutcome``
(A keeps its worker's record). Reports of the whole swarm travel as a broadcast
``ClusterQuery`` and each other replica's ``ClusterAnswer``.

The replicas are one operator's processes, but the decoder still validates every message
(pydantic, in Rust): a bad message is a ``ProtocolError``, never a half-read one. Encoding is
``model_dump_json`` and decoding one ``validate_json`` of the tagged union, so a relayed token
costs a few microseconds of CPU on each side (measured by
``tests/queen_server/cluster/measure_hop.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

import orjson
from pydantic import Field, TypeAdapter, ValidationError

from shared_schema.base import WireModel
from shared_schema.errors import ProtocolError
from shared_schema.groups import GROUP_ID
from shared_schema.protocol import CACHE_SCOPE, Chunk, JobError, Result

MAX_GROUP_SHARES = 64  # parts of one model group named in an ``Assigned``


class Accepted(WireModel):
    """A took the job (always seq 0): B's short first deadline becomes the idle deadline."""

    type: Literal["accepted"] = "accepted"


class Assigned(WireModel):
    """A gave the job to one of its workers (again after a failover on A): who it is, for B's
    books (the worker's earnings key for ``Part`` and ``sent``, and its group's shares when it
    heads one), its logs, and B's own failover (a twin must hold the same file: ``sha256``)."""

    type: Literal["assigned"] = "assigned"
    worker_key: str | None = None  # the earnings key; None for a legacy worker
    worker_id: str = ""  # the public id
    sha256: str | None = None
    # A model group's head (issue 19): its group's (worker key, layers held), the head first,
    # for B's books (``billing.shares.split_parts``).
    shares: list[tuple[str, int]] = Field(default_factory=list, max_length=MAX_GROUP_SHARES)
    # And the group's id: if the head fails mid-answer, B asks A to wait for the group to
    # re-form and continue there (``ClusterJob.regroup``).
    group: str | None = Field(default=None, pattern=GROUP_ID)


class KeepAlive(WireModel):
    """A is still on the job but has had nothing to send for a while (a long prompt, a queue)."""

    type: Literal["keepalive"] = "keepalive"


class Lost(WireModel):
    """A cannot finish the job: its worker was lost with no twin on A, its handler failed, or
    A is shutting down. B reads it as a ``WorkerLost`` (and may fail over)."""

    type: Literal["lost"] = "lost"
    reason: str


Frame = Annotated[Chunk | Result | JobError | Accepted | Assigned | KeepAlive | Lost,
                  Field(discriminator="type")]
# The frames that end a job's stream.
TERMINAL_FRAMES = (Result, JobError, Lost)


class ClusterJob(WireModel):
    """A job sent from the replica that holds the client (``origin``) to the one that holds a
    worker for it. Mirrors the dispatcher's ``JobRequest``; ``timeout_s`` is relative (the
    replicas' clocks need not agree)."""

    type: Literal["job"] = "job"
    job_id: str = Field(min_length=1, max_length=200)
    origin: str = Field(min_length=1, max_length=200)
    reply_to: str = Field(min_length=1, max_length=400)
    model: str
    openai_url: str
    openai_req: dict[str, Any]
    stream: bool = True
    continuation: str | None = None
    needs: dict[str, str] = Field(default_factory=dict)
    billed: bool = False
    timeout_s: float = Field(gt=0)
    # A continuation goes only to a twin: a worker holding this file (and able to continue).
    sha256: str | None = Field(default=None, max_length=64)
    # Workers that already failed this answer (their keys): not given it again.
    exclude: list[str] = Field(default_factory=list, max_length=64)
    # The model group (issue 19) on the serving replica whose head failed this answer: that
    # replica ends the group, waits for the next one (its ``group_failover_wait_s``, within
    # ``timeout_s``) and continues the answer on its head; ``worker_lost`` if none forms.
    regroup: str | None = Field(default=None, pattern=GROUP_ID)
    # The caller's prompt-cache scope, as the job frame carries it (``protocol.Job``).
    cache_scope: str | None = Field(default=None, pattern=CACHE_SCOPE)


class ClusterEvent(WireModel):
    """One event of a job, from the serving replica back to the origin, in ``seq`` order."""

    type: Literal["event"] = "event"
    job_id: str
    seq: int = Field(ge=0)
    frame: Frame

    @property
    def terminal(self) -> bool:
        return isinstance(self.frame, TERMINAL_FRAMES)


MAX_BATCH_EVENTS = 256  # events of one job in one ``ClusterEvents``


class ClusterEvents(WireModel):
    """Several consecutive events of one job in one bus message (issue 40): ``frames[i]`` is
    the event of sequence number ``first_seq + i``. What the serving replica sends: the
    events queued while its last message was on its way go together, so a fast stream costs
    one publish, one pub/sub message and one decode per batch, not per event."""

    type: Literal["events"] = "events"
    job_id: str
    first_seq: int = Field(ge=0)
    frames: list[Frame] = Field(min_length=1, max_length=MAX_BATCH_EVENTS)


class ClusterCancel(WireModel):
    """The origin's client went away, or the origin gave up on the job."""

    type: Literal["cancel"] = "cancel"
    job_id: str
    reason: str = "cancelled"


class ClusterOutcome(WireModel):
    """How a job served by another replica ended, as the origin counted it (the usage it
    bounded by the bytes delivered, the times on its clock), sent to the serving replica once
    the job is over: the replica that holds a worker keeps its speed record and its counts
    (routing there reads them), and no other replica writes them."""

    type: Literal["outcome"] = "outcome"
    job_id: str = Field(min_length=1, max_length=200)
    outcome: str = Field(default="ok", min_length=1, max_length=64)  # or timeout, worker_lost...
    prompt_tokens: int = Field(default=0, ge=0)
    completion_tokens: int = Field(default=0, ge=0)
    total_s: float = Field(default=0.0, ge=0)
    ttft_s: float | None = Field(default=None, ge=0)


QUERIES = ("totals", "workers", "worker", "worker_key", "jobs", "placements", "groups")
Query = Literal["totals", "workers", "worker", "worker_key", "jobs", "placements", "groups"]


class ClusterQuery(WireModel):
    """A report one replica asks of every other (``/stats``, the admin pages), broadcast; each
    answers with its own part, and the asker merges them (``queen_server.stats.merge``)."""

    type: Literal["query"] = "query"
    id: str = Field(min_length=1, max_length=200)
    origin: str = Field(min_length=1, max_length=200)
    reply_to: str = Field(min_length=1, max_length=400)
    what: Query
    arg: str | None = Field(default=None, max_length=400)


class ClusterAnswer(WireModel):
    """One replica's part of a report (JSON-ready data, as ``queen_server.reports`` makes
    it), or why it has none."""

    type: Literal["answer"] = "answer"
    id: str
    replica: str
    data: Any = None
    error: str | None = None


ClusterMessage = Annotated[
    ClusterJob | ClusterEvent | ClusterEvents | ClusterCancel | ClusterOutcome | ClusterQuery
    | ClusterAnswer,
    Field(discriminator="type")]
CLUSTER_ADAPTER: TypeAdapter[ClusterMessage] = TypeAdapter(ClusterMessage)
AnyClusterMessage = (ClusterJob | ClusterEvent | ClusterEvents | ClusterCancel | ClusterOutcome
                     | ClusterQuery | ClusterAnswer)


def encode_cluster(message: AnyClusterMessage) -> bytes:
    """One bus message (UTF-8 JSON)."""
    return message.__pydantic_serializer__.to_json(message)


def encode_events(job_id: str, first_seq: int, frames: Sequence[Frame]) -> bytes:
    """``encode_cluster(ClusterEvents(job_id=job_id, first_seq=first_seq, frames=frames))``,
    the same bytes, without building and checking the batch's model: each frame, already a
    checked model, is serialised by its own model's serializer and the batch written around
    them. The relay's hot path (issue 40): a quarter of the CPU of the model's way."""
    if not 1 <= len(frames) <= MAX_BATCH_EVENTS or first_seq < 0:
        raise ValueError(f"a batch holds 1 to {MAX_BATCH_EVENTS} frames from a seq >= 0")
    return b"".join((b'{"type":"events","job_id":', orjson.dumps(job_id), b',"first_seq":',
                     b"%d" % first_seq, b',"frames":[',
                     b",".join([frame.__pydantic_serializer__.to_json(frame)
                                for frame in frames]), b"]}"))


def decode_cluster(data: bytes | str) -> AnyClusterMessage:
    """Parse one bus message, ignoring fields a newer replica added. ``ProtocolError``
    (``invalid_message``) when it is not one."""
    try:
        return CLUSTER_ADAPTER.validate_json(data, extra="ignore")
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ProtocolError("invalid_message",
                            f"bad cluster message at {where or 'top'}: {first['msg']}") from exc
