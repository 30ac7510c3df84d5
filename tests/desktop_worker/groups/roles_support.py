"""What the ``test_roles*`` tests share: a worker's side of groups (its own store of the real
SmolLM2, pool and ``GroupRoles``) driven by frames, the reports it sends, and its children."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from desktop_worker.engine.pool import ModelPool
from desktop_worker.groups.lead import GroupContexts
from desktop_worker.groups.roles import GroupRoles
from desktop_worker.link.machine import RelayData
from desktop_worker.store import ModelStore
from shared_schema import (
    GroupClose,
    GroupLead,
    GroupLink,
    GroupMemberReady,
    GroupOpen,
    GroupServe,
)
from tests.support.one_process import REAL

N_LAYER = 30  # SmolLM2-135M's block count
GROUP = "0123456789abcdef"
HEAD = "head-1"
TOKEN = "5a" * 32
ASK = {"model": "smol", "messages": [{"role": "user", "content": "Tell me about Paris."}],
       "temperature": 0, "max_tokens": 24}


class Reports:
    """The frames a part reported, in order (the link's ``report``). A relayed channel's
    frames (``GroupOpen``, ``GroupClose``, ``RelayData``) go to ``relay`` instead, when set
    (a switchboard's ``sender``), else they are recorded like the rest."""

    def __init__(self, relay: Callable[[Any], Awaitable[None]] | None = None) -> None:
        self.sent: list[Any] = []
        self.relay = relay
        self._queue: asyncio.Queue[Any] = asyncio.Queue()

    async def __call__(self, message: Any) -> None:
        if self.relay is not None and isinstance(message, GroupOpen | GroupClose | RelayData):
            await self.relay(message)
            return
        self.sent.append(message)
        self._queue.put_nowait(message)

    async def next(self, timeout_s: float = 120) -> Any:
        async with asyncio.timeout(timeout_s):
            return await self._queue.get()


@dataclass
class Side:
    """One worker: its store holding SmolLM2 as ``smol``, its pool and its roles."""

    roles: GroupRoles
    pool: ModelPool
    store: ModelStore
    reports: Reports = field(default_factory=Reports)

    def send(self, message: Any) -> None:
        self.roles.receive(message, self.reports)

    async def chat(self, request: dict[str, Any] = ASK) -> str:
        pieces: list[str] = []

        async def on_chunk(chunk: dict[str, Any]) -> None:
            if chunk.get("choices"):
                pieces.append(chunk["choices"][0]["delta"].get("content") or "")

        await self.pool.chat("smol", request, threading.Event(), on_chunk)
        return "".join(pieces)

    async def close(self) -> None:
        await self.roles.close()
        await self.pool.close()


def make_side(folder: Path, **roles_options: Any) -> Side:
    store = ModelStore(folder / "models")
    store.import_file(REAL, "smol")
    contexts = GroupContexts()
    pool = ModelPool(store.get, max_jobs=1, n_ctx=512, n_threads=1, budget_mb=4096,
                     contexts=contexts, max_contexts=contexts.max_contexts)

    def held(name: str) -> Any:
        return store.get(name) if name in store else None

    roles = GroupRoles(pool, contexts, held, n_threads=1, **roles_options)
    return Side(roles, pool, store)


def serve_frame(group: str = GROUP, token: str = TOKEN, layers: int = 20,
                route: str = "direct") -> GroupServe:
    return GroupServe(group=group, head=HEAD, token=token, layers=layers, model="smol",
                      route=route)


def lead_frame(ready: GroupMemberReady, *, group: str = GROUP, token: str = TOKEN,
               fingerprint: str | None = None, head_layers: tuple[int, ...] = (10,),
               member_layers: tuple[int, ...] = (20,), model: str = "smol",
               sha256: str | None = None) -> GroupLead:
    link = GroupLink(worker_id="member-1", host=ready.host, port=ready.port,
                     fingerprint=fingerprint or ready.fingerprint, token=token,
                     device_layers=list(member_layers))
    return GroupLead(group=group, head=HEAD, model=model, sha256=sha256, n_ctx=512,
                     head_layers=list(head_layers), members=[link])


def children() -> set[int]:
    """This process's children, but multiprocessing's resource tracker (shared by every spawn)."""
    found = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(child.cmdline()):
                found.add(child.pid)
        except psutil.Error:
            continue
    return found


async def refused(host: str, port: int) -> bool:
    """Whether nothing listens on ``host:port`` any more."""
    try:
        _reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        return True
    writer.close()
    return False
