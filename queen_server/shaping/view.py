"""The chat answer as a chat client sees it, handed to the API's shaper.

Between the relay (which keeps the books on the worker's chat-shaped frames) and the ``Shaper``
of the API the client called sits one ``ChatView`` per request. It stamps each chunk with the
queen's id, and when the request had tools it turns the grammar-constrained JSON the worker
wrote into OpenAI ``tool_calls`` (``shaping.tools``): per choice, incrementally for streams, at
once for whole answers. Without tools it adds nothing but the stamp: it runs for every token.
"""

from __future__ import annotations

from typing import Any

from queen_server.shaping.base import Event, Shaper
from queen_server.shaping.tools import CallStream, ToolPlan, answer_message
from shared_schema.answers import CHAT_CHUNK, STOP, AnswerStamp, chat_chunk, delta_choice


class ChatView:
    """One request's chat answer, stamped and with its tool calls, fed to ``shaper``."""

    __slots__ = ("_calls", "shaper", "stamp", "tools")

    def __init__(self, stamp: AnswerStamp, shaper: Shaper, tools: ToolPlan | None = None) -> None:
        self.stamp = stamp
        self.shaper = shaper
        self.tools = tools
        self._calls: dict[int, CallStream] = {}

    @property
    def sse_done(self) -> bool:
        return self.shaper.sse_done

    def opening(self) -> list[Event]:
        return self.shaper.opening()

    def chunk(self, data: dict[str, Any]) -> list[Event]:
        """Events for one relayed chunk (the relay has noted it already)."""
        self.stamp.stamp(data, CHAT_CHUNK)
        if self.tools is None or not data.get("choices"):
            return self.shaper.chunk(data)
        events: list[Event] = []
        for choice in data["choices"]:
            for piece in self._tool_chunks(choice):
                events.extend(self.shaper.chunk(self.stamp.stamp(piece, CHAT_CHUNK)))
        return events

    def _tool_chunks(self, choice: dict[str, Any]) -> list[dict[str, Any]]:
        """One choice of a worker's chunk (JSON text of the call format) as chat chunks with
        ``content`` or ``tool_calls`` deltas."""
        assert self.tools is not None
        index = choice.get("index", 0)
        calls = self._calls.get(index)
        if calls is None:
            calls = self._calls[index] = CallStream(self.tools)
        delta = choice.get("delta") or {}
        out: list[dict[str, Any]] = []
        if "role" in delta:
            out.append(chat_chunk([delta_choice({"role": delta["role"], "content": None},
                                                None, index)]))
        if delta.get("content"):
            out.extend(chat_chunk([delta_choice(piece, None, index)])
                       for piece in calls.feed(delta["content"]))
        finish_reason = choice.get("finish_reason")
        if finish_reason:
            last, reason = calls.finish(finish_reason)
            out.extend(chat_chunk([delta_choice(piece, None, index)]) for piece in last)
            out.append(chat_chunk([delta_choice({}, reason, index)]))
        return out

    def closing(self, usage: dict[str, int]) -> list[Event]:
        return self.shaper.closing(usage)

    def failed(self, error: dict[str, Any]) -> list[Event]:
        return self.shaper.failed(error)

    def whole(self, answer: dict[str, Any]) -> dict[str, Any]:
        """The plain answer: the stamped ``chat.completion`` (with usage), through the shaper."""
        if self.tools is not None:
            for choice in answer.get("choices") or []:
                message = choice.get("message") or {}
                choice["message"], choice["finish_reason"] = answer_message(
                    message.get("content") or "", self.tools,
                    choice.get("finish_reason") or STOP)
        return self.shaper.whole(answer)
