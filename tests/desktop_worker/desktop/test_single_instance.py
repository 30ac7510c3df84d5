"""The single-instance guard over real local sockets (pytest-qt, offscreen)."""

from __future__ import annotations

import os
import socket
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from PySide6.QtCore import QDir
from PySide6.QtNetwork import QLocalSocket

from desktop_worker.desktop.single_instance import SingleInstance, default_key


@pytest.fixture
def key() -> Iterator[str]:
    name = f"apiary-test-{uuid.uuid4().hex[:12]}"
    yield name
    # Never leave a socket file in the temp dir.
    Path(QDir.tempPath(), name).unlink(missing_ok=True)


def test_the_second_launch_raises_the_first(qtbot, key: str) -> None:
    first = SingleInstance(key)
    assert first.acquire() is True
    assert first.is_primary
    second = SingleInstance(key)
    with qtbot.waitSignal(first.raise_requested, timeout=5000):
        assert second.acquire() is False
    assert not second.is_primary
    # A third launch does the same, the guard keeps serving.
    with qtbot.waitSignal(first.raise_requested, timeout=5000):
        assert SingleInstance(key).acquire() is False
    first.release()
    second.release()


def test_after_release_the_next_launch_is_first(qtbot, key: str) -> None:
    first = SingleInstance(key)
    assert first.acquire()
    assert first.acquire()  # acquiring again is harmless
    first.release()
    assert not first.is_primary
    again = SingleInstance(key)
    assert again.acquire() is True
    again.release()


@pytest.mark.skipif(sys.platform == "win32", reason="named pipes leave nothing behind")
def test_a_stale_socket_from_a_crash_is_taken_over(qtbot, key: str) -> None:
    # What a crashed instance leaves: a Unix socket file that nobody listens on.
    path = Path(QDir.tempPath(), key)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()
    assert path.exists()

    survivor = SingleInstance(key)
    assert survivor.acquire() is True
    assert survivor.is_primary
    assert path.exists()
    if os.name == "posix":
        assert path.stat().st_mode & 0o077 == 0  # only this user may connect
    with qtbot.waitSignal(survivor.raise_requested, timeout=5000):
        assert SingleInstance(key).acquire() is False
    survivor.release()
    assert not path.exists()


def test_other_messages_do_not_raise(qtbot, key: str) -> None:
    first = SingleInstance(key)
    assert first.acquire()
    raised: list[bool] = []
    first.raise_requested.connect(lambda: raised.append(True))
    stranger = QLocalSocket()
    stranger.connectToServer(key)
    assert stranger.waitForConnected(2000)
    stranger.write(b"x" * 100)
    assert stranger.waitForBytesWritten(2000)
    # The guard drops a sender of junk: wait for that, not for time to pass.
    qtbot.waitUntil(
        lambda: stranger.state() == QLocalSocket.LocalSocketState.UnconnectedState, timeout=5000
    )
    assert raised == []
    first.release()


def test_default_key_names_the_user() -> None:
    key = default_key()
    assert key.startswith("apiary-worker-")
    assert all(ch.isalnum() or ch in "_.-" for ch in key)
    assert SingleInstance().key == key
