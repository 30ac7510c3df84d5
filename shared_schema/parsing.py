"""Checked parsing of the frames a worker sends outside ``decode``: a v1 hello and a legacy
registration, read from a JSON object the queen has already looked into, and a legacy answer's
usage. Every failure is a ``ProtocolError``, so that the queen's link machine
(``queen_server.swarm.link``) refuses or answers it without knowing pydantic.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from shared_schema.errors import ProtocolError
from shared_schema.legacy import LegacyRegistration
from shared_schema.openai_types import Usage
from shared_schema.protocol import Hello


def parse_hello(body: dict[str, Any]) -> Hello:
    """The hello in ``body`` (unknown fields ignored); ``ProtocolError`` ``invalid_message``."""
    try:
        return Hello.model_validate(body, extra="ignore")
    except ValidationError as exc:
        raise ProtocolError("invalid_message", first_error(exc)) from exc


def parse_registration(body: dict[str, Any]) -> LegacyRegistration:
    """A legacy worker's registration, the wiki's or the real workerbee's (read its size as
    ``vram_mb``: the workerbee sends bytes); ``ProtocolError`` ``invalid_message`` if it is not
    one, or claims more than any machine holds."""
    try:
        return LegacyRegistration.model_validate(body, extra="ignore")
    except ValidationError as exc:
        raise ProtocolError("invalid_message", first_error(exc)) from exc


def legacy_usage(answer: dict[str, Any]) -> Usage:
    """The usage of a legacy worker's answer: zero when it has none, or none that is valid."""
    try:
        return Usage.model_validate(answer.get("usage"), extra="ignore")
    except ValidationError:
        return Usage(prompt_tokens=0, total_tokens=0)


def first_error(exc: ValidationError) -> str:
    """The first thing wrong, as ``where: what`` (a refusal's reason)."""
    first = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in first["loc"]) or "hello"
    return f"{where}: {first['msg']}"
