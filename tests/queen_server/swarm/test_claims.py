"""What the holders of each model say of its file, as the registry keeps it (``swarm.claims``):
only routable holders count, a status that changes a worker's file changes its claim, and a
flood of distinct claims under one name says nothing (the name is then priced as unverified)."""

from __future__ import annotations

from queen_server.swarm.claims import MAX_DISTINCT, FileClaims
from queen_server.swarm.registry import Registry
from queen_server.swarm.worker import Worker
from shared_schema import ModelDescriptor
from tests.queen_server.swarm.test_jobs_registry import add

NAME = "my-local-model"


def holder(key: str, size_bytes: int, sha256: str | None = None) -> Worker:
    model = ModelDescriptor(name=NAME, size_bytes=size_bytes, sha256=sha256)
    return Worker(key=key, public_id=f"id-{key}", session_id=f"s-{key}", models=[model])


def test_claims_follow_the_routable_holders():
    registry = Registry()
    first, second = holder("a", 100), holder("b", 200, "ab" * 32)
    add(registry, first, second)
    claims = registry.claims
    assert set(claims.of(NAME)) == {(None, 100), ("ab" * 32, 200)}
    stamp = claims.stamp(NAME)
    registry.set_paused(second, "on battery")  # out of routing: its claim leaves with it
    assert claims.of(NAME) == [(None, 100)]
    assert claims.stamp(NAME) != stamp
    registry.apply_status(first, models=[ModelDescriptor(name=NAME, size_bytes=300)])
    assert claims.of(NAME) == [(None, 300)]
    registry.remove(first, "gone")
    registry.remove(second, "gone")
    assert claims.of(NAME) == []
    assert claims.stamp(NAME) == 0


def test_a_flood_of_distinct_claims_says_nothing():
    claims = FileClaims()
    for size in range(MAX_DISTINCT):
        claims.add(NAME, (None, size + 1))
    assert len(claims.of(NAME)) == MAX_DISTINCT
    claims.add(NAME, (None, 10**9))
    assert claims.of(NAME) == []  # priced as unverified, read in O(1)
    claims.remove(NAME, (None, 10**9))
    assert len(claims.of(NAME)) == MAX_DISTINCT
    claims.remove(NAME, (None, 12345678))  # never added: nothing moves
    assert len(claims.of(NAME)) == MAX_DISTINCT
