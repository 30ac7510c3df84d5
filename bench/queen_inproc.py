"""The queen's own CPU per routed chat completion, in one process, with no sockets.

The whole ASGI app (fast path, parsing, auth with a development key, metering, admission,
dispatch, relay, the answer's JSON) serves plain chat completions from an in-process worker
connection that answers at once. No HTTP parsing, no websocket, no other process: a steadier
figure than ``queen_overhead.py`` for comparing two trees in one sitting. Run it from each
tree's root: it imports the tree it is run from.

    .venv/bin/python bench/queen_inproc.py [N]      # N requests (default 3000), after 300 warm-up
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.getcwd())

from queen_server.app import create_app
from queen_server.settings import QueenSettings
from queen_server.swarm.worker import Worker
from shared_schema import ModelDescriptor, Result, Usage

MODEL = "org/m:Q4"
BODY = (b'{"model":"org/m:Q4","messages":[{"role":"user","content":"Say hello in a few words"}],'
        b'"max_tokens":16}')
ANSWER = {"choices": [{"index": 0, "finish_reason": "stop",
                       "message": {"role": "assistant", "content": " tok" * 16}}]}
USAGE = Usage(prompt_tokens=7, completion_tokens=16, total_tokens=23)


class InstantConnection:
    """A worker's connection that answers every job on the next loop turn."""

    def __init__(self, registry: Any, key: str) -> None:
        self.registry = registry
        self.key = key

    async def send_job(self, job_id: str, url: str, req: dict[str, Any],
                       continuation: str | None = None, cache_scope: str | None = None) -> None:
        handle = self.registry.leases_of(self.key)[job_id]
        result = Result(id=job_id, data=ANSWER, usage=USAGE)
        asyncio.get_running_loop().call_soon(handle.feed, result)

    async def send_cancel(self, job_id: str, reason: str) -> None:
        pass

    async def close(self, code: int, reason: str) -> None:
        pass


async def main(n: int) -> None:
    app = create_app(QueenSettings(auth="keys", api_keys=["sk-dev"]), use_db=False)
    async with app.router.lifespan_context(app):
        registry = app.state.queen.registry
        worker = Worker(key="k" * 64, public_id="w1", session_id="s", max_jobs=64,
                        models=[ModelDescriptor(name=MODEL, loaded=True,
                                                parameter_count=135_000_000)])
        registry.add(worker, InstantConnection(registry, worker.key))
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": "/v1/chat/completions",
            "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
            "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000),
            "headers": [(b"content-type", b"application/json"),
                        (b"authorization", b"Bearer sk-dev"),
                        (b"content-length", str(len(BODY)).encode())],
        }
        statuses: list[int] = []

        async def one() -> None:
            sent = False
            never = asyncio.get_running_loop().create_future()

            async def receive() -> dict[str, Any]:
                nonlocal sent
                if not sent:
                    sent = True
                    return {"type": "http.request", "body": BODY, "more_body": False}
                return await never  # the client stays: the disconnect guard waits on this

            async def send(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    statuses.append(message["status"])

            await app(dict(scope), receive, send)

        for _ in range(300):
            await one()
        catalog = getattr(app.state.queen, "catalog", None)  # trees before the catalog have none
        if catalog is not None:  # its one reading of the model (a failure here: no hub) must
            # end before the count, or the reading thread's CPU is counted
            await asyncio.gather(*catalog._pending.values(), return_exceptions=True)
        statuses.clear()
        # As apiary-queen does once started: what start-up made is never scanned again, so a
        # full collection of the import-time heap does not land in one tree's count by chance.
        gc.collect()
        gc.freeze()
        started = time.process_time()
        for _ in range(n):
            await one()
        elapsed = time.process_time() - started
        assert set(statuses) == {200}, set(statuses)
        print(f"{elapsed / n * 1e6:.1f} us of CPU per request ({n} requests)")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 3000))
