"""A threaded HTTP server on 127.0.0.1 for the fake services, which can hang up on every open
keep-alive connection, so that a stopped fake is really gone."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Generic, Protocol, Self, TypeVar

logger = logging.getLogger(__name__)


class TrackedHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, handler: type[BaseHTTPRequestHandler], name: str) -> None:
        self.name = name
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._connections_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._connections_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        """Hang up on every open (keep-alive) connection."""
        with self._connections_lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("%s: error serving %s", self.name, client_address, exc_info=True)


class ServedFake:
    """Start, stop, ``with`` and ``async with`` for a fake that serves from a background thread.

    Subclasses make their server in ``_make_server`` and may release whatever they hold in
    ``_before_stop`` (held downloads, say) so that stopping never waits on them.
    """

    name = "fake"
    poll_interval_s = 0.05

    def __init__(self) -> None:
        self._server: TrackedHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def _make_server(self) -> TrackedHTTPServer:
        raise NotImplementedError

    def _before_stop(self) -> None:
        """Called before the server shuts down."""

    def start(self) -> Self:
        server = self._make_server()
        thread = threading.Thread(target=server.serve_forever,
                                  kwargs={"poll_interval": self.poll_interval_s}, daemon=True,
                                  name=self.name)
        thread.start()
        self._server, self._thread = server, thread
        logger.debug("%s at %s:%s", self.name, *server.server_address[:2])
        return self

    def stop(self) -> None:
        server, thread = self._server, self._thread
        if server is None:
            return
        self._before_stop()
        server.shutdown()
        server.close_connections()
        server.server_close()
        if thread is not None:
            thread.join(timeout=5)
        self._server = self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        return self.start()

    async def __aexit__(self, *exc: object) -> None:
        self.stop()


class _Request(Protocol):
    method: str
    path: str


R = TypeVar("R", bound=_Request)


class RequestLog(Generic[R]):
    """What a fake received, in order, safe to read from the test while the fake serves."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[R] = []

    def record(self, request: R) -> None:
        with self._lock:
            self._items.append(request)

    @property
    def items(self) -> list[R]:
        with self._lock:
            return list(self._items)

    def count(self, method: str | None = None, contains: str = "") -> int:
        """How many requests (of ``method``, with ``contains`` in the path) arrived."""
        return sum(1 for r in self.items
                   if (method is None or r.method == method) and contains in r.path)

