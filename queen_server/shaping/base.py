"""The shaper: what one API makes of the chat-shaped answer the swarm delivers.

Workers answer every generation job in chat shapes (``chat.completion.chunk`` pieces, or a whole
``chat.completion``); the queen's relay keeps the books on those. Between the relay and the
client sits one ``Shaper`` per request, which turns them into the answer of the API the client
called. A shaper sees the chat answer as a chat client would: stamped with the queen's id, and
with tool calls already turned from the grammar's JSON into ``tool_calls``
(``shaping.tools``). Shapers are pure (no I/O) and one per request, so they may keep state.
"""

from __future__ import annotations

from typing import Any, Protocol

# One server-sent event: its ``event:`` name (None: a plain ``data:`` event) and its data.
Event = tuple[str | None, dict[str, Any]]


class Shaper(Protocol):
    """One request's answer, in the shape of the API the client called."""

    @property
    def sse_done(self) -> bool:
        """Whether a stream ends with ``data: [DONE]`` (chat and text completions do; the
        Responses API's streams end with their ``response.completed`` event)."""
        ...

    def opening(self) -> list[Event]:
        """Events sent before the first chunk (once the first worker frame has arrived)."""
        ...

    def chunk(self, chunk: dict[str, Any]) -> list[Event]:
        """Events for one stamped ``chat.completion.chunk`` (content, tool-call fragments,
        logprobs, a choice's finish)."""
        ...

    def closing(self, usage: dict[str, int]) -> list[Event]:
        """Events after the last chunk of an answer that ended well; ``usage`` is the billed
        usage (``prompt_tokens``, ``completion_tokens``, ``total_tokens``)."""
        ...

    def failed(self, error: dict[str, Any]) -> list[Event]:
        """Events that end a broken stream; ``error`` is OpenAI's ``{"error": {...}}`` body."""
        ...

    def whole(self, answer: dict[str, Any]) -> dict[str, Any]:
        """The plain (non-streamed) answer, from the whole stamped ``chat.completion`` (with
        ``usage``, tool calls already converted)."""
        ...
