"""Prompt caches through a real queen (issue 36): each job carries its caller's cache scope, a
chat's next turn goes back to the worker that holds its prefix while that worker is free, and
a batched worker's speed is recorded under the load each job met.

Real queen, real sockets, protocol-v1 scripted workers; the adversary is a client that tries to
choose its scope or flood the affinity map."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
from typing import Any

import httpx
import pytest

from queen_server.billing.keys import hash_secret
from queen_server.swarm.prefix import SCOPE_LABEL
from shared_schema import Job
from shared_schema.protocol import CACHE_SCOPE
from tests.support.queen import QueenHarness, running_queen
from tests.support.sse import sse_events, text_of
from tests.support.workers import ECHO_MODEL, ScriptedWorker

KEY_A, KEY_B = "key-a", "key-b"
SLOW_S = 0.3  # the slow worker's time per answer, so the queen measures it as slower


class SlowWorker(ScriptedWorker):
    """A scripted worker that takes ``SLOW_S`` over each answer, as a slower machine does."""

    async def _run(self, job: Job) -> None:
        await asyncio.sleep(SLOW_S)
        await super()._run(job)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class Chat:
    """One conversation of one caller: each turn resends the whole history, as clients do."""

    def __init__(self, http: httpx.AsyncClient, queen: QueenHarness, key: str, first: str,
                 *, stream: bool = False) -> None:
        self.http, self.queen, self.key, self.stream = http, queen, key, stream
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": first}]

    async def turn(self, text: str | None = None) -> str:
        """Send the next turn (``text``: the user's next message; None for the first)."""
        if text is not None:
            self.messages.append({"role": "user", "content": text})
        body = {"model": ECHO_MODEL, "messages": list(self.messages), "max_tokens": 32}
        if self.stream:
            answer = text_of(await sse_events(self.queen.base_url, {**body, "stream": True},
                                              auth(self.key)))
        else:
            response = await self.http.post("/v1/chat/completions", json=body,
                                             headers=auth(self.key))
            assert response.status_code == 200, response.text
            answer = response.json()["choices"][0]["message"]["content"]
        self.messages.append({"role": "assistant", "content": answer})
        return answer


async def served_by(turn: Any, *workers: ScriptedWorker) -> ScriptedWorker:
    """Run one turn and return the worker that got its job."""
    before = [len(worker.jobs) for worker in workers]
    await turn
    got = [worker for worker, count in zip(workers, before, strict=True)
           if len(worker.jobs) > count]
    assert len(got) == 1, [worker.pubkey[:8] for worker in got]
    return got[0]


async def test_the_next_turn_goes_back_to_the_worker_holding_the_prefix_while_it_is_free(
        tmp_path):
    # No audits: a new worker whose answers wait for audits ranks as busy (issue 16), which
    # would take the holder out of the preference at random.
    async with running_queen(tmp_path, auth="keys", api_keys=[KEY_A], audits=False,
                             first_token_timeout_s=20.0, total_timeout_s=30.0,
                             queue_timeout_s=10.0) as queen:
        slow = await SlowWorker(queen.ws_url).start()
        fast: ScriptedWorker | None = None
        try:
            async with httpx.AsyncClient(base_url=queen.base_url, timeout=30) as http:
                # The slow worker, alone, serves the first turns of two conversations (plain
                # and streamed); then, while it is held busy, the fast one joins and gets a
                # speed record of its own.
                plain = Chat(http, queen, KEY_A, "tell me about bees")
                streamed = Chat(http, queen, KEY_A, "tell me about wasps", stream=True)
                await plain.turn()
                await streamed.turn()
                slow.behaviour = "gated"
                blocker = asyncio.create_task(Chat(http, queen, KEY_A, "hold on").turn())
                await queen.wait_until(lambda: len(slow.jobs) == 3, what="the slow one busy")
                fast = await ScriptedWorker(queen.ws_url).start()
                assert await served_by(Chat(http, queen, KEY_A, "warm up").turn(),
                                       fast, slow) is fast
                slow.release.set()
                await blocker
                slow.behaviour = "echo"
                slow.release.clear()
                await queen.wait_until(lambda: queen.state.registry.leased == 0,
                                       what="every slot free")

                # By the queen's own measure the fast worker is faster: a new conversation
                # goes there.
                assert await served_by(Chat(http, queen, KEY_A, "new").turn(),
                                       fast, slow) is fast
                # The next turn of each conversation goes back to the slow worker, which
                # holds its prefix, with the same cache scope as its first turn.
                assert await served_by(plain.turn("and honey?"), fast, slow) is slow
                assert await served_by(streamed.turn("and nests?"), fast, slow) is slow
                assert slow.jobs[-1].cache_scope == slow.jobs[0].cache_scope is not None

                # Busy: the holder's only slot is taken, so the next turn goes elsewhere.
                slow.behaviour = "gated"
                held = asyncio.create_task(plain.turn("and wax?"))
                await queen.wait_until(lambda: len(slow.jobs) == 6, what="the holder busy")
                assert await served_by(streamed.turn("and stings?"), fast, slow) is fast
                slow.release.set()
                await held
                assert len(slow.jobs) == 6

                # Gone: the holder left, so its conversations go on elsewhere.
                await slow.stop()
                await queen.wait_until(lambda: len(queen.state.registry) == 1,
                                       what="the holder gone")
                before = len(fast.jobs)
                assert (await plain.turn("and queens?")).startswith("echo:")
                assert len(fast.jobs) == before + 1
        finally:
            await slow.stop()
            if fast is not None:
                await fast.stop()


def expected_scope(secret: bytes, caller: str) -> str:
    return hmac.new(secret, SCOPE_LABEL + caller.encode(), hashlib.sha256).hexdigest()[:32]


async def test_each_caller_has_its_own_scope_and_it_never_names_the_caller(tmp_path):
    conversation = {"model": ECHO_MODEL, "max_tokens": 8,
                    "messages": [{"role": "user", "content": "the same words"}]}
    scopes: dict[str, list[str | None]] = {KEY_A: [], KEY_B: []}
    async with running_queen(tmp_path, auth="keys", api_keys=[KEY_A, KEY_B]) as queen:
        worker = await ScriptedWorker(queen.ws_url).start()
        try:
            async with httpx.AsyncClient(base_url=queen.base_url, timeout=20) as http:
                for key in (KEY_A, KEY_B, KEY_A, KEY_B):
                    response = await http.post("/v1/chat/completions", json=conversation,
                                               headers=auth(key))
                    assert response.status_code == 200, response.text
                    scopes[key].append(worker.jobs[-1].cache_scope)
                # Embeddings reuse no prompt cache: no scope.
                response = await http.post("/v1/embeddings", headers=auth(KEY_A),
                                           json={"model": ECHO_MODEL, "input": "hello"})
                assert response.status_code == 200, response.text
                assert worker.jobs[-1].openai_url == "/v1/embeddings"
                assert worker.jobs[-1].cache_scope is None
            secret = queen.state.scopes.secret
        finally:
            await worker.stop()
    scope_a, scope_b = scopes[KEY_A][0], scopes[KEY_B][0]
    assert scopes[KEY_A] == [scope_a, scope_a]
    assert scopes[KEY_B] == [scope_b, scope_b]
    assert scope_a != scope_b
    for key, scope in ((KEY_A, scope_a), (KEY_B, scope_b)):
        assert scope is not None
        assert re.fullmatch(CACHE_SCOPE, scope)
        caller = "dev:" + hash_secret(key)
        # Not the caller's id, nor its hash, nor any part of them: an HMAC under the secret.
        assert scope not in caller
        assert caller[4:36] != scope
        assert scope == expected_scope(secret, caller)
        assert scope != expected_scope(b"", caller)

    # The secret is kept in the database: a restarted queen (or another replica on the same
    # database) derives the same scopes; a queen with its own database does not.
    async with running_queen(tmp_path, auth="keys", api_keys=[KEY_A, KEY_B]) as again:
        assert again.state.scopes.of("dev:" + hash_secret(KEY_A)) == scope_a
    other_db = tmp_path / "other"
    other_db.mkdir()
    async with running_queen(other_db, auth="keys", api_keys=[KEY_A, KEY_B]) as other:
        assert other.state.scopes.of("dev:" + hash_secret(KEY_A)) != scope_a
    # An operator's own secret wins over the database's.
    async with running_queen(tmp_path, auth="keys", api_keys=[KEY_A],
                             cache_scope_secret="operator secret") as chosen:
        assert chosen.state.scopes.of("dev:" + hash_secret(KEY_A)) == expected_scope(
            b"operator secret", "dev:" + hash_secret(KEY_A))


async def test_a_client_cannot_choose_its_scope(tmp_path):
    messages = [{"role": "user", "content": "hello"}]
    async with running_queen(tmp_path, auth="keys", api_keys=[KEY_A, KEY_B]) as queen:
        worker = await ScriptedWorker(queen.ws_url).start()
        try:
            async with httpx.AsyncClient(base_url=queen.base_url, timeout=20) as http:
                response = await http.post("/v1/chat/completions", headers=auth(KEY_B),
                                           json={"model": ECHO_MODEL, "messages": messages})
                assert response.status_code == 200, response.text
                victim = worker.jobs[-1].cache_scope
                # The attacker names the victim's scope: refused as the unknown field it is,
                # and nothing reaches a worker.
                response = await http.post("/v1/chat/completions", headers=auth(KEY_A), json={
                    "model": ECHO_MODEL, "messages": messages, "cache_scope": victim})
                assert response.status_code == 400
                error = response.json()["error"]
                assert (error["param"], error["code"]) == ("cache_scope", "unknown_parameter")
                assert len(worker.jobs) == 1
                # OpenAI's own identifiers and cache hint are accepted and change nothing.
                for extra in ({"user": victim}, {"prompt_cache_key": victim},
                              {"user": "dev:" + hash_secret(KEY_B), "safety_identifier": "b"}):
                    response = await http.post("/v1/chat/completions", headers=auth(KEY_A),
                                               json={"model": ECHO_MODEL, "messages": messages,
                                                     **extra})
                    assert response.status_code == 200, response.text
                    job = worker.jobs[-1]
                    assert job.cache_scope not in (None, victim)
                    assert job.cache_scope == worker.jobs[1].cache_scope  # its own, each time
                    assert not {"user", "prompt_cache_key", "cache_scope"} & set(job.openai_req)
        finally:
            await worker.stop()


async def test_a_flood_of_conversations_keeps_the_affinity_map_bounded(tmp_path):
    entries = 16
    async with running_queen(tmp_path, auth="keys", api_keys=[KEY_A], affinity_entries=entries,
                             max_concurrent_per_key=64) as queen:
        worker = await ScriptedWorker(queen.ws_url, max_jobs=16).start()
        affinity = queen.state.affinity
        sizes: list[int] = []
        try:
            async with httpx.AsyncClient(base_url=queen.base_url, timeout=20) as http:
                async def one(number: int) -> None:
                    response = await http.post("/v1/chat/completions", headers=auth(KEY_A), json={
                        "model": ECHO_MODEL, "max_tokens": 4,
                        "messages": [{"role": "user", "content": f"conversation {number}"}]})
                    assert response.status_code == 200, response.text
                    sizes.append(len(affinity))

                flood = entries + 1000
                for start in range(0, flood, 16):
                    await asyncio.gather(*(one(number)
                                           for number in range(start, min(flood, start + 16))))
        finally:
            await worker.stop()
    assert len(sizes) == entries + 1000
    assert max(sizes) == entries  # full, never past it
    assert len(affinity) == entries


async def test_a_jobs_speed_is_recorded_under_the_load_it_started_with(tmp_path):
    async with running_queen(tmp_path, auth="keys", api_keys=[KEY_A],
                             first_token_timeout_s=20.0, total_timeout_s=30.0) as queen:
        worker = await ScriptedWorker(queen.ws_url, max_jobs=2, behaviour="gated").start()
        stats = queen.state.stats
        try:
            async with httpx.AsyncClient(base_url=queen.base_url, timeout=30) as http:
                def chat(text: str) -> asyncio.Task[httpx.Response]:
                    return asyncio.create_task(http.post(
                        "/v1/chat/completions", headers=auth(KEY_A), json={
                            "model": ECHO_MODEL, "stream": True,
                            "messages": [{"role": "user", "content": text}]}))

                first = chat("one two three")  # alone on the worker
                await queen.wait_until(lambda: len(worker.jobs) == 1, what="the first job")
                second = chat("four five six")  # the worker's second job at once
                await queen.wait_until(lambda: len(worker.jobs) == 2, what="the second job")
                worker.release.set()
                for response in await asyncio.gather(first, second):
                    assert response.status_code == 200
        finally:
            await worker.stop()
    key = worker.pubkey
    record = stats.workers[key].speeds["tiny"]
    assert record.samples == 1  # only the job that ran alone feeds the unloaded record
    assert stats.workers[key].jobs == 2
    alone = stats.speeds_for("tiny")[key]
    assert stats.speed_at("tiny", key, 1) == alone
    loaded = stats.speed_at("tiny", key, 2)
    assert loaded is not None
    assert loaded != pytest.approx(2 * alone)
