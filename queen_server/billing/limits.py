"""A key's request limits: requests per minute and requests at once.

Two implementations behind one small interface. ``InProcessKeyLimits`` counts in this process
(one queen). ``RedisKeyLimits`` counts in a shared Redis, so N queen replicas behind a load
balancer enforce one limit together rather than N of them: one Lua script checks and records
both limits atomically, on Redis's clock (the replicas' clocks never matter).

* Requests per minute is a sliding-window log: a sorted set of the admitted requests' times,
  trimmed to the last 60 s. Exact (a 60-per-minute key gets 60 in any 60 s, not 120 across a
  window edge); its size is bounded by the limit.
* Requests at once is a sorted set of leases scored by their expiry. A live replica pushes its
  leases' expiry forward every third of the TTL; a dead replica's leases lapse after the TTL, so
  a crash never locks a key out for good.

Redis unreachable (or slower than ``timeout_s``): a request from a key WITH a limit fails closed
with a 503 ``limits_unavailable`` and ``Retry-After: 1``. A limit is the operator's promise about
a key's load; falling back to per-replica counts would silently multiply it by the number of
replicas. A key with no limits never touches Redis, and money is never at stake here: the
balance is guarded by the database (``store.py``). Redis restarted empty: the windows start
afresh, and live leases are written back by the next refresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from redis.exceptions import RedisError

from queen_server.errors import LimitsUnavailable, RateLimited

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from queen_server.billing.keys import KeyRecord

log = logging.getLogger(__name__)

WINDOW_S = 60.0


@dataclass(slots=True)
class Lease:
    """One admitted request's place in its key's limits, until ``release`` or ``cancel``."""

    key_id: int
    token: str
    stamp: float | None = None  # counted in the rpm window (in-process: the time)
    slot: bool = False  # holds one of the key's concurrent slots


def concurrency_refused(limit: int) -> RateLimited:
    return RateLimited(f"This key allows {limit} requests at once.",
                       code="concurrency_limit_exceeded", headers={"Retry-After": "1"})


def rpm_refused(limit: int, wait_s: float) -> RateLimited:
    """The 429 of a full minute; ``wait_s``: until the oldest request leaves the window."""
    wait = max(1, int(wait_s) + 1)
    return RateLimited(f"This key allows {limit} requests per minute.",
                       headers={"Retry-After": str(wait)})


class KeyLimits(Protocol):
    """Admit a request under its key's limits (raise ``RateLimited``), and give its place back.
    ``admit`` returns None for a key with no limits: there is nothing to give back."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def admit(self, key: KeyRecord) -> Lease | None: ...

    async def release(self, lease: Lease | None) -> None:
        """The request ended: free its slot (it stays counted in its minute)."""

    async def cancel(self, lease: Lease | None) -> None:
        """The request was refused after admission (no money): as if it never came."""


@dataclass
class _Counts:
    inflight: int = 0
    recent: deque[float] = field(default_factory=deque)


class InProcessKeyLimits:
    """One queen's limits, counted in memory. ``admit`` never awaits, so the check and the
    count cannot be split by another request."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self._clock = clock or time.monotonic
        self._counts: dict[int, _Counts] = {}

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def admit(self, key: KeyRecord) -> Lease | None:
        if key.concurrency_limit is None and key.rpm_limit is None:
            return None
        counts = self._counts.setdefault(key.id, _Counts())
        if key.concurrency_limit is not None and counts.inflight >= key.concurrency_limit:
            raise concurrency_refused(key.concurrency_limit)
        now = self._clock()
        lease = Lease(key.id, "")
        if key.rpm_limit is not None:
            recent = counts.recent
            while recent and now - recent[0] >= WINDOW_S:
                recent.popleft()
            if len(recent) >= key.rpm_limit:
                raise rpm_refused(key.rpm_limit, WINDOW_S - (now - recent[0]))
            recent.append(now)
            lease.stamp = now
        counts.inflight += 1
        lease.slot = True
        return lease

    async def release(self, lease: Lease | None) -> None:
        if lease is not None and lease.slot:
            lease.slot = False
            self._counts[lease.key_id].inflight -= 1

    async def cancel(self, lease: Lease | None) -> None:
        if lease is None:
            return
        await self.release(lease)
        if lease.stamp is not None:
            with contextlib.suppress(ValueError):
                self._counts[lease.key_id].recent.remove(lease.stamp)
            lease.stamp = None


# KEYS: the key's leases, its window. ARGV: token, concurrency limit (0: none), rpm limit (0:
# none), lease TTL ms, window ms. Returns {0, now} admitted; {1, 0} too many at once; {2, ms}
# the minute is full, and ms until its oldest request leaves it.
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local conc, rpm = tonumber(ARGV[2]), tonumber(ARGV[3])
local ttl, window = tonumber(ARGV[4]), tonumber(ARGV[5])
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  if redis.call('ZCARD', KEYS[1]) >= conc then return {1, 0} end
end
if rpm > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - window)
  if redis.call('ZCARD', KEYS[2]) >= rpm then
    local oldest = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
    return {2, tonumber(oldest[2]) + window - now}
  end
  redis.call('ZADD', KEYS[2], now, ARGV[1])
  redis.call('PEXPIRE', KEYS[2], window)
end
if conc > 0 then
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
  redis.call('PEXPIRE', KEYS[1], ttl)
end
return {0, now}
"""

# KEYS: one key's leases. ARGV: TTL ms, then the live tokens: their expiry moves to now + TTL
# (written back if a restarted Redis lost them).
_REFRESH = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], now + ttl, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], ttl)
return #ARGV - 1
"""


class RedisKeyLimits:
    """Limits shared by every queen replica on one Redis (see the module's docstring)."""

    def __init__(self, redis: aioredis.Redis, *, lease_ttl_s: float = 30.0,
                 timeout_s: float = 2.0, prefix: str = "apiary:limits") -> None:
        self.redis = redis
        self.lease_ttl_ms = max(1, int(lease_ttl_s * 1000))
        self.timeout_s = timeout_s
        self.prefix = prefix
        self._admit = redis.register_script(_ADMIT)
        self._refresh = redis.register_script(_REFRESH)
        self._live: dict[int, set[str]] = {}  # key id: tokens of this replica's slots
        self._refresher: asyncio.Task[None] | None = None
        self._down = False

    def _keys(self, key_id: int) -> list[str]:
        # The braces keep one key's two sets in one Redis Cluster slot.
        return [f"{self.prefix}:{{{key_id}}}:leases", f"{self.prefix}:{{{key_id}}}:window"]

    async def start(self) -> None:
        if self._refresher is None:
            self._refresher = asyncio.create_task(self._refresh_loop(), name="limits refresher")

    async def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
            self._refresher = None

    async def admit(self, key: KeyRecord) -> Lease | None:
        conc, rpm = key.concurrency_limit or 0, key.rpm_limit or 0
        if conc <= 0 and rpm <= 0:
            return None
        token = uuid.uuid4().hex
        try:
            verdict, value = await asyncio.wait_for(self._admit(
                keys=self._keys(key.id),
                args=[token, conc, rpm, self.lease_ttl_ms, int(WINDOW_S * 1000)]),
                self.timeout_s)
        except (RedisError, OSError, TimeoutError) as exc:
            self._went_down(exc)
            raise LimitsUnavailable(
                "This key's rate limits cannot be checked right now; try again shortly.",
                headers={"Retry-After": "1"}) from exc
        self._came_back()
        if int(verdict) == 1:
            raise concurrency_refused(conc)
        if int(verdict) == 2:
            raise rpm_refused(rpm, int(value) / 1000)
        lease = Lease(key.id, token, stamp=float(value) if rpm > 0 else None, slot=conc > 0)
        if lease.slot:
            self._live.setdefault(key.id, set()).add(token)
        return lease

    async def release(self, lease: Lease | None) -> None:
        if lease is None or not lease.slot:
            return
        lease.slot = False
        self._forget(lease)
        await self._remove([(self._keys(lease.key_id)[0], lease.token)])

    async def cancel(self, lease: Lease | None) -> None:
        if lease is None:
            return
        leases, window = self._keys(lease.key_id)
        gone = []
        if lease.slot:
            lease.slot = False
            self._forget(lease)
            gone.append((leases, lease.token))
        if lease.stamp is not None:
            lease.stamp = None
            gone.append((window, lease.token))
        await self._remove(gone)

    def _forget(self, lease: Lease) -> None:
        tokens = self._live.get(lease.key_id)
        if tokens is not None:
            tokens.discard(lease.token)
            if not tokens:
                del self._live[lease.key_id]

    async def _remove(self, members: list[tuple[str, str]]) -> None:
        """Best effort: a slot Redis cannot be told about lapses after the TTL."""
        if not members:
            return
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for name, token in members:
                    pipe.zrem(name, token)
                await asyncio.wait_for(pipe.execute(), self.timeout_s)
        except (RedisError, OSError, TimeoutError) as exc:
            self._went_down(exc)

    async def refresh(self) -> int:
        """Push this replica's live leases' expiry forward; returns how many."""
        live = {key_id: sorted(tokens) for key_id, tokens in self._live.items() if tokens}
        if not live:
            return 0
        async with self.redis.pipeline(transaction=False) as pipe:
            for key_id, tokens in live.items():
                await self._refresh(keys=[self._keys(key_id)[0]],
                                    args=[self.lease_ttl_ms, *tokens], client=pipe)
            await asyncio.wait_for(pipe.execute(), self.timeout_s)
        return sum(len(tokens) for tokens in live.values())

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.lease_ttl_ms / 3000)
            try:
                await self.refresh()
                self._came_back()
            except (RedisError, OSError, TimeoutError) as exc:
                self._went_down(exc)
            except Exception:
                log.exception("refreshing the rate-limit leases failed")

    def _went_down(self, exc: BaseException) -> None:
        if not self._down:
            self._down = True
            log.warning("Redis is unreachable for the keys' rate limits: requests from keys "
                        "with limits are refused (503) until it is back: %s", exc)

    def _came_back(self) -> None:
        if self._down:
            self._down = False
            log.warning("Redis is back: the keys' rate limits are checked again")
