"""Prometheus metrics, in a registry of the app's own (no process-wide singleton)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                   60, 120)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)


class Metrics:
    def __init__(self, workers: Callable[[], float], queued: Callable[[], float],
                 swarm: Callable[[], Mapping[str, int]] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("apiary_http_requests", "HTTP requests",
                                ["route", "method", "status"], registry=self.registry)
        self.latency = Histogram("apiary_http_request_seconds", "HTTP request latency",
                                 ["route", "method"], buckets=LATENCY_BUCKETS,
                                 registry=self.registry)
        self.tokens = Counter("apiary_tokens", "Tokens served", ["direction"],
                              registry=self.registry)
        self.ttft = Histogram("apiary_time_to_first_token_seconds",
                              "Time from sending a streamed job to its first token",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.retries = Counter("apiary_job_retries", "Jobs retried on another worker",
                               registry=self.registry)
        self.failovers = Counter("apiary_job_failovers",
                                 "Answers continued on another worker after theirs was lost",
                                 registry=self.registry)
        self.errors = Counter("apiary_errors", "Errors answered, by code", ["code"],
                              registry=self.registry)
        # Audits (issue 16): answers that could be audited, audits by outcome, what they cost.
        self.auditable = Counter("apiary_auditable_answers",
                                 "Finished answers offered to the audits' sampling",
                                 registry=self.registry)
        self.audits = Counter("apiary_audits", "Audits by outcome (queued, passed, failed, "
                              "uninformative, disagreed, unconfirmed, error, expired, dropped)",
                              ["outcome"], registry=self.registry)
        self.audit_tokens = Counter("apiary_audit_tokens",
                                    "Tokens auditors evaluated (prompt plus answer)",
                                    registry=self.registry)
        self.audit_seconds = Counter("apiary_audit_seconds",
                                     "Seconds auditors spent on score jobs",
                                     registry=self.registry)
        self.flags = Counter("apiary_workers_flagged", "Workers flagged by audits",
                             registry=self.registry)
        self._http: dict[tuple[str, str, int], tuple[Counter, Histogram]] = {}
        Gauge("apiary_workers_connected", "Connected workers",
              registry=self.registry).set_function(workers)
        Gauge("apiary_queue_depth", "Jobs waiting for a free worker",
              registry=self.registry).set_function(queued)
        if swarm is not None:  # every replica's (issue 18); the rest are this process's
            for name, field, about in (
                    ("apiary_swarm_replicas", "replicas", "Queen replicas alive"),
                    ("apiary_swarm_workers_connected", "workers",
                     "Workers connected to any replica"),
                    ("apiary_swarm_jobs_in_flight", "jobs_in_flight",
                     "Jobs running on any replica's workers")):
                Gauge(name, about, registry=self.registry).set_function(
                    lambda field=field: float(swarm().get(field, math.nan)))

    def observe_http(self, route: str, method: str, status: int, seconds: float) -> None:
        """Count one request and its latency (the labelled children are looked up once)."""
        children = self._http.get((route, method, status))
        if children is None:
            children = self._http[(route, method, status)] = (
                self.requests.labels(route, method, str(status)),
                self.latency.labels(route, method),
            )
        children[0].inc()
        children[1].observe(seconds)
