"""Forming model groups (issue 19): a model no single worker can hold, served by several.

Every ``group_interval_s`` (and at once after a group ends) the service looks at the models a
worker with the ``rpc`` capability holds, pinned by the queen's own reading of the file (its
shape: per-layer bytes and KV size). For each without a group it asks the pure planner
(``queen_server.groups.plan_group``, off the event loop) for the fewest workers that hold it
together, in proportion to their memory, preferring one LAN (direct links) and, with
``group_relay`` on, otherwise relayed through this queen (``group_relay.py``). A plan makes the
model *group-only*: from then on routing uses no lone holder of it (``Registry.serves_model``),
only the group's head once the group is ready.

Forming a group (``Group``): each member gets ``GroupServe`` (its own one-time link token, its
route and its share per device: the most its gate lets the head allocate there) and is held
out of routing (``Registry.set_held``); once every member answered
``GroupMemberReady`` (a direct member: its gate's LAN address and certificate fingerprint; a
relayed one: no address) within
``group_setup_timeout_s``, the head gets ``GroupLead`` and loads the model across them; its
``GroupReady`` within ``group_load_timeout_s`` puts it in routing for the model. A
``GroupFailed`` from any part, a part that leaves, or a deadline ends the group: every part is
told ``GroupEnd``, the members are let go, and the model is planned again (without a worker
that failed, for ``group_retry_s``). A job in flight on the head fails with a retryable error;
the dispatcher ends the group at once (``job_lost``), waits for the next ready group
(``regrouped``, at most ``group_failover_wait_s``) and continues the answer on its head, as any
failover does. Each job keeps the shares of the group that served it (``credit``), which is
what its books credit, whatever the group becomes by the time they close.

Only a worker the queen trusts leads (members run the graphs the head sends them): one the
operator names in ``APIARY_GROUP_HEADS`` (``*``: any), or one in good standing with the audits;
it must also hold the queen's pinned file. Frames about a group from a worker that is not part
of it, or out of turn, are ignored (logged): a worker can only end a group it is in. Only the
head opens relayed channels, only to a relayed member of its own group, and only while the
group loads or serves (``on_channel``); anything else is answered ``GroupClose``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Collection, Iterable

from queen_server.catalog import ModelCatalog
from queen_server.errors import ModelLoading, NoCapacity
from queen_server.groups import Candidate, GroupPlan, NoPlan, NoPlanReason, plan_group
from queen_server.placement.group_relay import GroupRelay
from queen_server.placement.group_state import Group, GroupSettings, Phase, part_of
from queen_server.swarm.jobs import Shares
from queen_server.swarm.registry import Registry
from queen_server.swarm.worker import Worker
from shared_schema import (
    GroupClose,
    GroupEnd,
    GroupFailed,
    GroupLead,
    GroupLink,
    GroupMemberReady,
    GroupOpen,
    GroupReady,
    GroupServe,
    encode,
)
from shared_schema.base import WireModel
from shared_schema.capabilities import AUDITOR, RPC
from shared_schema.fitting import MB

__all__ = ["Group", "GroupService", "GroupSettings", "Phase"]

log = logging.getLogger(__name__)

ASSUMED_LAN_MB_S = 50.0  # for the estimate a request gets while a group loads
GOOD_STANDING = 1.0  # audits set ``trust`` below this for a worker in good standing
OUTCOME_KEEP_S = 3600.0  # the planner's word on a model nobody holds any more, kept this long


class _SendFailed(Exception):
    def __init__(self, worker: Worker, why: str) -> None:
        super().__init__(why)
        self.worker = worker


class GroupService:
    def __init__(self, settings: GroupSettings, registry: Registry, catalog: ModelCatalog, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.registry = registry
        self.catalog = catalog
        self.clock = clock
        self.groups: dict[str, Group] = {}  # by id
        self.by_model: dict[str, Group] = {}
        self.group_only: set[str] = set()  # models only a group serves
        self.outcomes: dict[str, str] = {}  # model -> the last planning's outcome, in words
        # Models no worker held, whose would-be head downloads them (model -> its key), and
        # those it now holds, until the next round plans them (``head_to_fetch``).
        self.fetching: dict[str, str] = {}
        self.fetched: set[str] = set()
        self._unworthy_since: dict[str, float] = {}  # model -> since when (``outcomes``)
        self._cooldown: dict[str, float] = {}  # worker key -> not in a plan until
        # member key -> when its last ``head_protocol`` report stops counting (``_blame``)
        self._accused: dict[str, float] = {}
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()  # set (and replaced) on every change ``regrouped`` reads
        self._loop: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.relay = GroupRelay(registry, max_channels=settings.group_relay_channels)
        registry.serves_model = self.serves
        # a member the audits' evidence names (``AuditService.named``): joins no group
        self.named_by_audits: Callable[[str], bool] = lambda key: False

    # --- what routing and billing ask -------------------------------------------------------

    def serves(self, worker: Worker, model: str) -> bool:
        """Whether routing may give ``worker`` jobs of ``model``, which it holds: any holder of
        an ordinary model; only the ready group's head of a group-only one."""
        if model not in self.group_only:
            return True
        group = self.by_model.get(model)
        return group is not None and group.phase is Phase.READY and group.head is worker

    def credit(self, worker: Worker, model: str) -> tuple[str, Shares]:
        """For a job given to ``worker`` (``swarm.grouping.GroupJobs``): the id and shares of
        the ready group it heads for ``model``, kept on the job for its books and failover;
        ("", ()) when it serves the model alone."""
        group = self.by_model.get(model)
        if group is None or group.phase is not Phase.READY or group.head is not worker:
            return "", ()
        return group.id, group.shares

    def head_of(self, group_id: str) -> Worker | None:
        group = self.groups.get(group_id)
        return group.head if group is not None else None

    # --- what audits ask (``audits.service.GroupsForAudits``) -------------------------------

    def need_bytes(self, model: str) -> int | None:
        """The memory ``model`` needs held whole, as its group was planned (an auditor that
        re-scores the group's answers alone needs that much); None without a group."""
        group = self.by_model.get(model)
        return group.plan.total_bytes if group is not None else None

    def heads(self, model: str) -> list[tuple[Worker, tuple[str, ...]]]:
        """Each ready group of ``model``: its head and its workers' keys (one group a model
        today, so never another group than the one audited)."""
        group = self.by_model.get(model)
        if group is None or group.phase is not Phase.READY:
            return []
        return [(group.head, group.plan.keys)]

    def job_lost(self, group_id: str, worker: Worker, reason: str) -> None:
        """The head of ``group_id`` failed a job mid-answer (a part of its group was lost, it
        was paused, or it crashed): end the group now, if it still lives, rather than wait for
        its own report. Only the group's head can, and it could end its group anyway."""
        group = self.groups.get(group_id)
        if group is not None and group.head is worker:
            self.end(group, f"worker {worker.public_id}, its head, {reason}")

    async def regrouped(self, model: str, timeout_s: float) -> str | None:
        """Wait, at most ``timeout_s``, for a ready group of ``model`` (an answer whose group
        ended goes on on the next one's head): None once there is one; else why not, in words,
        as soon as the planner finds no group can serve the model any more."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            group = self.by_model.get(model)
            if group is not None and group.phase is Phase.READY:
                return None
            if model not in self.group_only:
                return self.outcomes.get(model, "no group can serve the model now")
            changed = self._changed
            left = deadline - loop.time()
            if left <= 0:
                return (f"no group was ready within {timeout_s:.0f} s "
                        f"({self.outcomes.get(model, 'planning')})")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await changed.wait()

    def _notify(self) -> None:
        """A group became ready or ended, or a model lost its group-only standing: wake
        every ``regrouped`` wait to look again."""
        self._changed.set()
        self._changed = asyncio.Event()

    def prepare(self, model: str) -> None:
        """A request for ``model`` found no worker in routing: while its group forms, a 503
        ``model_loading`` with an estimate; for a group-only model without a group, a 503 that
        says why. Nothing for any other model."""
        if model in self.fetching:
            return  # its head downloads it: placement's wait and estimate
        group = self.by_model.get(model)
        if group is not None and group.phase is not Phase.READY:
            estimate = self.load_estimate_s(group.size_bytes) - (self.clock() - group.started)
            across = f"a group of {len(group.parts)} workers"
        elif group is None and model in self.fetched:  # held by its head: planned this round
            facts = self.catalog.pin(model)
            estimate = self.load_estimate_s((facts.size_bytes or 0) if facts is not None else 0)
            across = "a group of workers"
        else:
            estimate = None
        if estimate is not None:
            estimate = max(1.0, estimate)
            seconds = max(1, round(estimate))
            raise ModelLoading(
                f"The model '{model}' is being loaded across {across}; it should be ready in "
                f"about {seconds} s. Try again then.", code="model_loading",
                headers={"Retry-After": str(seconds)},
                extra={"estimated_time": round(estimate, 1)})
        if model in self.group_only and group is None:
            why = self.outcomes.get(model, "its group is being planned")
            raise NoCapacity(f"No single worker can hold '{model}', and no group of workers "
                             f"serves it right now ({why}); try again later.",
                             code="group_unavailable",
                             headers={"Retry-After": str(round(self.settings.group_interval_s))})

    @staticmethod
    def load_estimate_s(size_bytes: int) -> float:
        """About how long a group takes to form and load a model of ``size_bytes``."""
        return size_bytes / (ASSUMED_LAN_MB_S * MB) + 5.0

    # --- a model no worker holds yet --------------------------------------------------------

    async def head_to_fetch(self, model: str, exclude: Collection[str] = ()
                            ) -> Worker | str | None:
        """For a model no worker holds (``PlacementService``): the worker to download it and
        lead its group, or why no group could serve it, in words; None when one worker holds
        it alone by the planner's rule (headroom included), or groups are off. The head is
        the plan's, as if every trusted ``rpc`` worker with room for the file (``exclude``
        left out: those that failed it) held it. The model is group-only from now on, so no
        worker serves it alone, until the download is given up (``fetch_ended``)."""
        facts = self.catalog.pin(model)
        if not self.settings.groups or model in self.by_model or facts is None:
            return None
        if facts.shape is None:
            return "the queen could not read the model's layers from its file"
        candidates = self._candidates(model, facts.sha256, fetch_bytes=facts.size_bytes or 0,
                                      exclude=exclude)
        result = await asyncio.to_thread(
            plan_group, facts.shape, candidates, relayed=self.settings.group_relay,
            headroom_fraction=self.settings.group_headroom_fraction,
            reserve_mb=self.settings.group_reserve_mb)
        if isinstance(result, NoPlan):  # one worker holds it alone: no group's model
            return (None if result.reason is NoPlanReason.FITS_ONE_WORKER
                    else f"{result.reason}: {result.detail}")
        head = self.registry.get(result.head)
        if head is None or head.closed:
            return "its planned head left"
        held = head.models.get(model)
        if held is not None and held.sha256 == facts.sha256:  # planned at the next round
            self._wake.set()
            return f"worker {head.public_id} holds it; its group is being planned"
        self.fetching[model] = head.key
        self.fetched.discard(model)
        self.outcomes[model] = (f"worker {head.public_id} is downloading it to lead a group of "
                                f"{len(result.members)}")
        self._set_group_only(model, True)
        return head

    def fetch_ended(self, model: str, ok: bool, why: str = "") -> None:
        """The download ``head_to_fetch`` started ended: held (the group is planned now), or
        given up (the model is no longer group-only, unless a group serves it)."""
        if self.fetching.pop(model, None) is None:
            return
        if ok:
            self.fetched.add(model)
            self.outcomes[model] = "its head holds it; its group is being planned"
            self._wake.set()
            return
        self.outcomes[model] = f"its head could not download it: {why}"[:600]
        if model not in self.by_model:
            self._set_group_only(model, False)

    # --- what workers say -------------------------------------------------------------------

    def on_report(self, worker: Worker, message: WireModel) -> None:
        """A ``group_member_ready``, ``group_ready`` or ``group_failed`` from ``worker``."""
        group = self.groups.get(getattr(message, "group", ""))
        if group is None or group.phase is Phase.ENDED or not part_of(group, worker):
            log.info("ignored a %s from worker %s about a group it is not in",
                     getattr(message, "type", "?"), worker.public_id)
            return
        if isinstance(message, GroupFailed):
            self.end(group, f"worker {worker.public_id} failed ({message.code}): "
                     f"{message.message[:200]}", blame=self._blame(group, worker, message))
        elif isinstance(message, GroupMemberReady):
            if group.phase is Phase.FORMING and worker.key in group.members:
                if message.relayed != group.relayed(worker.key):
                    told = "relayed" if group.relayed(worker.key) else "direct"
                    self.end(group, f"worker {worker.public_id} answered a {told} serve with "
                             f"{'no' if message.relayed else 'a'} gate address", blame=[worker])
                    return
                group.readies[worker.key] = message
                if len(group.readies) == len(group.members):
                    group.members_ready.set()
        elif (isinstance(message, GroupReady) and group.phase is Phase.LOADING
              and worker is group.head):
            group.load_s = message.load_s
            group.head_ready.set()

    def _blame(self, group: Group, worker: Worker, message: GroupFailed) -> list[Worker]:
        """Who a ``group_failed`` from ``worker`` leaves out of groups for a while: the sender,
        unless the owner paused it; a member its head names (its server could not hold the
        layers it claimed room for); the head, when a member's gate refused the head's RPC
        commands (``head_protocol``) while the head could send any (the group loading or
        serving). A member cannot blame a head that never reached it, nor anyone outside its
        group, and a second such report within ``group_retry_s`` blames the member instead (a
        lying member could otherwise bench every trusted head in turn)."""
        if worker is group.head:
            named = [m for m in group.members.values() if m.public_id == message.member]
            if named:
                return named
        elif message.code == "head_protocol":
            if group.phase not in (Phase.LOADING, Phase.READY):
                return [worker]  # no head has reached it yet: the report cannot be true
            if worker.key in self._accused:
                log.warning("group %s: member %s blamed a second head within %.0f s; blaming "
                            "it instead", group.id, worker.public_id,
                            self.settings.group_retry_s)
                return [worker]
            self._accused[worker.key] = self.clock() + self.settings.group_retry_s
            log.warning("group %s: member %s refused its head %s's RPC commands: %s",
                        group.id, worker.public_id, group.head.public_id,
                        message.message[:200])
            return [group.head]
        return [] if message.code == "paused" else [worker]

    async def on_channel(self, worker: Worker, message: GroupOpen | GroupClose) -> None:
        """A relayed channel opened by a group's head, or closed by either end."""
        if isinstance(message, GroupClose):
            channel = self.relay.close(worker, message.channel)
            if channel is not None:
                peer = channel.member if worker is channel.head else channel.head
                await self.relay.tell(peer, message)
            return
        group = self.groups.get(message.group)
        member = None if group is None else next(
            (w for w in group.members.values() if w.public_id == message.member), None)
        if group is None or group.phase not in (Phase.LOADING, Phase.READY):
            why = "the group is not loading or serving"
        elif worker is not group.head:
            why = "only the group's head opens channels"
        elif member is None or member.closed:
            why = f"{message.member} is not a member of the group"
        elif not group.relayed(member.key):
            why = f"{message.member} is reached directly, not through the queen"
        else:
            why = self.relay.open(group.id, worker, member, message.channel) or ""
        if not why:
            assert member is not None
            connection = self.registry.connection(member.key)
            try:
                if connection is None:
                    raise ConnectionError("not connected")
                await connection.send_frame(encode(message))
                return
            except Exception as exc:  # the member is going: its cleanup ends the group
                self.relay.close(worker, message.channel)
                why = f"{message.member} cannot be reached ({type(exc).__name__})"
        log.info("refused channel %d of group %s from worker %s: %s", message.channel,
                 message.group, worker.public_id, why)
        await self.relay.tell(worker, GroupClose(group=message.group, channel=message.channel,
                                                 reason=why[:200]))

    def left(self, worker: Worker) -> None:
        """A worker disconnected: every group it was part of ends."""
        for group in list(self.groups.values()):
            if part_of(group, worker):
                self.end(group, f"worker {worker.public_id} left")

    # --- forming and ending -----------------------------------------------------------------

    def start(self) -> None:
        if self.settings.groups:
            self._loop = asyncio.get_running_loop().create_task(self._run(), name="groups")

    async def stop(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
        for group in list(self.groups.values()):
            self.end(group, "the queen is stopping")
        tasks = [*self._tasks, *([self._loop] if self._loop else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # the loop must outlive any one bad round
                log.exception("the group loop failed a round")
            self._wake.clear()
            # Not ``wait_for``: on Python 3.11 it can swallow a cancellation that arrives as the
            # event is set (``stop`` ends groups, which sets it), and ``stop`` would wait forever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.group_interval_s):
                    await self._wake.wait()

    async def tick(self) -> None:
        """Plan a group for each group-worthy model that has none."""
        settings = self.settings
        now = self.clock()
        self._cooldown = {k: t for k, t in self._cooldown.items() if t > now}
        self._accused = {k: t for k, t in self._accused.items() if t > now}
        models = self._models()
        self._forget_outcomes(models.keys() | self.by_model.keys() | self.fetching.keys(), now)
        for model, sha256 in sorted(models.items()):
            facts = self.catalog.pin(model)
            if (model in self.by_model or model in self.fetching or facts is None
                    or facts.shape is None):
                continue
            candidates = self._candidates(model, sha256)
            result = await asyncio.to_thread(
                plan_group, facts.shape, candidates, relayed=settings.group_relay,
                headroom_fraction=settings.group_headroom_fraction,
                reserve_mb=settings.group_reserve_mb)
            self.fetched.discard(model)
            if model in self.by_model:
                continue  # formed meanwhile
            if isinstance(result, NoPlan):
                self.outcomes[model] = f"{result.reason}: {result.detail}"
                if model in self.group_only:
                    self._set_group_only(model, False)
                continue
            self._form(model, sha256, facts.size_bytes or 0, result)

    def _forget_outcomes(self, worth: Collection[str], now: float) -> None:
        """Drop the outcome of a model no longer worth a group (held by no ``rpc`` worker, not
        group-only, not served by a group nor fetched for one) for ``OUTCOME_KEEP_S``: the
        admin page says why a group ended for a while, not for every model ever planned."""
        for model in list(self.outcomes):
            if model in worth:
                self._unworthy_since.pop(model, None)
            elif now - self._unworthy_since.setdefault(model, now) > OUTCOME_KEEP_S:
                del self.outcomes[model]
                del self._unworthy_since[model]

    def _form(self, model: str, sha256: str, size_bytes: int, plan: GroupPlan) -> None:
        if any(self._busy(key) for key in plan.keys):
            return  # the swarm changed under the planning: next round
        head, *members = [w for key in plan.keys if (w := self.registry.get(key)) is not None]
        group = Group(id=secrets.token_hex(8), model=model, sha256=sha256,
                      size_bytes=size_bytes, plan=plan, head=head,
                      members={w.key: w for w in members},
                      tokens={w.key: secrets.token_hex(32) for w in members},
                      started=self.clock())
        self.groups[group.id] = group
        self.by_model[model] = group
        self.outcomes[model] = f"group {group.id} forming"
        self._set_group_only(model, True)
        for member in group.members.values():
            self.registry.set_held(member, group.id)
        log.info("forming group %s for %s: head %s, members %s (%d MB in all)", group.id, model,
                 head.public_id, ", ".join(f"{w.public_id} ({m.layers} layers)" for w, m in
                                           zip(group.members.values(), plan.members[1:],
                                               strict=True)),
                 plan.total_bytes // MB)
        group.task = self._spawn(self._bring_up(group))

    async def _bring_up(self, group: Group) -> None:
        settings = self.settings
        plans = {m.key: m for m in group.plan.members}
        phase = "answer its group_serve"
        try:
            for key, member in group.members.items():
                await self._send(member, GroupServe(
                    group=group.id, head=group.head.public_id, token=group.tokens[key],
                    devices=len(plans[key].device_layers), layers=plans[key].layers,
                    model=group.model,
                    route="relayed" if group.relayed(key) else "direct",
                    share_mb=list(plans[key].share_mb) or None))
            async with asyncio.timeout(settings.group_setup_timeout_s):
                await group.members_ready.wait()
            group.phase = Phase.LOADING
            phase = "load the model"
            head_plan = plans[group.head.key]
            await self._send(group.head, GroupLead(
                group=group.id, head=group.head.public_id, model=group.model,
                sha256=group.sha256, n_ctx=group.plan.n_ctx,
                head_layers=list(head_plan.device_layers),
                members=[GroupLink(worker_id=w.public_id, host=group.readies[k].host,
                                   port=group.readies[k].port,
                                   fingerprint=group.readies[k].fingerprint,
                                   token=group.tokens[k],
                                   device_layers=list(plans[k].device_layers))
                         for k, w in group.members.items()]))
            async with asyncio.timeout(settings.group_load_timeout_s):
                await group.head_ready.wait()
        except TimeoutError:
            slow = ([w for k, w in group.members.items() if k not in group.readies]
                    if group.phase is Phase.FORMING else [group.head])
            self.end(group, f"{', '.join(w.public_id for w in slow)} did not {phase} in time",
                     blame=slow)
            return
        except _SendFailed as exc:
            self.end(group, f"worker {exc.worker.public_id} could not be told: {exc}",
                     blame=[exc.worker])
            return
        except Exception as exc:  # a bug must end the group, not leave it forming for ever
            log.exception("group %s: bringing it up failed", group.id)
            self.end(group, f"the queen failed to bring it up ({type(exc).__name__})")
            return
        if group.phase is not Phase.LOADING:
            return
        group.phase = Phase.READY
        group.ready_at = self.clock()
        self.outcomes[group.model] = f"group {group.id} ready"
        self.registry.models_changed(group.head)
        self._notify()
        log.info("group %s serves %s: ready %.1f s after it was planned (the head loaded it in "
                 "%.1f s)", group.id, group.model, group.ready_at - group.started,
                 group.load_s or 0.0)

    def end(self, group: Group, reason: str, *, blame: Iterable[Worker] = ()) -> None:
        """End ``group`` (once): tell every part still here, let the members go, take the
        head out of routing for the model, and plan again soon."""
        if group.phase is Phase.ENDED:
            return
        was_ready = group.phase is Phase.READY
        group.phase = Phase.ENDED
        group.reason = reason
        self.groups.pop(group.id, None)
        self.relay.end_group(group.id)
        if self.by_model.get(group.model) is group:
            del self.by_model[group.model]
        self.outcomes[group.model] = f"group {group.id} ended: {reason}"
        for member in group.members.values():
            if member.held_by == group.id:
                self.registry.set_held(member, None)
        if was_ready:
            self.registry.models_changed(group.head)
        until = self.clock() + self.settings.group_retry_s
        for worker in blame:
            self._cooldown[worker.key] = until
        task = group.task
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        log.warning("group %s for %s ended: %s", group.id, group.model, reason)
        frame = encode(GroupEnd(group=group.id, reason=reason[:400]))
        self._spawn(self._tell_end([w for w in group.parts if not w.closed], frame))
        self._wake.set()
        self._notify()

    async def _tell_end(self, workers: list[Worker], frame: str) -> None:
        for worker in workers:
            connection = self.registry.connection(worker.key)
            if connection is not None:
                with contextlib.suppress(Exception):  # a broken socket: its cleanup follows
                    await connection.send_frame(frame)

    async def _send(self, worker: Worker, message: WireModel) -> None:
        connection = self.registry.connection(worker.key)
        if connection is None or worker.closed:
            raise _SendFailed(worker, "not connected")
        try:
            await connection.send_frame(encode(message))
        except Exception as exc:
            raise _SendFailed(worker, f"{type(exc).__name__}: {exc}") from exc

    def _spawn(self, coro: object) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # --- who could be in a group ------------------------------------------------------------

    def _models(self) -> dict[str, str]:
        """Models an ``rpc`` worker holds in the queen's pinned file, and that sha256; and the
        group-only ones (planned again each round). O(workers x models) per round."""
        found: dict[str, str] = {}
        for worker in self.registry:
            if RPC not in worker.capabilities or worker.legacy:
                continue
            for name, held in worker.models.items():
                facts = self.catalog.pin(name)
                if facts is not None and held.sha256 == facts.sha256:
                    found[name] = facts.sha256
        for name in self.group_only:
            facts = self.catalog.pin(name)
            if facts is not None:
                found.setdefault(name, facts.sha256)
        return found

    def _heading(self) -> set[str]:
        return {g.head.key for g in self.groups.values()}

    def _busy(self, key: str) -> bool:
        worker = self.registry.get(key)
        return (worker is None or worker.closed or worker.held_by is not None
                or key in self._heading())

    def may_head(self, worker: Worker) -> bool:
        heads = self.settings.group_heads
        return ("*" in heads or worker.key in heads or worker.public_id in heads
                or worker.trust < GOOD_STANDING)

    def _candidates(self, model: str, sha256: str, *, fetch_bytes: int | None = None,
                    exclude: Collection[str] = ()) -> list[Candidate]:
        """Every worker as the planner sees it: its memory per device and its pool's budget
        (claims the planner bounds), LAN, build, ``rpc``, the queen's round trip to it; a head
        only if trusted and holding the pinned file, or, with ``fetch_bytes``, able to fetch
        that much (not one in ``exclude``). A worker busy in a group, paused, flagged or
        cooling down after a failure is left out."""
        heading = self._heading()
        out = []
        for w in self.registry:
            if (w.legacy or w.closed or w.paused or w.flagged or w.held_by or w.key in heading
                    or w.key in self._cooldown or AUDITOR in w.capabilities
                    or self.named_by_audits(w.key)):
                continue
            held = w.models.get(model)
            holds = held is not None and held.sha256 == sha256
            if fetch_bytes is not None and not holds:
                holds = (w.takes_fetch and w.key not in exclude and model not in w.downloads
                         and (w.model_room_mb or 0) * MB >= fetch_bytes)
            out.append(Candidate(
                key=w.key, free_mb=w.group_free_mb, alone_mb=float(w.memory_budget_mb or 0),
                lan=w.lan, trusted=holds and self.may_head(w), build=w.llama_build,
                rpc=RPC in w.capabilities, rtt_ms=w.rtt_ms, family=w.group_family))
        return out

    def _set_group_only(self, model: str, on: bool) -> None:
        if (model in self.group_only) == on:
            return
        if on:
            self.group_only.add(model)
        else:
            self.group_only.discard(model)
            self._notify()
        for worker in self.registry:
            if model in worker.cached:
                self.registry.models_changed(worker)

    # --- reports ----------------------------------------------------------------------------

    def rows(self) -> list[dict[str, object]]:
        """The groups, for the admin pages."""
        now = self.clock()
        rows: list[dict[str, object]] = []
        for g in self.groups.values():
            names = {w.key: w.public_id for w in g.parts}
            relayed = self.relay.usage(g.id)
            rows.append({
                "id": g.id, "model": g.model, "phase": str(g.phase), "head": g.head.public_id,
                "members": [{"worker": names[m.key], "layers": m.layers, "route": str(m.route)}
                            for m in g.plan.members],
                "since_s": round(now - g.started, 1), "load_s": g.load_s,
                "relayed_channels": relayed.channels,
                "relayed_bytes": relayed.bytes_to_members + relayed.bytes_to_head})
        return rows
