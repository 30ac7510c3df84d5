"""One app per user: a second launch asks the first to show its window, then quits.

The first instance listens on a ``QLocalServer`` named for the user (a Unix socket in the temp
dir, a named pipe on Windows, open to this user only). A later one connects, sends ``raise`` and
learns it is not first. A crashed instance can leave its Unix socket file behind: nobody answers
on it, so it is removed and taken over. No widgets here; the app connects ``raise_requested`` to
showing its main window.
"""

from __future__ import annotations

import getpass
import logging
import re

from PySide6.QtCore import QObject, Signal
from PySide6.QtNetwork import QAbstractSocket, QLocalServer, QLocalSocket

from desktop_worker.errors import WorkerError

__all__ = ["RAISE_MESSAGE", "SingleInstance", "SingleInstanceError", "default_key"]

log = logging.getLogger(__name__)

RAISE_MESSAGE = b"raise\n"
CONNECT_TIMEOUT_MS = 1000
MAX_MESSAGE_BYTES = 64


class SingleInstanceError(WorkerError):
    """The guard could neither reach a running instance nor start listening."""


def default_key() -> str:
    """``apiary-worker-<user>``, with only characters safe in a socket or pipe name."""
    try:
        user = getpass.getuser()
    except (OSError, KeyError):  # no login name in the environment or the password database
        user = "user"
    return "apiary-worker-" + (re.sub(r"[^A-Za-z0-9_.-]", "_", user) or "user")


class SingleInstance(QObject):
    """``acquire()`` once at start, after the ``QApplication`` exists: True means carry on (we
    listen now, and ``raise_requested`` fires when a later launch asks), False means another
    instance runs and has been asked to show itself, so quit. ``acquire`` blocks for at most
    about a second while it asks."""

    raise_requested = Signal()

    def __init__(self, key: str | None = None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.key = key or default_key()
        self._server: QLocalServer | None = None
        self._connections: set[QLocalSocket] = set()

    @property
    def is_primary(self) -> bool:
        return self._server is not None and self._server.isListening()

    def acquire(self) -> bool:
        if self.is_primary:
            return True
        if self._ask_running_instance():
            log.info("another Apiary Worker is running (%s); asked it to show its window",
                     self.key)
            return False
        server = QLocalServer(self)
        server.setSocketOptions(QLocalServer.SocketOption.UserAccessOption)
        if not server.listen(self.key):
            if server.serverError() != QAbstractSocket.SocketError.AddressInUseError:
                raise SingleInstanceError(
                    f"cannot listen for other launches on {self.key!r}: {server.errorString()}"
                )
            # Someone holds the name. Live (it started just now): defer to it. Dead (a crash
            # left the socket file): take the name over.
            if self._ask_running_instance():
                server.deleteLater()
                return False
            log.warning("removing the stale single-instance socket %r left by a crashed "
                        "instance", self.key)
            QLocalServer.removeServer(self.key)
            if not server.listen(self.key):
                raise SingleInstanceError(
                    f"cannot listen for other launches on {self.key!r}: {server.errorString()}"
                )
        server.newConnection.connect(self._accept)
        self._server = server
        log.debug("single-instance guard listening on %s", server.fullServerName())
        return True

    def release(self) -> None:
        """Stop listening (and remove the socket file), so a new launch becomes the first."""
        # Drop the sockets of launches still talking to us first: a signal from one of them
        # while the server deletes it would reach a dead object.
        for connection in list(self._connections):
            self._drop(connection)
        if self._server is not None:
            self._server.close()
            self._server.deleteLater()
            self._server = None

    def _ask_running_instance(self) -> bool:
        """True when an instance answers on the key and took our ``raise``."""
        socket = QLocalSocket()
        socket.connectToServer(self.key)
        if not socket.waitForConnected(CONNECT_TIMEOUT_MS):
            return False
        socket.write(RAISE_MESSAGE)
        sent = socket.waitForBytesWritten(CONNECT_TIMEOUT_MS)
        socket.disconnectFromServer()
        if socket.state() != QLocalSocket.LocalSocketState.UnconnectedState:
            socket.waitForDisconnected(CONNECT_TIMEOUT_MS)
        if not sent:
            log.warning("the running instance on %s did not take the raise message", self.key)
        return True

    def _accept(self) -> None:
        assert self._server is not None
        while (connection := self._server.nextPendingConnection()) is not None:
            buffer = bytearray()

            def read(conn: QLocalSocket = connection, buf: bytearray = buffer) -> None:
                buf += bytes(conn.readAll().data())
                if RAISE_MESSAGE in buf:
                    buf.clear()
                    self.raise_requested.emit()
                elif len(buf) > MAX_MESSAGE_BYTES:
                    log.warning("dropping an unknown message on the single-instance socket")
                    conn.abort()

            connection.readyRead.connect(read)
            connection.disconnected.connect(lambda conn=connection: self._drop(conn))
            self._connections.add(connection)
            if connection.bytesAvailable():
                read()

    def _drop(self, connection: QLocalSocket) -> None:
        if connection not in self._connections:
            return
        self._connections.discard(connection)
        connection.readyRead.disconnect()
        connection.disconnected.disconnect()
        connection.abort()
        connection.deleteLater()
