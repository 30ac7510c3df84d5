"""Chat completions (``POST /v1/chat/completions``): the swarm's chat shapes are the answer.

Workers already answer in ``chat.completion.chunk`` / ``chat.completion`` shapes and the relay
stamps them with the queen's id, so this shaper passes them on as they are. What it adds is the
stream's end: the usage chunk a client asked for with ``stream_options.include_usage`` (OpenAI's:
no choices, the usage), and the error event of a broken stream.
"""

from __future__ import annotations

from typing import Any

from queen_server.shaping.base import Event
from shared_schema.answers import CHAT_CHUNK, AnswerStamp, usage_chunk


class ChatShaper:
    """One chat request's answer, passed through; the usage chunk carries the request's
    ``stamp`` (the queen's id, creation time and the client's model name)."""

    __slots__ = ("_include_usage", "_stamp")

    def __init__(self, include_usage: bool, stamp: AnswerStamp) -> None:
        self._include_usage = include_usage
        self._stamp = stamp

    @property
    def sse_done(self) -> bool:
        return True

    def opening(self) -> list[Event]:
        return []

    def chunk(self, chunk: dict[str, Any]) -> list[Event]:
        return [(None, chunk)]  # runs for every token: nothing but the event

    def closing(self, usage: dict[str, int]) -> list[Event]:
        if not self._include_usage:
            return []
        return [(None, self._stamp.stamp(usage_chunk(dict(usage)), CHAT_CHUNK))]

    def failed(self, error: dict[str, Any]) -> list[Event]:
        return [(None, error)]

    def whole(self, answer: dict[str, Any]) -> dict[str, Any]:
        return answer
