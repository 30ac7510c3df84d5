"""The harness of the group service's tests (issue 19): ``GroupService`` over a real
``Registry`` and ``ModelCatalog`` (a real GGUF header of 8 layers, 4 MB each), real ``Worker``s
on fake connections that record the frames the queen sends. The fixtures are in
``conftest.py``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from queen_server.placement.groups import Group, GroupService, Phase
from queen_server.swarm.worker import Worker
from shared_schema import (
    GroupLead,
    GroupMemberReady,
    GroupServe,
    ModelDescriptor,
)
from shared_schema.capabilities import RPC
from tests.queen_server.placement.harness import MODEL, WAIT, Swarm

BUILD = "ggml-0.25.3+0c1e570/rpc-7.0.0"
FINGERPRINT = "ab" * 32


@dataclass
class GroupSettings:
    groups: bool = True
    group_heads: list[str] = field(default_factory=lambda: ["head"])
    group_interval_s: float = 60.0
    group_setup_timeout_s: float = WAIT
    group_load_timeout_s: float = WAIT
    group_headroom_fraction: float = 0.0
    group_reserve_mb: int = 0
    group_retry_s: float = 300.0
    group_relay: bool = True
    group_relay_channels: int = 8


class Groups:
    def __init__(self, header: bytes, settings: GroupSettings) -> None:
        self.swarm = Swarm(header)
        self.settings = settings
        self.service = GroupService(settings, self.swarm.registry, self.swarm.catalog,
                                    clock=self.swarm.clock)
        self.sent = asyncio.Event()  # set on every frame the queen sends any worker

    async def pin(self) -> None:
        await self.swarm.catalog.resolve(MODEL)

    def add(self, name: str, memory_mb: int, *, holds: bool = False, rpc: bool = True,
            lan: str | None = "a" * 32, build: str = BUILD, host: str = "203.0.113.7"
            ) -> Worker:
        models = []
        if holds:
            facts = self.swarm.catalog.pin(MODEL)
            assert facts is not None
            models = [ModelDescriptor(name=MODEL, sha256=facts.sha256)]
        worker = self.swarm.add(name, memory_mb=memory_mb, models=models)
        connection = self.swarm.connections[name]
        send = connection.send_frame

        async def send_frame(frame: str) -> None:
            await send(frame)
            self.sent.set()

        connection.send_frame = send_frame  # type: ignore[method-assign]
        worker.capabilities = frozenset(worker.capabilities) | ({RPC} if rpc else set())
        worker.llama_build, worker.lan_hint, worker.peer_host = build, lan, host
        self.swarm.registry.models_changed(worker)
        return worker

    def frames(self, name: str, kind: type) -> list:
        return [f for f in self.swarm.connections[name].frames if isinstance(f, kind)]

    async def frame(self, name: str, kind: type) -> object:
        async with asyncio.timeout(WAIT):
            while not self.frames(name, kind):
                self.sent.clear()
                await self.sent.wait()
        return self.frames(name, kind)[-1]

    def ready(self, name: str, serve: GroupServe, port: int = 40_000) -> None:
        """The member's honest ready: its gate's address (direct), or none (relayed)."""
        worker = self.swarm.workers[name]
        if serve.route == "relayed":
            self.service.on_report(worker, GroupMemberReady(group=serve.group))
            return
        self.service.on_report(worker, GroupMemberReady(group=serve.group, host="192.168.1.20",
                                                        port=port, fingerprint=FINGERPRINT))

    def holders(self) -> set[str]:
        return {w.public_id for w in self.swarm.registry.holders(MODEL)}


async def up(group: Group) -> None:
    """Wait for the queen's bring-up of ``group`` to end, and check it made the group ready."""
    assert group.task is not None
    await asyncio.wait_for(asyncio.shield(group.task), WAIT)
    assert group.phase is Phase.READY


def need_mb(groups: Groups) -> int:
    facts = groups.swarm.catalog.pin(MODEL)
    assert facts is not None
    assert facts.shape is not None
    return -(-(sum(facts.shape.layer_bytes) + facts.shape.other_bytes) // (1 << 20)) + 8


def sizes(groups: Groups) -> tuple[int, int]:
    """Memory for a head (the non-layer tensors, 68 MB, and two layers) and for a member
    (about half of the rest, KV cache included): no one alone holds the model, three do."""
    facts = groups.swarm.catalog.pin(MODEL)
    assert facts is not None
    assert facts.shape is not None
    head = facts.shape.other_bytes // (1 << 20) + 12
    return head, (need_mb(groups) - head) // 2 + 6


def add_three(groups: Groups, **member: object) -> None:
    head, each = sizes(groups)
    groups.add("head", head, holds=True)
    groups.add("m1", each)
    groups.add("m2", each, **member)  # type: ignore[arg-type]


async def formed(groups: Groups) -> tuple[GroupServe, GroupServe, GroupLead]:
    """A head holding the file and two members form a group; returns what the queen sent."""
    add_three(groups)
    assert groups.holders() == {"head"}  # an ordinary holder, before the queen plans
    await groups.service.tick()
    serves = [await groups.frame(n, GroupServe) for n in ("m1", "m2")]
    assert len({s.group for s in serves}) == 1
    for name, serve in zip(("m1", "m2"), serves, strict=True):
        groups.ready(name, serve, port=40_000 + int(name[1]))
    lead = await groups.frame("head", GroupLead)
    return serves[0], serves[1], lead  # type: ignore[return-value]


