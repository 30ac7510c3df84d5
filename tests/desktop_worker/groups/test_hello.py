"""What a worker tells the queen about groups (issue 19): ``rpc`` and its llama.cpp build only
when its llama.cpp has the RPC backend and its owner lets it join; a LAN hint that names no
network; and the queen's ``Worker.lan``, which a copied hint cannot forge."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from desktop_worker.group_family import family_tag, new_family_code
from desktop_worker.groups.lan import lan_hint, network_of
from desktop_worker.groups.rpc import Device, NullRpc, RpcProbe
from desktop_worker.groups.rpc_backend import LlamaRpc
from desktop_worker.service import WorkerService
from desktop_worker.settings import WorkerSettings
from queen_server.swarm.worker import Worker
from shared_schema import Hello
from shared_schema.capabilities import RPC
from tests.desktop_worker.groups.device_fakes import NO_GPU
from tests.support.hardware_fixtures import fixture_path, recorded_machine


class FixedRpc:
    def __init__(self, probe: RpcProbe) -> None:
        self.result = probe
        self.calls = 0

    def probe(self) -> RpcProbe:
        self.calls += 1
        return self.result

    def devices(self) -> list[Device]:
        return list(NO_GPU)  # a RAM-only machine (GPU cases: test_service_devices.py)


async def hello_of(tmp_path: Path, rpc, **settings) -> Hello:
    config = WorkerSettings(models_dir=tmp_path / "models", key_path=tmp_path / "key.pem",
                            key_store="file", queen_url="ws://127.0.0.1:9/worker", **settings)
    service = WorkerService(config, rpc=rpc, detector=lambda models_dir: recorded_machine(
        fixture_path("gaming_rtx3060"), models_dir))
    try:
        hello_for, _ = await service.hello_factory()
        await service.hello_factory()  # a reconnect: the probe is not run again
        return hello_for("nonce", "http://127.0.0.1:9")
    finally:
        await service.pool.close()


async def test_a_worker_with_rpc_says_so_with_its_build_and_lan(tmp_path: Path) -> None:
    rpc = FixedRpc(RpcProbe(True, "ggml-0.25.3+abc/rpc-7.0.0"))
    hello = await hello_of(tmp_path, rpc, lan_groups=True)
    assert RPC in hello.capabilities
    assert hello.llama_build == "ggml-0.25.3+abc/rpc-7.0.0"
    assert hello.lan_hint is not None
    assert re.fullmatch(r"[0-9a-f]{32}", hello.lan_hint)
    assert rpc.calls == 1


async def test_an_owners_family_is_named_only_with_rpc(tmp_path: Path) -> None:
    """``group_family`` (issue 34): the hello names the owner's family, as a tag of the code and
    this queen's origin; a worker that joins no group names none."""
    code = new_family_code()
    rpc = FixedRpc(RpcProbe(True, "ggml-0.25.3+abc/rpc-7.0.0"))
    hello = await hello_of(tmp_path / "a", rpc, group_family=code)
    assert hello.group_family == family_tag(code, "http://127.0.0.1:9")
    off = await hello_of(tmp_path / "b", rpc, group_family=code, join_groups=False)
    assert off.group_family is None
    anyone = await hello_of(tmp_path / "c", rpc)
    assert anyone.group_family is None
    queen_side = Worker(key="key", public_id="key", session_id="s", max_jobs=1, models=[])
    queen_side.note_hello(hello)
    assert queen_side.group_family == hello.group_family


async def test_a_worker_that_does_not_listen_on_its_lan_names_no_lan(tmp_path: Path) -> None:
    """lan_groups off (the default): its gates listen on 127.0.0.1 only, so no head on its
    LAN could reach it directly; it still joins groups (relayed)."""
    hello = await hello_of(tmp_path, FixedRpc(RpcProbe(True, "ggml-0.25.3+abc/rpc-7.0.0")))
    assert RPC in hello.capabilities
    assert hello.llama_build == "ggml-0.25.3+abc/rpc-7.0.0"
    assert hello.lan_hint is None


@pytest.mark.parametrize(("rpc", "settings"), [
    (NullRpc(), {"lan_groups": True}),  # llama.cpp without the RPC backend
    (FixedRpc(RpcProbe(True, "b")), {"join_groups": False, "lan_groups": True}),  # owner: no
])
async def test_no_rpc_no_build_no_lan(tmp_path: Path, rpc, settings) -> None:
    hello = await hello_of(tmp_path, rpc, **settings)
    assert RPC not in hello.capabilities
    assert hello.llama_build is None
    assert hello.lan_hint is None


def test_this_build_has_rpc_and_names_its_ggml() -> None:
    """CI builds llama-cpp-python with -DGGML_RPC=on (dev.py): the real probe finds it."""
    probe = LlamaRpc().probe()
    assert probe.available, probe.reason
    assert re.fullmatch(r"ggml-[\w.]+\+[\w-]+/rpc-7\.0\.0", probe.build or "")


def test_the_hint_hashes_the_network_not_the_address() -> None:
    def interfaces(address: str):
        return lambda: {"eth0": [SimpleNamespace(address=address, netmask="255.255.255.0")]}

    assert network_of("192.168.1.20", interfaces("192.168.1.20")) == "192.168.1.0/24"
    assert network_of("10.0.0.1", interfaces("192.168.1.20")) is None
    # the loopback interface's hint is the same for every worker on this machine
    assert lan_hint("127.0.0.1") == lan_hint("127.0.0.1")
    assert lan_hint("127.0.0.1") is not None


def test_a_copied_hint_does_not_make_a_lan_from_another_address() -> None:
    def worker(key: str, host: str | None, hint: str | None) -> Worker:
        w = Worker(key=key, public_id=key[:8], session_id="s", max_jobs=1, models=[])
        w.peer_host, w.lan_hint = host, hint
        return w

    hint = "a" * 32
    home_a = worker("a" * 64, "203.0.113.5", hint)
    home_b = worker("b" * 64, "203.0.113.5", hint)
    thief = worker("c" * 64, "198.51.100.7", hint)  # copied the hint, not the address
    assert home_a.lan == home_b.lan is not None
    assert thief.lan != home_a.lan
    assert worker("d" * 64, "203.0.113.5", None).lan is None


def test_hello_bounds_the_new_fields() -> None:
    """A hostile hello: a LAN hint that is not 32 hex digits (an address in clear, say) and a
    build name that is too long or has spaces are refused, never stored."""
    fields = {"protocol": 1, "worker_version": "x", "pubkey": "1" * 64, "signature": "0" * 128,
              "cpu_count": 1, "disk_space": 1, "vram": 0}
    good = Hello.model_validate({**fields, "lan_hint": "a" * 32, "llama_build": "ggml-1+x/rpc-7"})
    assert good.lan_hint == "a" * 32  # so each refusal below is the bad field's
    for bad in ({"lan_hint": "192.168.1.0/24"}, {"lan_hint": "A" * 32},
                {"llama_build": "x" * 129}, {"llama_build": "ggml 1"}):
        with pytest.raises(ValidationError):
            Hello.model_validate({**fields, **bad})
    base = Hello.model_json_schema()["properties"]
    assert base["lan_hint"]["anyOf"][0]["pattern"] == "^[0-9a-f]{32}$"
    assert base["llama_build"]["anyOf"][0]["maxLength"] == 128


async def test_the_link_hands_group_commands_to_the_roles_only_when_the_hello_says_rpc(
        tmp_path: Path) -> None:
    def service(rpc, **settings) -> WorkerService:
        config = WorkerSettings(models_dir=tmp_path / "models", key_path=tmp_path / "key.pem",
                                key_store="file", queen_url="ws://127.0.0.1:9/worker",
                                **settings)
        return WorkerService(config, rpc=rpc, detector=lambda models_dir: recorded_machine(
            fixture_path("gaming_rtx3060"), models_dir))

    joining = service(FixedRpc(RpcProbe(True, "b")))
    refusing = service(FixedRpc(RpcProbe(True, "b")), join_groups=False)
    local = service(NullRpc(), local_group=1)
    try:
        # the pool's contexts come from the roles' dispatcher, which falls back to the local
        # group's heads under --local-group and to plain contexts otherwise
        assert joining.pool.contexts is joining.group_contexts
        assert local.group_contexts.fallback is local.local_group
        assert joining.link.on_session_end == joining.groups.session_ended
        for worker in (joining, refusing, local):
            assert worker.link.on_group is None  # nothing before the first hello
            await worker.hello_factory()
        assert joining.link.on_group == joining.groups.receive
        assert refusing.link.on_group is None
        assert local.link.on_group is None
    finally:
        for worker in (joining, refusing, local):
            await worker.pool.close()
