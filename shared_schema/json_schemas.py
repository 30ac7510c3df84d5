"""JSON Schemas that clients send (``response_format``, tools' ``parameters``): checked before
anything is sent to a worker, and answers validated against them.

A schema must be a valid JSON Schema (checked against its meta-schema with ``jsonschema``), stay
within size and depth limits (a worker turns it into a grammar), and refer only to its own parts
(``$ref`` to ``#...``): a worker never fetches anything a client names.
"""

from __future__ import annotations

from typing import Any

import orjson
from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import SchemaError as JsonSchemaError

MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 32


def check_json_schema(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    """``schema`` if it is a JSON Schema a worker can turn into a grammar; ``ValueError`` (which
    pydantic reports as a 400 naming the field) otherwise."""
    if schema is None:
        return None
    try:
        size = len(orjson.dumps(schema))
    except TypeError as exc:  # an integer past 64 bits (JSON allows it; no grammar needs it)
        raise ValueError(f"the schema holds a value JSON cannot carry here: {exc}") from None
    if size > MAX_SCHEMA_BYTES:
        raise ValueError(f"the schema is larger than {MAX_SCHEMA_BYTES // 1024} KiB")
    _check_refs(schema)
    validator = validators.validator_for(schema, default=Draft202012Validator)
    try:
        validator.check_schema(schema)
    except JsonSchemaError as exc:
        where = "/".join(str(part) for part in exc.path) or "the top level"
        raise ValueError(f"not a valid JSON Schema: {exc.message} (at {where})") from None
    return schema


def _check_refs(schema: Any) -> None:
    stack: list[tuple[Any, int]] = [(schema, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if isinstance(node, dict):
            ref = node.get("$ref")
            if ref is not None and (not isinstance(ref, str) or not ref.startswith("#")):
                raise ValueError(f"'$ref' may only point inside the schema ('#/...'), not "
                                 f"{str(ref)[:100]!r}")
            stack.extend((value, depth + 1) for value in node.values())
        elif isinstance(node, list):
            stack.extend((value, depth + 1) for value in node)


def validation_problem(schema: dict[str, Any], value: Any) -> str | None:
    """Why ``value`` does not validate against ``schema``, or None if it does."""
    validator = validators.validator_for(schema, default=Draft202012Validator)(schema)
    error = next(iter(validator.iter_errors(value)), None)
    return None if error is None else error.message
