"""The state the queen's edges share, built once by ``create_app`` and kept on ``app.state``."""

from __future__ import annotations

from dataclasses import dataclass

from queen_server.billing.service import Billing
from queen_server.settings import QueenSettings
from queen_server.stats.metrics import Metrics
from queen_server.stats.swarm import SwarmStats
from queen_server.storage.engine import Database
from queen_server.swarm.dispatch import Dispatcher
from queen_server.swarm.registry import Registry


@dataclass
class QueenState:
    settings: QueenSettings
    registry: Registry
    dispatcher: Dispatcher
    billing: Billing
    db: Database | None
    stats: SwarmStats
    metrics: Metrics
