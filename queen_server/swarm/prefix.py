"""Prompt caches across jobs (issue 36): whose cache a job may use, and which worker holds a
conversation's prefix.

A worker keeps the tokens it computed for a prompt and reuses the longest cached prefix of the
next one. A cached prefix answers faster, which is a timing side channel: a developer must never
learn from a first token's time what another sent. So every job carries its caller's *cache
scope* (``Job.cache_scope``), and a worker reuses a prefix only between jobs of the same scope.
The scope is the first 32 hex digits of an HMAC-SHA256 of the caller (an API key's id, a
development key's hash, an open queen's client address: ``http.generation.caller_of``) under a
secret of this queen's (``CacheScopes``): a worker can neither tell who the caller is nor link
one caller's scopes across queens, and no request field can choose it.

The next turn of a chat resends the whole history, so the worker that answered the last turn
holds all of it but the new message. ``PrefixAffinity`` remembers, for each answered turn, the
hash of its conversation with the answer appended (``conversation_key``) and the worker that
served it, in a bounded LRU; the next turn's leading messages hash to the same key, and routing
tries that worker first when it is free (``routing.rank``'s ``prefer``). A canonical form keeps
the hash stable: each message's role and text only (content parts' text joined), every field
length-prefixed, under the scope and the model, fed to the hash as it goes (a few times cheaper
than a JSON text of the same). O(the request's size), never O(workers).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from queen_server.swarm.metering import content_text

# What the HMAC of a scope signs before the caller: the secret may serve other purposes later.
SCOPE_LABEL = b"apiary prompt-cache scope v1\x00"
SCOPE_HEX = 32  # digits of the HMAC kept: 128 bits (``protocol.CACHE_SCOPE``)
SECRET_BYTES = 32


class CacheScopes:
    """Callers' prompt-cache scopes under one secret (``secret``: this queen's, shared by its
    replicas; a random one until it is set)."""

    __slots__ = ("secret",)

    def __init__(self, secret: bytes | None = None) -> None:
        self.secret = secret if secret is not None else secrets.token_bytes(SECRET_BYTES)

    def of(self, caller: str) -> str:
        """The scope of ``caller``: 32 lowercase hex digits."""
        mac = hmac.new(self.secret, SCOPE_LABEL + caller.encode("utf-8", "surrogatepass"),
                       hashlib.sha256)
        return mac.hexdigest()[:SCOPE_HEX]


def conversation_key(scope: str | None, model: str, messages: Iterable[Any],
                     answer: str | None = None) -> bytes:
    """The sha256 of a conversation's canonical form: ``scope``, ``model``, then each of
    ``messages``' role and text (anything not a message counts as an empty one), then the
    ``answer`` as an assistant message if given; every field length-prefixed, so that no two
    conversations share a form."""
    digest = hashlib.sha256()
    _field(digest, scope or "")
    _field(digest, model)
    for message in messages:
        if isinstance(message, Mapping):
            _field(digest, str(message.get("role")))
            _field(digest, content_text(message.get("content")))
        else:
            _field(digest, "")
            _field(digest, "")
    if answer is not None:
        _field(digest, "assistant")
        _field(digest, answer)
    return digest.digest()


def _field(digest: Any, text: str) -> None:
    data = text.encode("utf-8", "surrogatepass")
    digest.update(len(data).to_bytes(8, "little"))
    digest.update(data)


def chat_messages(openai_req: Mapping[str, Any]) -> Sequence[Any] | None:
    """A chat job's messages, or None for any other job."""
    messages = openai_req.get("messages")
    return messages if isinstance(messages, list) and messages else None


class PrefixAffinity:
    """Conversation key -> the key of the worker that served its last turn, the
    ``max_entries`` most recently used (0: none kept)."""

    __slots__ = ("_entries", "max_entries")

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def remember(self, key: bytes, worker_key: str) -> None:
        """``worker_key`` served the turn that ends ``key``'s conversation: the oldest entry
        goes when the map is full."""
        if self.max_entries <= 0:
            return
        entries = self._entries
        entries[key] = worker_key
        entries.move_to_end(key)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)

    def worker_for(self, key: bytes) -> str | None:
        """The worker that holds the conversation ``key`` ends, if remembered."""
        worker_key = self._entries.get(key)
        if worker_key is not None:
            self._entries.move_to_end(key)
        return worker_key

    def next_turn(self, scope: str | None, model: str, openai_req: Mapping[str, Any]
                  ) -> str | None:
        """For a chat job: the worker that served the turn its messages but the last one end
        with, if remembered. None for a first turn or any other job."""
        if self.max_entries <= 0 or not self._entries:
            return None
        messages = chat_messages(openai_req)
        if messages is None or len(messages) < 2:
            return None
        return self.worker_for(conversation_key(scope, model, messages[:-1]))

    def served(self, scope: str | None, model: str, openai_req: Mapping[str, Any], answer: str,
               worker_key: str) -> None:
        """A chat job's one answer, ``answer``, came whole from the worker of ``worker_key``:
        its next turn goes back there when it can."""
        messages = chat_messages(openai_req)
        if messages is not None and self.max_entries > 0:
            self.remember(conversation_key(scope, model, messages, answer), worker_key)
