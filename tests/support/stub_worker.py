"""A worker process with the real link, job runner and identity, and a stub engine.

Chaos tests start many of these and SIGKILL them at random: they connect, back off and
reconnect exactly as ``apiary-worker --headless`` does, but answer in milliseconds with a text
the test can check word for word: ``echo_words`` of the request, one chunk per word, continued
from a ``Job.continuation`` like a real model would.

    python -m tests.support.stub_worker --queen ws://127.0.0.1:PORT/worker --key PATH
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from desktop_worker import __version__
from desktop_worker.errors import UnsupportedRequest
from desktop_worker.identity import WorkerIdentity
from desktop_worker.jobs import JobRunner
from desktop_worker.link.client import LinkClient
from shared_schema import CAPABILITY_CONTINUE, PROTOCOL_VERSION, Hello, ModelDescriptor
from tests.support.workers import ECHO_MODEL, ECHO_SHA256, echo_words, words_done

log = logging.getLogger(__name__)


class StubPool:
    """The two engine calls ``JobRunner`` makes, answered from ``echo_words``."""

    def __init__(self, token_delay_s: float) -> None:
        self.token_delay_s = token_delay_s

    async def chat(
        self,
        name: str,
        request: dict[str, Any],
        cancel: threading.Event,
        on_chunk: Callable[[dict[str, Any]], Awaitable[None]],
        continuation: str | None = None,
        scope: str | None = None,
    ) -> dict[str, int]:
        words = echo_words(request)
        done = words_done(words, continuation)
        if done is None:
            raise UnsupportedRequest(f"{continuation!r} is not the start of my answer")
        sent = 0
        for word in words[done:]:
            if cancel.is_set():
                break
            delta = {"content": word} if sent else {"role": "assistant", "content": word}
            await on_chunk({"object": "chat.completion.chunk", "model": name, "choices": [
                {"index": 0, "delta": delta, "finish_reason": None}]})
            sent += 1
            await asyncio.sleep(self.token_delay_s)
        await on_chunk({"object": "chat.completion.chunk", "model": name, "choices": [
            {"index": 0, "delta": {}, "finish_reason": "stop"}]})
        prompt = 7 + done
        return {"prompt_tokens": prompt, "completion_tokens": sent,
                "total_tokens": prompt + sent}

    async def embed(self, name: str, inputs: list[str]) -> tuple[list[list[float]], int]:
        return [[float(len(text)), 1.0] for text in inputs], sum(len(t.split()) for t in inputs)


async def serve(queen_url: str, key_path: Path, max_jobs: int, token_delay_s: float) -> None:
    identity = WorkerIdentity.load_or_create(key_path)
    runner = JobRunner(StubPool(token_delay_s), has_model=lambda name: name == ECHO_MODEL)  # type: ignore[arg-type]
    model = ModelDescriptor(name=ECHO_MODEL, size_bytes=1000, parameter_count=135_000_000,
                            loaded=True, sha256=ECHO_SHA256)

    async def hello_factory() -> tuple[Callable[[str, str], Hello], int]:
        def hello_for(nonce: str, origin: str) -> Hello:
            return Hello(protocol=PROTOCOL_VERSION, worker_version=__version__,
                         pubkey=identity.pubkey,
                         signature=identity.sign_hello(nonce, None, origin=origin),
                         cpu_count=2, disk_space=10, vram=0, models=[model],
                         capabilities=["chat", "stream", "embeddings", CAPABILITY_CONTINUE],
                         max_jobs=max_jobs)
        return hello_for, max_jobs

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    # Several URLs (replicas of one queen), comma-separated: the link tries them in turn.
    link = LinkClient(queen_url.split(","), hello_factory, runner, shutdown_grace_s=1.0)
    await link.run(stop)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--queen", required=True)
    parser.add_argument("--key", required=True, type=Path)
    parser.add_argument("--max-jobs", type=int, default=4)
    parser.add_argument("--token-delay-ms", type=float, default=10.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.queen, args.key, args.max_jobs, args.token_delay_ms / 1000))


if __name__ == "__main__":
    main()
