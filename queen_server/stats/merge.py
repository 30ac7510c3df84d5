"""The whole swarm's reports from every replica's part (issue 18).

Each replica knows the workers connected to it; ``/stats`` and the admin pages ask the others
for their parts (``cluster.queries``) and merge them here, in pure functions over the
JSON-ready data ``queen_server.reports`` makes: counts are summed, a model's holders summed by
name, the hour's series summed point by point, worker rows deduplicated (a worker connected
somewhere beats the offline record another replica keeps of it), recent jobs interleaved by
time. Times to first token travel as a *sketch*: the samples themselves when there are few,
else 101 evenly spaced quantiles with the count they stand for, so the merged percentiles are
weighted by each replica's traffic without sending thousands of samples.

A part that is not what this version makes (a replica of another version, a bug) is skipped
field by field rather than failing the page: a missing number counts as zero.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

SKETCH_POINTS = 101  # quantiles 0, 1, ..., 100 %
SUMMED = ("workers_online", "workers_with_gpu", "gpus", "vram_total_mb")
RATES = ("tokens_per_s", "jobs_per_min")
SERIES_FIELDS = ("workers", "tokens_per_s", "jobs", "errors")


def sketch(samples: Sequence[float]) -> dict[str, Any]:
    """``samples`` (sorted) as at most ``SKETCH_POINTS`` points standing for ``count``."""
    count = len(samples)
    if count <= SKETCH_POINTS:
        return {"count": count, "points": list(samples)}
    last = count - 1
    points = [samples[round(last * i / (SKETCH_POINTS - 1))] for i in range(SKETCH_POINTS)]
    return {"count": count, "points": points}


def _number(part: Mapping[str, Any], key: str) -> float:
    value = part.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return 0
    return value


def percentiles(sketches: Iterable[Any]) -> tuple[float | None, float | None]:
    """p50 and p95 over several sketches, each point weighted by the samples it stands for."""
    weighted: list[tuple[float, float]] = []
    for found in sketches:
        if not isinstance(found, Mapping):
            continue
        points = [p for p in found.get("points") or () if isinstance(p, int | float)]
        count = _number(found, "count")
        if not points or count <= 0:
            continue
        weight = count / len(points)
        weighted.extend((float(point), weight) for point in points)
    if not weighted:
        return None, None
    weighted.sort()
    total = sum(weight for _, weight in weighted)

    def at(fraction: float) -> float:
        target = fraction * total
        running = 0.0
        for value, weight in weighted:
            running += weight
            if running >= target - 1e-9:
                return value
        return weighted[-1][0]

    return at(0.5), at(0.95)


def totals(parts: Iterable[Any]) -> dict[str, Any]:
    """Counts and rates summed; ``models``: name -> holders and workers with it loaded."""
    merged: dict[str, Any] = {key: 0 for key in SUMMED}
    merged.update({key: 0.0 for key in RATES})
    models: dict[str, dict[str, int]] = {}
    for part in parts:
        if not isinstance(part, Mapping):
            continue
        for key in (*SUMMED, *RATES):
            merged[key] += _number(part, key)
        found = part.get("models")
        if not isinstance(found, Mapping):
            continue
        for name, counts in found.items():
            if not isinstance(name, str) or not isinstance(counts, Mapping):
                continue
            model = models.setdefault(name, {"workers": 0, "loaded_on": 0})
            model["workers"] += int(_number(counts, "workers"))
            model["loaded_on"] += int(_number(counts, "loaded_on"))
    merged["models"] = models
    return merged


def series(all_series: Iterable[Any], points: int) -> list[dict[str, float]]:
    """The hour's points summed by time (``t``), the newest ``points`` of them, oldest first."""
    by_time: dict[float, dict[str, float]] = {}
    for one in all_series:
        if not isinstance(one, Sequence):
            continue
        for point in one:
            if not isinstance(point, Mapping) or not isinstance(point.get("t"), int | float):
                continue
            merged = by_time.setdefault(point["t"], {"t": point["t"],
                                                     **{key: 0 for key in SERIES_FIELDS}})
            for key in SERIES_FIELDS:
                merged[key] += _number(point, key)
    return [by_time[t] for t in sorted(by_time)[-points:]]


def _rank(row: Mapping[str, Any]) -> tuple[bool, str]:
    return bool(row.get("online")), str(row.get("last_seen") or "")


def worker_rows(*row_lists: Iterable[Any]) -> list[dict[str, Any]]:
    """One row per worker (by public id): the one where it is online, else the newest."""
    best: dict[str, dict[str, Any]] = {}
    for rows in row_lists:
        for row in rows:
            if not isinstance(row, Mapping) or not isinstance(row.get("public_id"), str):
                continue
            held = best.get(row["public_id"])
            if held is None or _rank(row) > _rank(held):
                best[row["public_id"]] = dict(row)
    merged = list(best.values())
    merged.sort(key=lambda row: (not row.get("online"), row["public_id"]))
    return merged


def recent_jobs(job_lists: Iterable[Any], limit: int) -> list[dict[str, Any]]:
    """Every replica's recent jobs, newest first (ISO times in UTC sort as text)."""
    jobs = [job for jobs in job_lists if isinstance(jobs, Sequence) for job in jobs
            if isinstance(job, Mapping) and isinstance(job.get("at"), str)]
    jobs.sort(key=lambda job: job["at"], reverse=True)
    return [dict(job) for job in jobs[:limit]]
