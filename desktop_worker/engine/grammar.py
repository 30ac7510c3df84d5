"""Structured output: a ``response_format`` as a llama.cpp grammar (GBNF).

``json_object`` uses the JSON grammar llama-cpp-python ships (any JSON object, whitespace
bounded so a small model cannot run off into blank lines); ``json_schema`` goes through
llama-cpp-python's schema converter. A schema the converter cannot handle (it raises, asserts,
or writes a grammar llama.cpp refuses) is the client's ``invalid_request``, never a crash: the
grammar text is parsed by llama.cpp in ``SamplerChain``, which reports a refusal as ``None``.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

from desktop_worker.errors import UnsupportedRequest

log = logging.getLogger(__name__)

GRAMMAR_ROOT = "root"
# An integer range with at most this many values becomes an enum (the converter ignores
# minimum/maximum, so the grammar would allow any integer).
MAX_ENUM_RANGE = 1024


def bounded_integers(schema: Any) -> Any:
    """``schema`` with each small bounded integer range (``minimum``/``maximum`` and their
    exclusive forms) written as an ``enum`` of its values, which the converter does honour."""
    if isinstance(schema, list):
        return [bounded_integers(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: bounded_integers(value) for key, value in schema.items()}
    if out.get("type") != "integer":
        return out
    low, high = _bound(out, "minimum", "exclusiveMinimum", 1), _bound(
        out, "maximum", "exclusiveMaximum", -1)
    if low is None or high is None or high < low or high - low >= MAX_ENUM_RANGE:
        return out
    kept = {key: value for key, value in out.items() if key not in (
        "type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")}
    return {**kept, "enum": list(range(low, high + 1))}


def _bound(schema: dict[str, Any], inclusive: str, exclusive: str, step: int) -> int | None:
    """The inclusive integer bound a schema sets on one side, or None."""
    values = []
    if isinstance(schema.get(inclusive), int | float) and not isinstance(
            schema.get(inclusive), bool):
        value = schema[inclusive]
        values.append(math.ceil(value) if step > 0 else math.floor(value))
    if isinstance(schema.get(exclusive), int | float) and not isinstance(
            schema.get(exclusive), bool):
        value = schema[exclusive]
        values.append(math.floor(value) + 1 if step > 0 else math.ceil(value) - 1)
    if not values:
        return None
    return max(values) if step > 0 else min(values)


def grammar_text(response_format: dict[str, Any] | None) -> str | None:
    """The GBNF grammar a ``response_format`` asks for, or None for free text."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "json_object":
        return JSON_GBNF
    if kind != "json_schema":
        return None
    spec = response_format.get("json_schema") or {}
    schema = spec.get("schema") or {}
    try:
        return json_schema_to_gbnf(json.dumps(bounded_integers(schema)))
    except RecursionError:
        raise UnsupportedRequest("the response_format schema nests too deeply to become a "
                                 "grammar") from None
    except Exception as exc:  # the converter raises ValueError, KeyError, AssertionError...
        log.info("schema not convertible: %s: %s", type(exc).__name__, exc)
        detail = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise UnsupportedRequest("this worker cannot turn the response_format schema into a "
                                 f"grammar ({detail})") from None
