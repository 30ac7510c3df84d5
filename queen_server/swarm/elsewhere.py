"""Jobs served by another queen replica (issue 18), as the dispatcher sees them.

With replicas, a request reaches one queen process while the worker that could serve it may be
connected to another. ``Elsewhere`` is the dispatcher's port to the other replicas: which of
them have workers of a model (a short-lived cached view of the shared directory), and sending
one of them a job whose events are fed to an ordinary ``JobHandle``. Everything after that
(relay, metering, billing, mid-stream failover) is the same as for a local worker: the job's
events arrive in order or end in one ``WorkerLost`` (``queen_server.cluster.remote``).

``queen_server.replicas`` implements the port on the cluster's bus and directory; the swarm
does not import the cluster. ``view_of`` turns what the serving replica says of its worker
(``RemoteWorker``) into the directory entry a ``JobRun`` carries, so that the books credit the
worker that did the work and a failover looks for a twin of its file.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from queen_server.swarm.jobs import JobHandle, Shares
from queen_server.swarm.worker import Worker
from shared_schema import CAPABILITY_CONTINUE, ModelDescriptor

REPLICA_PREFIX = "replica:"  # a remote job's handle names its replica until a worker is known


@dataclass(frozen=True, slots=True)
class RemoteWorker:
    """The worker another replica gave a job to: its earnings key (None: legacy), public id,
    the sha256 of the model file it holds, and its model group's shares and id if it heads
    one."""

    key: str | None
    public_id: str
    sha256: str | None
    shares: Shares = ()
    group: str = ""


class RemoteRun(Protocol):
    """A job sent to another replica; its events go to the handle given to ``submit``."""

    @property
    def worker(self) -> RemoteWorker | None:
        """Who serves it, once the serving replica said (before its first event)."""
        ...

    async def cancel(self, reason: str) -> None: ...


class Elsewhere(Protocol):
    """The other replicas of this queen."""

    @property
    def replica_id(self) -> str: ...

    async def replicas(self, model: str, exclude: Collection[str] = ()) -> list[tuple[str, int]]:
        """Other live replicas with workers of ``model``: (replica id, free slots), best
        first; at most a second old."""
        ...

    async def submit(self, replica: str, handle: JobHandle, *, model: str, openai_url: str,
                     openai_req: Mapping[str, Any], stream: bool, timeout_s: float,
                     continuation: str | None, needs: Mapping[str, str], billed: bool,
                     sha256: str | None, exclude: Collection[str],
                     regroup: str | None = None, cache_scope: str | None = None) -> RemoteRun:
        """Send the job; its events are fed to ``handle``. Raises when nothing was sent (the
        replica is gone, the bus is down): the job may go elsewhere. ``regroup``: the group
        there whose head failed this answer, to end and wait for again before continuing.
        ``cache_scope``: the caller's prompt-cache scope, for the job frame there."""
        ...

    def outcome(self, replica: str, job_id: str, *, outcome: str, prompt_tokens: int,
                completion_tokens: int, total_s: float, ttft_s: float | None) -> None:
        """Tell ``replica`` how the job it served ended (as this replica counted it): the
        worker's record is kept by the replica that holds the worker. Best effort, in the
        background."""
        ...


def view_of(worker: RemoteWorker | None, replica: str, model: str) -> Worker:
    """A directory entry for the worker another replica gave the job to (not registered here:
    it is only what the run, the books and a failover read)."""
    key = worker.key if worker is not None and worker.key else f"{REPLICA_PREFIX}{replica}"
    public_id = worker.public_id if worker is not None and worker.public_id else key
    sha256 = worker.sha256 if worker is not None else None
    return Worker(key=key, public_id=public_id, session_id=f"via {replica}",
                  models=[ModelDescriptor(name=model, loaded=True, sha256=sha256)],
                  capabilities=[CAPABILITY_CONTINUE],
                  legacy=worker is not None and worker.key is None)
