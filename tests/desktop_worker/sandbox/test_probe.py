"""The worker asks a confined engine child for llama.cpp's build and devices (it never loads
llama.cpp itself), and joins model groups only where that child's sandbox holds whole."""

from __future__ import annotations

import sys

import pytest

from desktop_worker.groups.rpc_probe import SandboxedRpc
from shared_schema.engine_ipc import Confinement, Probed
from tests.support.rpc import needs_rpc

PARTIAL = Confinement(os="linux", no_new_privs=True, seccomp=True, landlock_abi=3,
                      filesystem=True, network=True, signals=False, rlimits=True,
                      notes=["Landlock ABI 3 cannot limit TCP ports (Linux 6.7+ can)"])


class KnownProbe(SandboxedRpc):
    """The real rule over a given answer and sandbox."""

    def __init__(self, confinement: Confinement | None) -> None:
        super().__init__()
        self.confinement = confinement

    def _ask(self) -> Probed:
        return Probed(available=True, build="ggml-test/rpc-7.0.0")


def test_groups_are_off_where_the_sandbox_does_not_hold() -> None:
    probe = KnownProbe(PARTIAL).probe()
    assert not probe.available
    assert probe.build == "ggml-test/rpc-7.0.0"
    assert "sandbox does not fully hold" in probe.reason
    assert "Landlock ABI 3" in probe.reason
    assert not KnownProbe(None).probe().available
    whole = PARTIAL.model_copy(update={"landlock_abi": 7, "tcp_ports": True, "signals": True,
                                       "notes": []})
    assert KnownProbe(whole).probe().available


@needs_rpc
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the Linux sandbox")
@pytest.mark.timeout(120)
def test_the_real_probe_answers_from_a_confined_child() -> None:
    rpc = SandboxedRpc()
    try:
        probe = rpc.probe()
        assert rpc.confinement is not None
        assert rpc.confinement.seccomp
        assert probe.build is not None
        assert probe.build.endswith("/rpc-7.0.0")
        assert probe.available == rpc.confinement.holds_for_groups
        devices = rpc.devices()
        assert any(device.name == "CPU" for device in devices)
        first = rpc._process
        assert first is not None
        assert first.pid is not None
        rpc.devices()
        assert rpc._process is first  # one child answers them all
    finally:
        rpc.close()
    assert first.returncode is not None
