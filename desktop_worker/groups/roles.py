"""This worker's part in the groups the queen forms (issue 19): it obeys ``GroupServe``,
``GroupLead`` and ``GroupEnd`` and answers ``GroupMemberReady``, ``GroupReady`` or
``GroupFailed`` (``shared_schema/groups.py`` is the contract); on the relayed route it also
opens, serves and closes channels through the queen (``GroupOpen``, ``GroupClose`` and binary
data frames, ``relay.py``).

A **member** starts llama.cpp's RPC server on 127.0.0.1 (``MemberServer``) and a gate before
it (``MemberGate``, TLS with a throwaway certificate) that lets in only the head the queen
named, and validates every RPC command it sends (``rpc_guard``) within the share the queen
granted each device (``GroupServe.share_mb``; from a queen that sends none, this worker's own
budget, ``memory_mb``). A command the gate refuses ends the member's part: it reports
``head_protocol`` and the queen blames the head. The gate listens on 127.0.0.1, or on the LAN
address towards the queen when the owner turned ``lan_groups`` on: nothing listens beyond
loopback otherwise. A **relayed** member
(``route="relayed"``) listens nowhere at all: its gate serves each channel the queen opens for
the head (``MemberGate.serve_stream``), the same handshake and pipe over the channel.

A **head** checks it holds the model, dials every member's gate (``HeadDialer``: TLS pinned to
the fingerprint the member reported, the link's token), and loads one head context through the
worker's own pool (``GroupContexts`` makes it a ``GroupHead``; a relayed member gets a
``RelayedDialer``, whose connections are channels through the queen), so a group's jobs run through
the same job runner as any model's. A head that died (a member restarted its server, say) is
made again over the same dialers on the next job; if that cannot be done the group is ``lost``.

One part at a time: a second command while in a group is ``busy``. A part ends on ``GroupEnd``,
on a failure it reports, on the owner's pause, when the worker stops and when the link to the
queen drops (a group does not outlive the session that formed it), and its ending stops every
process and listener it started.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal

from desktop_worker.engine.pool import ModelPool, ServableModel
from desktop_worker.errors import (
    GroupError,
    GroupLinkError,
    GroupLost,
    GroupPartFailed,
    MemberShort,
    RpcRefused,
)
from desktop_worker.groups.dialer import HeadDialer, RelayedDialer
from desktop_worker.groups.gate import LOOPBACK, MemberGate
from desktop_worker.groups.lan import local_address
from desktop_worker.groups.lead import GroupBinding, GroupContexts, head_config, head_layers
from desktop_worker.groups.member import MemberServer
from desktop_worker.groups.relay import ChannelRefused, RelayTable
from desktop_worker.groups.rpc_guard import GuardPolicy
from desktop_worker.groups.tls import SelfSignedIdentity
from desktop_worker.link.machine import RelayData
from shared_schema.groups import (
    GroupClose,
    GroupEnd,
    GroupFailed,
    GroupLead,
    GroupMemberReady,
    GroupOpen,
    GroupReady,
    GroupServe,
)

log = logging.getLogger(__name__)

GroupMessage = GroupServe | GroupLead | GroupEnd | GroupOpen | GroupClose
GroupReport = GroupMemberReady | GroupReady | GroupFailed
# Sends a worker-to-queen group frame on the session that carried the command: an answer, a
# relayed channel's ``GroupOpen``/``GroupClose``, or its bytes (``RelayData``, a binary frame).
# A no-op once that connection is gone.
Report = Callable[[GroupReport | GroupOpen | GroupClose | RelayData], Awaitable[None]]

RELINK_S = 20.0  # how long a new head waits for a member whose server is restarting
RELINK_FIRST_PAUSE_S = 0.25


@dataclass(eq=False)
class GroupPart:
    """What this worker runs for one group, and where its reports go."""

    group: str
    role: Literal["member", "head"]
    report: Report
    # The queen's command that made this part (read-only here; the desktop app's status says
    # from it how many layers of which model, or how many workers, this part serves).
    command: GroupServe | GroupLead | None = None
    task: asyncio.Task[None] | None = None
    ready: bool = False
    ended: bool = False
    down: asyncio.Event = field(default_factory=asyncio.Event)  # set once torn down
    # a member's
    server: MemberServer | None = None
    gate: MemberGate | None = None
    fingerprint: str | None = None
    relayed: bool = False  # its gate serves channels through the queen and listens nowhere
    # a head's
    model: str | None = None
    dialers: list[HeadDialer] = field(default_factory=list)
    binding: GroupBinding | None = None
    lost: bool = False


class GroupRoles:
    """One per ``WorkerService``: the link's ``on_group`` (``receive``), ``pause``,
    ``session_ended`` and ``close``. Widget-free; runs on the worker's event loop."""

    def __init__(
        self,
        pool: ModelPool,
        contexts: GroupContexts,
        models: Callable[[str], ServableModel | None],
        *,
        n_threads: int = 1,
        lan_groups: bool = False,
        queen_host: str = "",
        head_gpus: Callable[[], int] = lambda: 0,
        gpus: Callable[[], bool] = lambda: True,
        relink_s: float = RELINK_S,
        channels: RelayTable | None = None,
        memory_mb: Callable[[], list[int] | None] | None = None,
    ) -> None:
        """``models(name)``: the model the store holds by that name, else None; ``head_gpus``:
        how many local GPUs a head offloads to (0: its own layers stay on its CPU; blocking, it
        asks llama.cpp); ``gpus``: whether a member serves its GPUs (else its CPU), by the
        same rule (``rpc.group_devices``);
        ``queen_host``: whom the LAN address is found towards (``lan_groups``); ``channels``:
        this worker's relayed channels (a fresh table by default); ``memory_mb``: the memory
        of each device it gives a group, as the queen was told (``device_free_mb``; blocking),
        a member's share when the queen sends none (None, or an answer of None: the pool's
        budget on each device)."""
        self.pool = pool
        self.contexts = contexts
        self.models = models
        self.n_threads = n_threads
        self.lan_groups = lan_groups
        self.queen_host = queen_host
        self.head_gpus = head_gpus
        self.gpus = gpus
        self.relink_s = relink_s
        self.channels = channels if channels is not None else RelayTable()
        self.memory_mb = memory_mb
        self.part: GroupPart | None = None
        self._previous: GroupPart | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    # --- commands -------------------------------------------------------------------------

    def receive(self, message: GroupMessage, report: Report) -> None:
        """The link's ``on_group``: act on a command (in tasks; never blocks the link). A
        channel's open or close takes effect at once, so the data after it finds it."""
        if isinstance(message, GroupOpen):
            self._open_channel(message, report)
            return
        if isinstance(message, GroupClose):
            self.channels.remote_close(message.group, message.channel, message.reason)
            return
        if isinstance(message, GroupEnd):
            why = "the queen ended it" + (f" ({message.reason})" if message.reason else "")
            part = self.part
            if part is None or part.group != message.group:
                log.info("group %s: an end for a group this worker is not in; ignored",
                         message.group)
                return
            # Let go of the part at once: the queen forms the next group right after an end,
            # and its command (next on this link) must not find this one and answer "busy".
            # The next part's setup waits for this one to be down (``_run``).
            self.part, self._previous = None, part
            self._spawn(self._end(part, why))
            return
        current = self.part
        if current is not None:
            if current.group == message.group:
                log.warning("group %s: the queen sent %s again; ignored", message.group,
                            message.type)
                return
            self._spawn(_send(report, GroupFailed(
                group=message.group, code="busy",
                message=f"this worker is already in group {current.group}")))
            return
        role: Literal["member", "head"] = "member" if isinstance(message, GroupServe) else "head"
        part = GroupPart(group=message.group, role=role, report=report, command=message)
        self.part = part
        setup = (self._serve(part, message) if isinstance(message, GroupServe)
                 else self._lead(part, message))
        part.task = self._spawn(self._run(part, setup))

    async def relay(self, channel: int, payload: bytes) -> None:
        """The link's ``on_relay``: bytes for a relayed channel, awaited (a channel whose
        reader is behind makes this wait: the link reads no more until it catches up)."""
        await self.channels.deliver(channel, payload)

    async def end(self, group: str, why: str) -> None:
        """``GroupEnd``: stop this worker's part of ``group``; any other group is ignored."""
        part = self.part
        if part is None or part.group != group:
            log.info("group %s: an end for a group this worker is not in; ignored", group)
            return
        await self._end(part, why)

    def pause(self, reason: str) -> None:
        """The owner paused the worker: its part of a group ends (``paused``)."""
        part = self.part
        if part is not None:
            self._spawn(self._fail(part, "paused", f"the owner paused this worker: {reason}"))

    def session_ended(self) -> None:
        """The session that formed the group is gone: the group ends with it."""
        self.channels.drop()  # a channel never outlives the websocket it runs over
        part = self.part
        if part is not None:
            self._spawn(self._end(part, "the link to the queen dropped"))

    async def close(self) -> None:
        """The worker stops: end the part and wait for every task of ours."""
        part = self.part
        if part is not None:
            await self._end(part, "the worker is stopping")
        tasks = list(self._tasks)
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- a member -------------------------------------------------------------------------

    async def _serve(self, part: GroupPart, serve: GroupServe) -> None:
        relayed = serve.route == "relayed"
        token = bytes.fromhex(serve.token)
        try:
            host = LOOPBACK if relayed else await self._listen_host()
            # The layers it serves take the memory its pool's idle models hold (the queen
            # planned with the whole budget); they load again on their next job.
            freed = await self.pool.unload_idle()
            if freed:
                log.info("group %s: unloaded %s to make room for its layers", serve.group,
                         ", ".join(sorted(freed)))
            share_mb = await self._share_mb(serve)
            server = part.server = MemberServer(n_threads=self.n_threads, devices=serve.devices,
                                                gpus=self.gpus(), memory_mb=sum(share_mb))
            await server.start()
            guard = GuardPolicy.from_mb(share_mb)

            def refused(exc: RpcRefused) -> None:
                self._head_refused(part, exc)

            if relayed:  # no listener at all: the queen brings the head's channels
                gate = part.gate = MemberGate(serve.group, serve.head, token, server.port,
                                              guard=guard, on_refused=refused)
                ready = GroupMemberReady(group=serve.group)
            else:
                identity = await asyncio.to_thread(SelfSignedIdentity.generate)
                context = await asyncio.to_thread(identity.server_context)
                gate = part.gate = MemberGate(serve.group, serve.head, token, server.port,
                                              host=host, ssl=context, guard=guard,
                                              on_refused=refused)
                await gate.start()
                gate_host, gate_port = gate.address
                part.fingerprint = identity.fingerprint
                ready = GroupMemberReady(group=serve.group, host=gate_host, port=gate_port,
                                         fingerprint=identity.fingerprint)
        except GroupPartFailed:
            raise
        except (GroupError, GroupLinkError, OSError) as exc:
            raise GroupPartFailed("server_failed", f"the RPC server or its gate did not "
                                  f"start: {exc}") from exc
        where = ("relayed through the queen" if relayed
                 else f"gate on {ready.host}:{ready.port} (TLS)")
        log.info("group %s: serving %d layers of %s to head %s on %d device(s); %s, RPC "
                 "server on %s", serve.group, serve.layers, serve.model, serve.head,
                 serve.devices, where, server.endpoint)
        part.relayed = relayed
        part.ready = True
        await _send(part.report, ready)
        await server.gave_up.wait()
        raise GroupPartFailed("server_failed", server.failed or "the RPC server died")

    async def _share_mb(self, serve: GroupServe) -> list[int]:
        """What the head may allocate on each served device: the queen's grant, else (an older
        queen) what this worker told the queen it has, else its pool's budget on each."""
        if serve.share_mb is not None:
            return list(serve.share_mb)
        own = await asyncio.to_thread(self.memory_mb) if self.memory_mb is not None else None
        if own and len(own) >= serve.devices:
            log.info("group %s: the queen sent no share; the head may use this worker's own "
                     "memory, %s MB", serve.group, own[:serve.devices])
            return list(own[:serve.devices])
        budget = max(0, int(getattr(self.pool, "budget_mb", 0)))
        log.info("group %s: the queen sent no share; the head may use this worker's budget, "
                 "%d MB on each of %d device(s)", serve.group, budget, serve.devices)
        return [budget] * serve.devices

    def _head_refused(self, part: GroupPart, exc: RpcRefused) -> None:
        """The gate refused a command of the head: this part ends and the queen hears why."""
        if part.ended or part.role != "member":
            return
        self._spawn(self._fail(part, "head_protocol", f"the gate refused the head's "
                               f"{exc.command}: {exc.detail} ({exc.code})"))

    def _open_channel(self, message: GroupOpen, report: Report) -> None:
        """A head's channel to this member's gate, through the queen: served by the gate like
        a connection; anything else is answered ``GroupClose`` at once."""
        part = self.part
        gate = part.gate if part is not None else None
        why = self._channel_refusal(message, part)
        if why is None and gate is not None:
            try:
                channel = self.channels.open(message.group, message.channel, report,
                                             side="member")
            except ChannelRefused as exc:
                why = str(exc)
            else:
                self._spawn(gate.serve_stream(channel, channel,
                                              f"relay channel {message.channel}"))
                return
        log.info("group %s: refused relayed channel %d: %s", message.group, message.channel,
                 why)
        self._spawn(_send(report, GroupClose(group=message.group, channel=message.channel,
                                             reason=(why or "refused")[:200])))

    def _channel_refusal(self, message: GroupOpen, part: GroupPart | None) -> str | None:
        """Why this worker takes no channel ``message`` opens (None: it takes it)."""
        if part is None or part.group != message.group:
            return f"this worker is not in group {message.group}"
        if part.role != "member" or not part.relayed:
            return f"this worker is not a relayed member of group {message.group}"
        if part.gate is None or not part.ready or part.ended:
            return "this member is not ready"
        existing = self.channels.get(message.channel)
        if existing is not None:
            # Our close ends that number at the queen and at the head: end ours with it.
            existing.silence()
            return f"channel {message.channel} was already open"
        return None

    async def _listen_host(self) -> str:
        if not self.lan_groups:
            return LOOPBACK
        address = await asyncio.to_thread(local_address, self.queen_host)
        if address is None:
            raise GroupPartFailed("server_failed", "no local address reaches the queen, so the "
                                  "gate has no LAN address to listen on")
        ip = ipaddress.ip_address(address)
        if not (ip.is_private or ip.is_loopback or ip.is_link_local):
            raise GroupPartFailed("server_failed", f"{address}, the address towards the queen, "
                                  "is not a LAN address")
        return address

    # --- a head ---------------------------------------------------------------------------

    async def _lead(self, part: GroupPart, lead: GroupLead) -> None:
        model = self.models(lead.model)
        if model is None:
            raise GroupPartFailed("model_missing", f"this worker does not hold {lead.model}")
        sha256 = getattr(model, "sha256", None)
        if lead.sha256 is not None and sha256 != lead.sha256:
            raise GroupPartFailed("model_missing", f"this worker's {lead.model} is not the file "
                                  f"the queen named (sha256 {str(sha256)[:12]}…)")
        n_layer = model.info.block_count
        gpus = await asyncio.to_thread(self.head_gpus)  # llama.cpp asks the GPU driver
        head_layers(lead, n_layer, gpus)  # a plan that cannot work fails before any dialling
        part.model = lead.model
        for link in lead.members:
            token = bytes.fromhex(link.token)
            dialer = (RelayedDialer(lead.group, lead.head, token, link.worker_id, self.channels,
                                    part.report) if link.relayed
                      else HeadDialer(lead.group, lead.head, token, link.host, link.port,
                                      tls_fingerprint=link.fingerprint))
            part.dialers.append(dialer)
            try:
                await dialer.start()
                await dialer.check()
            except (GroupLinkError, OSError) as exc:
                raise GroupPartFailed("link_failed", f"member {link.worker_id} "
                                      f"({dialer.target}): {exc}") from exc
        config = head_config(lead, model_path=str(model.path), n_layer=n_layer,
                             endpoints=[d.endpoint for d in part.dialers], head_gpus=gpus,
                             n_threads=self.n_threads)
        loop = asyncio.get_running_loop()
        part.binding = GroupBinding(
            group=lead.group, config=config,
            prepare=lambda: self._prepare_head(part, loop),
            failed=lambda exc: loop.call_soon_threadsafe(self._head_failed, part, exc))
        if lead.model in self.pool.loaded():
            await self.pool.unload(lead.model)  # loaded alone: the group's head replaces it
        self.contexts.bind(lead.model, part.binding)
        started = time.monotonic()
        try:
            await self.pool.load(lead.model)
        except Exception as exc:  # every reason a head did not load is the queen's to hear
            raise GroupPartFailed("load_failed", f"the head could not load {lead.model} "
                                  f"across the members: {exc}",
                                  member=_short_member(exc, part.dialers, lead)) from exc
        load_s = time.monotonic() - started
        log.info("group %s: head of %s over %d member(s) (%s), loaded in %.1f s", lead.group,
                 lead.model, len(lead.members),
                 ", ".join(f"{m.worker_id} {m.device_layers}" for m in lead.members), load_s)
        part.ready = True
        await _send(part.report, GroupReady(group=lead.group, load_s=round(load_s, 3)))

    def _prepare_head(self, part: GroupPart, loop: asyncio.AbstractEventLoop) -> None:
        """Before each head after the first (in the pool's thread): every member reachable
        again, waiting up to ``relink_s`` for a server being restarted; else ``GroupLost``."""
        if not part.ready:
            return  # the first head: the links were checked just now
        if part.ended:
            raise GroupLost(f"group {part.group} has ended")
        future = asyncio.run_coroutine_threadsafe(self._relink(part), loop)
        future.result(timeout=self.relink_s + 30)

    async def _relink(self, part: GroupPart) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.relink_s
        for dialer in part.dialers:
            pause = RELINK_FIRST_PAUSE_S
            while True:
                try:
                    await dialer.check()
                    break
                except GroupLinkError as exc:
                    if loop.time() + pause > deadline:
                        raise GroupLost(f"a member ({dialer.target}) is gone: {exc}") from exc
                await asyncio.sleep(pause)  # a member's server restarting has no event to us
                pause = min(pause * 2, 2.0)

    def _head_failed(self, part: GroupPart, exc: BaseException) -> None:
        """A head could not be made (on the loop). During the lead, ``_lead`` reports it as
        ``load_failed``; once serving, the group is ``lost`` (reported once)."""
        if not part.ready or part.ended or part.lost:
            return
        part.lost = True
        self._spawn(self._fail(part, "lost", f"the group's head could not be made again: {exc}"))

    # --- ending ---------------------------------------------------------------------------

    async def _run(self, part: GroupPart, setup: Coroutine[Any, Any, None]) -> None:
        """A part's setup (and, for a member, its watch), ending it on a failure."""
        try:
            previous = self._previous
            if previous is not None:
                try:
                    await previous.down.wait()  # the last group's processes are gone first
                except BaseException:
                    setup.close()  # cancelled before it began: never left un-awaited
                    raise
            await setup
        except GroupPartFailed as exc:
            await self._fail(part, exc.code, str(exc), member=exc.member)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must still end the part and tell the queen
            log.exception("group %s: the %s's part failed", part.group, part.role)
            await self._fail(part, "server_failed" if part.role == "member" else "load_failed",
                             str(exc))

    async def _fail(self, part: GroupPart, code: str, message: str, *,
                    member: str | None = None) -> None:
        if part.ended:
            return
        log.warning("group %s: this %s's part failed (%s): %s", part.group, part.role, code,
                    message)
        await _send(part.report, GroupFailed(group=part.group, code=code, message=message[:2000],
                                             member=member))
        await self._end(part, f"{code}: {message}")

    async def _end(self, part: GroupPart, why: str) -> None:
        """Stop everything ``part`` started; idempotent."""
        if part.ended:
            await part.down.wait()
            return
        part.ended = True
        if self.part is part:
            self.part = None
        self._previous = part
        log.info("group %s: ending this worker's part as %s: %s", part.group, part.role, why)
        task = part.task
        if task is not None and task is not asyncio.current_task() and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        try:
            await self._teardown(part)
        finally:
            part.down.set()

    async def _teardown(self, part: GroupPart) -> None:
        if part.binding is not None and part.model is not None:
            self.contexts.close(part.model, part.group)
        # The dialers first: a head mid-answer then fails at once instead of finishing it.
        await asyncio.gather(*(dialer.stop() for dialer in part.dialers),
                             return_exceptions=True)
        if part.binding is not None and part.model is not None:
            await self.pool.unload(part.model)
            for head in part.binding.heads:
                await asyncio.to_thread(head.close)
        if part.gate is not None:
            await part.gate.stop()
        self.channels.drop(part.group)  # any channel not yet served or piped
        if part.server is not None:
            await part.server.stop()

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


async def _send(report: Report, message: GroupReport) -> None:
    try:
        await report(message)
    except Exception:  # the link's own failures are its to handle; the part goes on
        log.exception("could not report %s for group %s", message.type, message.group)


def _short_member(exc: BaseException, dialers: list[HeadDialer], lead: GroupLead) -> str | None:
    """The member (public id) whose server could not allocate its layers, when llama.cpp said
    so (a ``MemberShort`` anywhere in ``exc``'s causes, naming a dialer's endpoint)."""
    seen: BaseException | None = exc
    while seen is not None and not isinstance(seen, MemberShort):
        seen = seen.__cause__ or seen.__context__
    if seen is None:
        return None
    for dialer, link in zip(dialers, lead.members, strict=False):
        if dialer.endpoint == seen.endpoint:
            return link.worker_id
    return None
