"""What the landing page tells someone who wants to run a worker for this queen: which build of
the desktop app to download, the URL to paste into it, and whether the queen pays.

Pure: settings values and the request's URL in, text out, so each case is tested without a
server. ``pages.py`` feeds it the request.

The worker URL is what the app dials: ``wss://host/worker`` behind TLS, ``ws://host:port/worker``
otherwise. The queen cannot always see how people reach it, so the operator's ``public_url``
(``APIARY_PUBLIC_URL``, one URL or a list; the first is the one shown) wins; without it the
request's own scheme and host are used. The scheme is what uvicorn made of the request: it
trusts ``X-Forwarded-Proto`` only from the addresses in ``FORWARDED_ALLOW_IPS`` (loopback by
default), the same notion of a trusted proxy the admin cookie's ``Secure`` flag relies on, so a
client cannot talk the page into showing a ``wss://`` URL by sending the header itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

WORKER_PATH = "/worker"
WS_SCHEMES = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}


@dataclass(frozen=True)
class Variant:
    """One build of the desktop app, and who should pick it (in a hobbyist's words)."""

    computer: str
    name: str
    note: str = ""


VARIANTS = (
    Variant("An NVIDIA graphics card (GeForce GTX 10xx, RTX, or newer)", "cuda"),
    Variant("An AMD Radeon or Intel Arc graphics card", "vulkan"),
    Variant("A Mac with Apple Silicon (M1 or newer)", "metal"),
    Variant("No graphics card, an Intel Mac, or not sure", "cpu",
            "works on every computer, just slower"),
)


def first_url(value: Any) -> str | None:
    """The first URL of a setting that may be unset, one URL, a comma-separated string, or a
    list of them; None when there is none."""
    if value is None:
        return None
    items: Iterable[Any] = value.split(",") if isinstance(value, str) else value
    try:
        for item in items:
            text = str(item).strip()
            if text:
                return text
    except TypeError:  # neither a string nor a list: not a URL setting we understand
        return None
    return None


def worker_url(public_url: Any, request_base_url: str) -> str:
    """The websocket URL workers should dial to reach this queen.

    From the first ``public_url`` when it is a usable http(s) or ws(s) URL (its path kept as a
    prefix, for a queen served under one), else from the request's base URL. The default port
    of the scheme is left out, as people would write it.
    """
    chosen = _as_worker_url(first_url(public_url))
    if chosen is not None:
        return chosen
    fallback = _as_worker_url(request_base_url)
    return fallback if fallback is not None else "ws://127.0.0.1:8000" + WORKER_PATH


def _as_worker_url(url: str | None) -> str | None:
    if not url:
        return None
    try:
        parts = urlsplit(url if "://" in url else "http://" + url)
        port = parts.port
    except ValueError:
        return None
    scheme = WS_SCHEMES.get(parts.scheme.lower())
    if scheme is None or not parts.hostname:
        return None
    host = parts.hostname.lower()
    if ":" in host:  # an IPv6 literal keeps its brackets
        host = f"[{host}]"
    default = 443 if scheme == "wss" else 80
    netloc = host if port in (None, default) else f"{host}:{port}"
    path = parts.path.rstrip("/")
    if not path.endswith(WORKER_PATH):
        path += WORKER_PATH
    return urlunsplit((scheme, netloc, path, "", ""))


def pay_sentence(terms: dict[str, Any]) -> str:
    """Whether this queen pays its workers, in one plain sentence (``reports.worker_terms``)."""
    if terms.get("open"):
        return ("This queen is open for demos: it serves requests for free, so it does not "
                "pay its workers.")
    if not terms.get("pays"):
        return "This queen keeps no ledger, so it does not pay its workers."
    share = round(float(terms.get("worker_share", 0)) * 100)
    threshold = int(terms.get("payout_threshold_sats", 0))
    if terms.get("mode") == "manual":
        sentence = (f"This queen pays its workers {share}% of what each job costs, in sats: "
                    f"its operator pays by hand what is due once a worker has earned "
                    f"{threshold:,} sats.")
    else:
        sentence = (f"This queen pays its workers {share}% of what each job costs, in sats "
                    f"over Lightning, automatically, once they have earned {threshold:,} sats "
                    "and set a payout address in the app.")
    note = terms.get("note")
    return f"{sentence} The operator says: {note}" if note else sentence
