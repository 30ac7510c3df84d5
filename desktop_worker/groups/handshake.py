"""The handshake on the path between a group's head and a member's gate (issue 19), sans-I/O.

llama.cpp's RPC server has no authentication, so each member puts a gate in front of it that
lets in only the head the queen named. The gate speaks first, with a fresh nonce; the head
answers with an HMAC of the group's one-time token over that nonce; the gate says yes or no.
Every line is ASCII (the answer is JSON), ends in ``\\n`` and is at most ``MAX_LINE`` bytes::

    gate -> head   APIARY-RPC/1 <64 hex digits: 32 random bytes>\\n
    head -> gate   {"group":"<group>","head":"<head>","mac":"<64 hex digits>"}\\n
    gate -> head   OK\\n                      (then raw RPC bytes both ways)
               or  NO <reason>\\n              (then the gate closes)

``mac = HMAC-SHA256(token, mac_message(group, head, nonce))``, where ``mac_message`` is
``b"apiary-rpc/1|" + group + b"|" + head + b"|" + nonce`` (names UTF-8, nonce raw). Names may
not contain ``|`` (nor spaces or control characters), so the layout is unambiguous. Reasons:
``bad_line``, ``wrong_group``, ``wrong_head``, ``bad_mac``, ``timeout``, ``busy``,
``unavailable``. A MAC is bound to one nonce, so an answer replayed on another connection fails.

Nothing here reads a socket or a clock: ``gate.py`` and ``dialer.py`` move the bytes, and a
relayed route (the queen's websocket) can reuse the same functions.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
from dataclasses import dataclass

from desktop_worker.errors import GroupCredentialsError, GroupLinkError, GroupLinkRefused

PROTOCOL = "APIARY-RPC/1"
MAC_CONTEXT = b"apiary-rpc/1"
NONCE_BYTES = 32
MIN_TOKEN_BYTES = 32
# The longest line either side reads, newline included; a longer one is refused, never kept.
MAX_LINE = 512
MAX_NAME = 128

OK_LINE = b"OK\n"
REFUSAL_REASONS = frozenset(
    {"bad_line", "wrong_group", "wrong_head", "bad_mac", "timeout", "busy", "unavailable"}
)

# Printable ASCII without space and without "|", the separator of the MAC's layout.
_NAME = re.compile(r"[\x21-\x7b\x7d\x7e]{1," + str(MAX_NAME) + "}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_REASON = re.compile(r"[a-z_]{1,32}")
_ANSWER_KEYS = frozenset({"group", "head", "mac"})


def check_token(token: bytes) -> bytes:
    """The token as given, or ``GroupCredentialsError`` when it is not bytes of 32 or more."""
    if not isinstance(token, bytes | bytearray):
        raise GroupCredentialsError("a group token must be bytes")
    if len(token) < MIN_TOKEN_BYTES:
        raise GroupCredentialsError(
            f"a group token must be at least {MIN_TOKEN_BYTES} bytes (got {len(token)})"
        )
    return bytes(token)


def check_name(kind: str, name: str) -> str:
    """A group or head name as given, or ``GroupCredentialsError`` naming what is wrong."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise GroupCredentialsError(
            f"a {kind} name must be 1-{MAX_NAME} printable ASCII characters "
            f"without spaces or '|' (got {name!r:.60})"
        )
    return name


def mac_message(group: str, head: str, nonce: bytes) -> bytes:
    """The exact bytes the MAC covers; both sides build them here and nowhere else."""
    check_name("group", group)
    check_name("head", head)
    if len(nonce) != NONCE_BYTES:
        raise GroupCredentialsError(f"a nonce is {NONCE_BYTES} bytes (got {len(nonce)})")
    return b"|".join((MAC_CONTEXT, group.encode("ascii"), head.encode("ascii"), nonce))


def mac(token: bytes, group: str, head: str, nonce: bytes) -> bytes:
    """HMAC-SHA256 of ``mac_message`` under the group's token (32 raw bytes)."""
    return hmac.new(check_token(token), mac_message(group, head, nonce), hashlib.sha256).digest()


@dataclass(frozen=True)
class Challenge:
    """The gate's opening line: one fresh nonce per connection."""

    nonce: bytes

    @classmethod
    def new(cls) -> Challenge:
        return cls(secrets.token_bytes(NONCE_BYTES))

    def line(self) -> bytes:
        return f"{PROTOCOL} {self.nonce.hex()}\n".encode("ascii")

    @classmethod
    def parse(cls, line: bytes) -> Challenge:
        """Reads the gate's line, or ``GroupLinkError`` (another protocol, a bad nonce)."""
        text = _line_text(line)
        if text is None:
            raise GroupLinkError("the member's gate sent no valid challenge line")
        version, _, nonce_hex = text.partition(" ")
        if version != PROTOCOL:
            raise GroupLinkError(
                f"the member's gate speaks {version[:32]!r}, this head speaks {PROTOCOL!r}"
            )
        if not _HEX64.fullmatch(nonce_hex):
            raise GroupLinkError("the member's gate sent a malformed nonce")
        return cls(bytes.fromhex(nonce_hex))


def answer(token: bytes, group: str, head: str, challenge_line: bytes) -> bytes:
    """The head's answer line to the gate's challenge line."""
    nonce = Challenge.parse(challenge_line).nonce
    body = {"group": group, "head": head, "mac": mac(token, group, head, nonce).hex()}
    return json.dumps(body, separators=(",", ":")).encode("ascii") + b"\n"


@dataclass(frozen=True)
class Verdict:
    """The gate's decision on one answer: ``reason`` is None when the head is let in."""

    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.reason is None

    def line(self) -> bytes:
        """What the gate sends back: ``OK\\n`` or ``NO <reason>\\n``."""
        return OK_LINE if self.reason is None else refusal_line(self.reason)


def verify(token: bytes, group: str, head: str, nonce: bytes, answer_line: bytes) -> Verdict:
    """The gate's check of the head's answer to ``nonce``, against the group and head the
    queen named. The MAC is compared in constant time; a malformed answer is ``bad_line``."""
    text = _line_text(answer_line)
    if text is None:
        return Verdict("bad_line")
    try:
        body = json.loads(text)
    except ValueError:
        return Verdict("bad_line")
    if not isinstance(body, dict) or set(body) != _ANSWER_KEYS:
        return Verdict("bad_line")
    if not all(isinstance(body[key], str) for key in _ANSWER_KEYS):
        return Verdict("bad_line")
    if not _HEX64.fullmatch(body["mac"]):
        return Verdict("bad_line")
    if body["group"] != group:
        return Verdict("wrong_group")
    if body["head"] != head:
        return Verdict("wrong_head")
    expected = mac(token, group, head, nonce)
    if not hmac.compare_digest(expected, bytes.fromhex(body["mac"])):
        return Verdict("bad_mac")
    return Verdict()


def refusal_line(reason: str) -> bytes:
    if reason not in REFUSAL_REASONS:
        raise ValueError(f"unknown refusal reason {reason!r}")
    return f"NO {reason}\n".encode("ascii")


def read_reply(line: bytes) -> None:
    """The head's reading of the gate's last line: returns on ``OK``, raises
    ``GroupLinkRefused(reason)`` on ``NO <reason>`` and ``GroupLinkError`` on anything else."""
    text = _line_text(line)
    if text == "OK":
        return
    if text is not None and text.startswith("NO "):
        reason = text[3:]
        if _REASON.fullmatch(reason):
            raise GroupLinkRefused(reason)
    raise GroupLinkError("the member's gate answered the handshake with an unreadable line")


class LineTooLong(GroupLinkError):
    """A handshake line passed ``MAX_LINE`` bytes without a newline."""


class LineBuffer:
    """Collects bytes until one line, bounded by ``MAX_LINE``.

    ``feed`` returns the line (newline included) once it is whole and keeps whatever came after
    it in ``rest``: those are the first bytes of the stream that follows the handshake and must
    be passed on, not dropped. Past ``MAX_LINE`` bytes without a newline it raises
    ``LineTooLong`` and keeps nothing more.
    """

    def __init__(self, limit: int = MAX_LINE) -> None:
        self._limit = limit
        self._buffer = bytearray()
        self.rest = b""

    def feed(self, data: bytes) -> bytes | None:
        self._buffer += data
        end = self._buffer.find(b"\n", 0, self._limit)
        if end < 0:
            if len(self._buffer) >= self._limit:
                self._buffer.clear()
                raise LineTooLong(f"a handshake line is longer than {self._limit} bytes")
            return None
        line = bytes(self._buffer[: end + 1])
        self.rest = bytes(self._buffer[end + 1 :])
        self._buffer.clear()
        return line

    @property
    def read_size(self) -> int:
        """How much to ask the stream for next: never more than the line can still hold."""
        return max(1, self._limit - len(self._buffer))


def _line_text(line: bytes) -> str | None:
    """The line without its newline, if it is one bounded line of printable ASCII."""
    if len(line) > MAX_LINE or not line.endswith(b"\n"):
        return None
    body = line[:-1]
    if b"\n" in body:
        return None
    try:
        text = body.decode("ascii")
    except UnicodeDecodeError:
        return None
    if not text.isprintable():
        return None
    return text
