"""The head's end of the path to one member's gate (issue 19).

llama.cpp's RPC client speaks raw TCP to ``host:port`` and knows nothing of tokens or TLS, so
the head gives it a local endpoint instead: the dialer listens on ``127.0.0.1:<ephemeral>``
(``endpoint``), and for each connection llama.cpp opens there it dials the member's gate (TLS
pinned to the fingerprint the queen handed over, on the direct route over a LAN), answers the
gate's challenge with the group's token, and then pipes bytes both ways. A refusal or failure
closes the local connection and is kept in ``last_error`` for the head to report; ``check()``
tries the whole path once before llama.cpp is pointed at it, because any RPC failure aborts
the process that holds the RPC client.
"""

from __future__ import annotations

import asyncio
import logging

from desktop_worker.errors import GroupLinkError
from desktop_worker.groups import handshake, tls
from desktop_worker.groups.gate import (
    LOOPBACK,
    LinkStats,
    StatsBook,
    authenticate_member,
    close_quietly,
    pipe,
    set_nodelay,
)

log = logging.getLogger(__name__)


class HeadDialer:
    """A local endpoint for llama.cpp that leads, authenticated, to one member's gate."""

    def __init__(
        self,
        group: str,
        head: str,
        token: bytes,
        member_host: str,
        member_port: int,
        *,
        tls_fingerprint: str | None = None,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self.group = handshake.check_name("group", group)
        self.head = handshake.check_name("head", head)
        self._token = handshake.check_token(token)
        self.member_host = member_host
        self.member_port = member_port
        self._fingerprint = (
            tls.normalize_fingerprint(tls_fingerprint) if tls_fingerprint is not None else None
        )
        self.connect_timeout_s = connect_timeout_s
        self.last_error: str | None = None
        self._stats = StatsBook()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, LOOPBACK, 0)
        log.info("dialer for group %s: %s leads to %s:%d (%s)", self.group, self.endpoint,
                 self.member_host, self.member_port, "TLS pinned" if self._fingerprint else "plain")

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:<port>``, the RPC endpoint to give llama.cpp for this member."""
        if self._server is None or not self._server.sockets:
            raise RuntimeError("the dialer is not started")
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    def stats(self) -> LinkStats:
        return self._stats.snapshot()

    async def check(self) -> None:
        """Dials the gate and authenticates once, then hangs up; ``GroupLinkError`` (or its
        ``GroupLinkRefused`` and ``TlsPinMismatch``) says why the path does not work."""
        _reader, writer, _leftover = await self._dial()
        await close_quietly(writer)

    async def stop(self) -> None:
        """Closes the local listener and every connection through it (both ends)."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _dial(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
        """A connection to the gate, past TLS pinning and the handshake."""
        context = tls.client_context() if self._fingerprint is not None else None
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection(
                    self.member_host, self.member_port, ssl=context
                )
        except TimeoutError:
            raise GroupLinkError(
                f"the member's gate at {self.member_host}:{self.member_port} did not answer "
                f"within {self.connect_timeout_s:g} s"
            ) from None
        except OSError as exc:
            raise GroupLinkError(
                f"the member's gate at {self.member_host}:{self.member_port} cannot be "
                f"reached: {exc}"
            ) from exc
        try:
            set_nodelay(writer)
            if self._fingerprint is not None:
                tls.check_pin(writer.get_extra_info("ssl_object"), self._fingerprint)
            leftover = await authenticate_member(
                reader, writer, group=self.group, head=self.head, token=self._token,
                timeout_s=self.connect_timeout_s,
            )
        except BaseException:
            await close_quietly(writer)
            raise
        return reader, writer, leftover

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        try:
            if self._closing:
                return
            set_nodelay(writer)
            try:
                member_reader, member_writer, leftover = await self._dial()
            except GroupLinkError as exc:
                self.last_error = str(exc)
                log.warning("dialer for group %s: %s", self.group, exc)
                return
            counters = self._stats.open()
            try:
                await pipe(reader, writer, member_reader, member_writer, counters,
                           to_a_first=leftover)
            finally:
                self._stats.close(counters)
                await close_quietly(member_writer)
        except asyncio.CancelledError:
            pass  # ``stop()`` cancelled it (see ``MemberGate._serve``)
        finally:
            self._tasks.discard(task)  # type: ignore[arg-type]
            await close_quietly(writer)
