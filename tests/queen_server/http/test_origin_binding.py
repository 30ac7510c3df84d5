"""Worker signatures name the queen they are for, played as the adversary over real sockets.

A hostile queen that a worker connects to can open its own connection to a real queen as that
worker, pass the real queen's challenge on, and relay the worker's signed hello back. Before
protocol 2 the hello signed only the nonce, the key and the payout address, so the relay below
was welcomed by the real queen: the hostile queen held a session as the worker (its jobs, its
speed record, its earnings' account). Now the worker signs the origin of the URL it dialled, and
the real queen checks the hello against its own origins, so the relayed hello is refused. The
same goes for the earnings header, and for a queen behind a proxy that names its public URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

import httpx
import orjson
import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve

from desktop_worker import __version__
from desktop_worker.earnings import earnings_authorization, fetch_earnings
from desktop_worker.errors import HandshakeRefusedError
from desktop_worker.identity import WorkerIdentity
from desktop_worker.jobs import JobRunner
from desktop_worker.link.backoff import Backoff
from desktop_worker.link.client import LinkClient
from queen_server.identity import verify_hello
from shared_schema import (
    PROTOCOL_VERSION,
    SUBPROTOCOL,
    Challenge,
    Hello,
    Refused,
    Welcome,
    decode,
    encode,
    queen_origin,
)
from tests.support.queen import QueenHarness, running_queen
from tests.support.workers import ScriptedWorker, new_key, pubkey_hex, signed_hello

PUBLIC = "https://queen.example"


class RelayingQueen:
    """A hostile queen on 127.0.0.1: for each worker that connects, it connects to the real
    queen, forwards the real queen's challenge to the worker, the worker's hello to the real
    queen, and the real queen's verdict back to the worker, recording each.

    ``claim_own_host``: its connection to the real queen sends the hostile queen's own address
    as its Host header (anyone can send any Host header), hoping the queen takes it as its
    origin."""

    def __init__(self, real_ws_url: str, *, claim_own_host: bool = False) -> None:
        self.real_ws_url = real_ws_url
        self.claim_own_host = claim_own_host
        self.port = 0
        self.nonce: str | None = None
        self.hello: Hello | None = None
        self.verdict: Refused | Welcome | None = None
        self.relayed = asyncio.Event()

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/worker"

    async def handle(self, worker: ServerConnection) -> None:
        target = self.real_ws_url
        kwargs = {}
        if self.claim_own_host:
            real_port = int(self.real_ws_url.rsplit(":", 1)[1].split("/")[0])
            target, kwargs = self.url, {"host": "127.0.0.1", "port": real_port}
        async with connect(target, subprotocols=[SUBPROTOCOL], proxy=None, **kwargs) as real:
            challenge = await real.recv()
            self.nonce = decode(challenge).nonce
            await worker.send(challenge)
            hello = await worker.recv()
            self.hello = decode(hello)
            await real.send(hello)
            verdict = await real.recv()
            self.verdict = decode(verdict)
            self.relayed.set()
            await worker.send(verdict)


@contextlib.asynccontextmanager
async def relaying_queen(real: QueenHarness, **kwargs) -> AsyncIterator[RelayingQueen]:
    hostile = RelayingQueen(real.ws_url, **kwargs)
    async with serve(hostile.handle, "127.0.0.1", 0, subprotocols=[SUBPROTOCOL]) as server:
        hostile.port = next(iter(server.sockets)).getsockname()[1]
        yield hostile


def real_worker(url: str, identity: WorkerIdentity, *,
                on_welcome: Callable[[Welcome], None] | None = None) -> LinkClient:
    """The worker's own link (``desktop_worker.link.client``), with a hello like the
    service's, signed by ``identity``; it serves no jobs."""

    async def hello_factory() -> tuple[Callable[[str, str], Hello], int]:
        def hello_for(nonce: str, origin: str) -> Hello:
            return Hello(protocol=PROTOCOL_VERSION, worker_version=__version__,
                         pubkey=identity.pubkey,
                         signature=identity.sign_hello(nonce, None, origin=origin),
                         cpu_count=2, disk_space=10, vram=0, models=[], max_jobs=1)
        return hello_for, 1

    runner = JobRunner(object(), has_model=lambda _name: False)  # type: ignore[arg-type]
    return LinkClient(url, hello_factory, runner, shutdown_grace_s=0.1,
                      backoff=Backoff(base_s=0.01, cap_s=0.05), on_welcome=on_welcome)


async def _served_until_welcomed(link: LinkClient) -> Welcome:
    """Run ``link`` until its first welcome, then stop it."""
    welcomed: asyncio.Future[Welcome] = asyncio.get_running_loop().create_future()
    link.on_welcome = lambda welcome: welcomed.done() or welcomed.set_result(welcome)
    stop = asyncio.Event()
    running = asyncio.create_task(link.run(stop))
    try:
        async with asyncio.timeout(10):
            return await welcomed
    finally:
        stop.set()
        async with asyncio.timeout(10):
            await running


# --- (1) a relaying queen -----------------------------------------------------------------------


@pytest.mark.parametrize("claim_own_host", [False, True])
async def test_a_hello_relayed_by_a_hostile_queen_is_refused(tmp_path, caplog, claim_own_host):
    identity = WorkerIdentity(new_key())
    async with running_queen(tmp_path) as queen, \
            relaying_queen(queen, claim_own_host=claim_own_host) as hostile:
        link = real_worker(hostile.url, identity)
        with caplog.at_level(logging.WARNING, logger="queen_server.http.worker_ws"), \
                pytest.raises(HandshakeRefusedError) as refused:
            async with asyncio.timeout(10):
                await link.run(asyncio.Event())  # a fatal refusal ends the worker's link
        await asyncio.wait_for(hostile.relayed.wait(), 5)

        # The relay worked as an attack would: the real queen's own nonce reached the worker,
        # whose genuine signature came back over it. Under protocol 1 (no origin in the
        # payload) this exact hello verified, and the real queen welcomed the hostile queen as
        # this worker. It is signed for the origin the worker dialled: the hostile queen's.
        assert hostile.hello is not None
        assert hostile.nonce is not None
        assert hostile.hello.pubkey == identity.pubkey
        assert verify_hello(hostile.hello, hostile.nonce, [queen_origin(hostile.url)]) == (
            queen_origin(hostile.url))

        # The real queen refused it and admitted no one.
        assert isinstance(hostile.verdict, Refused)
        # With its own address as the Host header, the refusal even says where it was signed
        # for; either way nothing is admitted.
        expected = "wrong_origin" if claim_own_host else "bad_signature"
        assert hostile.verdict.code == expected
        assert refused.value.code == expected  # and the worker's owner is told why
        if claim_own_host:
            assert queen_origin(hostile.url) in hostile.verdict.reason
        assert len(queen.state.registry) == 0
        assert identity.pubkey not in queen.state.stats.workers
        assert any("refused a worker" in r.getMessage() for r in caplog.records)

        # Control: the same worker dialling the real queen itself is welcomed.
        welcome = await _served_until_welcomed(real_worker(queen.ws_url, identity))
        assert welcome.worker_id


# --- (2) an earnings header signed for another queen ------------------------------------------


async def test_an_earnings_header_signed_for_another_queen_is_refused(queen):
    identity = WorkerIdentity(new_key())
    here = queen_origin(queen.base_url)
    elsewhere = "http://127.0.0.1:1"  # the hostile queen the worker sent it to
    async with httpx.AsyncClient(base_url=queen.base_url, trust_env=False) as http:
        own = await http.get("/worker/earnings",
                             headers={"Authorization": earnings_authorization(identity, here)})
        replayed = await http.get("/worker/earnings", headers={
            "Authorization": earnings_authorization(identity, elsewhere)})
        # Replayed with the other queen's name in the Host header: refused all the same, and
        # the refusal names both origins.
        with_host = await http.get("/worker/earnings", headers={
            "Authorization": earnings_authorization(identity, elsewhere),
            "Host": "127.0.0.1:1"})
    assert own.status_code == 200
    assert own.json()["worker_id"]
    assert replayed.status_code == 401
    assert replayed.json()["error"]["code"] == "bad_worker_signature"
    assert with_host.status_code == 401
    assert with_host.json()["error"]["code"] == "wrong_origin"
    assert elsewhere in with_host.json()["error"]["message"]
    assert here in with_host.json()["error"]["message"]


async def test_the_worker_signs_its_earnings_for_the_queen_it_asks(queen):
    identity = WorkerIdentity(new_key())
    earnings = await fetch_earnings(queen.ws_url, identity)
    assert earnings.jobs_settled == 0
    # The same queen dialled as localhost (its loopback alias) works too.
    earnings = await fetch_earnings(f"ws://localhost:{queen.port}/worker", identity)
    assert earnings.jobs_settled == 0


async def test_an_old_earnings_header_is_refused_with_an_upgrade_reason(queen):
    key = new_key()
    pubkey, stamp = pubkey_hex(key), int(time.time())
    unbound = b"\n".join([b"apiary-earnings/1", pubkey.encode(), str(stamp).encode()])
    header = f"Apiary-Worker {pubkey}.{stamp}.{key.sign(unbound).hex()}"
    async with httpx.AsyncClient(base_url=queen.base_url, trust_env=False) as http:
        response = await http.get("/worker/earnings", headers={"Authorization": header})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "outdated_worker_signature"
    assert "upgrade your worker" in response.json()["error"]["message"]


# --- (4) a queen behind a proxy -----------------------------------------------------------------


async def test_a_queen_behind_a_proxy_takes_its_public_url_and_not_the_host_header(tmp_path):
    async with running_queen(tmp_path, public_url=f"{PUBLIC}, https://alt.example:8443") \
            as queen:
        # A worker that dialled wss://queen.example/worker (through the proxy) signs that.
        proxied = await ScriptedWorker(queen.ws_url,
                                       origin=queen_origin("wss://queen.example/worker")).start()
        alt = await ScriptedWorker(queen.ws_url, origin="https://alt.example:8443").start()
        try:
            assert proxied.welcome is not None
            assert alt.welcome is not None
            assert len(queen.state.registry) == 2
        finally:
            await proxied.stop()
            await alt.stop()
        # One that dialled the queen's own address (the Host header's origin) is refused, and
        # told in plain words what to set.
        with pytest.raises(RuntimeError) as info:
            await ScriptedWorker(queen.ws_url).start()
        message = str(info.value)
        assert "wrong_origin" in message
        assert f"signed for {queen_origin(queen.ws_url)}" in message
        assert PUBLIC in message
        assert "APIARY_PUBLIC_URL" in message
        # Earnings likewise: signed for the public URL, accepted; for the Host header, not.
        identity = WorkerIdentity(new_key())
        async with httpx.AsyncClient(base_url=queen.base_url, trust_env=False) as http:
            public = await http.get("/worker/earnings", headers={
                "Authorization": earnings_authorization(identity, PUBLIC)})
            local = await http.get("/worker/earnings", headers={
                "Authorization": earnings_authorization(identity,
                                                        queen_origin(queen.base_url))})
        assert public.status_code == 200
        assert (local.status_code, local.json()["error"]["code"]) == (401, "wrong_origin")


async def test_a_queen_on_every_address_takes_the_host_header_and_warns_once(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="queen_server.app"):
        async with running_queen(tmp_path, host="0.0.0.0") as queen:
            worker = await ScriptedWorker(queen.ws_url).start()
            await worker.stop()
            with pytest.raises(RuntimeError, match="bad_signature"):
                await ScriptedWorker(queen.ws_url, origin="http://127.0.0.1:1").start()
    warnings = [r.getMessage() for r in caplog.records if "APIARY_PUBLIC_URL" in r.getMessage()]
    assert len(warnings) == 1
    assert "relay" in warnings[0]


async def test_a_queen_with_a_public_url_or_a_specific_host_does_not_warn(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="queen_server.app"):
        async with running_queen(tmp_path, host="0.0.0.0", public_url=PUBLIC):
            pass
        async with running_queen(tmp_path):
            pass
    assert not [r for r in caplog.records if "APIARY_PUBLIC_URL" in r.getMessage()]


# --- (5) an old worker --------------------------------------------------------------------------


async def test_an_old_workers_hello_is_refused_with_an_upgrade_reason(queen):
    key = new_key()
    pubkey = pubkey_hex(key)
    async with connect(queen.ws_url, subprotocols=[SUBPROTOCOL], proxy=None) as ws:
        challenge = decode(await ws.recv())
        assert isinstance(challenge, Challenge)
        # Exactly what a protocol-1 worker sends: the old, unbound payload and version.
        unbound = b"\n".join([b"apiary-hello/1", challenge.nonce.encode(), pubkey.encode(), b""])
        hello = orjson.loads(encode(signed_hello(key, challenge.nonce, models=[])))
        hello.update(protocol=1, signature=key.sign(unbound).hex())
        await ws.send(orjson.dumps(hello).decode())
        refused = decode(await ws.recv())
    assert isinstance(refused, Refused)
    assert refused.code == "protocol_version"
    assert "upgrade your worker" in refused.reason
    assert len(queen.state.registry) == 0


async def test_an_old_signature_under_the_new_version_is_refused(queen):
    """A worker cannot choose the old, unbound payload by claiming the new version."""
    key = new_key()
    pubkey = pubkey_hex(key)
    async with connect(queen.ws_url, subprotocols=[SUBPROTOCOL], proxy=None) as ws:
        challenge = decode(await ws.recv())
        unbound = b"\n".join([b"apiary-hello/1", challenge.nonce.encode(), pubkey.encode(), b""])
        hello = orjson.loads(encode(signed_hello(key, challenge.nonce, models=[])))
        hello["signature"] = key.sign(unbound).hex()
        await ws.send(orjson.dumps(hello).decode())
        refused = decode(await ws.recv())
    assert isinstance(refused, Refused)
    assert refused.code == "bad_signature"
    assert len(queen.state.registry) == 0


async def test_the_old_worker_link_shows_the_upgrade_reason(queen):
    """What an owner of an old worker sees: the refusal is fatal and names the fix."""
    identity = WorkerIdentity(new_key())

    async def hello_factory() -> tuple[Callable[[str, str], Hello], int]:
        def hello_for(nonce: str, origin: str) -> Hello:
            return Hello(protocol=1, worker_version="0.9", pubkey=identity.pubkey,
                         signature=identity.sign_hello(nonce, None, origin=origin),
                         cpu_count=1, disk_space=1, vram=0)
        return hello_for, 1

    runner = JobRunner(object(), has_model=lambda _name: False)  # type: ignore[arg-type]
    link = LinkClient(queen.ws_url, hello_factory, runner, shutdown_grace_s=0.1)
    with pytest.raises(HandshakeRefusedError) as info:
        async with asyncio.timeout(10):
            await link.run(asyncio.Event())
    assert info.value.code == "protocol_version"
    assert "upgrade your worker" in str(info.value)


# --- the welcome says whether the queen pays ----------------------------------------------------


@pytest.mark.parametrize(("auth", "pays", "threshold"),
                         [("keys", True, 250_000), ("open", False, None)])
async def test_the_welcome_says_whether_the_queen_pays(tmp_path, auth, pays, threshold):
    async with running_queen(tmp_path, auth=auth, payout_threshold_sats=250) as queen:
        identity = WorkerIdentity(new_key())
        link = real_worker(queen.ws_url, identity)
        welcome = await _served_until_welcomed(link)
        assert (welcome.pays_workers, welcome.payout_threshold_msat) == (pays, threshold)
        assert link.welcome == welcome  # kept on the link for the app to read
