"""The queen's worker address, from whatever an owner pastes to the websocket URL the link needs.

People paste what a queen's landing page or its operator gives them: ``https://queen.example``,
``http://192.168.1.5:8000``, ``queen.example:8000``, ``queen.example``, or the full
``wss://queen.example/worker``, often with spaces or a trailing slash. ``normalise_queen_url``
turns each into ``ws(s)://host[:port][/prefix]/worker`` or raises ``QueenAddressError`` with a
message that shows the expected form. It is pure (no DNS, no sockets): the wizard checks as the
owner types, and Settings refuses at Save what it cannot read, not at the next Start.

The rules:
* ``http`` becomes ``ws`` and ``https`` becomes ``wss``; ``ws``/``wss`` stay; any other scheme is
  refused.
* With no scheme, a local host (``localhost``, a ``.local`` name, a loopback or private IP) or an
  explicit port other than 443 means plain ``ws``; anything else means ``wss`` (a hosted queen
  is behind TLS).
* The path gets ``/worker`` unless it already ends with it; an OpenAI base path ``/v1`` pasted
  from the API docs is dropped first. A fragment is dropped; a query, a user name or password,
  or a malformed host or port is refused.

A worker may name several queen URLs (replicas of one queen, issue 18): ``parse_queen_urls``
reads them comma-separated (``APIARY_QUEEN_URL``) or as a list (``--queen`` repeated), each
normalised as above, duplicates dropped, the order kept (the link tries them in turn).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from urllib.parse import urlsplit

from desktop_worker.errors import QueenAddressError

WORKER_PATH = "/worker"
EXAMPLES = "queen.example.com, queen.example.com:8000 or wss://queen.example.com/worker"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")
_SCHEMES = {"ws": "ws", "wss": "wss", "http": "ws", "https": "wss"}


def _refuse(problem: str) -> QueenAddressError:
    return QueenAddressError(f"{problem}. Expected a queen address such as {EXAMPLES}")


def normalise_queen_url(text: str) -> str:
    """The websocket URL for what the owner typed (see the module docstring for the rules)."""
    raw = (text or "").strip()  # pasted text often carries spaces or a newline around it
    if not raw:
        raise _refuse("The queen address is empty")
    if any(ch.isspace() for ch in raw):
        raise _refuse(f"{raw!r} has a space in it")
    match = _SCHEME.match(raw)
    given_scheme = match.group(1).lower() if match else None
    if given_scheme is not None and given_scheme not in _SCHEMES:
        raise _refuse(f"{given_scheme}:// is not a queen address (use https://, http://, wss:// "
                      "or ws://)")
    if given_scheme is None and re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:[^0-9]", raw):
        raise _refuse(f"{raw.split(':', 1)[0]}: is not a queen address")
    try:
        parts = urlsplit(raw if given_scheme else f"//{raw}")
        port = parts.port
    except ValueError as exc:
        raise _refuse(f"{raw!r} has a malformed host or port (the port is a number from 1 to "
                      "65535)") from exc
    if parts.username is not None or parts.password is not None:
        raise _refuse("A queen address has no user name or password")
    if parts.query:
        raise _refuse("A queen address has no '?' query")
    host = _host(parts.hostname or "", raw)
    if port == 0:
        raise _refuse("Port 0 is not a port")
    if given_scheme is not None:
        scheme = _SCHEMES[given_scheme]
    elif _is_local(host) or (port is not None and port != 443):
        scheme = "ws"
    else:
        scheme = "wss"
    netloc = f"[{host}]" if ":" in host else host
    if port is not None and port != {"ws": 80, "wss": 443}[scheme]:
        netloc = f"{netloc}:{port}"
    return f"{scheme}://{netloc}{_path(parts.path)}"


def parse_queen_urls(value: str | Sequence[str]) -> list[str]:
    """Every queen URL in ``value`` (comma-separated text, or a list whose items may be comma-
    separated too), normalised, in order, without duplicates; ``QueenAddressError`` names the
    entry that cannot be read, or says that none was given."""
    items = [value] if isinstance(value, str) else list(value)
    urls: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise _refuse(f"{item!r} is not a queen address")
        for entry in item.split(","):
            if not entry.strip():
                continue
            url = normalise_queen_url(entry)
            if url not in urls:
                urls.append(url)
    if not urls:
        raise _refuse("The queen address is empty")
    return urls


def describe(url: str) -> str:
    """``host:port`` of a normalised URL, for messages ("nothing is listening at host:port")."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "wss" else 80)
    host = parts.hostname or "?"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _host(host: str, raw: str) -> str:
    host = host.strip().rstrip(".").lower()
    if not host:
        raise _refuse(f"{raw!r} names no host")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        ascii_host = host.encode("idna").decode("ascii")
    except UnicodeError as exc:
        raise _refuse(f"{host!r} is not a valid host name") from exc
    if not all(_LABEL.match(label) for label in ascii_host.split(".")):
        raise _refuse(f"{host!r} is not a valid host name")
    if ascii_host.replace(".", "").isdigit():
        raise _refuse(f"{host!r} is not a valid IP address")
    return ascii_host


def _is_local(host: str) -> bool:
    if host == "localhost" or host.endswith((".localhost", ".local", ".lan")):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return "." not in host  # a bare machine name on the local network
    return address.is_loopback or address.is_private or address.is_link_local


def _path(path: str) -> str:
    path = re.sub(r"/+", "/", path).rstrip("/")
    if path.endswith(WORKER_PATH):
        return path
    path = path.removesuffix("/v1")
    return f"{path}{WORKER_PATH}"
