"""The cluster's directory: which replicas are alive, which replica holds which worker, and what
each replica's workers can take, per model.

Three kinds of entry, all with a time to live, so that a replica that dies without a word
leaves nothing behind for long:

- **Replicas**: ``heartbeat(ReplicaInfo)`` every few seconds (its address, and its counts for
  the whole swarm's ``/stats``: workers connected, jobs in flight). ``alive()`` is every replica
  whose last heartbeat has not expired.
- **Workers**: ``claim_worker`` when a worker's socket reaches a replica (the newest connection
  wins, as in one queen's registry; the previous owner is returned so that it can close its
  stale session), ``refresh_workers`` by the owner with its heartbeat (a batch; it returns the
  keys another replica has taken over meanwhile, and claims again those whose entry is gone: a
  Redis restarted empty, or an owner cut off past the TTL, must not close workers that are
  still connected to it and claimed by nobody else), ``release_worker`` when the socket closes
  (only by the owner). An owner that dies stops refreshing and its entries expire.
- **Capacity**: per model, a small summary per replica (``Capacity``: holders, free slots,
  the best speed), published by the replica on change and with its heartbeat.
  ``replicas_for(model)`` reads one model's summaries: O(replicas holding it), never a scan of
  workers. A summary of a replica not alive is ignored (and cleaned when it is found dead).

``MemoryDirectory`` is one queen's (no Redis; its clock can be injected for tests);
``RedisDirectory`` keeps the entries in Redis with Redis's own expiry, and uses Lua scripts
where a read and a write must be one step (refresh and release by the owner only, reaping a
dead replica's summaries).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import orjson
import redis.asyncio as aioredis

DEFAULT_TTL_S = 15.0


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """What a replica says of itself with each heartbeat."""

    replica_id: str
    address: str = ""  # how operators (and the admin pages) name it
    workers: int = 0  # workers connected to it
    jobs_in_flight: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Capacity:
    """One replica's workers for one model, summed: how many hold it loaded, how many job
    slots are free, and the best completion seconds per token among them (None: unmeasured)."""

    holders: int
    free_slots: int
    best_s_per_token: float | None = None


@dataclass(frozen=True, slots=True)
class SwarmCounts:
    """The whole swarm, for ``/stats``: summed over the replicas alive."""

    replicas: int
    workers: int
    jobs_in_flight: int
    by_replica: dict[str, ReplicaInfo]


def swarm_counts(alive: Mapping[str, ReplicaInfo]) -> SwarmCounts:
    return SwarmCounts(len(alive), sum(r.workers for r in alive.values()),
                       sum(r.jobs_in_flight for r in alive.values()), dict(alive))


def rank_replicas(summaries: Iterable[tuple[str, Capacity]]) -> list[tuple[str, Capacity]]:
    """Best first: replicas with a free slot, then the fastest (unmeasured last), then the most
    free slots. Replicas with no free slot stay in the list, last (the caller may queue)."""
    def key(item: tuple[str, Capacity]) -> tuple[bool, bool, float, int, str]:
        replica_id, cap = item
        speed = cap.best_s_per_token
        return (cap.free_slots <= 0, speed is None, speed or 0.0, -cap.free_slots, replica_id)

    return sorted(summaries, key=key)


class Directory(Protocol):
    async def heartbeat(self, info: ReplicaInfo) -> None:
        """Say this replica is alive (for ``ttl_s`` more seconds), with its counts."""
        ...

    async def alive(self) -> dict[str, ReplicaInfo]:
        """Every replica whose heartbeat has not expired, by id."""
        ...

    async def remove_replica(self, replica_id: str) -> None:
        """A clean shutdown: the replica and its capacity go at once (its workers' entries
        expire, or are released as their sockets close)."""
        ...

    async def claim_worker(self, worker_key: str, replica_id: str) -> str | None:
        """``worker_key`` is now connected to ``replica_id``; the previous owner if another
        replica held it (it should close its stale session), else None."""
        ...

    async def refresh_workers(self, replica_id: str, worker_keys: Iterable[str]) -> list[str]:
        """Extend the owner's entries, and claim again those that are gone (expired, or lost
        with Redis's data: the worker is still connected here); the keys another replica has
        taken over."""
        ...

    async def release_worker(self, worker_key: str, replica_id: str) -> bool:
        """The worker's socket closed: drop the entry if this replica still owns it."""
        ...

    async def owner(self, worker_key: str) -> str | None: ...

    async def publish_capacity(self, replica_id: str, capacity: Mapping[str, Capacity]) -> None:
        """This replica's summary for every model it serves (models not named are removed)."""
        ...

    async def replicas_for(self, model: str, *, exclude: Iterable[str] = ()
                           ) -> list[tuple[str, Capacity]]:
        """The alive replicas with a summary for ``model``, ranked (``rank_replicas``)."""
        ...

    async def close(self) -> None: ...


class MemoryDirectory:
    """The directory of one process (one queen with no Redis, and the tests)."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._replicas: dict[str, tuple[ReplicaInfo, float]] = {}
        self._workers: dict[str, tuple[str, float]] = {}
        self._capacity: dict[str, dict[str, Capacity]] = {}  # model -> replica -> summary
        self._models_of: dict[str, set[str]] = {}

    async def heartbeat(self, info: ReplicaInfo) -> None:
        self._replicas[info.replica_id] = (info, self._clock() + self.ttl_s)

    async def alive(self) -> dict[str, ReplicaInfo]:
        now = self._clock()
        for replica_id in [r for r, (_, expires) in self._replicas.items() if expires <= now]:
            await self.remove_replica(replica_id)
        return {replica_id: info for replica_id, (info, _) in self._replicas.items()}

    async def remove_replica(self, replica_id: str) -> None:
        self._replicas.pop(replica_id, None)
        for model in self._models_of.pop(replica_id, ()):
            self._capacity.get(model, {}).pop(replica_id, None)

    def _live_owner(self, worker_key: str) -> str | None:
        entry = self._workers.get(worker_key)
        if entry is None:
            return None
        if entry[1] <= self._clock():
            del self._workers[worker_key]
            return None
        return entry[0]

    async def claim_worker(self, worker_key: str, replica_id: str) -> str | None:
        previous = self._live_owner(worker_key)
        self._workers[worker_key] = (replica_id, self._clock() + self.ttl_s)
        return previous if previous != replica_id else None

    async def refresh_workers(self, replica_id: str, worker_keys: Iterable[str]) -> list[str]:
        expires = self._clock() + self.ttl_s
        lost = []
        for key in worker_keys:
            if self._live_owner(key) in (replica_id, None):
                self._workers[key] = (replica_id, expires)
            else:
                lost.append(key)
        return lost

    async def release_worker(self, worker_key: str, replica_id: str) -> bool:
        if self._live_owner(worker_key) != replica_id:
            return False
        del self._workers[worker_key]
        return True

    async def owner(self, worker_key: str) -> str | None:
        return self._live_owner(worker_key)

    async def publish_capacity(self, replica_id: str, capacity: Mapping[str, Capacity]) -> None:
        for model in self._models_of.get(replica_id, set()) - capacity.keys():
            self._capacity.get(model, {}).pop(replica_id, None)
        for model, summary in capacity.items():
            self._capacity.setdefault(model, {})[replica_id] = summary
        self._models_of[replica_id] = set(capacity)

    async def replicas_for(self, model: str, *, exclude: Iterable[str] = ()
                           ) -> list[tuple[str, Capacity]]:
        alive = await self.alive()
        skip = set(exclude)
        return rank_replicas((r, cap) for r, cap in self._capacity.get(model, {}).items()
                             if r in alive and r not in skip)

    async def close(self) -> None:
        pass


# --- Redis ----------------------------------------------------------------------------------

# KEYS: the worker keys; ARGV[1]: the replica, ARGV[2]: the TTL in ms. Extends the replica's
# entries, sets again those that are gone (an empty Redis after a restart); returns the keys
# another replica owns.
_REFRESH = """
local lost = {}
for i, key in ipairs(KEYS) do
  local owner = redis.call('GET', key)
  if owner == ARGV[1] then
    redis.call('PEXPIRE', key, ARGV[2])
  elseif owner == false then
    redis.call('SET', key, ARGV[1], 'PX', ARGV[2])
  else
    lost[#lost + 1] = key
  end
end
return lost
"""
# KEYS[1]: the worker key; ARGV[1]: the replica. Deletes only the owner's entry.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
# KEYS[1]: the replica's models set, KEYS[2]: the replica ids set; ARGV[1]: the replica,
# ARGV[2]: the model key prefix, ARGV[3]: the replica's key, ARGV[4]: "reap" (only if its
# heartbeat expired) or "remove"; then pairs (model, summary JSON) to publish, for "publish".
_CAPACITY = """
local replica, prefix, mode = ARGV[1], ARGV[2], ARGV[4]
if mode == 'reap' and redis.call('EXISTS', ARGV[3]) == 1 then return 0 end
local keep = {}
if mode == 'publish' then
  for i = 5, #ARGV, 2 do keep[ARGV[i]] = ARGV[i + 1] end
end
for _, model in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if keep[model] == nil then
    redis.call('HDEL', prefix .. model, replica)
    redis.call('SREM', KEYS[1], model)
  end
end
for model, summary in pairs(keep) do
  redis.call('HSET', prefix .. model, replica, summary)
  redis.call('SADD', KEYS[1], model)
end
if mode ~= 'publish' then
  redis.call('SREM', KEYS[2], replica)
  if mode == 'remove' then redis.call('DEL', ARGV[3]) end
end
return 1
"""


class RedisDirectory:
    """The directory in Redis, under ``namespace``:

    - ``{ns}:replica:{id}``: the replica's ``ReplicaInfo`` as JSON, expiring after ``ttl_s``;
      ``{ns}:replicas``: the set of ids (an id whose key expired is reaped by ``alive``);
    - ``{ns}:worker:{key}``: the owning replica's id, expiring after ``ttl_s``;
    - ``{ns}:model:{model}``: a hash, replica id -> ``Capacity`` as JSON;
      ``{ns}:models-of:{id}``: the models a replica published (to remove what it dropped).
    """

    def __init__(self, url: str, *, ttl_s: float = DEFAULT_TTL_S, namespace: str = "apiary",
                 client: aioredis.Redis | None = None) -> None:
        self.ttl_s = ttl_s
        self.ns = namespace
        self._redis = client if client is not None else aioredis.from_url(url)
        self._owns_client = client is None
        self._refresh = self._redis.register_script(_REFRESH)
        self._release = self._redis.register_script(_RELEASE)
        self._capacity = self._redis.register_script(_CAPACITY)

    @property
    def _ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))

    def _replica_key(self, replica_id: str) -> str:
        return f"{self.ns}:replica:{replica_id}"

    def _worker_key(self, worker_key: str) -> str:
        return f"{self.ns}:worker:{worker_key}"

    async def heartbeat(self, info: ReplicaInfo) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self._replica_key(info.replica_id), orjson.dumps(asdict(info)),
                     px=self._ttl_ms)
            pipe.sadd(f"{self.ns}:replicas", info.replica_id)
            await pipe.execute()

    async def alive(self) -> dict[str, ReplicaInfo]:
        ids = sorted(member.decode() for member in
                     await self._redis.smembers(f"{self.ns}:replicas"))
        if not ids:
            return {}
        values = await self._redis.mget([self._replica_key(r) for r in ids])
        alive: dict[str, ReplicaInfo] = {}
        for replica_id, value in zip(ids, values, strict=True):
            if value is None:
                await self._edit_capacity(replica_id, "reap")
            else:
                alive[replica_id] = ReplicaInfo(**orjson.loads(value))
        return alive

    async def remove_replica(self, replica_id: str) -> None:
        await self._edit_capacity(replica_id, "remove")

    async def _edit_capacity(self, replica_id: str, mode: str, *pairs: str | bytes) -> None:
        await self._capacity(
            keys=[f"{self.ns}:models-of:{replica_id}", f"{self.ns}:replicas"],
            args=[replica_id, f"{self.ns}:model:", self._replica_key(replica_id), mode, *pairs])

    async def claim_worker(self, worker_key: str, replica_id: str) -> str | None:
        previous = await self._redis.set(self._worker_key(worker_key), replica_id,
                                         px=self._ttl_ms, get=True)
        previous_id = previous.decode() if previous is not None else None
        return previous_id if previous_id != replica_id else None

    async def refresh_workers(self, replica_id: str, worker_keys: Iterable[str]) -> list[str]:
        keys = list(worker_keys)
        lost: list[str] = []
        prefix = len(self._worker_key(""))
        for start in range(0, len(keys), 1000):  # bounded script runs for a big replica
            batch = [self._worker_key(k) for k in keys[start:start + 1000]]
            gone = await self._refresh(keys=batch, args=[replica_id, self._ttl_ms])
            lost.extend(key.decode()[prefix:] for key in gone)
        return lost

    async def release_worker(self, worker_key: str, replica_id: str) -> bool:
        return bool(await self._release(keys=[self._worker_key(worker_key)], args=[replica_id]))

    async def owner(self, worker_key: str) -> str | None:
        value = await self._redis.get(self._worker_key(worker_key))
        return value.decode() if value is not None else None

    async def publish_capacity(self, replica_id: str, capacity: Mapping[str, Capacity]) -> None:
        pairs: list[str | bytes] = []
        for model, summary in capacity.items():
            pairs += [model, orjson.dumps(asdict(summary))]
        await self._edit_capacity(replica_id, "publish", *pairs)

    async def replicas_for(self, model: str, *, exclude: Iterable[str] = ()
                           ) -> list[tuple[str, Capacity]]:
        summaries = await self._redis.hgetall(f"{self.ns}:model:{model}")
        if not summaries:
            return []
        skip = set(exclude)
        ids = [r.decode() for r in summaries if r.decode() not in skip]
        if not ids:
            return []
        beats = await self._redis.mget([self._replica_key(r) for r in ids])
        return rank_replicas(
            (replica_id, Capacity(**orjson.loads(summaries[replica_id.encode()])))
            for replica_id, beat in zip(ids, beats, strict=True) if beat is not None)

    async def close(self) -> None:
        if self._owns_client:
            await self._redis.aclose()
