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
from typing import Any

from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

from desktop_worker.errors import UnsupportedRequest

log = logging.getLogger(__name__)

GRAMMAR_ROOT = "root"


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
        return json_schema_to_gbnf(json.dumps(schema))
    except RecursionError:
        raise UnsupportedRequest("the response_format schema nests too deeply to become a "
                                 "grammar") from None
    except Exception as exc:  # the converter raises ValueError, KeyError, AssertionError...
        log.info("schema not convertible: %s: %s", type(exc).__name__, exc)
        detail = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise UnsupportedRequest("this worker cannot turn the response_format schema into a "
                                 f"grammar ({detail})") from None
