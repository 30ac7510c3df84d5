"""The state the queen's edges share, built once by ``create_app`` and kept on ``app.state``,
and ``DispatchStats``: the swarm's ``JobStats`` port, wired to the swarm stats and the metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from queen_server.audits.service import AuditService
from queen_server.billing.pricing import Price
from queen_server.billing.quotes import Quote
from queen_server.billing.service import Billing
from queen_server.catalog import ModelCatalog
from queen_server.files.service import Files
from queen_server.finetune.service import FineTuning
from queen_server.images.audits import ImageAudits
from queen_server.images.links import ImageLinks
from queen_server.placement.groups import GroupService
from queen_server.placement.service import PlacementService
from queen_server.quoting import Pricer
from queen_server.settings import QueenSettings
from queen_server.stats.metrics import Metrics
from queen_server.stats.swarm import SwarmStats
from queen_server.storage.engine import Database
from queen_server.swarm.dispatch import Dispatcher
from queen_server.swarm.jobs import JobHandle
from queen_server.swarm.prefix import CacheScopes, PrefixAffinity
from queen_server.swarm.registry import Registry
from shared_schema import ModelPrice

if TYPE_CHECKING:
    from queen_server.replicas import Replicas


@dataclass
class QueenState:
    settings: QueenSettings
    registry: Registry
    dispatcher: Dispatcher
    billing: Billing
    db: Database | None
    stats: SwarmStats
    metrics: Metrics
    catalog: ModelCatalog
    audits: AuditService
    placement: PlacementService
    groups: GroupService
    pricer: Pricer
    # Prompt caches (issue 36): the callers' cache scopes, and which worker served each
    # conversation's last turn.
    scopes: CacheScopes
    affinity: PrefixAffinity
    replicas: Replicas | None = None  # the other queen replicas (issue 18), with a Redis
    files: Files | None = None  # the Files API's uploads (issue 37), with a database
    fine_tuning: FineTuning | None = None  # fine-tuning jobs (issue 37), with a database
    image_links: ImageLinks | None = None  # url answers' images (issue 38), with a database
    image_audits: ImageAudits | None = None  # image jobs rendered again (issue 38), with audits

    def quote_of(self, model: str) -> Quote:
        """The model's price and why (``billing.quotes``): the operator's class for it, else
        by the size the queen read itself (``catalog``), else bounded by its holders' files,
        else the class for unverified models. Starts a reading of a hub model that has no
        fresh one; a billed request ``settle``s the catalog first."""
        self.catalog.refresh(model)
        return self.pricer.quote(model)

    def price_of(self, model: str) -> Price:
        """``quote_of``'s price."""
        return self.quote_of(model).price

    def model_price(self, model: str) -> ModelPrice:
        """``quote_of`` as the wire shows it: class, rates, basis and reason."""
        self.catalog.refresh(model)
        return self.pricer.model_price(model)


class DispatchStats:
    """What the dispatcher reads and reports (``swarm.dispatch.JobStats``), kept by the swarm
    stats (speeds, each worker's record, the recent jobs) and counted in the Prometheus
    metrics (tokens, time to first token, retries, failovers) when there are any."""

    def __init__(self, stats: SwarmStats, metrics: Metrics | None = None) -> None:
        self.stats = stats
        self.metrics = metrics
        self.speeds_for = stats.speeds_for  # read on every request: no extra call
        self.speed_at = stats.speed_at

    def job_done(self, handle: JobHandle, size_class: str, prompt_tokens: int,
                 completion_tokens: int, total_s: float, ttft_s: float | None, *,
                 here: bool = True) -> None:
        if here:  # else the replica that served it keeps its worker's record
            self.stats.job_done(handle.id, handle.worker_key, handle.worker_id, handle.model,
                                size_class, prompt_tokens, completion_tokens, total_s, ttft_s,
                                jobs=handle.load)
        metrics = self.metrics
        if metrics is not None:
            metrics.tokens.labels("in").inc(prompt_tokens)
            metrics.tokens.labels("out").inc(completion_tokens)
            if ttft_s is not None:
                metrics.ttft.observe(ttft_s)

    def job_failed(self, handle: JobHandle, outcome: str, elapsed_s: float, *,
                   here: bool = True) -> None:
        if here:
            self.stats.job_failed(handle.id, handle.worker_key, handle.worker_id, handle.model,
                                  outcome, elapsed_s)

    def retried(self) -> None:
        if self.metrics is not None:
            self.metrics.retries.inc()

    def failed_over(self) -> None:
        if self.metrics is not None:
            self.metrics.failovers.inc()
