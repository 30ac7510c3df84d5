"""What the swarm is doing, in memory: per-worker counters and speeds, recent jobs, and the
windows behind tokens/s, jobs per minute, time to first token and the charts.

Recording is a few appends and additions per job (it sits on the request path); everything else
is computed when a page or ``/stats`` asks. The clock is injected, so it is tested without
waiting. ``stats/store.py`` persists the per-worker parts.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from queen_server.stats.ema import Speed
from queen_server.stats.load import LoadSpeeds, speed_at
from queen_server.stats.merge import sketch
from shared_schema.images import IMAGE_CLASS

BUCKET_S = 10
HISTORY_S = 3600
WINDOW_S = 60
TTFT_WINDOW_S = 300
_NONE: Mapping[str, float] = {}
_NO_LOADS: Mapping[str, LoadSpeeds] = {}


@dataclass
class WorkerStats:
    key: str
    public_id: str
    version: str = ""
    jobs: int = 0
    failures: int = 0
    timeouts: int = 0
    uptime_base_s: float = 0.0  # finished sessions
    connected_at: float | None = None
    last_seen: float | None = None
    speeds: dict[str, Speed] = field(default_factory=dict)
    dirty: bool = False
    # jobs, failures, timeouts and uptime as the database has them (when last loaded or
    # written): what is written is the difference, so replicas never overwrite each other.
    saved: tuple[int, int, int, float] = (0, 0, 0, 0.0)

    def unsaved(self) -> tuple[int, int, int, float]:
        jobs, failures, timeouts, uptime_s = self.saved
        return (self.jobs - jobs, self.failures - failures, self.timeouts - timeouts,
                self.uptime_base_s - uptime_s)

    def uptime_s(self, now: float) -> float:
        current = now - self.connected_at if self.connected_at is not None else 0.0
        return self.uptime_base_s + current

    @property
    def failure_rate(self) -> float:
        attempts = self.jobs + self.failures + self.timeouts
        return (self.failures + self.timeouts) / attempts if attempts else 0.0

    def sec_per_token(self) -> float | None:
        """The completion speed of the text class this worker has done most of."""
        best = max((speed for size_class, speed in self.speeds.items()
                    if not size_class.startswith(IMAGE_CLASS)),
                   key=lambda s: s.samples, default=None)
        return best.completion_s_per_token if best else None

    def sec_per_image_token(self) -> float | None:
        """Issue 38: the seconds per image token (``image_tokens_per_megapixel_step`` of them
        make a megapixel-step) of the image class this worker has done most of."""
        best = max((speed for size_class, speed in self.speeds.items()
                    if size_class.startswith(IMAGE_CLASS)),
                   key=lambda s: s.samples, default=None)
        return best.completion_s_per_token if best else None


@dataclass(frozen=True, slots=True)
class JobRecord:
    id: str
    worker_key: str
    worker: str  # public id
    model: str
    prompt_tokens: int
    completion_tokens: int
    seconds: float
    ttft_s: float | None
    outcome: str
    at: float


@dataclass
class Bucket:
    jobs: int = 0
    tokens: int = 0
    errors: int = 0
    workers: int = 0  # online at the bucket's last connect, disconnect or creation


class SwarmStats:
    def __init__(self, clock: Callable[[], float] = time.time, recent_jobs: int = 500) -> None:
        self.clock = clock
        self.workers: dict[str, WorkerStats] = {}
        self.recent: deque[JobRecord] = deque(maxlen=recent_jobs)
        self._window: deque[tuple[float, int]] = deque()  # (when, completion tokens)
        self._ttft: deque[tuple[float, float]] = deque(maxlen=5000)
        self._buckets: dict[int, Bucket] = {}
        self._speeds: dict[str, dict[str, float]] = {}  # size class -> worker key -> s/token
        # Size class -> worker key -> its speeds under load (``stats.load``): kept here only,
        # by the replica that holds the worker; the unloaded record above is the shared one.
        self._loaded: dict[str, dict[str, LoadSpeeds]] = {}
        self.online = 0

    # --- recording ----------------------------------------------------------------------------

    def worker(self, key: str, public_id: str) -> WorkerStats:
        stats = self.workers.get(key)
        if stats is None:
            stats = self.workers[key] = WorkerStats(key, public_id)
        return stats

    def connected(self, key: str, public_id: str, version: str) -> None:
        now = self.clock()
        stats = self.worker(key, public_id)
        stats.version = version
        if stats.connected_at is None:
            self.online += 1
        else:  # a new session of the same key replaced the old one
            stats.uptime_base_s += now - stats.connected_at
        stats.connected_at = stats.last_seen = now
        stats.dirty = True
        self._bucket(now).workers = self.online

    def disconnected(self, key: str) -> None:
        stats = self.workers.get(key)
        if stats is None or stats.connected_at is None:
            return
        now = self.clock()
        stats.uptime_base_s += now - stats.connected_at
        stats.connected_at = None
        stats.last_seen = now
        stats.dirty = True
        self.online = max(0, self.online - 1)
        self._bucket(now).workers = self.online

    def job_done(
        self,
        job_id: str,
        key: str,
        public_id: str,
        model: str,
        size_class: str,
        prompt_tokens: int,
        completion_tokens: int,
        total_s: float,
        ttft_s: float | None,
        jobs: int = 1,
    ) -> None:
        """One job ended well. ``jobs``: how many its worker was running when it started,
        itself included; a job that ran alone feeds the worker's unloaded speed record, one
        that shared the worker its record under that load (``stats.load``)."""
        now = self.clock()
        stats = self.worker(key, public_id)
        stats.jobs += 1
        stats.last_seen = now
        stats.dirty = True
        speed = stats.speeds.get(size_class)
        if speed is None:
            speed = stats.speeds[size_class] = Speed()
        if jobs <= 1:
            speed.record(prompt_tokens, completion_tokens, total_s, ttft_s)
            self.index_speed(key, size_class, speed)
        elif (sample := speed.completion_sample(prompt_tokens, completion_tokens, total_s,
                                                ttft_s)) is not None:
            by_worker = self._loaded.setdefault(size_class, {})
            loaded = by_worker.get(key)
            if loaded is None:
                loaded = by_worker[key] = LoadSpeeds()
            loaded.record(jobs, sample)
        bucket = self._bucket(now)
        bucket.jobs += 1
        # the swarm's tokens/s counts generated text: image tokens are none
        generated = 0 if size_class.startswith(IMAGE_CLASS) else completion_tokens
        bucket.tokens += generated
        self._window.append((now, generated))
        if ttft_s is not None:
            self._ttft.append((now, ttft_s))
        self.recent.appendleft(JobRecord(job_id, key, public_id, model, prompt_tokens,
                                         completion_tokens, total_s, ttft_s, "ok", now))

    def index_speed(self, key: str, size_class: str, speed: Speed) -> None:
        """Keep ``speeds_for`` current (it is read on every request, so it is not rebuilt)."""
        if speed.completion_s_per_token is not None:
            self._speeds.setdefault(size_class, {})[key] = speed.completion_s_per_token

    def job_failed(self, job_id: str, key: str, public_id: str, model: str, outcome: str,
                   seconds: float = 0.0) -> None:
        """A job that did not finish on this worker: ``timeout`` counts as a timeout, any other
        outcome (``worker_lost``, an error code) as a failure."""
        now = self.clock()
        stats = self.worker(key, public_id)
        if outcome == "timeout":
            stats.timeouts += 1
        else:
            stats.failures += 1
        stats.dirty = True
        self._bucket(now).errors += 1
        self.recent.appendleft(JobRecord(job_id, key, public_id, model, 0, 0, seconds, None,
                                         outcome, now))

    def _bucket(self, now: float) -> Bucket:
        index = int(now // BUCKET_S)
        bucket = self._buckets.get(index)
        if bucket is None:
            bucket = self._buckets[index] = Bucket(workers=self.online)
            oldest = index - HISTORY_S // BUCKET_S
            for stale in [i for i in self._buckets if i < oldest]:
                del self._buckets[stale]
        return bucket

    # --- reading ------------------------------------------------------------------------------

    def speeds_for(self, size_class: str) -> Mapping[str, float]:
        """Completion seconds per token of every worker with a record on this class (its
        unloaded record: jobs that ran alone on it)."""
        return self._speeds.get(size_class, {})

    def speed_at(self, size_class: str, key: str, jobs: int) -> float | None:
        """Completion seconds per token a new stream would get on the worker of ``key`` as its
        ``jobs``-th job at once (``stats.load.speed_at``); None without any record. O(1)."""
        unloaded = self._speeds.get(size_class, _NONE).get(key)
        if jobs <= 1 and unloaded is not None:
            return unloaded
        return speed_at(jobs, unloaded, self._loaded.get(size_class, _NO_LOADS).get(key))

    def _trim(self, now: float) -> None:
        while self._window and now - self._window[0][0] > WINDOW_S:
            self._window.popleft()

    def tokens_per_s(self) -> float:
        now = self.clock()
        self._trim(now)
        return sum(tokens for _, tokens in self._window) / WINDOW_S

    def jobs_per_min(self) -> float:
        now = self.clock()
        self._trim(now)
        return len(self._window) * 60 / WINDOW_S

    def _ttft_samples(self) -> list[float]:
        now = self.clock()
        return sorted(ttft for when, ttft in self._ttft if now - when <= TTFT_WINDOW_S)

    def ttft_sketch(self) -> dict[str, Any]:
        """The last five minutes' times to first token, in a few numbers another replica can
        merge with its own (``stats.merge.percentiles``)."""
        return sketch(self._ttft_samples())

    def ttft_percentiles(self) -> tuple[float | None, float | None]:
        """p50 and p95 time to first token over the last five minutes."""
        samples = self._ttft_samples()
        if not samples:
            return None, None
        if len(samples) == 1:
            return samples[0], samples[0]
        cuts = statistics.quantiles(samples, n=20, method="inclusive")
        return statistics.median(samples), cuts[18]

    def series(self) -> list[dict[str, float]]:
        """One point per 10 s over the last hour, oldest first. An empty bucket carries the
        workers-online count of the one before it."""
        now = self.clock()
        last = int(now // BUCKET_S)
        points = []
        workers = 0
        for index in range(last - HISTORY_S // BUCKET_S + 1, last + 1):
            bucket = self._buckets.get(index)
            if bucket is not None:
                workers = bucket.workers
            points.append({
                "t": index * BUCKET_S,
                "workers": self.online if index == last else workers,
                "tokens_per_s": (bucket.tokens / BUCKET_S) if bucket else 0.0,
                "jobs": bucket.jobs if bucket else 0,
                "errors": bucket.errors if bucket else 0,
            })
        return points
