"""Only the replicas speak on the cluster bus (issue 40): every message is sealed with their
shared secret (``cluster.seal.BusSeal``), and a ``RedisBus`` drops whatever is not. Played as
the adversary who has Redis's password: a forged job and a forged outcome published straight
into a real ``redis-server`` (unsealed, sealed with another secret, a sealed message replayed on
another channel or after the window, a sealed one altered) never reach the serving replica's
``JobServer``; a replica's own sealed job does. A queen with Redis but no secret does not
start."""

from __future__ import annotations

import asyncio
import os

import pytest
import redis.asyncio as aioredis
from pydantic import ValidationError

from queen_server.cluster.bus import RedisBus
from queen_server.cluster.remote import Emitter, JobServer, job_channel
from queen_server.cluster.seal import SEAL_BYTES, BusSeal
from queen_server.settings import QueenSettings
from shared_schema.cluster import ClusterJob, ClusterOutcome, encode_cluster
from tests.support.redis_server import RedisServer, bus_seal

SECRET = "a-cluster-secret-of-the-replicas"


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


# --- the seal, pure ------------------------------------------------------------------------------


def test_a_sealed_message_opens_only_unchanged_on_its_channel_within_the_window() -> None:
    clock = Clock()
    seal = BusSeal(SECRET, clock=clock, window_s=300)
    sealed = seal.seal("apiary:jobs:a", b"payload")
    assert len(sealed) == SEAL_BYTES + len(b"payload")
    assert seal.open("apiary:jobs:a", sealed) == b"payload"
    assert seal.open("apiary:jobs:b", sealed) is None  # another channel's
    altered = bytearray(sealed)
    altered[-1] ^= 1
    assert seal.open("apiary:jobs:a", bytes(altered)) is None
    later = bytearray(sealed)
    later[1:9] = int((clock.now + 1) * 1000).to_bytes(8, "big")  # its time moved
    assert seal.open("apiary:jobs:a", bytes(later)) is None
    assert BusSeal("another-cluster-secret", clock=clock).open("apiary:jobs:a", sealed) is None
    for junk in (b"", b"payload", sealed[:SEAL_BYTES - 1], b"\x02" + sealed[1:]):
        assert seal.open("apiary:jobs:a", junk) is None
    clock.now += 299
    assert seal.open("apiary:jobs:a", sealed) == b"payload"
    clock.now += 2  # 301 s later: a replay of a recorded message
    assert seal.open("apiary:jobs:a", sealed) is None
    clock.now -= 602  # from 301 s in the future
    assert seal.open("apiary:jobs:a", sealed) is None


def test_a_short_secret_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 16 characters"):
        BusSeal("short")


def test_a_queen_with_redis_needs_the_cluster_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("APIARY_CLUSTER_SECRET", raising=False)
    with pytest.raises(ValidationError, match="APIARY_CLUSTER_SECRET is required"):
        QueenSettings(redis_url="redis://127.0.0.1:6379")
    with pytest.raises(ValidationError, match="at least 16 characters"):
        QueenSettings(redis_url="redis://127.0.0.1:6379", cluster_secret="short")
    assert QueenSettings().cluster_secret is None  # one queen, no bus to seal
    assert QueenSettings(redis_url="redis://127.0.0.1:6379",
                         cluster_secret=SECRET).cluster_secret is not None


# --- the adversary on a real Redis ---------------------------------------------------------------


def job(job_id: str) -> ClusterJob:
    return ClusterJob(job_id=job_id, origin="queen-b", reply_to="apiary:replies:queen-b",
                      model="org/m-GGUF:Q4_K_M", openai_url="/v1/chat/completions",
                      openai_req={"messages": [{"role": "user", "content": "hi"}]},
                      timeout_s=30)


async def test_forged_jobs_and_outcomes_never_reach_the_serving_replica(
        redis_server: RedisServer) -> None:
    jobs: list[str] = []
    outcomes: list[ClusterOutcome] = []
    arrived = asyncio.Event()

    async def handler(message: ClusterJob, emit: Emitter) -> None:
        jobs.append(message.job_id)
        arrived.set()

    serving = await RedisBus(redis_server.url, seal=bus_seal()).start()
    origin = await RedisBus(redis_server.url, seal=bus_seal()).start()
    raw = aioredis.Redis.from_url(redis_server.url)
    server = await JobServer(serving, "queen-a", handler, on_outcome=outcomes.append).start()
    channel = job_channel("queen-a")
    stranger = BusSeal("not-the-cluster-secret-at-all")
    try:
        forged_job = encode_cluster(job("forged-plain"))
        forged_outcome = encode_cluster(ClusterOutcome(job_id="forged-outcome",
                                                       completion_tokens=10**9, total_s=0.001))
        replayed = bus_seal().seal(job_channel("queen-c"), encode_cluster(job("other-channel")))
        altered = bytearray(bus_seal().seal(channel, encode_cluster(job("altered"))))
        altered[-3] ^= 0x20
        stale = BusSeal(os.environ["APIARY_CLUSTER_SECRET"], clock=lambda: 1_000_000.0).seal(
            channel, encode_cluster(job("stale")))
        for message in (forged_job, forged_outcome,
                        stranger.seal(channel, encode_cluster(job("wrong-secret"))),
                        stranger.seal(channel, forged_outcome),
                        replayed, bytes(altered), stale):
            assert await raw.publish(channel, message) == 1  # it reached the replica's reader
        # A replica's own job, sent after them on the same channel: once it is handled, every
        # message before it has been read (each publish above was answered before this one).
        await origin.publish(channel, encode_cluster(job("the-real-one")))
        await asyncio.wait_for(arrived.wait(), 10)
        assert jobs == ["the-real-one"]
        assert outcomes == []
        assert serving.refused == 7
    finally:
        await server.close()
        await raw.aclose()
        await origin.close()
        await serving.close()
