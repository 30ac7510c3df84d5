"""The queen's live registry of connected workers, indexed by key and by model.

It owns leases: a job is leased to a worker from the moment its frame is sent until it ends,
the whole stream included, and a worker never holds more leases than its ``max_jobs``. Waiters
for capacity are woken whenever a lease is released or the swarm changes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

from queen_server.swarm.jobs import JobHandle
from queen_server.swarm.sessions import WorkerSession

log = logging.getLogger(__name__)


class Registry:
    def __init__(self) -> None:
        self._sessions: dict[str, WorkerSession] = {}
        self._by_model: dict[str, set[WorkerSession]] = {}
        self._fetchers: set[WorkerSession] = set()
        self._changed = asyncio.Event()
        self._waiting = 0

    # --- membership ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[WorkerSession]:
        return iter(list(self._sessions.values()))

    def get(self, key: str) -> WorkerSession | None:
        return self._sessions.get(key)

    def add(self, session: WorkerSession) -> WorkerSession | None:
        """Register a session; returns the older session of the same key, now removed."""
        older = self._sessions.get(session.key)
        if older is not None:
            self.remove(older, "replaced by a newer session of the same key")
        self._sessions[session.key] = session
        self._index(session)
        self._notify()
        return older

    def remove(self, session: WorkerSession, reason: str) -> bool:
        """Take a session out at once and fail its jobs. False if it was already gone."""
        if self._sessions.get(session.key) is not session:
            return False
        del self._sessions[session.key]
        self._unindex(session)
        session.closed = True
        session.fail_all(reason)
        self._notify()
        log.info("worker %s left: %s", session.public_id, reason)
        return True

    def models_changed(self, session: WorkerSession) -> None:
        """Re-index a session after its model holdings changed (a status message)."""
        if self._sessions.get(session.key) is not session:
            return
        self._unindex(session)
        self._index(session)
        self._notify()

    def _index(self, session: WorkerSession) -> None:
        for name in session.cached:
            self._by_model.setdefault(name, set()).add(session)
        if session.can_fetch:
            self._fetchers.add(session)

    def _unindex(self, session: WorkerSession) -> None:
        for name, holders in list(self._by_model.items()):
            holders.discard(session)
            if not holders:
                del self._by_model[name]
        self._fetchers.discard(session)

    # --- lookups for routing ------------------------------------------------------------------

    def holders(self, model: str) -> set[WorkerSession]:
        return self._by_model.get(model, set())

    def candidates(self, model: str) -> list[WorkerSession]:
        """Every session that could serve ``model`` (holders and fetchers), in no order."""
        holders = self._by_model.get(model)
        if not self._fetchers:
            return list(holders) if holders else []
        return list((holders or set()) | self._fetchers)

    def parameter_count(self, model: str) -> int | None:
        """The model's parameter count as its holders read it from the GGUF (None if unknown)."""
        for session in self._by_model.get(model, ()):
            count = session.models[model].parameter_count
            if count is not None:
                return count
        return None

    def model_names(self) -> list[str]:
        return sorted(self._by_model)

    # --- leases -------------------------------------------------------------------------------

    def lease(self, session: WorkerSession, handle: JobHandle) -> None:
        if session.free_slots <= 0:
            raise RuntimeError(f"{session!r} has no free slot")
        session.jobs[handle.id] = handle

    def release(self, handle: JobHandle) -> None:
        if handle.session.jobs.pop(handle.id, None) is not None:
            self._notify()

    # --- waiting for capacity -----------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return self._waiting

    async def wait_for_change(self, timeout_s: float) -> None:
        """Wait until a lease is released or the swarm changes, at most ``timeout_s``."""
        event = self._changed
        self._waiting += 1
        try:
            async with asyncio.timeout(timeout_s):
                await event.wait()
        except TimeoutError:
            pass
        finally:
            self._waiting -= 1

    def _notify(self) -> None:
        if self._waiting:
            self._changed.set()
            self._changed = asyncio.Event()

    async def close_all(self, code: int, reason: str) -> None:
        for session in list(self._sessions.values()):
            self.remove(session, reason)
            try:
                await session.transport.close(code, reason)
            except Exception:  # the socket may already be gone
                log.debug("closing %r failed", session, exc_info=True)
