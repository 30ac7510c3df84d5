"""Worker identity: Ed25519 challenge verification and the short public id shown on pages.

``HelloGate`` hands these checks, and the payout-address rules, to the swarm's link machine
(``swarm.link.Gate``), which imports neither cryptography nor the Lightning code itself.

Every worker signature names the queen it is for (``shared_schema.queen_origin``): a hostile
queen that relays this queen's challenge to a worker, or replays a worker's earnings header,
holds a signature for its own origin, which is refused here. ``QueenOrigins`` says which
origins this queen answers to (``public_url``, else its bind address, else each request's Host
header); ``RequestOrigins`` is that answer for one request.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import secrets
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from queen_server.errors import HandshakeRefused
from queen_server.payouts.lightning import InvalidPayoutAddress, parse_payout_address
from shared_schema import Hello, InvalidQueenUrl, hello_signing_payload, queen_origin
from shared_schema.protocol import is_small_order_key

# Bind addresses that name no one host: the origin must come from elsewhere.
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})
# Names of this machine a worker on it may dial for a queen bound to one of them.
_LOOPBACK_ALIASES = {
    "127.0.0.1": ("127.0.0.1", "localhost"),
    "localhost": ("localhost", "127.0.0.1", "[::1]"),
    "[::1]": ("[::1]", "localhost"),
}
PROXY_HINT = "set APIARY_PUBLIC_URL if the queen sits behind a proxy"


def new_nonce() -> str:
    return secrets.token_hex(32)


def verify_hello(hello: Hello, nonce: str, origins: Iterable[str]) -> str:
    """The one of ``origins`` the hello is signed for, by its own key over this session's
    nonce; ``HandshakeRefused("bad_signature")`` when it is signed for none of them."""
    try:
        key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(hello.pubkey))
        signature = bytes.fromhex(hello.signature)
    except ValueError as exc:
        raise HandshakeRefused("bad_signature", "the hello's signature does not verify") from exc
    for origin in origins:
        try:
            key.verify(signature, hello_signing_payload(nonce, hello.pubkey, hello.ln_url,
                                                        origin))
        except InvalidSignature:
            continue
        return origin
    raise HandshakeRefused("bad_signature", "the hello's signature does not verify")


def verify_signature(pubkey: str, signature: str, payload: bytes) -> bool:
    """Whether ``signature`` is the key's over ``payload``. Small-order keys never verify:
    OpenSSL accepts forged signatures under them."""
    try:
        if is_small_order_key(pubkey):
            return False
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(pubkey)).verify(
            bytes.fromhex(signature), payload)
    except (InvalidSignature, ValueError):
        return False
    return True


def public_id(pubkey: str) -> str:
    """A short, stable, non-secret id for a worker key (12 base32 characters)."""
    digest = hashlib.sha256(bytes.fromhex(pubkey)).digest()
    return base64.b32encode(digest).decode("ascii")[:12].lower()


# --- the origins this queen answers to --------------------------------------------------------


class OriginSettings(Protocol):
    """What ``QueenOrigins`` reads (``QueenSettings`` has it)."""

    @property
    def public_url(self) -> Sequence[str]: ...
    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...


@dataclass(frozen=True, slots=True)
class RequestOrigins:
    """The origins one request (a worker's websocket, an earnings request) may be signed for,
    and the origin its Host header names (``None`` if it names none): used only to explain a
    refusal, never to accept, unless the queen has nothing better (a wildcard bind)."""

    accepted: tuple[str, ...]
    host_origin: str | None = None

    def describe(self) -> str:
        return " or ".join(self.accepted) or "(no origin: the request named no host)"

    def misdirected(self) -> tuple[str, ...]:
        """Origins a refused signature may have been made for, to say so: the Host header's,
        and the same with the other scheme (a TLS proxy that does not say it is one)."""
        if self.host_origin is None:
            return ()
        scheme, rest = self.host_origin.split("://", 1)
        flipped = _origin_or_none(("https" if scheme == "http" else "http") + "://" + rest)
        return tuple(o for o in (self.host_origin, flipped) if o and o not in self.accepted)


class QueenOrigins:
    """The origins this queen answers to, from its settings (see ``QueenSettings.public_url``).

    * ``public_url`` set: exactly its origins.
    * else a specific bind host: that host at the port the connection came in on (so an
      ephemeral port works), with its loopback aliases (127.0.0.1 and localhost).
    * else (0.0.0.0 or ::): each request's Host header. Anyone can send any Host header, so
      this gives no relay protection; ``startup_warning`` says so.
    """

    def __init__(self, settings: OriginSettings) -> None:
        self.configured = tuple(dict.fromkeys(queen_origin(url) for url in settings.public_url))
        self.bind_host = _bracketed(settings.host.strip().lower())
        self.bind_port = settings.port
        self.from_host_header = not self.configured and self.bind_host in WILDCARD_HOSTS

    def startup_warning(self) -> str | None:
        """The one warning to log at start, or None."""
        if not self.from_host_header:
            return None
        return (f"the queen listens on every address ({self.bind_host or 'any'}) and "
                "APIARY_PUBLIC_URL is not set, so it takes each request's Host header as its "
                "own origin: worker signatures are not protected against a hostile queen "
                "relaying them. Set APIARY_PUBLIC_URL to the URL workers dial "
                "(e.g. https://queen.example)")

    def for_request(self, scheme: str, host_header: str | None,
                    server: Sequence[Any] | None) -> RequestOrigins:
        """The origins of one request: its ASGI ``scheme``, ``Host`` header and ``server``
        (the local address the connection came in on: the port when bound to port 0)."""
        http_scheme = "https" if scheme in ("https", "wss") else "http"
        host_origin = None
        if host_header and not any(c in host_header for c in "/\\@?#"):  # a host[:port]
            host_origin = _origin_or_none(f"{http_scheme}://{host_header}")
        if self.configured:
            return RequestOrigins(self.configured, host_origin)
        if self.from_host_header:
            return RequestOrigins((host_origin,) if host_origin else (), host_origin)
        port = server[1] if server and len(server) > 1 and server[1] else self.bind_port
        hosts = _LOOPBACK_ALIASES.get(self.bind_host, (self.bind_host,))
        accepted = (_origin_or_none(f"{http_scheme}://{host}:{port}") for host in hosts)
        return RequestOrigins(tuple(o for o in accepted if o), host_origin)

    def for_scope(self, scope: Mapping[str, Any]) -> RequestOrigins:
        """``for_request`` for an ASGI scope (HTTP or websocket)."""
        host = None
        for name, value in scope.get("headers") or ():
            if name == b"host":
                host = value.decode("latin-1")
                break
        return self.for_request(scope.get("scheme", "http"), host, scope.get("server"))


def origins_of(app: Any) -> QueenOrigins:
    """The ``QueenOrigins`` an app keeps on ``app.state.origins`` (``create_app`` puts it
    there); made from its settings for an app built without one."""
    origins = getattr(app.state, "origins", None)
    if origins is None:
        origins = app.state.origins = QueenOrigins(app.state.queen.settings)
    return origins


def _bracketed(host: str) -> str:
    """An IPv6 literal as a URL writes it; anything else as it is."""
    if host.startswith("[") or ":" not in host:
        return host
    try:
        return f"[{ipaddress.IPv6Address(host).compressed}]"
    except ValueError:
        return host


def _origin_or_none(url: str) -> str | None:
    try:
        return queen_origin(url)
    except InvalidQueenUrl:
        return None


class HelloGate:
    """The checks of a worker's hello that the link machine cannot make itself: its signature
    (for one of ``origins``, the connection's ``RequestOrigins``), its public id, and its
    payout address (``insecure_hosts`` as in ``QueenSettings``)."""

    def __init__(self, insecure_hosts: Collection[str] = (),
                 origins: RequestOrigins | None = None) -> None:
        self.insecure_hosts = insecure_hosts
        self.request_origins = origins or RequestOrigins(())

    @property
    def origins(self) -> tuple[str, ...]:
        return self.request_origins.accepted

    def hello_signed(self, hello: Hello, nonce: str) -> bool:
        try:
            verify_hello(hello, nonce, self.request_origins.accepted)
        except HandshakeRefused:
            return False
        return True

    def signed_for_elsewhere(self, hello: Hello, nonce: str) -> str | None:
        """For a hello that ``hello_signed`` refused: the origin it was signed for, when that
        is the one the connection's Host header names (the worker dialled this queen by a
        name it does not answer to: a proxy, a DNS name), so the refusal can say so."""
        try:
            return verify_hello(hello, nonce, self.request_origins.misdirected())
        except HandshakeRefused:
            return None

    def public_id(self, pubkey: str) -> str:
        return public_id(pubkey)

    def payout_problem(self, ln_url: str | None) -> str | None:
        try:
            parse_payout_address(ln_url, insecure_hosts=self.insecure_hosts)
        except InvalidPayoutAddress as exc:
            return exc.message
        return None
