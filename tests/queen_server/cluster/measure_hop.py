"""What a cross-replica token hop costs: ``python -m tests.queen_server.cluster.measure_hop``.

Starts a redis-server on loopback, a ``JobServer`` ("A") and a ``RemoteJobClient`` ("B") in one
process, each with its own ``RedisBus``, and a handler that emits chat chunks as a worker's
would. Prints the CPU cost of encoding and decoding one event, the time per event of a stream
(A emits back to back; B receives, reorders, checks and decodes), and the latency of one event
from ``emit`` to B's mailbox (emitted one at a time, p50 and p95). Both ends share one process
and one event loop here, so the stream figure is the sum of both sides' costs.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from queen_server.cluster.bus import RedisBus
from queen_server.cluster.remote import Emitter, JobServer, RemoteJobClient
from shared_schema import Chunk, Result, Usage
from shared_schema.cluster import ClusterEvent, ClusterJob, decode_cluster, encode_cluster
from tests.support.redis_server import RedisServer, bus_seal


def token(i: int, t: float = 0.0) -> Chunk:
    return Chunk(id="chatcmpl-1.1", seq=i, data={
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000,
        "model": "SmolLM2-135M-Instruct", "t": t,
        "choices": [{"index": 0, "delta": {"content": " token"}, "finish_reason": None}]})


def codec_us(n: int = 20000) -> tuple[float, float]:
    frame = token(1)
    started = time.perf_counter()
    for i in range(n):
        data = encode_cluster(ClusterEvent(job_id="chatcmpl-1.1", seq=i, frame=frame))
    encode = (time.perf_counter() - started) / n * 1e6
    started = time.perf_counter()
    for _ in range(n):
        decode_cluster(data)
    return encode, (time.perf_counter() - started) / n * 1e6


async def hop(url: str, events: int, paced: int) -> tuple[float, float, float, float]:
    server_bus = await RedisBus(url, seal=bus_seal()).start()
    client_bus = await RedisBus(url, seal=bus_seal()).start()
    go: asyncio.Queue[tuple[int, bool]] = asyncio.Queue()

    async def handler(job: ClusterJob, emit: Emitter) -> None:
        loop = asyncio.get_running_loop()
        count, pace = await go.get()
        for i in range(count):
            await emit(token(i, loop.time()))
            if pace:
                await asyncio.sleep(0.002)
        await emit(Result(id=job.job_id, usage=Usage(prompt_tokens=1, completion_tokens=count,
                                                     total_tokens=count + 1)))

    server = await JobServer(server_bus, "A", handler).start()
    client = await RemoteJobClient(client_bus, "B").start()
    loop = asyncio.get_running_loop()
    try:
        job = await client.submit("A", job_id="s.1", model="m", openai_url="/v1/chat",
                                  openai_req={}, timeout_s=60)
        await go.put((events, False))
        started, cpu = time.perf_counter(), time.process_time()
        got = [event async for event in job]
        per_event = (time.perf_counter() - started) / len(got) * 1e6
        cpu_per_event = (time.process_time() - cpu) / len(got) * 1e6
        assert isinstance(got[-1], Result)
        assert len(got) == events + 1
        job = await client.submit("A", job_id="p.1", model="m", openai_url="/v1/chat",
                                  openai_req={}, timeout_s=60)
        await go.put((paced, True))
        latencies = []
        async for event in job:
            if isinstance(event, Chunk):
                latencies.append((loop.time() - event.data["t"]) * 1e6)
        latencies.sort()
        return (per_event, cpu_per_event, statistics.median(latencies),
                latencies[int(len(latencies) * 0.95)])
    finally:
        await client.close()
        await server.close()
        await server_bus.close()
        await client_bus.close()


def main() -> None:
    encode, decode = codec_us()
    out = sys.stdout.write
    out(f"encode one event: {encode:.1f} us; decode: {decode:.1f} us\n")
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(Path(tmp)).start()
        try:
            per_event, cpu, p50, p95 = asyncio.run(hop(redis.url, 20000, 500))
        finally:
            redis.stop(kill=True)
    out(f"stream over RedisBus (both ends, one process): {per_event:.1f} us/event "
        f"({1e6 / per_event:,.0f} events/s), of which queen CPU {cpu:.1f} us\n")
    out(f"one event, emit to B's mailbox: p50 {p50:.0f} us, p95 {p95:.0f} us\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
