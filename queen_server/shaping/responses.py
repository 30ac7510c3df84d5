"""The Responses API (``POST /v1/responses``) over the swarm's chat shapes.

Going in, ``chat_request`` translates a ``ResponsesRequest`` into the chat completion request
the rest of the queen already serves (instructions as the first system message, input items
as chat messages, function calls as ``tool_calls`` and their outputs as ``tool`` messages).
Coming out, ``ResponsesShaper`` turns the chat answer into a ``response`` object, or a stream
of ``response.*`` events: each event named in its SSE ``event:`` line and in its data's
``type``, numbered by ``sequence_number`` from 0, with the item ids, ``output_index`` and
``content_index`` the openai SDK's stream accumulator follows. Only choice 0 exists here
(the Responses API has no ``n``).

An answer cut off by its token limit has status ``incomplete`` with
``incomplete_details.reason == "max_output_tokens"``, as OpenAI's. Streamed, it still ends with
``response.completed`` (carrying that status), not with the ``response.incomplete`` event
OpenAI sends: the openai SDK's ``responses.stream().get_final_response()`` raises "Didn't
receive a `response.completed` event" after ``response.incomplete`` (openai-python PR #3538,
open), and clients reading events by type still see the status in the final response. A broken
stream ends with ``response.failed`` and then an ``error`` event whose data carries an
``error`` object, which the SDK raises.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from queen_server.shaping.base import Event
from shared_schema.openai_requests import ChatCompletionRequest
from shared_schema.responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    InputMessage,
    ResponsesRequest,
    TextFormatJsonSchema,
    part_texts,
)

logger = logging.getLogger(__name__)

# The codes a ``response.error`` may carry (the SDK's ResponseError.code); others map to these.
_RESPONSE_ERROR_CODES = frozenset({"server_error", "rate_limit_exceeded", "invalid_prompt"})


# --- request ------------------------------------------------------------------------------------


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that asks the swarm for what ``req`` asks."""
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req),
                            "stream": req.stream}
    optional = {
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "parallel_tool_calls": req.parallel_tool_calls,
        "user": req.user,
        "safety_identifier": req.safety_identifier,
        "prompt_cache_key": req.prompt_cache_key,
        "service_tier": req.service_tier,
    }
    body.update({key: value for key, value in optional.items() if value is not None})
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, TextFormatJsonSchema):
        spec: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema_}
        spec.update({key: value for key, value in (("description", fmt.description),
                                                   ("strict", fmt.strict)) if value is not None})
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    if req.tools:
        body["tools"] = [{"type": "function", "function": tool.model_dump(
            exclude={"type"}, exclude_none=True)} for tool in req.function_tools]
    if isinstance(req.tool_choice, FunctionChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    return ChatCompletionRequest.model_validate(body)


def chat_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages. Function calls join the assistant turn just before
    them (the prose of the same answer) or start one; each output is a ``tool`` message."""
    messages: list[dict[str, Any]] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    for item in req.items:
        if isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _chat_content(item.output)})
        elif isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": _chat_content(item.content)})
    return messages


def _chat_content(content: str | list[Any]) -> str | list[dict[str, str]]:
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": text} for text in part_texts(content)]


# --- answer -------------------------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def new_response_id() -> str:
    """A fresh ``resp_...`` id for a ``ResponsesShaper``."""
    return _new_id("resp")


def response_usage(usage: dict[str, int] | None) -> dict[str, Any] | None:
    """Chat usage in the Responses API's names, with the detail objects the SDK requires."""
    if usage is None:
        return None
    prompt = int(usage.get("prompt_tokens", 0))
    completion = int(usage.get("completion_tokens", 0))
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": int(usage.get("total_tokens", prompt + completion)),
    }


def _response_error(error: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's ``{"error": {...}}`` body as a response's ``error`` (whose code is one of a
    fixed list)."""
    body = error.get("error", error)
    code = body.get("code")
    if code not in _RESPONSE_ERROR_CODES:
        code = "invalid_prompt" if body.get("type") == "invalid_request_error" else "server_error"
    return {"code": code, "message": str(body.get("message") or "the answer failed")}


@dataclass
class _Item:
    """One output item as it is built: a message's text or a call's arguments."""

    kind: str  # "message" | "function_call"
    output_index: int
    id: str
    text: str = ""
    call_id: str = ""
    name: str = ""
    status: str = "in_progress"

    def as_dict(self) -> dict[str, Any]:
        if self.kind == "message":
            content = [] if self.status == "in_progress" else [self.part()]
            return {"id": self.id, "type": "message", "role": "assistant",
                    "status": self.status, "content": content}
        return {"id": self.id, "type": "function_call", "call_id": self.call_id,
                "name": self.name, "arguments": self.text, "status": self.status}

    def part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}


@dataclass
class ResponsesShaper:
    """One request's answer as a Responses API ``response`` or its stream of events."""

    req: ResponsesRequest
    response_id: str
    created_at: int | float
    clock: Callable[[], float] = time.time
    _seq: int = field(default=0, init=False)
    _items: list[_Item] = field(default_factory=list, init=False)
    _open: _Item | None = field(default=None, init=False)
    _calls: dict[int, _Item] = field(default_factory=dict, init=False)  # by chat call index
    _finish: str | None = field(default=None, init=False)

    @property
    def sse_done(self) -> bool:
        return False

    # --- whole answers ------------------------------------------------------------------------

    def whole(self, answer: dict[str, Any]) -> dict[str, Any]:
        choice = next((c for c in answer.get("choices") or [] if c.get("index", 0) == 0), {})
        message = choice.get("message") or {}
        incomplete = choice.get("finish_reason") == "length"
        status = "incomplete" if incomplete else "completed"
        items: list[_Item] = []
        content = message.get("content")
        calls = message.get("tool_calls") or []
        if content or not calls:
            items.append(_Item("message", 0, _new_id("msg"), text=content or "", status=status))
        for call in calls:
            function = call.get("function") or {}
            items.append(_Item("function_call", len(items), _new_id("fc"),
                               text=function.get("arguments") or "", call_id=call.get("id", ""),
                               name=function.get("name", ""), status="completed"))
        return self._response(status, [item.as_dict() for item in items],
                              usage=response_usage(answer.get("usage")))

    # --- streams ------------------------------------------------------------------------------

    def opening(self) -> list[Event]:
        snapshot = self._response("in_progress", [])
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def chunk(self, chunk: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue  # the Responses API has one answer; no other choice is asked for
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return events

    def closing(self, usage: dict[str, int]) -> list[Event]:
        incomplete = self._finish == "length"
        events: list[Event] = []
        if not self._items:  # an empty answer is still one (empty) message, as whole() gives
            events += self._open_message()
        events += self._close_open("incomplete" if incomplete else "completed")
        status = "incomplete" if incomplete else "completed"
        response = self._response(status, [item.as_dict() for item in self._items],
                                  usage=response_usage(usage))
        return [*events, self._event("response.completed", response=response)]

    def failed(self, error: dict[str, Any]) -> list[Event]:
        body = error.get("error", error)
        for item in self._items:
            if item.status == "in_progress":
                item.status = "incomplete"
        response = self._response("failed", [item.as_dict() for item in self._items],
                                  error=_response_error(error))
        return [
            self._event("response.failed", response=response),
            # The SDK raises on a stream event whose data has an "error" object.
            self._event("error", code=body.get("code"), message=str(body.get("message") or ""),
                        param=body.get("param"), error=body),
        ]

    # --- the pieces ---------------------------------------------------------------------------

    def _text(self, text: str) -> list[Event]:
        events: list[Event] = []
        item = self._open
        if item is None or item.kind != "message":
            events += self._close_open("completed")
            events += self._open_message()
            item = self._open
        assert item is not None
        item.text += text
        events.append(self._event("response.output_text.delta", item_id=item.id,
                                  output_index=item.output_index, content_index=0, delta=text,
                                  logprobs=[]))
        return events

    def _call(self, call: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        index = int(call.get("index", 0))
        item = self._calls.get(index)
        function = call.get("function") or {}
        if item is None:
            events += self._close_open("completed")
            item = _Item("function_call", len(self._items), _new_id("fc"),
                         call_id=call.get("id") or _new_id("call"),
                         name=function.get("name") or "")
            self._items.append(item)
            self._calls[index] = item
            self._open = item
            events.append(self._event("response.output_item.added",
                                      output_index=item.output_index, item=item.as_dict()))
        arguments = function.get("arguments") or ""
        if not arguments:
            return events
        item.text += arguments
        if item is self._open:
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=item.id, output_index=item.output_index,
                                      delta=arguments))
        else:  # calls arrive one after another; a late fragment still reaches the response
            logger.warning("arguments for call %d after a later output item began", index)
        return events

    def _open_message(self) -> list[Event]:
        item = _Item("message", len(self._items), _new_id("msg"))
        self._items.append(item)
        self._open = item
        return [
            self._event("response.output_item.added", output_index=item.output_index,
                        item=item.as_dict()),
            self._event("response.content_part.added", item_id=item.id,
                        output_index=item.output_index, content_index=0,
                        part={**item.part(), "text": ""}),
        ]

    def _close_open(self, status: str) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        where = {"item_id": item.id, "output_index": item.output_index}
        if item.kind == "message":
            events = [
                self._event("response.output_text.done", **where, content_index=0,
                            text=item.text, logprobs=[]),
                self._event("response.content_part.done", **where, content_index=0,
                            part=item.part()),
            ]
        else:
            events = [self._event("response.function_call_arguments.done", **where,
                                  name=item.name, arguments=item.text)]
        events.append(self._event("response.output_item.done", output_index=item.output_index,
                                  item=item.as_dict()))
        return events

    def _event(self, kind: str, /, **data: Any) -> Event:
        event = (kind, {"type": kind, "sequence_number": self._seq, **data})
        self._seq += 1
        return event

    def _response(self, status: str, output: list[dict[str, Any]], *,
                  usage: dict[str, Any] | None = None,
                  error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The ``response`` object, echoing the request's settings as OpenAI does."""
        req = self.req
        fmt = req.text.format if req.text is not None else None
        response: dict[str, Any] = {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": req.model,
            "output": output,
            "parallel_tool_calls": (req.parallel_tool_calls
                                    if req.parallel_tool_calls is not None else True),
            "previous_response_id": None,
            "reasoning": None,
            "service_tier": "default",
            "store": False,
            "temperature": req.temperature if req.temperature is not None else 1.0,
            "text": {"format": (fmt.model_dump(by_alias=True, exclude_none=True)
                                if fmt is not None else {"type": "text"})},
            "tool_choice": (req.tool_choice.model_dump()
                            if isinstance(req.tool_choice, FunctionChoice)
                            else req.tool_choice or "auto"),
            "tools": [tool.model_dump(exclude_none=True) for tool in req.function_tools],
            "top_p": req.top_p if req.top_p is not None else 1.0,
            "truncation": "disabled",
            "usage": usage,
            "user": req.user,
            "safety_identifier": req.safety_identifier,
            "prompt_cache_key": req.prompt_cache_key,
            "metadata": {},
        }
        if status == "completed":
            response["completed_at"] = self.clock()
        return response
