"""How the pages show values: one ``fmt`` per kind of value, table cells, bound fields, and the
tables' columns. ``static/app.js`` has the same functions, kind by kind, so a value looks the same
on the first (server-rendered) paint and after every refresh; a test compares the two.

Everything here is pure: values in, escaped text or markup out.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from markupsafe import Markup, escape

DASH = "\u2014"


def _parse_time(value: Any) -> datetime | None:
    if isinstance(value, int | float):
        return datetime.fromtimestamp(value, UTC)
    if isinstance(value, str) and value:
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            return None
        return parsed.astimezone(UTC) if parsed.tzinfo else parsed.replace(tzinfo=UTC)
    return None


def _duration(seconds: float) -> str:
    s = int(max(0.0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def _seconds_per_token(value: float) -> str:
    if value >= 1:
        return f"{value:.2f}"
    if value < 0.0001:
        return "<0.0001"
    return f"{value:.2g}"


def _sats(msat: Any) -> str:
    text = f"{msat / 1000:,.3f}".rstrip("0").rstrip(".")
    return "0" if text in {"-0", ""} else text


def _bytes(count: Any) -> str:
    """Bytes in binary units with one decimal, the tenths rounded half up (as ``app.js``'s
    ``bytes``: both round the same number, so a tie such as 1,280 bytes reads "1.3 KB" on
    both sides)."""
    count = float(count)
    if count < 1024:
        return f"{math.floor(count + 0.5):,} B"
    power = 1
    while power < 4 and count >= 1024 ** (power + 1):
        power += 1
    tenths = math.floor(count / 1024**power * 10 + 0.5) / 10
    return f"{tenths:,.1f} {'KMGT'[power - 1]}B"


def _params(count: Any) -> str:
    count = float(count)
    for size, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= size:
            return f"{count / size:.1f}".removesuffix(".0") + suffix
    return f"{int(count)}"


def _gpus(names: Sequence[str]) -> str:
    if not names:
        return "none"
    counts = Counter(names)
    return ", ".join(name if n == 1 else f"{n}\u00d7 {name}" for name, n in counts.items())


def _gpu_share(totals: Any) -> str:
    """How many of the workers online have a GPU, from the swarm's totals: "1 with a GPU",
    "all with a GPU", "none with a GPU", and the GPUs in all when some worker has several."""
    if not isinstance(totals, Mapping):
        return DASH
    online = int(totals.get("workers_online") or 0)
    with_gpu = int(totals.get("workers_with_gpu") or 0)
    gpus = int(totals.get("gpus") or 0)
    if with_gpu == 0:
        share = "none with a GPU"
    elif with_gpu == online and online > 1:
        share = "all with a GPU"
    else:
        share = f"{with_gpu:,} with a GPU"
    return share + (f" ({gpus:,} GPUs in all)" if gpus > with_gpu else "")


def fmt(value: Any, kind: str = "text") -> str:
    """One value as the pages show it (``app.js`` has the same function)."""
    if value is None or value == "":
        return DASH
    try:
        match kind:
            case "int":
                return f"{math.floor(value + 0.5):,}"  # half up, as JavaScript's Math.round
            case "float1" | "float2" | "float3":
                return f"{float(value):,.{kind[-1]}f}"
            case "rate":
                return f"{float(value):,.1f}"
            case "seconds":
                return f"{float(value):.2f} s"
            case "spt":
                return _seconds_per_token(float(value))
            case "pct":
                return f"{float(value) * 100:.1f}%"
            case "sats" | "price":
                return _sats(value)
            case "mb":
                return (f"{value / 1024:.1f} GB" if value >= 1024
                        else f"{math.floor(value + 0.5):,} MB")
            case "params":
                return _params(value)
            case "bytes":
                return _bytes(value)
            case "duration":
                return _duration(float(value))
            case "list" | "models":
                return ", ".join(str(item) for item in value) if value else DASH
            case "gpus":
                return _gpus(value)
            case "gpu_share":
                return _gpu_share(value)
            case "time":
                parsed = _parse_time(value)
                return parsed.strftime("%Y-%m-%d %H:%M:%S") if parsed else str(value)
            case "ago":
                parsed = _parse_time(value)
                return _duration(time.time() - parsed.timestamp()) if parsed else str(value)
            case "online":
                return "online" if value else "offline"
            case "revoked":
                return "revoked" if value else "active"
            case _:
                return str(value)
    except (TypeError, ValueError):
        return str(value)


BADGES = {"online", "revoked", "outcome", "state"}
GOOD = {"online", "active", "ok", "paid", "settled", "succeeded", "done", "ready"}
BAD = {"offline", "revoked", "failed", "error", "timeout", "worker_lost", "expired"}


def _badge_class(text: str) -> str:
    if text in GOOD:
        return "badge good"
    if text in BAD or "error" in text or "fail" in text:
        return "badge bad"
    return "badge"


def short_model(name: str) -> str:
    """A model's name without its Hugging Face owner (the full name is in the title)."""
    return name.rsplit("/", 1)[-1]


def cell(value: Any, kind: str) -> Markup:
    """A table cell's content: text, a link to a worker, or a badge; always escaped."""
    text = fmt(value, kind)
    if kind == "worker" and value:
        return Markup('<a href="/admin/workers/{}">{}</a>').format(quote(str(value), safe=""),
                                                                    text)
    if kind in BADGES and value is not None:
        return Markup('<span class="{}">{}</span>').format(_badge_class(text), text)
    if kind == "models" and isinstance(value, list) and value:
        return Markup("").join(Markup('<span class="model" title="{}">{}</span>').format(
            name, short_model(str(name))) for name in value)
    if kind == "ago" and value:
        return Markup('<span title="{}">{}</span>').format(fmt(value, "time") + " UTC", text)
    return escape(text)


def lookup(data: Any, path: str) -> Any:
    """``a.b.0.c`` into nested dicts and lists; None when any step is missing."""
    if not path:
        return data
    for part in path.split("."):
        if isinstance(data, Mapping):
            data = data.get(part)
        elif isinstance(data, list) and part.isdigit() and int(part) < len(data):
            data = data[int(part)]
        else:
            return None
    return data


def aggregate(value: Any, agg: str | None, scale: float = 1) -> Any:
    """``len`` of a list, or ``sum:key`` over a list of points (times ``scale``)."""
    if not agg:
        return value
    if not isinstance(value, list):
        return None
    if agg == "len":
        return len(value)
    if agg.startswith("sum:"):
        key = agg[4:]
        return sum((point.get(key) or 0) for point in value if isinstance(point, Mapping)) * scale
    return None


def field(data: Any, path: str, kind: str = "text", agg: str | None = None,
          scale: float = 1, fallback: str | None = None) -> Markup:
    """A bound value's content, as ``app.js`` renders it."""
    value = aggregate(lookup(data, path), agg, scale)
    if value is None and fallback is not None:
        return escape(fallback)
    return cell(value, kind)


# --- columns ----------------------------------------------------------------------------------

NUMERIC = frozenset({"int", "float1", "float2", "float3", "rate", "seconds", "spt", "pct",
                     "sats", "price", "mb", "params", "bytes", "duration"})


@dataclass(frozen=True)
class Column:
    key: str
    label: str
    kind: str = "text"
    title: str = ""
    wrap: bool = False  # long values (model lists) wrap instead of widening the table

    @property
    def numeric(self) -> bool:
        return self.kind in NUMERIC


WORKER_COLUMNS = (
    Column("public_id", "Worker", "worker", "Short public id of the worker's key"),
    Column("version", "Version"),
    Column("gpus", "GPUs", "gpus", wrap=True),
    Column("vram_mb", "VRAM", "mb"),
    Column("models", "Models", "models", wrap=True),
    Column("sec_per_token", "s/token", "spt", "Seconds per completion token (EMA)"),
    Column("sec_per_megapixel_step", "s/MP-step", "spt",
           "Seconds per megapixel-step of the images it rendered (EMA)"),
    Column("jobs", "Jobs", "int"),
    Column("failure_rate", "Failed", "pct", "Share of attempts that failed or timed out"),
    Column("earnings_msat", "Earned", "sats", "Sats earned: pending, available and paid"),
    Column("connected_since", "Connected", "ago", "Time since the current session began"),
    Column("online", "Status", "online"),
)
JOB_COLUMNS = (
    Column("at", "When (UTC)", "time"),
    Column("worker", "Worker", "worker"),
    Column("model", "Model", wrap=True),
    Column("prompt_tokens", "Prompt", "int", "Prompt tokens"),
    Column("completion_tokens", "Completion", "int", "Completion tokens"),
    Column("seconds", "Time", "seconds"),
    Column("ttft_s", "TTFT", "seconds", "Time to first token"),
    Column("outcome", "Outcome", "outcome"),
    Column("id", "Job id"),
)
WORKER_JOB_COLUMNS = tuple(c for c in JOB_COLUMNS if c.key != "worker")
MODEL_COLUMNS = (
    Column("id", "Model"),
    Column("workers", "Workers", "int", "Connected workers holding the model"),
    Column("loaded_on", "Loaded on", "int", "Workers with the model in memory"),
    Column("parameter_count", "Parameters", "params",
           "As the queen read them from the model file on the hub"),
    Column("verified", "Size read", "text",
           "verified: the queen read the file's header and pinned it; operator: a local name "
           "pinned to sha256s (APIARY_LOCAL_MODEL_PINS); unverified or local: priced by the "
           "price file, its workers' file, or the class for unverified models; pending: "
           "reading now"),
    Column("audited", "Audited", "text",
           "yes: answers are re-scored by holders of the pinned file; no: the queen cannot "
           "pin the model's file, so its answers are never audited"),
    Column("pinned_files", "Pinned file", "list",
           "The file routing, price and audits use until the operator re-pins the name"),
    Column("hub_moved", "Hub now", "text",
           "The hub holds another file under this name: POST /admin/api/models/repin "
           "{\"model\": name} moves routing, price and audits to it together", wrap=True),
    Column("price.size_class", "Size class"),
    Column("price.prompt_msat_per_1k", "Prompt sats/1k", "price", "sats per 1,000 prompt tokens"),
    Column("price.completion_msat_per_1k", "Completion sats/1k", "price",
           "sats per 1,000 completion tokens"),
    Column("price.reason", "Why this price", wrap=True),
)
PLACEMENT_COLUMNS = (
    Column("model", "Model", wrap=True),
    Column("worker", "Worker"),
    Column("size_mb", "Size", "mb"),
    Column("progress", "Downloaded", "pct"),
    Column("bytes_per_s", "Speed", "int", "Bytes a second, as the worker reports"),
    Column("estimated_time", "Ready in", "seconds", "The queen's estimate"),
    Column("since_s", "Since", "seconds", "Since the placement began"),
    Column("failures", "Failed on", "list", "Workers that could not fetch it, and why"),
)
GROUP_COLUMNS = (
    Column("model", "Model", wrap=True),
    Column("phase", "Phase", "state",
           "forming: the members start their servers; loading: the head loads the model "
           "across them; ready: serving requests"),
    Column("head", "Head", "worker", "The trusted worker that holds the rest of the model and "
           "answers requests"),
    Column("members_text", "Members", "list",
           "Each worker in layer order, the layers it holds, and how the head reaches it "
           "(direct on its LAN, or relayed through the queen)", wrap=True),
    Column("size", "Workers", "int", "Workers in the group, the head included"),
    Column("since_s", "Age", "duration", "Since the group was planned"),
    Column("load_s", "Load time", "seconds", "How long the head took to load the model"),
    Column("relayed_channels", "Relayed channels", "int",
           "Connections between the head and its members carried through this queen now"),
    Column("relayed_bytes", "Relayed", "bytes",
           "Bytes this queen carried between the head and its relayed members"),
)
UNGROUPED_COLUMNS = (
    Column("model", "Model", wrap=True),
    Column("served_by", "Served by", title="Whether requests for the model get a worker now"),
    Column("outcome", "Why no group", wrap=True,
           title="The group planner's last outcome for the model, in its words"),
)
PUBLIC_MODEL_COLUMNS = (
    Column("id", "Model", wrap=True),
    Column("workers", "Workers", "int"),
    Column("price.size_class", "Size class"),
    Column("price.prompt_msat_per_1k", "Prompt", "price", "sats per 1,000 prompt tokens"),
    Column("price.completion_msat_per_1k", "Completion", "price",
           "sats per 1,000 completion tokens"),
    Column("price.reason", "Why this price", wrap=True),
)
KEY_COLUMNS = (
    Column("id", "Id", "int"),
    Column("name", "Name"),
    Column("prefix", "Prefix"),
    Column("created_at", "Created (UTC)", "time"),
    Column("available_msat", "Available (sats)", "sats"),
    Column("reserved_msat", "Reserved (sats)", "sats"),
    Column("budget_msat", "Budget (sats)", "sats"),
    Column("rpm_limit", "Req/min", "int"),
    Column("concurrency_limit", "At once", "int"),
    Column("revoked", "Status", "revoked"),
)
PAYOUT_COLUMNS = (
    Column("id", "Id"),
    Column("worker", "Worker", "worker"),
    Column("amount_msat", "Amount (sats)", "sats"),
    Column("state", "State", "state"),
    Column("updated_at", "Updated (UTC)", "time"),
    Column("detail", "Detail", wrap=True),
)


AUDIT_COLUMNS = (
    Column("at", "When (UTC)", "time"),
    Column("worker", "Worker", "worker"),
    Column("auditor", "Auditor", "worker", "The worker that re-scored the answer"),
    Column("model", "Model", wrap=True),
    Column("temperature", "Temp.", "float1", "The request's sampling temperature"),
    Column("claimed_tokens", "Claimed", "int", "Completion tokens the worker claimed"),
    Column("answer_tokens", "Counted", "int", "Tokens the auditor counted in the answer"),
    Column("claimed_prompt_tokens", "Prompt claimed", "int",
           "Prompt tokens the worker was billed for"),
    Column("prompt_tokens", "Prompt counted", "int",
           "Prompt tokens the auditor counted, the model's template rendered"),
    Column("z", "z", "float2", "How far the answer's scores sit below an honest answer's"),
    Column("mismatches", "Mismatches", "int", "Greedy positions the model would not choose"),
    Column("reason", "Verdict", wrap=True, title="Why the audit failed; empty when it passed"),
    Column("charged_msat", "Charged (sats)", "sats"),
    Column("id", "Audit id"),
)
