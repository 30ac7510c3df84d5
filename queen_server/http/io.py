"""Small HTTP edge helpers: bounded body reading, strict parsing, client disconnects."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from queen_server.errors import InvalidRequest, PayloadTooLarge
from shared_schema.openai_fields import FieldRule, refusal

M = TypeVar("M", bound=BaseModel)

_TYPE_WORDS = {"str", "int", "float", "bool", "none", "list", "dict"}


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing anything over ``limit`` bytes before or while reading it."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the request body is {declared} bytes; the limit is {limit}")
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise PayloadTooLarge(f"the request body is over the limit of {limit} bytes")
    return bytes(body)


def parse(model: type[M], body: bytes, fields: Mapping[str, FieldRule] | None = None) -> M:
    """Validate a JSON body, or raise a 400 that names the offending parameter.

    With ``fields`` (an OpenAI endpoint's list in ``shared_schema.openai_fields``), a field the
    model does not hold is refused with a 400 naming it: why, if OpenAI defines it, or that it
    is unrecognised. Without, unknown fields are ignored (Apiary's own admin bodies)."""
    if not body:
        raise InvalidRequest("the request body is empty; send a JSON object", code="invalid_json")
    try:
        if fields is None:
            return model.model_validate_json(body, extra="ignore")
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc, fields) from exc


def request_schema(model: type[BaseModel], **kwargs: Any) -> dict[str, Any]:
    """A body's JSON schema as ``parse`` reads bodies: unknown fields are ignored, not refused
    (so no ``additionalProperties: false``, which a strict ``WireModel``'s schema has)."""

    def lenient(node: Any) -> Any:
        if isinstance(node, dict):
            return {key: lenient(value) for key, value in node.items()
                    if not (key == "additionalProperties" and value is False)}
        if isinstance(node, list):
            return [lenient(value) for value in node]
        return node

    return lenient(model.model_json_schema(**kwargs))


def validation_error(
    exc: ValidationError, fields: Mapping[str, FieldRule] | None = None
) -> InvalidRequest:
    errors = exc.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return InvalidRequest(
            f"the request body is not valid JSON: {first['msg']}", code="invalid_json"
        )
    if fields is not None:
        # A field the queen does not honour is the clearest thing to say.
        extra = next((error for error in errors if error["type"] == "extra_forbidden"
                      and len(error["loc"]) == 1), None)
        if extra is None and first["type"] == "extra_forbidden":
            extra = first
        if extra is not None:
            param = param_name(extra["loc"]) or "the request body"
            if len(extra["loc"]) == 1:
                message, code = refusal(fields, param)
            else:
                message, code = f"Unrecognized request argument supplied: {param}", (
                    "unknown_parameter")
            return InvalidRequest(message, param=param, code=code)
    param = param_name(first["loc"])
    code = "missing_required_parameter" if first["type"] == "missing" else "invalid_value"
    where = f"'{param}'" if param else "the request body"
    message = first["msg"].removeprefix("Value error, ")  # a validator's own words
    return InvalidRequest(f"Invalid value for {where}: {message}", param=param, code=code)


def param_name(loc: Iterable[Any]) -> str | None:
    """``('messages', 0, 'role')`` -> ``messages.0.role``, without pydantic's union branch names."""
    parts: list[str] = []
    for part in loc:
        if isinstance(part, int):
            parts.append(str(part))
        elif (part in ("body", "query") and not parts) or part.startswith("type:"):
            continue
        elif part.lower() in _TYPE_WORDS or any(c in part for c in "[]-"):
            break
        else:
            parts.append(part)
    return ".".join(parts) or None


class ClientGone(Exception):
    """The HTTP client disconnected while its request was being served."""


class DisconnectGuard:
    """Cancels the request's task if the client disconnects inside the ``async with`` block.

    The block then raises ``ClientGone`` instead of ``CancelledError``, so the handler can clean
    up (the dispatcher sends ``cancel`` to the worker) and return quietly.
    """

    __slots__ = ("_gone", "_receive", "_task", "_watcher")

    def __init__(self, request: Request) -> None:
        self._receive = request.receive
        self._gone = False

    async def __aenter__(self) -> DisconnectGuard:
        self._task = asyncio.current_task()
        self._watcher = asyncio.create_task(self._watch())
        return self

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self._gone = True
        if self._task is not None:
            self._task.cancel()

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        # Drop the task: its CancelledError's traceback holds _watch's frame, which holds self,
        # so keeping the task here makes a reference cycle that only the GC can free.
        watcher, self._watcher = self._watcher, None
        watcher.cancel()
        if self._gone and exc_type is asyncio.CancelledError and self._task is not None:
            self._task.uncancel()
            raise ClientGone from exc
        return False
