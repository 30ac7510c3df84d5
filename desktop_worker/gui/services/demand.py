"""The "In demand" list, widget-free: from the queen's ``Demand``, this machine's hardware, the
models it holds, the room on its disk and its measured speed, the models worth adding, each with
an estimate of what it would earn and a line in plain words. No Qt and no I/O: table-tested.

Fitting follows ``advice.py`` (the memory a suggested model may use: the usable VRAM, or on a
CPU-only machine a share of the RAM for its threads), with the queen's own memory figure
(``memory_mb``: file plus KV cache, computed with ``shared_schema.fitting``) when it sent one,
else ``advice.need_mb`` of the file's size. A model of unknown size and memory cannot be judged
and is left out.

The estimate: sats/hour = earn_msat_per_1k_tokens * tokens/s * 3.6 / 1000 (msat per token is
earn/1000; * tokens/s * 3,600 s is msat per hour; / 1,000 is sats). tokens/s is this worker's
own speed, measured on the jobs it served (``SpeedMeter``) and scaled to the model's size: the
token rate of a GGUF model is bound by memory bandwidth, so about inversely proportional to its
file's bytes. It is the rate while the worker has work for that model ("up to"). Before any job
is measured there is no figure ("—", with the price per 1,000 tokens instead): a guess from the
hardware would be off by a factor of ten either way, and an owner would choose on it.

A local file the queen knows (issue 35): the demand names each model's pinned file by sha256, so
a .gguf the owner imports (or the small model that comes with Apiary) that is that very file is
imported under the queen's hub name (``hub_name_of``), which the queen prices by its own reading
instead of as "unverified". Only files whose size matches a pinned model are hashed.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from desktop_worker.gui.services.advice import CatalogModel, model_room_mb, need_mb
from desktop_worker.hardware import HardwareReport
from desktop_worker.swarm_choice import is_wanted, worth
from shared_schema import Demand, ModelDemand

__all__ = [
    "NO_ESTIMATE",
    "DemandRow",
    "InDemandModel",
    "SpeedMeter",
    "demand_line",
    "demand_rows",
    "estimate_text",
    "hub_name_of",
    "pinned_candidates",
    "sats_per_hour",
]

NO_ESTIMATE = "—"
# Jobs shorter than this say more about the prompt than about the speed: not measured.
MIN_TOKENS = 16
MEASURED_JOBS = 20  # the speed is the mean over the last jobs measured


@dataclass(frozen=True)
class InDemandModel(CatalogModel):
    """A model the queen's demand offers (in the wizard's list, beside the built-in ones): the
    commit and sha256 the queen pinned, so that the copy pulled is the one it routes to."""

    revision: str | None = None
    sha256: str | None = None


class SpeedMeter:
    """This worker's measured speed, as memory bandwidth: completion tokens per second times
    the model file's bytes, over its last ``MEASURED_JOBS`` jobs that finished well. A model of
    ``size`` bytes then runs at about ``bandwidth / size`` tokens per second."""

    def __init__(self, keep: int = MEASURED_JOBS) -> None:
        self._samples: deque[tuple[int, float, int]] = deque(maxlen=keep)

    def record(self, completion_tokens: int, seconds: float, size_bytes: int | None,
               outcome: str = "ok") -> bool:
        """One finished job; False when it says nothing about the speed (failed, too short,
        no time, or a model of unknown size)."""
        if (outcome != "ok" or completion_tokens < MIN_TOKENS or not 0 < seconds < math.inf
                or not size_bytes or size_bytes <= 0):
            return False
        self._samples.append((completion_tokens, seconds, size_bytes))
        return True

    @property
    def measured(self) -> bool:
        return bool(self._samples)

    def bandwidth(self) -> float | None:
        """Bytes per second (tokens/s * file bytes), weighted by time; None before any job."""
        if not self._samples:
            return None
        seconds = sum(s for _, s, _ in self._samples)
        return sum(t * b for t, _, b in self._samples) / seconds

    def tokens_per_s(self, size_bytes: int | None) -> float | None:
        bandwidth = self.bandwidth()
        if bandwidth is None or not size_bytes or size_bytes <= 0:
            return None
        return bandwidth / size_bytes


def sats_per_hour(earn_msat_per_1k_tokens: int, tokens_per_s: float) -> float:
    """What serving at ``tokens_per_s`` earns in an hour, in sats (msat per 1k tokens)."""
    return earn_msat_per_1k_tokens * tokens_per_s * 3.6 / 1000


@dataclass(frozen=True)
class DemandRow:
    """One row of the "In demand" list."""

    demand: ModelDemand
    need_mb: int
    tokens_per_s: float | None  # this worker's estimated speed on it (None: not measured)
    sats_per_hour: float | None  # None: no measurement yet, or the queen does not pay
    estimate: str  # what the Estimate column says
    estimate_tip: str  # how it was computed
    line: str  # the demand in plain words
    replaces: bool = False  # held here as another file than the one the queen pinned

    @property
    def name(self) -> str:
        return self.demand.name


def _count(value: float) -> str:
    return f"{value:.0f}" if value >= 10 or value == int(value) else f"{value:.1f}"


def demand_line(d: ModelDemand) -> str:
    """The demand in plain words: "12 requests/min, 3 waiting, nobody serves it yet"."""
    parts = [f"{_count(d.requests_per_min)} requests/min"]
    if d.queued:
        parts.append(f"{d.queued} waiting")
    elif d.unmet_per_min > 0:
        parts.append(f"{_count(d.unmet_per_min)}/min found nobody free")
    if d.holders == 0 and d.loading == 0:
        parts.append("nobody serves it yet")
    else:
        serving = ("1 worker serves it" if d.holders == 1
                   else f"{d.holders} workers serve it" if d.holders else "")
        loading = f"{d.loading} downloading it" if d.loading else ""
        parts.append(", ".join(p for p in (serving, loading) if p))
    return ", ".join(parts)


def estimate_text(d: ModelDemand, tokens_per_s: float | None) -> tuple[str, str, float | None]:
    """The Estimate cell, its tooltip, and the sats/hour (None when there is no figure)."""
    price = d.earn_msat_per_1k_tokens
    if price <= 0:
        return ("not paid", "This queen does not pay for this model (it pays nothing per "
                "token).", None)
    per_1k = f"{price / 1000:g} sats per 1,000 tokens"
    if tokens_per_s is None:
        return (f"{NO_ESTIMATE} ({per_1k})",
                f"It pays {per_1k}. No estimate per hour yet: this worker's speed is measured "
                "on the jobs it serves, so serve a few first.", None)
    rate = sats_per_hour(price, tokens_per_s)
    shown = f"{rate:,.0f}" if rate >= 10 else f"{rate:.1f}"
    return (f"up to {shown} sats/h",
            f"{per_1k} at about {tokens_per_s:.0f} tokens/s (this worker's measured speed, scaled "
            "to this model's size) = "
            f"{shown} sats per hour while it has work for this model.", rate)


def _need(d: ModelDemand) -> int | None:
    if d.memory_mb is not None:
        return d.memory_mb
    if d.size_bytes is not None:
        return need_mb(d.size_bytes)
    return None


def demand_rows(
    demand: Demand | None,
    report: HardwareReport | None,
    *,
    cap_mb: int | None = None,
    held: dict[str, str | None] | Collection[str] = (),
    room_bytes: int | None = None,
    speed: SpeedMeter | None = None,
) -> list[DemandRow]:
    """The "In demand" rows, best first (``swarm_choice.worth``: pay * speed on it * how busy it
    would keep this worker). Left out: models nobody asks for now, those that do not fit the
    memory (``advice.model_room_mb``) or the room on disk (``room_bytes``: None, not judged),
    those of unknown size and memory, and those held here (``held``: names, or names to the
    sha256 held; a copy of another file than the one the queen pinned is offered, to replace).
    No hardware report yet: nothing (it cannot be judged)."""
    if demand is None or report is None:
        return []
    room_mb = model_room_mb(report, cap_mb)
    held_sha = dict(held) if isinstance(held, dict) else dict.fromkeys(held)
    rows = []
    for d in sorted(demand.models, key=worth, reverse=True):
        need = _need(d)
        if not is_wanted(d) or need is None or need > room_mb:
            continue
        if room_bytes is not None and d.size_bytes is not None and d.size_bytes > room_bytes:
            continue
        replaces = False
        if d.name in held_sha:
            sha = held_sha[d.name]
            if d.sha256 is None or sha is None or sha == d.sha256:
                continue
            replaces = True
        tps = speed.tokens_per_s(d.size_bytes) if speed is not None else None
        estimate, tip, rate = estimate_text(d, tps)
        line = demand_line(d)
        if replaces:
            line += "; you hold another file under this name, which Add replaces"
        rows.append(DemandRow(d, need, tps, rate, estimate, tip, line, replaces))
    return rows


def wizard_models(rows: Iterable[DemandRow], limit: int = 3) -> list[InDemandModel]:
    """The best in-demand rows as the wizard's choices (a label that says why)."""
    out = []
    for row in list(rows)[:limit]:
        d = row.demand
        label = f"{d.name} (in demand: {demand_line(d)})"
        out.append(InDemandModel(d.name, label, d.size_bytes or 0, d.revision, d.sha256))
    return out


# --- a local file the queen knows by a hub name (issue 35) --------------------------------------


def pinned_candidates(demand: Demand | None, size_bytes: int) -> list[ModelDemand]:
    """The models of the queen's demand pinned to a file (a sha256) that a local file of
    ``size_bytes`` could be: only when there are any is the file worth hashing."""
    if demand is None:
        return []
    return [d for d in demand.models
            if d.sha256 is not None and d.size_bytes in (None, size_bytes)]


def hub_name_of(demand: Demand | None, sha256: str, size_bytes: int) -> str | None:
    """The hub name under which the queen's demand lists this very file (same sha256), or None.
    A file imported under that name is priced by the queen's own reading of the hub, where under
    a local name it is "unverified"."""
    for d in pinned_candidates(demand, size_bytes):
        if d.sha256 == sha256.lower():
            return d.name
    return None
