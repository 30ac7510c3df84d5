"""A model group on one machine: N member RPC servers on 127.0.0.1 and a head process, so
anyone can watch a group serve (``apiary-worker --headless --local-group N``, ``python3 dev.py
run --group N``) and so the benchmark and tests have the real thing to measure.

Every part is the one a real group uses (``MemberServer``, ``GroupHead``, ``load_layout``);
only the plan is made here rather than by the queen: the layers are split evenly between the
head's CPU and the members (``even_split``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from desktop_worker.errors import GroupError, UnsupportedRequest
from desktop_worker.groups.head import GroupHead, HeadConfig
from desktop_worker.groups.member import MemberServer
from shared_schema.fitting import LoadPlan

log = logging.getLogger(__name__)

MAX_LOCAL_MEMBERS = 8


def even_split(n_layer: int, parts: int) -> list[int]:
    """``n_layer`` layers in ``parts`` contiguous shares, the larger ones first."""
    if parts <= 0:
        raise GroupError("a split needs at least one part")
    base, extra = divmod(n_layer, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class LocalGroup:
    """The members (started with ``start``) and a factory of heads for ``ModelPool``."""

    def __init__(self, members: int, *, n_threads: int = 1) -> None:
        if not 1 <= members <= MAX_LOCAL_MEMBERS:
            raise GroupError(f"a local group has 1 to {MAX_LOCAL_MEMBERS} members, not {members}")
        self.members = [MemberServer(n_threads=n_threads) for _ in range(members)]
        self.n_threads = n_threads
        self.heads: list[GroupHead] = []
        self.started = False

    async def start(self) -> None:
        if self.started:
            return
        self.started = True
        await asyncio.gather(*(member.start() for member in self.members))
        log.info("local group: %d RPC servers on %s", len(self.members),
                 ", ".join(member.endpoint for member in self.members))

    async def stop(self) -> None:
        await asyncio.gather(*(member.stop() for member in self.members))

    def config(self, name: str, path: str, n_layer: int, n_ctx: int,
               n_threads: int | None) -> HeadConfig:
        cpu, *shares = even_split(n_layer, len(self.members) + 1)
        return HeadConfig(name=name, model_path=path, n_ctx=n_ctx, n_layer=n_layer,
                          endpoints=tuple(member.endpoint for member in self.members),
                          cpu_layers=cpu, device_layers=tuple(shares), n_threads=n_threads,
                          output_on_cpu=True)  # the head is this machine's CPU

    def __call__(self, model: Any, plan: LoadPlan, n_threads: int | None,
                 embedding: bool) -> GroupHead:
        """``ModelPool``'s context factory: a head over the members (blocking)."""
        if embedding:
            raise UnsupportedRequest("a model group serves chat and completions, not embeddings")
        config = self.config(model.name, str(model.path), model.info.block_count, plan.n_ctx,
                             n_threads or self.n_threads)
        head = GroupHead(config)
        report = head.start()
        for (start, end), endpoint in zip(report.device_ranges, config.endpoints, strict=False):
            held = sum(size for buffer, size in report.buffers.items() if endpoint in buffer)
            log.info("group %s: member %s holds layers %d-%d, %.1f MiB of weights", model.name,
                     endpoint, start, end - 1, held / (1024 * 1024))
        self.heads.append(head)
        return head
