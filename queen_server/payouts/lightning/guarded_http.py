"""The HTTP client for URLs a worker chose: no request reaches the queen's own network.

A worker's payout address names a host; so does the callback its LNURL-pay service sends. Left
alone, the queen would GET whatever those resolve to: ``127.0.0.1:5432``, the cloud metadata
service at ``169.254.169.254``, the office LAN. ``guarded_client`` returns an ``httpx`` client
whose every TCP connection goes through ``GuardedNetworkBackend``:

1. the host is resolved once, by an injectable ``Resolver`` (default: the event loop's
   ``getaddrinfo``);
2. if ANY address it resolves to is loopback, private, link-local, multicast, reserved,
   unspecified or otherwise not global, the connection is refused (``AddressRefused``) and
   nothing is sent;
3. otherwise the socket is opened to one of exactly those checked addresses, so a DNS answer
   that changes between the check and the connect (DNS rebinding) changes nothing. TLS still
   verifies, and SNI still names, the original host: httpcore takes both from the URL, not from
   the address the socket was opened to.

``allowed_hosts`` (the operator's ``lnurl_insecure_hosts``) skips step 2 for those exact host
names, for tests and development against services on 127.0.0.1; they are still resolved by the
same resolver and pinned. The seam is httpcore's ``AsyncNetworkBackend``: httpx's
``AsyncHTTPTransport`` does not take one, so ``_GuardedTransport`` swaps its connection pool
for one that has it (and checks at construction that the swap took).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

import httpcore
import httpx

__all__ = [
    "AddressRefused",
    "GuardedNetworkBackend",
    "Resolver",
    "address_problem",
    "guarded_client",
    "refusal_in",
    "system_resolver",
]

logger = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
"""``(host, port) -> IP addresses as text``; raises ``OSError`` when the name does not resolve."""


async def system_resolver(host: str, port: int) -> list[str]:
    """The addresses the system resolver gives for ``host`` (the loop's ``getaddrinfo``,
    which runs in a thread)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def address_problem(text: str) -> str | None:
    """Why the queen must not connect to the IP address ``text`` (``"loopback"``,
    ``"private"``, ...), or None when it is a public unicast address. Pure."""
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return "unparseable"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for kind, hit in (
        ("unspecified", ip.is_unspecified),
        ("loopback", ip.is_loopback),
        ("link-local", ip.is_link_local),
        ("multicast", ip.is_multicast),
        ("reserved", ip.is_reserved),
        ("private", ip.is_private),
    ):
        if hit:
            return kind
    if not ip.is_global:  # 100.64.0.0/10 (carrier-grade NAT) and the like
        return "private"
    return None


class AddressRefused(httpcore.ConnectError):
    """A host resolved to an address the queen does not connect to. ``kind`` says what kind
    (``loopback``, ``private``, ...); the address itself is only logged, never shown."""

    def __init__(self, host: str, kind: str) -> None:
        super().__init__(f"{host} resolves to a {kind} address; refused")
        self.host = host
        self.kind = kind


def refusal_in(exc: BaseException) -> AddressRefused | None:
    """The ``AddressRefused`` behind an ``httpx`` error (httpx re-raises httpcore's errors as
    its own, ``from`` the original), if there is one."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, AddressRefused):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


@dataclass(frozen=True, slots=True)
class _Pinned:
    host: str
    addresses: tuple[str, ...]


class GuardedNetworkBackend(httpcore.AsyncNetworkBackend):
    """Resolves, checks and pins every TCP connection; see the module docstring."""

    def __init__(
        self,
        *,
        resolver: Resolver = system_resolver,
        allowed_hosts: Collection[str] = (),
        inner: httpcore.AsyncNetworkBackend | None = None,
    ) -> None:
        self.resolver = resolver
        self.allowed_hosts = frozenset(host.lower() for host in allowed_hosts)
        self.inner = inner if inner is not None else httpcore.AnyIOBackend()

    async def pin(self, host: str, port: int, timeout_s: float | None = None) -> _Pinned:
        """Resolve ``host`` and check every address; raises ``AddressRefused`` or
        ``httpcore.ConnectError`` / ``ConnectTimeout`` when it does not resolve."""
        name = host.strip("[]").lower()
        try:
            async with asyncio.timeout(timeout_s):
                addresses = tuple(await self.resolver(name, port))
        except TimeoutError as exc:
            raise httpcore.ConnectTimeout(f"resolving {name} timed out") from exc
        except OSError as exc:
            raise httpcore.ConnectError(f"{name} does not resolve") from exc
        if not addresses:
            raise httpcore.ConnectError(f"{name} does not resolve")
        if name not in self.allowed_hosts:
            for address in addresses:
                kind = address_problem(address)
                if kind is not None:
                    logger.warning("refused a connection to %s: it resolves to %s (%s)",
                                   name, address, kind)
                    raise AddressRefused(name, kind)
        return _Pinned(name, addresses)

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109  (httpcore's interface)
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        pinned = await self.pin(host, port, timeout)
        last: Exception | None = None
        for address in pinned.addresses:
            try:
                return await self.inner.connect_tcp(address, port, timeout=timeout,
                                                    local_address=local_address,
                                                    socket_options=socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                last = exc
        assert last is not None
        raise last

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109  (httpcore's interface)
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("unix sockets are not for worker-supplied URLs")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


class _GuardedTransport(httpx.AsyncHTTPTransport):
    """httpx's own transport (request mapping, error mapping, streaming) over a connection pool
    whose network backend is ``backend``. Proxies from the environment are never used."""

    def __init__(self, backend: GuardedNetworkBackend, limits: httpx.Limits) -> None:
        super().__init__(trust_env=False, limits=limits)
        pool = getattr(self, "_pool", None)
        if not isinstance(pool, httpcore.AsyncConnectionPool):  # httpx changed underneath us
            raise RuntimeError("httpx.AsyncHTTPTransport no longer keeps an AsyncConnectionPool "
                               "in _pool: the SSRF guard cannot be installed")
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(trust_env=False),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=backend,
        )


def guarded_client(
    *,
    allowed_hosts: Collection[str] = (),
    resolver: Resolver = system_resolver,
    timeout_s: float = 10.0,
) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` for worker-supplied URLs (close it after use): every connection
    resolved by ``resolver``, refused if private unless the host is in ``allowed_hosts``, and
    pinned to the checked address. No environment proxies, no redirects followed."""
    backend = GuardedNetworkBackend(resolver=resolver, allowed_hosts=allowed_hosts)
    limits = httpx.Limits(max_connections=10, max_keepalive_connections=0)
    return httpx.AsyncClient(transport=_GuardedTransport(backend, limits), timeout=timeout_s,
                             trust_env=False, follow_redirects=False)
