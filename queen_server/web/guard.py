"""The admin login's guards: a rate limit on wrong tokens, the cookie's ``Secure`` decision, and
the ``Origin`` check on state-changing requests that a session cookie authenticates.

All three decide from plain values (an address, a clock, header strings), so they are tested
without a server; ``session.py`` and ``pages.py`` feed them the request's parts.

Why each exists: the admin token is the key to every balance, so guessing it must be slow (a
token bucket per client address, plus one for all addresses together so that many addresses
cannot guess faster than that); the cookie must not travel over plain http when the operator
serves the pages over https through a proxy; and a browser sends the cookie along with any
site's form POST, so a cookie alone does not show that this queen's own page made the request
(the cookie's ``SameSite=lax`` stops most of that; the ``Origin`` check stops the rest, such as
a sibling subdomain, which counts as the same site).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

WINDOW_S = 60.0
MAX_ADDRESSES = 10_000
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
DEFAULT_PORTS = {"http": 80, "https": 443}

CookieSecure = Literal["auto", "always", "never"]


@dataclass
class _Bucket:
    tokens: float
    updated: float


class _TokenBucket:
    """``capacity`` failures at once, refilled at ``capacity`` per ``window_s``."""

    def __init__(self, capacity: int, window_s: float) -> None:
        self.capacity = float(capacity)
        self.rate = capacity / window_s

    def refill(self, bucket: _Bucket, now: float) -> None:
        bucket.tokens = min(self.capacity, bucket.tokens + (now - bucket.updated) * self.rate)
        bucket.updated = now

    def wait_s(self, bucket: _Bucket) -> float:
        """Seconds until ``bucket`` (refilled) holds one token; 0 when it holds one now."""
        return 0.0 if bucket.tokens >= 1 else (1 - bucket.tokens) / self.rate


class LoginLimiter:
    """Counts wrong admin tokens per client address, and over all addresses.

    ``retry_after(address)`` says whether an attempt may be checked at all (None) or how many
    seconds to wait; ``failed(address)`` records a wrong token. Both are O(1). Memory is bounded:
    at most ``max_addresses`` addresses are remembered, the least recently seen forgotten first
    (forgetting one lets it start afresh, which the overall bucket still bounds).
    """

    def __init__(self, per_address: int, overall: int, *, window_s: float = WINDOW_S,
                 max_addresses: int = MAX_ADDRESSES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.per_address = _TokenBucket(per_address, window_s)
        self.overall = _TokenBucket(overall, window_s)
        self.max_addresses = max_addresses
        self.clock = clock
        self._addresses: OrderedDict[str, _Bucket] = OrderedDict()
        self._all = _Bucket(float(overall), clock())

    def __len__(self) -> int:
        return len(self._addresses)

    def retry_after(self, address: str) -> float | None:
        """None when an attempt from ``address`` may be checked now, else seconds to wait."""
        now = self.clock()
        self.overall.refill(self._all, now)
        wait = self.overall.wait_s(self._all)
        bucket = self._addresses.get(address)
        if bucket is not None:
            self.per_address.refill(bucket, now)
            wait = max(wait, self.per_address.wait_s(bucket))
        return wait or None

    def failed(self, address: str) -> None:
        """Record a wrong token from ``address``."""
        now = self.clock()
        self.overall.refill(self._all, now)
        self._all.tokens = max(0.0, self._all.tokens - 1)
        bucket = self._addresses.get(address)
        if bucket is None:
            bucket = _Bucket(self.per_address.capacity, now)
            self._addresses[address] = bucket
            if len(self._addresses) > self.max_addresses:
                self._addresses.popitem(last=False)
        else:
            self._addresses.move_to_end(address)
            self.per_address.refill(bucket, now)
        bucket.tokens = max(0.0, bucket.tokens - 1)


def retry_after_header(wait_s: float) -> str:
    """``Retry-After`` in whole seconds, never 0 (a client would retry at once)."""
    return str(max(1, math.ceil(wait_s)))


def cookie_secure(mode: CookieSecure, scheme: str) -> bool:
    """Whether the session cookie gets ``Secure``: by the operator's setting, or in "auto" by
    the scheme the request came over (uvicorn sets it from a trusted proxy's
    ``X-Forwarded-Proto``)."""
    if mode == "always":
        return True
    if mode == "never":
        return False
    return scheme == "https"


def origin_of(url: str | None) -> tuple[str, str, int] | None:
    """``url``'s origin as (scheme, host, port), ports made explicit; None when it has none
    (missing, ``null``, not http(s), or unparsable)."""
    if not url:
        return None
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS or not parts.hostname:
        return None
    return scheme, parts.hostname.lower(), port or DEFAULT_PORTS[scheme]


def claimed_origin(origin: str | None, referer: str | None) -> str | None:
    """The origin a browser says the request comes from: ``Origin``, else ``Referer``'s."""
    if origin is not None:
        return origin
    return referer


def same_origin(claimed: str | None, own_url: str, *, required: bool) -> bool:
    """Whether a request claiming ``claimed`` (an ``Origin`` or ``Referer`` value, or None)
    may change state on the queen at ``own_url``.

    A claim must name exactly the queen's own origin. With none, the answer is ``not required``:
    required where a cookie authenticates (a browser always sends ``Origin`` on a POST), not
    where a script without cookies logs in or out.
    """
    if claimed is None:
        return not required
    own = origin_of(own_url)
    return own is not None and origin_of(claimed) == own


def changes_state(method: str) -> bool:
    return method.upper() not in SAFE_METHODS
