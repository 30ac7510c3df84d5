"""The audit service: sample finished answers, have them re-scored, judge, and act.

``wants`` runs once per finished answer and costs O(1): it draws against the worker's audit
rate (``decision.audit_rate``); only a drawn answer is built into a case and queued
(``consider``). A background loop hands queued cases to
free auditors (``cases.choose_auditor``: the operator's trusted auditors first, then workers in
good standing; never the audited worker; only the same model file) as ``score`` jobs through
the dispatcher, at most ``audit_concurrency`` at once and never ahead of a client's request:
an audit takes only a free slot, and waits (up to ``audit_max_wait_s``) when none is. A failed
verdict from an untrusted auditor is checked by a second auditor when there is one; if they
disagree, the job counts for nothing. Their two failing verdicts count only when the two are
independent (``independence``: no owner, /24 or /48 network in common, first connected an hour
or more apart); a second auditor that is not makes the case wait for another one, and it counts
for nothing if none comes in time. Untrusted auditors independent of the audited worker (and
of the first auditor) are asked first. A second opinion that contradicts the first, from a
trusted auditor or one independent of both the first and the audited worker, counts against
the first (``Record.outvoted``); past ``OUTVOTED_LIMIT`` it audits no one and its own answers
are audited at the new-worker rate. Each verdict moves the worker's ``Standing`` and is
written with its evidence (``store.AuditStore``).

A worker the test flags is taken out of routing (``Registry.set_flagged``), the developers
charged for its failed audited answers are refunded through the ledger (idempotent postings
``refund:<job>``), its pending earnings are forfeited to the queen, and its payouts are held
(the payout runner skips flagged workers). An admin can ``clear`` a false flag: the test starts
again, the worker is routed again and what was forfeited is paid back into its available
earnings. Routing reads each connected worker's ``trust`` (below 1 in good standing) and
``uncovered`` (a new worker with ``audit_backlog`` answers waiting for audits ranks as busy).

A fine-tuned (``ft:``) model's answer (issue 37) is audited as any other, by a holder of its
base's file with the ``lora`` capability; its score jobs carry the model's ``Job.adapter`` with
a token for that auditor (``fine_tuned``: the served models), and it is judged by the base's
bands. A case whose model was deleted (its adapter can no longer be fetched) is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from queen_server.audits.cases import AuditCase, BadScore, choose_auditor, read_scores
from queen_server.audits.decision import (
    DEFAULT_BANDS,
    HonestBands,
    JobScore,
    SprtParams,
    Standing,
    Verdict,
    audit_rate,
    enough_accusers,
    judge,
)
from queen_server.audits.independence import AuditorFacts, eligible_auditor, why_dependent
from queen_server.audits.store import AuditStore, Record
from queen_server.billing.service import Billing
from queen_server.errors import ApiError, NoCapacity
from queen_server.settings import QueenSettings
from queen_server.stats.metrics import Metrics
from queen_server.swarm.dispatch import Dispatcher
from queen_server.swarm.registry import Registry
from queen_server.swarm.worker import Worker
from shared_schema import AuditStanding, Chunk, JobError, Result, capabilities
from shared_schema.audits import SCORE_URL
from shared_schema.training import AdapterRef

if TYPE_CHECKING:
    from queen_server.finetune.models import FineTunedModel

log = logging.getLogger(__name__)

GOOD_TRUST = 0.8  # a worker in good standing: its speed score counts as 20 % better
RETRY_S = 1.0  # how often waiting cases look for a free auditor
AUDITOR_SCAN = 64  # holders looked at per case (beyond the trusted auditors): O(1) per audit
NAMED_AFTER_HEADS = 2  # a member in failing groups under this many heads is named
ACCUSERS_READ = 200  # a worker's latest audits read back for its accusers after a restart
MB = 1024 * 1024


class GroupsForAudits(Protocol):
    """What audits ask of model groups (``placement.groups.GroupService``)."""

    def need_bytes(self, model: str) -> int | None:
        """The memory ``model`` needs held whole, as its group was planned; None: no group."""
        ...

    def heads(self, model: str) -> list[tuple[Worker, tuple[str, ...]]]:
        """Each ready group of ``model``: its head and its workers' keys."""
        ...


class FineTunedForAudits(Protocol):
    """What audits ask of the served fine-tuned models (``finetune.models.FineTunedModels``)."""

    def served(self, name: str) -> FineTunedModel | None:
        """The served model ``name`` (anyone's); None once deleted."""
        ...

    def ref(self, model: FineTunedModel) -> Callable[[str], AdapterRef]:
        """The ``Job.adapter`` each worker (by key) gets for ``model``."""
        ...


def load_bands(path: Path | None) -> dict[str, HonestBands]:
    """Bands per model sha256 from the operator's file ({sha256: bands}); none without one. A
    bad file stops the queen at start with the reason."""
    if path is None:
        return {}
    try:
        raw = json.loads(path.read_text())
        return {sha256: HonestBands.from_dict(bands) for sha256, bands in raw.items()}
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"APIARY_AUDIT_BANDS_FILE {path}: {exc}") from exc


@dataclass(slots=True)
class _Waiting:
    case: AuditCase
    since: float
    exclude: frozenset[str] = frozenset()
    first: Verdict | None = None  # an untrusted auditor's failed verdict, to be confirmed
    first_auditor: AuditorFacts | None = None  # who gave it, as the queen saw it then
    # A second untrusted auditor's failing verdict agreeing with the first, waiting for a third
    # opinion (there was a third auditor to ask when it came)
    second_auditor: AuditorFacts | None = None


class AuditService:
    def __init__(
        self,
        settings: QueenSettings,
        registry: Registry,
        dispatcher: Dispatcher,
        billing: Billing,
        store: AuditStore | None,
        metrics: Metrics | None = None,
        *,
        bands: dict[str, HonestBands] | None = None,
        params: SprtParams | None = None,
        rng: random.Random | None = None,
        groups: GroupsForAudits | None = None,
        fine_tuned: FineTunedForAudits | None = None,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.dispatcher = dispatcher
        self.billing = billing
        self.store = store
        self.metrics = metrics
        self.bands = bands if bands is not None else load_bands(settings.audit_bands_file)
        self.params = params or SprtParams(contamination=settings.audit_contamination)
        self.rng = rng or random.Random()
        self.groups = groups
        self.fine_tuned = fine_tuned  # None: no fine-tuning here (an ``ft:`` case is dropped)
        # a group member -> the heads of the failing groups it was in (``_blame_members``)
        self._member_heads: dict[str, set[str]] = {}
        self.named: set[str] = set()  # members the evidence names: kept out of groups
        # a worker -> the auditors whose failing verdicts on it counted ("" for a trusted one):
        # a flag needs a trusted one or ``MIN_ACCUSERS`` (``decision.enough_accusers``)
        self._accusers: dict[str, set[str]] = {}
        self._flagged_now: dict[str, bool] = {}  # a verdict just flagged the worker
        self.trusted = frozenset(settings.trusted_auditors)  # keys or public ids
        self._trusted_keys: set[str] = set()  # the keys of trusted auditors that joined
        self._records: dict[str, Record] = {}
        self._facts: dict[str, AuditorFacts] = {}  # each joined worker's, for independence
        self._ineligible: set[str] = set()  # outvoted too often: audits no one
        self._queue: deque[_Waiting] = deque()
        self._waiting: dict[str, int] = {}  # worker key -> its cases waiting
        self._running: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._seq = 0

    @property
    def idle(self) -> bool:
        """No audit waiting or running (what tests and a graceful stop wait for)."""
        return not self._queue and not self._running

    @property
    def enabled(self) -> bool:
        return self.settings.audits and self.store is not None

    def start(self) -> None:
        if self.enabled:
            self._loop_task = asyncio.create_task(self._loop(), name="audits")

    async def stop(self) -> None:
        tasks = [*self._running, *([self._loop_task] if self._loop_task else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # --- standings ----------------------------------------------------------------------------

    def is_trusted(self, worker: Worker) -> bool:
        return worker.key in self.trusted or worker.public_id in self.trusted

    def standing(self, key: str) -> Standing:
        record = self._records.get(key)
        return record.standing if record is not None else Standing()

    async def joined(self, worker: Worker) -> None:
        """A worker connected: read its standing (a flag survives reconnecting) and apply it."""
        if self.store is None or worker.legacy:
            return
        if self.is_trusted(worker):
            self._trusted_keys.add(worker.key)  # audit-only workers are in no routing index
        elif capabilities.AUDITOR in worker.capabilities:
            log.warning("worker %s offers itself as an auditor but is not one of this queen's "
                        "trusted auditors (APIARY_TRUSTED_AUDITORS): it gets no work",
                        worker.public_id)
        record = self._records.get(worker.key)
        if record is None:
            record = self._records[worker.key] = await self.store.record(worker.key)
        if not eligible_auditor(record.outvoted):
            self._ineligible.add(worker.key)
        known = self._facts.get(worker.key)
        first_seen = (known.first_seen if known is not None and known.first_seen is not None
                      else await self.store.first_seen(worker.key))
        self._facts[worker.key] = replace(self._facts_of(worker), first_seen=first_seen)
        self._apply(worker)

    def _facts_of(self, worker: Worker) -> AuditorFacts:
        """What independence reads of a worker: as it joined, with what it says now."""
        known = self._facts.get(worker.key)
        return AuditorFacts(worker.key, worker.peer_host, worker.ln_url, worker.group_family,
                            known.first_seen if known is not None else None)

    def dependence(self, a: Worker, b: Worker) -> str | None:
        """Why workers ``a`` and ``b`` may be one party (``independence.why_dependent``), in
        words; None when they are independent. For audits of other kinds (issue 38)."""
        return why_dependent(self._facts_of(a), self._facts_of(b))

    def auditor_eligible(self, key: str) -> bool:
        """Whether the worker may audit others (not outvoted past ``OUTVOTED_LIMIT``)."""
        return key not in self._ineligible

    def _apply(self, worker: Worker) -> None:
        standing = self.standing(worker.key)
        trust = GOOD_TRUST if standing.state == "good" or self.is_trusted(worker) else 1.0
        uncovered = (standing.state == "unknown" and not self.is_trusted(worker)
                     and self._waiting.get(worker.key, 0) >= self.settings.audit_backlog)
        self.registry.set_standing(worker, trust=trust, uncovered=uncovered)
        if not worker.closed:
            self.registry.set_flagged(worker, standing.state == "flagged")

    def _applied(self, key: str) -> None:
        worker = self.registry.get(key)
        if worker is not None:
            self._apply(worker)

    async def view_of(self, key: str) -> AuditStanding | None:
        """``view`` for any worker, connected or not (None on a queen without a database)."""
        if self.store is None:
            return None
        if key not in self._records:
            self._records[key] = await self.store.record(key)
        return self.view(key)

    def view(self, key: str) -> AuditStanding:
        """A worker's standing as its app shows it (``/worker/earnings``)."""
        standing = self.standing(key)
        flagged = standing.state == "flagged"
        return AuditStanding(state=standing.state, audited=standing.audited,
                             failed=standing.failed, payouts_held=flagged,
                             flagged_reason=standing.reasons[-1] if flagged and standing.reasons
                             else None)

    # --- sampling (per finished answer: O(1)) -----------------------------------------------

    def wants(self, worker_key: str, *, failed_over: bool = False) -> bool:
        """Whether to audit this answer of ``worker_key``: a draw against its audit rate. O(1),
        and called before any case is built, so an answer not drawn costs nothing more. A part
        whose worker was lost mid-answer (``failed_over``) is drawn at least at the new-worker
        rate: dropping the socket is no way around the audits (issue 39)."""
        if not self.enabled:
            return False
        if self.metrics is not None:
            self.metrics.auditable.inc()
        worker = self.registry.get(worker_key)
        if worker is not None and self.is_trusted(worker):
            return False  # the operator's own auditors are trusted, not audited
        rate = self.rate(worker_key)
        if failed_over:
            rate = max(rate, self.settings.audit_new_rate)
        return self.rng.random() < rate

    def rate(self, worker_key: str) -> float:
        """The share of ``worker_key``'s answers audited: ``decision.audit_rate``, and at least
        the new-worker rate for one outvoted too often as an auditor (its lies as an auditor
        make its own answers suspect)."""
        standing = self.standing(worker_key)
        rate = audit_rate(standing, in_escrow=self.billing.in_escrow(worker_key),
                          base_rate=self.settings.audit_base_rate,
                          new_rate=self.settings.audit_new_rate, params=self.params)
        if (worker_key in self._ineligible or worker_key in self.named) \
                and standing.state != "flagged":
            rate = max(rate, self.settings.audit_new_rate)
        return rate

    def consider(self, case: AuditCase) -> bool:
        """Queue a drawn answer's case for an audit (``wants`` said yes); True if queued."""
        if len(self._queue) >= self.settings.audit_queue:
            self._count("dropped")
            return False
        self._queue.append(_Waiting(case, asyncio.get_running_loop().time()))
        self._waiting[case.worker_key] = self._waiting.get(case.worker_key, 0) + 1
        self._applied(case.worker_key)
        self._count("queued")
        self._wake.set()
        return True

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.audits.labels(outcome).inc()

    def _done_waiting(self, key: str) -> None:
        left = self._waiting.get(key, 0) - 1
        if left > 0:
            self._waiting[key] = left
        else:
            self._waiting.pop(key, None)
        self._applied(key)

    # --- the loop -----------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RETRY_S if self._queue else None):
                    await self._wake.wait()
            self._wake.clear()
            try:
                self._dispatch_waiting()
            except Exception:
                log.exception("audit dispatch failed")

    def _dispatch_waiting(self) -> None:
        now = asyncio.get_running_loop().time()
        kept: deque[_Waiting] = deque()
        while self._queue:
            waiting = self._queue.popleft()
            if now - waiting.since > self.settings.audit_max_wait_s:
                self._count("expired" if waiting.first is None else "unconfirmed")
                self._done_waiting(waiting.case.worker_key)
                continue
            if waiting.case.adapter_sha256 is not None and self._adapter(waiting.case) is None:
                self._count("model_deleted")  # its adapter can no longer be fetched
                self._done_waiting(waiting.case.worker_key)
                continue
            if len(self._running) >= self.settings.audit_concurrency:
                kept.append(waiting)
                continue
            auditor = self._auditor_for(waiting)
            if auditor is None:
                kept.append(waiting)
                continue
            task = asyncio.create_task(self._audit(waiting, auditor),
                                       name=f"audit {waiting.case.request_id}")
            self._running.add(task)
            task.add_done_callback(self._finished)
        self._queue = kept

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        self._wake.set()

    def trusted_auditors(self) -> list[Worker]:
        """The trusted auditors connected now (audit-only: in no routing index)."""
        return [worker for key in self._trusted_keys
                if (worker := self.registry.get(key)) is not None]

    def _auditor_for(self, waiting: _Waiting, *, busy_too: bool = False) -> Worker | None:
        case = waiting.case
        trusted = self.trusted_auditors()
        holds_group_model = None
        if case.group:  # a group's answer: a trusted auditor with the memory, or another group
            heads = {head.key: (head, keys) for head, keys in
                     (self.groups.heads(case.model) if self.groups is not None else [])}
            holders: Collection[Worker] = [head for head, _ in heads.values()]
            holds_group_model = self._group_auditor(case.model, case.group, heads)
        else:
            holders = self.registry.holders(case.held_as)
        scan = [*trusted, *(worker for _, worker in zip(range(AUDITOR_SCAN), holders,
                                                         strict=False))]

        def record(key: str) -> tuple[str, int]:
            standing = self.standing(key)
            return standing.state, standing.audited - standing.failed

        audited = self._facts.get(case.worker_key)
        earlier = [facts for facts in (waiting.first_auditor, waiting.second_auditor) if facts]
        accusers = self._accusers.get(case.worker_key, set())

        def independent(worker: Worker) -> bool:
            facts = self._facts_of(worker)
            return (audited is not None and why_dependent(audited, facts) is None
                    and all(why_dependent(known, facts) is None for known in earlier))

        return choose_auditor(case, scan, trusted={w.key for w in trusted},
                              record=record, exclude=waiting.exclude,
                              ineligible=self._ineligible, independent=independent,
                              holds_group_model=holds_group_model,
                              fresh=lambda worker: worker.key not in accusers,
                              busy_too=busy_too)

    def _group_auditor(self, model: str, group: tuple[str, ...],
                       heads: dict[str, tuple[Worker, tuple[str, ...]]]
                       ) -> Callable[[Worker], bool]:
        """Who can re-score a group's answer of ``model``: a trusted auditor whose memory holds
        the model whole (as its group was planned), or the head of another group with no
        worker in common."""
        need = self.groups.need_bytes(model) if self.groups is not None else None
        served_by = frozenset(group)

        def holds(worker: Worker) -> bool:
            if worker.key in heads:
                return served_by.isdisjoint(heads[worker.key][1])
            return (self.is_trusted(worker) and need is not None
                    and (worker.memory_budget_mb or 0) * MB >= need)

        return holds

    def _adapter(self, case: AuditCase) -> Callable[[str], AdapterRef] | None:
        """The ``Job.adapter`` (by auditor key) of a fine-tuned model's case; None when its
        model is no longer served (deleted) or is not the one the answer came from."""
        model = (self.fine_tuned.served(case.model) if self.fine_tuned is not None
                 else None)
        if model is None or model.sha256 != case.adapter_sha256 or model.base != case.base:
            return None
        return self.fine_tuned.ref(model) if self.fine_tuned is not None else None

    # --- one audit ----------------------------------------------------------------------------

    async def _audit(self, waiting: _Waiting, auditor: Worker) -> None:
        case = waiting.case
        loop = asyncio.get_running_loop()
        started = loop.time()
        self._seq += 1
        adapter = None
        if case.adapter_sha256 is not None:
            adapter = self._adapter(case)
            if adapter is None:  # deleted since it was queued
                self._count("model_deleted")
                self._done_waiting(case.worker_key)
                return
        try:
            results, tokens = [], 0
            for part, job in enumerate(case.jobs()):  # one score job per part, in order
                data, evaluated = await self._score(
                    case, auditor, f"audit-{self._seq}-{part}-{case.request_id}", job,
                    adapter)
                results.append(data)
                tokens += evaluated
            score = read_scores(case, results)
        except NoCapacity:  # a client's job took the auditor's slot first: wait for another
            self._queue.appendleft(waiting)
            return
        except Exception as exc:  # counts for nothing; an unexpected one is logged as a bug
            expected = isinstance(exc, ApiError | BadScore | TimeoutError)
            log.log(logging.INFO if expected else logging.ERROR, "audit of %s on %s failed: %s",
                    case.request_id, auditor.public_id, exc, exc_info=not expected)
            self._count("error")
            self._done_waiting(case.worker_key)
            return
        seconds = loop.time() - started
        if self.metrics is not None:
            self.metrics.audit_tokens.inc(tokens)
            self.metrics.audit_seconds.inc(seconds)
        # A fine-tuned model's answer is judged by its base's bands (``sha256`` is the base's).
        bands = self.bands.get(case.sha256 or "", DEFAULT_BANDS)
        verdict = judge(score, bands)
        trusted = self.is_trusted(auditor)
        if verdict.failed and not trusted:
            facts = self._facts_of(auditor)
            if waiting.first is None:
                # One untrusted auditor's word never fails a job: another must agree. The case
                # waits for one (up to audit_max_wait_s), and counts for nothing if none comes.
                self._again(waiting, auditor, first=verdict, first_auditor=facts)
                return
            why = (why_dependent(waiting.first_auditor, facts)
                   if waiting.first_auditor is not None else "the first auditor is unknown")
            if why is None and waiting.second_auditor is not None:
                why = why_dependent(waiting.second_auditor, facts)
            if why is not None:
                # Agreement between two workers that may be one party proves nothing: wait for
                # an independent one, as for any second opinion.
                log.info("audit of %s: %s's failing verdict does not confirm the first (%s): "
                         "waiting for an independent auditor", case.request_id,
                         auditor.public_id, why)
                self._count("not_independent")
                self._again(waiting, auditor)
                return
            if waiting.second_auditor is None and self._third_opinion_exists(waiting, auditor):
                # Two untrusted auditors agree: a third decides where the swarm has one, so a
                # pair of one party's keys is outvoted wherever an honest auditor can look.
                self._again(waiting, auditor, second_auditor=facts)
                return
        if waiting.first is not None and not verdict.failed:
            verdict = Verdict(None, False, "two auditors disagreed")
            self._count("disagreed")
            for wrong in (waiting.first_auditor, waiting.second_auditor):
                if wrong is not None:
                    await self._outvoted(waiting, wrong, auditor, trusted)
        self._done_waiting(case.worker_key)
        accusers = ({""} if trusted else {auditor.key, *(
            facts.key for facts in (waiting.first_auditor, waiting.second_auditor) if facts)})
        await self._settle(case, verdict, score, auditor.key, trusted, tokens, seconds,
                           accusers if verdict.failed else set())

    def _again(self, waiting: _Waiting, auditor: Worker, *, first: Verdict | None = None,
               first_auditor: AuditorFacts | None = None,
               second_auditor: AuditorFacts | None = None) -> None:
        """Put a case back at the head of the queue for another auditor than ``auditor`` (with
        the first failing verdict and its auditor, when this was it; the second's, when it
        agreed and a third is to decide)."""
        self._queue.appendleft(_Waiting(waiting.case, waiting.since,
                                        waiting.exclude | {auditor.key},
                                        first or waiting.first,
                                        first_auditor or waiting.first_auditor,
                                        second_auditor or waiting.second_auditor))
        self._wake.set()

    def _third_opinion_exists(self, waiting: _Waiting, second: Worker) -> bool:
        """Whether an auditor other than the first two, independent of them and of the audited
        worker, holds the file now (free or not): then it, not the two, decides."""
        probe = _Waiting(waiting.case, waiting.since, waiting.exclude | {second.key},
                         waiting.first, waiting.first_auditor, self._facts_of(second))
        third = self._auditor_for(probe, busy_too=True)
        if third is None or self.is_trusted(third):
            return third is not None
        facts = self._facts_of(third)
        audited = self._facts.get(waiting.case.worker_key)
        return audited is not None and all(
            why_dependent(known, facts) is None
            for known in (audited, probe.first_auditor, probe.second_auditor) if known)

    async def _outvoted(self, waiting: _Waiting, first: AuditorFacts, second: Worker,
                        trusted: bool) -> None:
        """``second`` contradicted ``first``'s failing verdict: count it against ``first`` when
        the second's word weighs (trusted, or independent of both the first auditor and the
        audited worker: a cheat's own second key cannot outvote its honest auditor)."""
        if self.store is None:
            return
        if not trusted:
            facts = self._facts_of(second)
            audited = self._facts.get(waiting.case.worker_key)
            if (why_dependent(first, facts) is not None or audited is None
                    or why_dependent(audited, facts) is not None):
                return
        key = first.key
        record = self._records.get(key) or await self.store.record(key)
        record = replace(record, outvoted=record.outvoted + 1)
        self._records[key] = record
        await self.store.save(key, record)
        self._count("outvoted")
        if not eligible_auditor(record.outvoted) and key not in self._ineligible:
            self._ineligible.add(key)
            log.warning("worker %s was outvoted %d times as an auditor: it audits no one now, "
                        "and its own answers are audited more", key[:12], record.outvoted)

    async def _score(self, case: AuditCase, auditor: Worker, job_id: str,
                     job: dict[str, object],
                     adapter: Callable[[str], AdapterRef] | None = None,
                     ) -> tuple[dict[str, object], int]:
        """Run one score job of ``case`` on ``auditor`` (a fine-tuned model's with its
        ``adapter``); its result's data and the tokens it evaluated."""
        run = await self.dispatcher.start_on(auditor, job_id, case.held_as, SCORE_URL, job,
                                             adapter=adapter)
        try:
            event = run.first
            while isinstance(event, Chunk):
                event = await run.next()
        finally:
            await run.finish("audit done")
        if isinstance(event, Result):
            return event.data, event.usage.prompt_tokens
        reason = event.message if isinstance(event, JobError) else str(event)
        raise BadScore(f"the auditor failed the score job: {reason}")

    async def _settle(self, case: AuditCase, verdict: Verdict, score: JobScore, auditor_key: str,
                      trusted: bool, tokens: int, seconds: float,
                      accusers: set[str] | None = None) -> None:
        evidence = _evidence(case, verdict, score, auditor_key, trusted, tokens, seconds)
        may_flag = await self.record_verdict(case.worker_key, verdict, evidence, auditor_key,
                                             trusted, accusers=accusers, flag=False)
        if not verdict.failed or may_flag:
            # A failing verdict's counts are a claim against the worker: they re-bill the job
            # only on evidence that could flag it (a trusted auditor's, or enough accusers'),
            # not on a pair's that is held at the line. A passing verdict's counts are within
            # the allowance of the worker's own claim.
            await self._rebill(case, score)
        if case.group and verdict.failed:
            self._blame_members(case)
        await self._flag_effects(case.worker_key)

    async def record_verdict(self, key: str, verdict: Verdict, evidence: dict[str, object],
                             auditor_key: str, trusted: bool, *,
                             accusers: set[str] | None = None, flag: bool = True) -> bool:
        """One audited job's verdict on worker ``key``, by ``auditor_key``: its standing moves
        (the sequential test, held at its flag line until enough independent accusers agree),
        the audit is kept (``evidence``: the ``audits`` row), and with ``flag`` a flag's
        consequences follow (refunds, escrow). ``accusers``: the auditors whose failing
        verdicts this one confirms (``""`` for a trusted one). Also the way in for audits of
        other kinds than re-scored text (issue 38's images). Whether the evidence so far may
        flag."""
        assert self.store is not None
        record = self._records.get(key) or await self.store.record(key)
        known = await self._accusers_of(key)
        known |= accusers or set()
        before = record.standing
        may_flag = enough_accusers(known - {""}, trusted="" in known)
        after = before.after(verdict, self.params, may_flag=may_flag)
        if after.state != "flagged" and after.llr >= self.params.upper:
            log.info("worker %s: the audits' evidence would flag it, but it comes from %d "
                     "untrusted auditor(s) and no trusted one: waiting for another accuser",
                     key[:12], len(known - {""}))
        flagged_now = after.state == "flagged" and before.state != "flagged"
        if flagged_now:
            record = replace(record, flags=record.flags + 1, flagged_at=datetime.now(UTC))
        record = replace(record, standing=after)
        self._records[key] = record
        self._flagged_now[key] = flagged_now
        self._count("uninformative" if verdict.suspicion is None
                    else "failed" if verdict.failed else "passed")
        await self.store.save(key, record, evidence)
        self._applied(key)
        if flag:
            await self._flag_effects(key)
        return may_flag

    async def _flag_effects(self, key: str) -> None:
        """What a flag brings, once the verdict that moved ``key`` is kept: a warning and the
        metric when it is new, then the refunds and (new) the escrow's forfeit."""
        record = self._records[key]
        after = record.standing
        if after.state != "flagged":
            return
        flagged_now = self._flagged_now.pop(key, False)
        if flagged_now:
            log.warning("worker %s flagged by audits after %d audits (%d failed): %s",
                        key[:12], after.audited, after.failed,
                        after.reasons[-1] if after.reasons else "")
            if self.metrics is not None:
                self.metrics.flags.inc()
        await self._consequences(key, record.flags, forfeit=flagged_now)

    async def _accusers_of(self, key: str) -> set[str]:
        """The auditors whose failing verdicts on ``key`` counted: kept as they come, and read
        back from its latest audits after a restart (the auditor that settled each; ""
        for a trusted one)."""
        known = self._accusers.get(key)
        if known is None:
            known = set()
            if self.store is not None:
                for row in await self.store.recent(ACCUSERS_READ, worker_key=key):
                    if row.failed:
                        known.add("" if row.auditor_trusted else row.auditor_key)
            self._accusers[key] = known
        return known

    def _blame_members(self, case: AuditCase) -> None:
        """A group's answer failed: its head's standing bears the verdict (the case is the
        head's). A member is named only by the evidence of failing groups under
        ``NAMED_AFTER_HEADS`` different heads (one cheating head cannot name its honest
        members): a named member is audited at the new-worker rate and joins no group."""
        head = case.group[0] if case.group else case.worker_key
        for member in case.group[1:]:
            heads = self._member_heads.setdefault(member, set())
            heads.add(head)
            if len(heads) >= NAMED_AFTER_HEADS and member not in self.named:
                self.named.add(member)
                log.warning("worker %s was in failing model groups under %d heads: it joins no "
                            "group now, and its own answers are audited more", member[:12],
                            len(heads))

    async def _rebill(self, case: AuditCase, score: JobScore) -> None:
        """An audited job is billed and credited by the auditor's exact counts (issue 39): the
        prompt as counted, the completion as counted plus each part's end token; billing never
        charges more than the client paid. Only a job one worker served whole: a failover's
        parts share one charge."""
        if case.claimed_prompt_tokens is None or score.prompt_tokens is None \
                or any(part.prefix for part in case.score_parts):
            return
        try:
            refunded = await self.billing.rebill(
                case.request_id, score.prompt_tokens, score.answer_tokens + score.parts,
                memo=f"audit of {case.request_id}: the auditor's exact counts")
        except Exception:  # the verdict stands; the ledger keeps what it had
            log.exception("re-billing audited job %s failed", case.request_id)
            return
        if refunded:
            log.info("audited job %s re-billed at the exact counts: %d msat back to the client",
                     case.request_id, refunded)

    async def _consequences(self, key: str, flag: int, *, forfeit: bool) -> None:
        """Refund every failed audited job of a flagged worker not refunded yet, and (on a new
        flag) forfeit its escrow. Both are idempotent ledger postings."""
        assert self.store is not None
        for audit_id, request_id in await self.store.failed_unrefunded(key):
            await self.billing.refund(request_id, memo=f"audit {audit_id}: worker flagged")
            await self.store.mark_refunded(audit_id)
        if forfeit:
            amount = await self.billing.forfeit_escrow(key, flag)
            if amount:
                log.warning("worker %s forfeited %d msat of escrow", key[:12], amount)

    async def clear(self, key: str) -> bool:
        """An admin cleared a worker's flag: test restarted, routed again, forfeit paid back.
        False if the worker is not flagged."""
        if self.store is None:
            return False
        record = self._records.get(key) or await self.store.record(key)
        if record.standing.state != "flagged":
            return False
        record = replace(record, standing=record.standing.cleared(), cleared_at=datetime.now(UTC))
        self._records[key] = record
        await self.store.save(key, record)
        restored = await self.billing.restore_escrow(key, record.flags)
        log.warning("an admin cleared worker %s's flag; %d msat of escrow paid back", key[:12],
                    restored)
        self._applied(key)
        return True


def _evidence(case: AuditCase, verdict: Verdict, score: JobScore, auditor_key: str,
              trusted: bool, tokens: int, seconds: float) -> dict[str, object]:
    """The audit's row: what was judged, by whom, and the verdict."""
    return {"request_id": case.request_id, "auditor_key": auditor_key,
            "auditor_trusted": trusted, "model": case.model, "sha256": case.sha256,
            "temperature": case.temperature, "answer_tokens": score.answer_tokens,
            "claimed_tokens": score.claimed_completion_tokens, "positions": score.positions,
            "claimed_prompt_tokens": score.claimed_prompt_tokens,
            "prompt_tokens": score.prompt_tokens,
            "mismatches": score.mismatches, "z": score.z, "suspicion": verdict.suspicion,
            "failed": verdict.failed, "reason": verdict.reason[:500], "key_id": case.key_id,
            "charged_msat": case.charged_msat, "audit_tokens": tokens, "audit_s": seconds}
