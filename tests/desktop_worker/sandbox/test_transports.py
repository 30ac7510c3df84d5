"""The two ways a worker starts and reaches an engine child, each with a real child: the frozen
app's entry point (``apiary-worker --engine-child``, which has no ``python -m``), and the
``tcp`` transport Windows uses (the child dials a one-time listener and proves itself with a
one-time token; a stranger dialling first is ignored)."""

from __future__ import annotations

import socket
import sys
import threading
from pathlib import Path

import pytest

from desktop_worker.sandbox import process as process_module
from desktop_worker.sandbox.policy import policy_for
from desktop_worker.sandbox.process import ENGINE_CHILD_FLAG, EngineProcess

ENTRY = Path(__file__).parents[3] / "installers" / "apiary_worker_main.py"


@pytest.mark.timeout(60)
def test_the_frozen_apps_entry_point_starts_an_engine_child(monkeypatch) -> None:
    monkeypatch.setattr(process_module, "child_command",
                        lambda: [sys.executable, str(ENTRY), ENGINE_CHILD_FLAG])
    engine = EngineProcess("probe", policy_for("probe"), label="frozen probe")
    try:
        hello = engine.start()
        engine.send(engine.link.devices())
        reply = engine.wait_for(30)
    finally:
        engine.close()
    assert hello.pid > 0
    assert reply is not None
    assert reply.type == "probed"


@pytest.mark.timeout(60)
def test_the_tcp_transport_takes_only_the_child_with_the_token(monkeypatch) -> None:
    strangers: list[bytes] = []
    readers: list[threading.Thread] = []
    real_create_server = socket.create_server

    def create_server(address, **kwargs):  # type: ignore[no-untyped-def]
        listener = real_create_server(address, **kwargs)
        # A stranger dials before the child can (first in the listener's queue) and sends a
        # wrong token.
        sock = socket.create_connection(("127.0.0.1", listener.getsockname()[1]))
        sock.sendall(b"\0" * 32)

        def hung_up() -> None:
            with sock:
                strangers.append(sock.recv(16))

        readers.append(threading.Thread(target=hung_up, daemon=True))
        readers[-1].start()
        return listener

    monkeypatch.setattr(process_module.socket, "create_server", create_server)
    engine = EngineProcess("probe", policy_for("probe"), label="tcp probe", transport="tcp")
    try:
        engine.start()
        engine.send(engine.link.devices())
        reply = engine.wait_for(30)
    finally:
        engine.close()
    assert reply is not None
    assert reply.type == "probed"
    readers[0].join(10)
    assert strangers == [b""]  # the stranger was hung up on, told nothing


def test_a_childs_log_lines_reach_the_owners_log_without_control_characters() -> None:
    from desktop_worker.sandbox.process import printable

    assert printable(b"\x1b[2J\x1b]0;owned\x07fake line\r\n") == "?[2J?]0;owned?fake line"
    assert printable("llama.cpp: ok \u00e9\tdone\n".encode()) == "llama.cpp: ok \u00e9\tdone"
