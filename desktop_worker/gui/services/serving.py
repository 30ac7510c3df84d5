"""What each loaded model serves now (issue 36): the Hardware tab's "Serving" box. Widget-free.

A model's batch runs several jobs at once (its slots, ``ModelPool.slots``). Per model the box
shows its slots, the jobs running now, and tokens per second per stream and in total, measured
on the jobs that ended in the last minute (``WINDOW_S``), from the records behind the Jobs tab:
a running job's tokens are known only when it ends.

- Per stream: the jobs' tokens over the time they ran (a mean weighted by each job's time, so a
  two-token answer weighs little), as the Jobs tab's Tokens/s reads a single job.
- In total: their tokens over the time any of them ran (the union of their intervals), that is
  the sum of the streams' speeds while they ran side by side: four jobs of 10 tokens/s at once
  read 40, and four of them one after the other 10.

``ServingLog`` keeps what the figures need (the jobs running now and the last minute's finished
ones); ``serving_figures`` is the arithmetic, pure, and ``serving_rows`` the words.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from desktop_worker.gui.services.worker import JobStart
from desktop_worker.jobs import JobRecord
from desktop_worker.service import WorkerService

WINDOW_S = 60.0  # the jobs the speeds are measured on: those that ended this recently
IDLE = "idle: no jobs in the last minute"
MEASURING = "measured when a job ends"
NOT_EARNING = "Not earning: the figures show while Apiary earns."
NOTHING_LOADED = "No model loaded yet: a model loads with its first job."


@dataclass(frozen=True)
class FinishedJob:
    """A generation job that ended, as the figures read it (``ended_s`` on ``clock``'s time)."""

    model: str
    ended_s: float
    seconds: float
    completion_tokens: int

    @property
    def started_s(self) -> float:
        return self.ended_s - self.seconds


@dataclass(frozen=True)
class ModelServing:
    """One loaded model's figures; the speeds are None when no job ended in the window."""

    model: str
    slots: int
    running: int
    jobs_measured: int
    per_stream_tps: float | None
    total_tps: float | None


def busy_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals: the time any of them ran."""
    total = 0.0
    reach: float | None = None
    start_of_run = 0.0
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            if reach is not None:
                total += reach - start_of_run
            start_of_run, reach = start, end
        else:
            reach = max(reach, end)
    if reach is not None:
        total += reach - start_of_run
    return total


def serving_figures(model: str, slots: int, running: int, finished: Iterable[FinishedJob],
                    now_s: float, window_s: float = WINDOW_S) -> ModelServing:
    """``model``'s figures from the jobs that ended within ``window_s`` before ``now_s``."""
    jobs = [job for job in finished
            if job.model == model and now_s - job.ended_s <= window_s
            and job.completion_tokens > 0 and job.seconds > 0]
    if not jobs:
        return ModelServing(model, slots, running, 0, None, None)
    tokens = sum(job.completion_tokens for job in jobs)
    stream_s = sum(job.seconds for job in jobs)
    busy_s = busy_seconds((job.started_s, job.ended_s) for job in jobs)
    return ModelServing(model, slots, running, len(jobs), tokens / stream_s, tokens / busy_s)


def loaded_slots(service: WorkerService | None, earning: bool) -> dict[str, int] | None:
    """Each loaded model's slots (jobs it runs at once) in the running worker; None when it
    does not earn (a stopped run's pool is closed)."""
    if not earning:
        return None
    if service is None:  # started, the worker not built yet
        return {}
    return {name: service.pool.slots(name) for name in service.pool.loaded()}


def serving_headline(slots: Mapping[str, int] | None) -> str:
    """The line above the models' figures ("" when there are models to show)."""
    if slots is None:
        return NOT_EARNING
    return "" if slots else NOTHING_LOADED


def tokens_per_s(value: float) -> str:
    return f"{value:,.1f} tokens/s"


def serving_rows(figures: ModelServing) -> list[tuple[str, str]]:
    """(label, value) lines under the model's name, in the owner's words."""
    rows = [("Jobs at once", f"{figures.slots}"),
            ("Running now", f"{figures.running} of {figures.slots}")]
    if figures.per_stream_tps is None or figures.total_tps is None:
        speed = MEASURING if figures.running else IDLE
        rows += [("Per stream", speed), ("In total", speed)]
        return rows
    jobs = f"{figures.jobs_measured} job{'' if figures.jobs_measured == 1 else 's'}"
    rows += [("Per stream", tokens_per_s(figures.per_stream_tps)),
             ("In total", f"{tokens_per_s(figures.total_tps)} ({jobs} in the last minute)")]
    return rows


class ServingLog:
    """The jobs running now and those that ended in the last ``window_s`` (older ones go), fed
    by the controller's ``job_started`` and ``job_finished``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 window_s: float = WINDOW_S) -> None:
        self.clock = clock
        self.window_s = window_s
        self._running: dict[str, str] = {}  # job id -> model
        self._finished: deque[FinishedJob] = deque()

    def started(self, start: JobStart) -> None:
        self._running[start.job_id] = start.model

    def finished(self, record: JobRecord) -> None:
        self._running.pop(record.job_id, None)
        self._finished.append(FinishedJob(record.model, self.clock(), record.seconds,
                                          record.completion_tokens))
        self._forget()

    def stopped(self) -> None:
        """The worker stopped: nothing runs any more (a job cut short never reports)."""
        self._running.clear()

    def running(self, model: str) -> int:
        return sum(1 for name in self._running.values() if name == model)

    def figures(self, slots: Mapping[str, int]) -> list[ModelServing]:
        """Each loaded model's figures (``slots``: name -> jobs at once), by name."""
        self._forget()
        now = self.clock()
        return [serving_figures(name, slots[name], self.running(name), self._finished, now,
                                self.window_s) for name in sorted(slots)]

    def _forget(self) -> None:
        horizon = self.clock() - self.window_s
        while self._finished and self._finished[0].ended_s < horizon:
            self._finished.popleft()
