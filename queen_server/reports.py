"""What the queen reports about itself: the data behind ``/stats``, ``/worker/stats``,
``/worker/earnings``, the admin JSON (``/admin/api/*``, ``GET /admin/keys``) and the pages.

One function per answer, each taking the queen's state and returning JSON-ready data (dicts,
lists, strings, numbers), so the HTTP routes (``http/``) and the pages (``web/``) show exactly the
same thing: the routes serialise it, the pages render it on the server and then poll the route
for it. An answer that is an error raises its ``ApiError`` (a 404 for an unknown worker, say),
which the route answers and the page shows. This module sits above the swarm, billing, stats and
storage, and below ``http/`` and ``web/``, which must not import each other.

A worker's key is never reported (it would let anyone read its earnings): only its short public
id.

With queen replicas (issue 18), the swarm's answers describe the whole swarm: each replica
answers for the workers connected to it (``part``, run when another replica asks over the
bus), and the replica that was asked merges the parts (``stats.merge``; ``_peers`` asks, at
most once a second per report). A worker's own figures come from the replica that holds it.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING, Any

from queen_server.audits.independence import eligible_auditor
from queen_server.billing import ledger
from queen_server.billing.admin import list_keys
from queen_server.errors import ModelUnverified, NotFound
from queen_server.groups import NoPlanReason
from queen_server.identity import public_id
from queen_server.placement.service import refusal
from queen_server.stats import merge
from queen_server.stats.swarm import BUCKET_S, HISTORY_S
from queen_server.storage import queries
from queen_server.storage.queries import LedgerCredit
from shared_schema import PayoutView, WorkerEarnings
from shared_schema.openai_types import DailyEarning, JobEarning

if TYPE_CHECKING:
    from queen_server.billing.keys import KeyStore
    from queen_server.billing.store import LedgerStore
    from queen_server.catalog import ModelCatalog
    from queen_server.runtime import QueenState
    from queen_server.stats.swarm import JobRecord, WorkerStats
    from shared_schema.cluster import Query

ADMIN_PAYOUTS = 200  # payouts the admin page lists
WORKER_PAYOUTS = 10  # payouts a worker's earnings list
WORKER_JOBS = 50  # jobs on an admin's page for one worker
HISTORY_DAYS = 30  # days in a worker's earnings chart
RECENT_JOBS = 50  # settled jobs in a worker's earnings table
WORKER_MODELS = 64  # models priced in a worker's earnings


def _iso(when: float | None) -> str | None:
    return datetime.fromtimestamp(when, UTC).isoformat() if when is not None else None


# --- the swarm ------------------------------------------------------------------------------

async def _peers(state: QueenState, what: Query, arg: str | None = None) -> list[Any]:
    """The other replicas' parts of a report (none without replicas)."""
    if state.replicas is None:
        return []
    return list((await state.replicas.gather(what, arg)).values())


def totals_part(state: QueenState, *, series: bool = False) -> dict[str, Any]:
    """This replica's part of the swarm's totals (``merge.totals``)."""
    registry, swarm = state.registry, state.stats
    sessions = list(registry)
    models = {}
    for name in registry.model_names():
        holders = registry.holders(name)
        models[name] = {"workers": len(holders),
                        "loaded_on": sum(name in session.loaded for session in holders)}
    part: dict[str, Any] = {
        "workers_online": len(sessions),
        "workers_with_gpu": sum(1 for session in sessions if session.gpus),
        "gpus": sum(len(session.gpus) for session in sessions),
        "vram_total_mb": sum(session.vram_mb for session in sessions),
        "models": models,
        "tokens_per_s": swarm.tokens_per_s(),
        "jobs_per_min": swarm.jobs_per_min(),
        "ttft": swarm.ttft_sketch(),
    }
    if series:
        part["series"] = swarm.series()
    return part


def swarm_totals(state: QueenState, peers: list[Any] | None = None) -> dict[str, Any]:
    """Workers, GPUs, VRAM, the models on offer with their prices, and the swarm's speed:
    this replica's, and ``peers``' parts added (the other replicas')."""
    return _totals(state, peers)[0]


def _totals(state: QueenState, peers: list[Any] | None
            ) -> tuple[dict[str, Any], dict[str, dict[str, int]]]:
    """``swarm_totals``, and per model its holders and the workers with it loaded."""
    local = totals_part(state)
    summed = merge.totals([local, *(peers or ())])
    if peers:
        p50, p95 = merge.percentiles([local["ttft"], *(
            part.get("ttft") for part in peers if isinstance(part, dict))])
    else:
        p50, p95 = state.stats.ttft_percentiles()
    models = []
    for name, counts in summed["models"].items():
        models.append({"id": name, "workers": counts["workers"],
                       "price": state.model_price(name).model_dump(mode="json")})
    answer = {key: summed[key] for key in merge.SUMMED}
    answer.update({
        "models": models,
        "tokens_per_s": round(summed["tokens_per_s"], 3),
        "jobs_per_min": round(summed["jobs_per_min"], 3),
        "ttft_p50_s": p50,
        "ttft_p95_s": p95,
    })
    if state.replicas is not None:
        answer["replicas"] = 1 + len(peers or ())  # those that answered
    return answer, summed["models"]


async def earnings_by_worker(state: QueenState) -> dict[str, int]:
    """Each worker's earnings (pending, available and paid together) by key."""
    if state.billing.ledger is None:
        return {}
    totals: dict[str, int] = {}
    for account, amount in (await state.billing.ledger.balances("worker:")).items():
        key = account.split(":")[1]
        totals[key] = totals.get(key, 0) + amount
    return totals


def worker_row(state: QueenState, record: WorkerStats, earnings: dict[str, int]) -> dict[str, Any]:
    """One worker as the tables show it: its record, and its session's facts while online."""
    session = state.registry.get(record.key)
    return {
        "public_id": record.public_id,
        "version": record.version,
        "gpus": session.gpus if session else [],
        "vram_mb": session.vram_mb if session else 0,
        "models": sorted(session.cached) if session else [],
        "sec_per_token": record.sec_per_token(),
        "sec_per_megapixel_step": image_speed(state, record),
        "jobs": record.jobs,
        "failures": record.failures,
        "timeouts": record.timeouts,
        "failure_rate": round(record.failure_rate, 4),
        "earnings_msat": earnings.get(record.key, 0),
        "uptime_s": round(record.uptime_s(state.stats.clock()), 1),
        "connected_since": _iso(record.connected_at),
        "last_seen": _iso(record.last_seen),
        "online": session is not None,
    }


def image_speed(state: QueenState, record: WorkerStats) -> float | None:
    """Issue 38: the worker's seconds per megapixel-step on the image class it rendered most
    (its record is kept per image token: ``image_tokens_per_megapixel_step`` make one)."""
    per_token = record.sec_per_image_token()
    if per_token is None:
        return None
    return round(per_token * state.settings.image_tokens_per_megapixel_step, 4)


def job_row(job: JobRecord) -> dict[str, Any]:
    return {"id": job.id, "worker": job.worker, "model": job.model,
            "prompt_tokens": job.prompt_tokens, "completion_tokens": job.completion_tokens,
            "seconds": round(job.seconds, 4),
            "ttft_s": round(job.ttft_s, 4) if job.ttft_s is not None else None,
            "outcome": job.outcome, "at": _iso(job.at)}


def per_minute(jobs: list[JobRecord]) -> list[dict[str, int]]:
    """Jobs and completion tokens per minute, oldest minute first (empty minutes left out)."""
    buckets: dict[int, dict[str, int]] = {}
    for job in jobs:
        point = buckets.setdefault(int(job.at // 60) * 60, {"jobs": 0, "tokens": 0})
        point["jobs"] += 1
        point["tokens"] += job.completion_tokens
    return [{"t": t, **point} for t, point in sorted(buckets.items())]


# --- the answers ----------------------------------------------------------------------------

async def stats(state: QueenState) -> dict[str, Any]:
    """``/stats`` and the landing page."""
    return swarm_totals(state, await _peers(state, "totals"))


def worker_terms(state: QueenState) -> dict[str, Any]:
    """What this queen offers a worker, for the landing page's "Run a worker" part and the
    worker's earnings: whether it pays (keys required and a ledger kept; an open queen serves
    for free and pays nothing) and how (``mode``: lightning, automatically through its
    Lightning backend; manual, its operator pays by hand; none), the operator's note on
    payouts, the workers' share of a job's price, and the payout threshold."""
    settings = state.settings
    pays = settings.auth == "keys" and state.billing.ledger is not None
    mode = "none" if not pays else (
        "lightning" if settings.lightning_backend != "none" else "manual")
    return {"pays": pays, "open": settings.auth == "open", "mode": mode,
            "note": settings.payout_note,
            "worker_share": settings.worker_share,
            "payout_threshold_sats": settings.payout_threshold_sats,
            "payout_interval_s": settings.payout_interval_s,
            "escrow_jobs": settings.escrow_jobs}


async def worker_stats(state: QueenState, key: str) -> dict[str, Any]:
    """``/worker/stats``: one worker, by its key, for its owner (from the replica that holds
    it, when another one does)."""
    for row in await _peers(state, "worker_key", key):
        if isinstance(row, dict) and row.get("online"):
            return row
    found = state.stats.workers.get(key)
    if found is None:
        raise NotFound(f"No worker {public_id(key)} has connected to this queen.",
                       code="worker_not_found")
    return worker_row(state, found, await earnings_by_worker(state))


async def overview(state: QueenState) -> dict[str, Any]:
    """``/admin/api/overview``: the totals and the last hour's series."""
    peers = await _peers(state, "totals", "series")
    series = merge.series([state.stats.series(), *(
        part.get("series") for part in peers if isinstance(part, dict))], HISTORY_S // BUCKET_S)
    return {"stats": swarm_totals(state, peers), "series": series}


def online_rows(state: QueenState, earnings: dict[str, int]) -> list[dict[str, Any]]:
    """The workers connected to this replica (its part of ``workers``)."""
    records = state.stats.workers
    return [worker_row(state, records[session.key], earnings) for session in state.registry
            if session.key in records]


async def workers(state: QueenState) -> list[dict[str, Any]]:
    """``/admin/api/workers``: every worker this queen has seen, online ones first (with
    replicas: online wherever it is connected)."""
    earnings = await earnings_by_worker(state)
    rows = [worker_row(state, found, earnings) for found in state.stats.workers.values()]
    peers = await _peers(state, "workers")
    if not peers:
        rows.sort(key=lambda row: (not row["online"], row["public_id"]))
        return rows
    return merge.worker_rows(rows, *(part for part in peers if isinstance(part, list)))


async def worker(state: QueenState, worker_id: str) -> dict[str, Any]:
    """``/admin/api/workers/{public id}``: one worker, its jobs per minute and recent jobs
    (from the replica that holds it, when another one does)."""
    for answer in await _peers(state, "worker", worker_id):
        if isinstance(answer, dict) and (answer.get("worker") or {}).get("online"):
            return answer
    return await _worker_here(state, worker_id)


async def _worker_here(state: QueenState, worker_id: str) -> dict[str, Any]:
    found = next((s for s in state.stats.workers.values() if s.public_id == worker_id), None)
    if found is None:
        raise NotFound(f"No worker {worker_id}.", code="worker_not_found")
    theirs = [job for job in state.stats.recent if job.worker_key == found.key]
    return {"worker": worker_row(state, found, await earnings_by_worker(state)),
            "series": per_minute(theirs),
            "recent_jobs": [job_row(job) for job in theirs[:WORKER_JOBS]]}


async def jobs(state: QueenState) -> list[dict[str, Any]]:
    """``/admin/api/jobs``: the recent jobs, newest first (every replica's)."""
    here = [job_row(job) for job in state.stats.recent]
    peers = await _peers(state, "jobs")
    if not peers:
        return here
    return merge.recent_jobs([here, *peers], state.stats.recent.maxlen or len(here))


async def models(state: QueenState) -> list[dict[str, Any]]:
    """``/admin/api/models``: the models on offer, where they are loaded, and their sizes."""
    totals, loaded = _totals(state, await _peers(state, "totals"))
    rows = []
    catalog, auditing = state.catalog, state.audits.enabled
    for model in totals["models"]:
        name = model["id"]
        facts, moved = catalog.facts(name), catalog.hub_moved(name)
        rows.append({**model, "loaded_on": loaded[name]["loaded_on"],
                     "parameter_count": catalog.parameter_count(name),
                     "verified": catalog.status(name),
                     "audited": "yes" if auditing and catalog.verified(name) else "no",
                     "sha256": facts.sha256 if facts is not None else None,
                     "pinned_files": _pinned_files(catalog, name),
                     "hub_moved": (f"the hub now holds {moved.sha256[:12]}… "
                                   f"({moved.parameter_count:,} parameters): re-pin to use it"
                                   if moved is not None else None)})
    return rows


def _pinned_files(catalog: ModelCatalog, name: str) -> list[str]:
    """The files ``name`` is pinned to, shortened: the hub file the queen read, or the
    operator's list for a local name."""
    facts = catalog.facts(name)
    shas = facts.sha256s[:1] if facts is not None else sorted(catalog.local_pins.get(name, ()))
    return [sha[:12] + "…" for sha in shas]


async def repin(state: QueenState, name: str) -> dict[str, Any]:
    """``POST /admin/api/models/repin``: the operator re-pins a hub name to the file the hub
    holds now (routing, price and audits all move to it at once)."""
    try:
        old, new = await state.catalog.repin(name)
    except ModelUnverified as exc:
        raise refusal(name, exc) from exc
    return {"model": name, "old_sha256": old.sha256 if old is not None else None,
            "sha256": new.sha256, "parameter_count": new.parameter_count,
            "price": state.model_price(name).model_dump(mode="json")}


async def placements(state: QueenState) -> list[dict[str, Any]]:
    """``/admin/api/placements``: models being fetched onto workers (issue 17), with their
    progress, the estimate, and the workers that failed them."""
    rows = state.placement.placements()
    for part in await _peers(state, "placements"):
        if isinstance(part, list):
            rows.extend(row for row in part if isinstance(row, dict))
    for row in rows:
        failed = row.get("failed") or {}
        row["failures"] = [f"{public_id(key)}: {why}" for key, why in failed.items()]
        row["size_mb"] = int(row["size_bytes"]) / 2**20
    return rows


# --- model groups (issue 19) ---------------------------------------------------------------

ROUTE_WORDS = {"local": "head", "direct": "direct", "relayed": "relayed"}
SERVED_BY_NO_ONE = "no one: only a group can hold it"
SERVED_BY_HOLDERS = "any worker that holds it, alone"


def groups_part(state: QueenState) -> dict[str, Any]:
    """This replica's part of ``groups``: its live groups (``GroupService.rows``) and its
    models without one (``ungrouped``). Each replica's groups live on that replica only."""
    service = state.groups
    return {"groups": service.rows(),
            "models": ungrouped(service.outcomes, service.group_only, set(service.by_model))}


def ungrouped(outcomes: dict[str, str], group_only: set[str],
              grouped: set[str]) -> list[dict[str, Any]]:
    """The models the group planner looked at that have no live group: every group-only
    model (its holders are out of routing, so requests for it fail until a group forms) and
    every planned model whose last outcome was no group, or a group that ended. A model that
    one worker holds alone ("fits_one_worker") needs no group and is left out."""
    rows = []
    for name in sorted((set(outcomes) | group_only) - grouped):
        outcome = outcomes.get(name) or "its group is being planned"
        only = name in group_only
        if not only and outcome.startswith(f"{NoPlanReason.FITS_ONE_WORKER}:"):
            continue
        rows.append({"model": name, "group_only": only, "outcome": outcome})
    return rows


def merge_groups(parts: list[Any]) -> dict[str, Any]:
    """The replicas' parts of ``groups`` as one answer (see ``groups``). A part that is not
    the shape ``groups_part`` makes is skipped, row by row."""
    rows: list[dict[str, Any]] = []
    models: dict[str, dict[str, Any]] = {}
    for part in parts:
        if not isinstance(part, dict):
            continue
        rows.extend(row for row in _list(part.get("groups")) if isinstance(row, dict))
        for row in _list(part.get("models")):
            if not isinstance(row, dict) or not isinstance(row.get("model"), str):
                continue
            seen = models.setdefault(row["model"], {"model": row["model"], "group_only": False,
                                                    "outcomes": []})
            seen["group_only"] = seen["group_only"] or bool(row.get("group_only"))
            if (outcome := str(row.get("outcome") or "")) and outcome not in seen["outcomes"]:
                seen["outcomes"].append(outcome)
    grouped = {row.get("model") for row in rows}
    groups = [group_row(row) for row in rows]
    groups.sort(key=lambda row: (str(row.get("model")), str(row.get("id"))))
    waiting = [{"model": name, "group_only": seen["group_only"],
                "served_by": SERVED_BY_NO_ONE if seen["group_only"] else SERVED_BY_HOLDERS,
                "outcome": "; ".join(seen["outcomes"])}
               for name, seen in models.items() if name not in grouped]
    waiting.sort(key=lambda row: (not row["group_only"], row["model"]))
    return {"groups": groups, "models": waiting}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def group_row(row: dict[str, Any]) -> dict[str, Any]:
    """One group as the admin page shows it: ``GroupService.rows``' row, with ``size`` (its
    workers, the head included) and ``members_text`` ("w_ab12 (12 layers, relayed)", in layer
    order, the head first)."""
    members = [m for m in _list(row.get("members")) if isinstance(m, dict)]
    texts = []
    for member in members:
        layers = member.get("layers")
        route = str(member.get("route", ""))
        texts.append(f"{member.get('worker')} ({layers} layer{'' if layers == 1 else 's'}, "
                     f"{ROUTE_WORDS.get(route, route)})")
    return {**row, "size": len(members), "members_text": texts}


async def groups(state: QueenState) -> dict[str, Any]:
    """``/admin/api/groups``: the model groups (issue 19) on every replica, and the models the
    planner found no group for, with why. The answer::

        {"groups": [{"id", "model", "phase": "forming" | "loading" | "ready",
                     "head": public id, "members": [{"worker": public id, "layers": int,
                     "route": "local" | "direct" | "relayed"}, ...] (the head first),
                     "members_text": ["w_ab12 (12 layers, relayed)", ...], "size": int,
                     "since_s": float, "load_s": float | null, "relayed_channels": int,
                     "relayed_bytes": int}, ...],
         "models": [{"model", "group_only": bool, "served_by": str,
                     "outcome": the planner's last outcome in words}, ...]}

    ``groups`` are sorted by model; ``models`` has the group-only ones first (no request for
    them gets a worker until a group forms), and only models no replica has a group for (each
    replica's distinct outcomes joined by "; ")."""
    return merge_groups([groups_part(state), *await _peers(state, "groups")])


async def payouts(state: QueenState) -> list[dict[str, Any]]:
    """``/admin/api/payouts``: the latest payouts, newest first (none without a database)."""
    if state.db is None:
        return []
    return [{"id": p.id, "worker": public_id(p.worker_key), "amount_msat": p.amount_msat,
             "state": p.state, "updated_at": p.updated_at.isoformat(), "detail": p.detail}
            for p in await queries.recent_payouts(state.db.engine, ADMIN_PAYOUTS)]


async def part(state: QueenState, what: Query, arg: str | None) -> Any:
    """This replica's part of a report another replica was asked for (``cluster.queries``):
    what it knows of the swarm, never what it learned from the others (no part asks again)."""
    if what == "totals":
        return totals_part(state, series=arg == "series")
    if what == "workers":
        return online_rows(state, await earnings_by_worker(state))
    if what == "worker":
        found = next((s for s in state.stats.workers.values() if s.public_id == arg), None)
        if found is None or state.registry.get(found.key) is None:
            return None
        return await _worker_here(state, found.public_id)
    if what == "worker_key":
        record = state.stats.workers.get(arg or "")
        if record is None or state.registry.get(record.key) is None:
            return None
        return worker_row(state, record, await earnings_by_worker(state))
    if what == "jobs":
        return [job_row(job) for job in state.stats.recent]
    if what == "placements":
        return state.placement.placements()
    if what == "groups":
        return groups_part(state)
    raise ValueError(f"no such report: {what}")


def key_stores(state: QueenState) -> tuple[KeyStore, LedgerStore]:
    """The key and ledger stores, or the 404 of a queen that keeps no database."""
    billing = state.billing
    if billing.keys is None or billing.ledger is None:
        raise NotFound("This queen keeps no database.", code="no_ledger")
    return billing.keys, billing.ledger


async def api_keys(state: QueenState) -> list[dict[str, Any]]:
    """``GET /admin/keys``: every key with its balance, by id."""
    keys, store = key_stores(state)
    return [view.model_dump(mode="json") for view in await list_keys(keys, store)]


# --- a worker's earnings --------------------------------------------------------------------

async def worker_earnings(state: QueenState, pubkey: str, now: datetime) -> WorkerEarnings:
    """``/worker/earnings``: what the worker with this key has earned, is owed and was paid."""
    store = state.billing.ledger
    if store is None:
        raise NotFound("This queen keeps no ledger.", code="no_ledger")
    balances = await store.balances(f"worker:{pubkey}:")
    midnight = now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    total, today = await store.worker_credits(pubkey, midnight)
    settled = await store.worker_jobs(pubkey)
    paid = await queries.recent_payouts(store.engine, WORKER_PAYOUTS, worker_key=pubkey)
    first = midnight.date() - timedelta(days=HISTORY_DAYS - 1)
    credits = await queries.charges_credited(
        store.engine, [ledger.worker_pending(pubkey), ledger.worker_available(pubkey)],
        datetime(first.year, first.month, first.day, tzinfo=UTC))
    daily, recent = earnings_history(credits, midnight.date())
    terms = worker_terms(state)
    pays = bool(terms["pays"])
    return WorkerEarnings(
        worker_id=public_id(pubkey),
        jobs_settled=settled,
        escrow_jobs_left=max(0, state.settings.escrow_jobs + 1 - settled),
        pending_msat=balances.get(ledger.worker_pending(pubkey), 0),
        available_msat=balances.get(ledger.worker_available(pubkey), 0),
        paid_msat=balances.get(f"worker:{pubkey}:paid", 0),
        today_msat=today,
        total_msat=total,
        recent_payouts=[PayoutView(id=p.id, amount_msat=p.amount_msat, state=p.state,
                                   updated_at=p.updated_at, detail=p.detail) for p in paid],
        week_msat=sum(d.earned_msat for d in daily[-7:]),
        daily=daily,
        recent_jobs=recent,
        pays_workers=pays,
        payout_threshold_msat=int(terms["payout_threshold_sats"]) * 1000 if pays else None,
        audit=await state.audits.view_of(pubkey),
        payout_mode=terms["mode"],
        payout_note=terms["note"],
        payout_address=await queries.payout_address(store.engine, pubkey) if pays else None,
        payout_interval_s=terms["payout_interval_s"] if pays else None,
        # The worker's names were read when it joined: pricing them starts no hub reading.
        models=[state.pricer.worker_price(name, state.settings.worker_share, pays)
                for name in (await worker_models(state, pubkey))[:WORKER_MODELS]],
    )


async def worker_models(state: QueenState, pubkey: str) -> list[str]:
    """The models a worker holds now, as the replica it is connected to knows them (none
    while it is not connected)."""
    session = state.registry.get(pubkey)
    if session is not None:
        return sorted(session.cached)
    for row in await _peers(state, "worker_key", pubkey):
        if isinstance(row, dict) and row.get("online"):
            return [name for name in _list(row.get("models")) if isinstance(name, str)]
    return []


def earnings_history(
    credits: list[LedgerCredit], today: date
) -> tuple[list[DailyEarning], list[JobEarning]]:
    """A worker's credits per UTC day for the ``HISTORY_DAYS`` days ending ``today`` (oldest
    first, empty days included) and per job for its latest ``RECENT_JOBS`` settled jobs (newest
    first), from its charge credits, newest first. Credits outside those days count for the
    jobs only."""
    first = today - timedelta(days=HISTORY_DAYS - 1)
    per_day = {first + timedelta(days=i): 0 for i in range(HISTORY_DAYS)}
    per_job: dict[str, JobEarning] = {}  # newest first; a txn may credit both accounts
    for credit in credits:
        created = credit.created_at
        stamp = created if created.tzinfo else created.replace(tzinfo=UTC)
        day = stamp.astimezone(UTC).date()
        if day in per_day:
            per_day[day] += credit.amount_msat
        if not credit.txn_id.startswith("settle:"):
            continue
        job_id = credit.txn_id.removeprefix("settle:")
        if job_id in per_job:
            earned = per_job[job_id].earned_msat + credit.amount_msat
            per_job[job_id] = per_job[job_id].model_copy(update={"earned_msat": earned})
        elif len(per_job) < RECENT_JOBS:
            per_job[job_id] = JobEarning(job_id=job_id, earned_msat=credit.amount_msat,
                                         settled_at=stamp)
    daily = [DailyEarning(day=day, earned_msat=msat) for day, msat in sorted(per_day.items())]
    return daily, list(per_job.values())


# --- audits (issue 16) ----------------------------------------------------------------------

ADMIN_AUDITS = 200  # audited jobs the admin page lists


def _sample(state: QueenState, name: str, **labels: str) -> float:
    return state.metrics.registry.get_sample_value(name, labels) or 0.0


async def audits(state: QueenState) -> dict[str, Any]:
    """``/admin/api/audits``: every worker's audit standing, each flag with its evidence (the
    failed jobs, their scores, their auditors), the recent audits, and what audits cost: the
    share of answers audited and auditors' tokens against the tokens served (since start)."""
    service = state.audits
    if service.store is None:
        raise NotFound("This queen keeps no database.", code="no_ledger")
    records = await service.store.standings()
    recent = await service.store.recent(ADMIN_AUDITS)
    count, audit_tokens, audit_s = await service.store.totals()
    served = (_sample(state, "apiary_tokens_total", direction="in")
              + _sample(state, "apiary_tokens_total", direction="out"))
    auditable = _sample(state, "apiary_auditable_answers_total")
    queued = _sample(state, "apiary_audits_total", outcome="queued")
    since_start = _sample(state, "apiary_audit_tokens_total")

    def row(audit: Any) -> dict[str, Any]:
        return {"id": audit.id, "at": audit.created_at.isoformat(),
                "request_id": audit.request_id, "worker": public_id(audit.worker_key),
                "auditor": public_id(audit.auditor_key), "trusted": audit.auditor_trusted,
                "model": audit.model, "temperature": audit.temperature,
                "answer_tokens": audit.answer_tokens, "claimed_tokens": audit.claimed_tokens,
                "prompt_tokens": audit.prompt_tokens,
                "claimed_prompt_tokens": audit.claimed_prompt_tokens,
                "positions": audit.positions, "mismatches": audit.mismatches,
                "z": round(audit.z, 2),
                "suspicion": None if audit.suspicion is None else round(audit.suspicion, 2),
                "failed": audit.failed, "reason": audit.reason,
                "charged_msat": audit.charged_msat, "refunded": audit.refunded,
                "audit_tokens": audit.audit_tokens, "audit_s": round(audit.audit_s, 3)}

    standings = []
    flagged_first = sorted(records.items(), key=lambda item: item[1].standing.state != "flagged")
    for key, record in flagged_first:
        standing = record.standing
        entry = {"worker": public_id(key), "state": standing.state,
                 "audited": standing.audited, "failed": standing.failed,
                 "llr": round(standing.llr, 2), "flags": record.flags,
                 "outvoted": record.outvoted, "auditor_eligible": eligible_auditor(record.outvoted),
                 "named_in_groups": key in service.named,
                 "flagged_at": record.flagged_at.isoformat() if record.flagged_at else None,
                 "cleared_at": record.cleared_at.isoformat() if record.cleared_at else None,
                 "reasons": list(standing.reasons)}
        if standing.state == "flagged":
            entry["evidence"] = [row(audit) for audit in
                                 await service.store.recent(ADMIN_AUDITS, worker_key=key)
                                 if audit.failed]
        standings.append(entry)
    return {
        "enabled": service.enabled,
        "trusted_auditors": len(service.trusted),
        "sampled_share": queued / auditable if auditable else None,
        "audit_token_share": since_start / served if served else None,
        "audits": count, "audit_tokens": audit_tokens, "audit_s": round(audit_s, 1),
        "standings": standings,
        "recent": [row(audit) for audit in recent],
    }


async def clear_flag(state: QueenState, worker_id: str) -> dict[str, Any]:
    """``POST /admin/api/audits/{public id}/clear``: an admin clears a false flag."""
    service = state.audits
    if service.store is None:
        raise NotFound("This queen keeps no database.", code="no_ledger")
    key = next((key for key in (await service.store.standings())
                if public_id(key) == worker_id or key == worker_id), None)
    if key is None or not await service.clear(key):
        raise NotFound(f"No flagged worker {worker_id}.", code="worker_not_flagged")
    return {"worker": public_id(key), "state": service.standing(key).state}
