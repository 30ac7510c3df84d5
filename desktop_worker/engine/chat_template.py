"""A model's chat template, rendered only in jinja2's sandbox.

The template comes from the model file, so from whoever uploaded it: it is code, run on the
volunteer's machine. It renders in ``jinja2.sandbox.ImmutableSandboxedEnvironment`` (jinja2 >=
3.1.6, which closed the ``str.format`` escapes of 3.1.4 and 3.1.5), with what
llama-cpp-python's ``Jinja2ChatFormatter`` and Hugging Face's transformers give a template
(``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII text, the
``{% generation %}`` tag and loop controls), and stricter:

- an attribute the sandbox calls unsafe (``__class__``, ``__globals__``, ``mro``, a list's
  ``append``...) fails the render at once, where jinja2 would hand back an undefined value
  and go on: a template that reaches for one is refused, never half-run;
- ``range`` counts: each holds at most 100,000 items (jinja2's own bound) and all the ranges of
  one render together at most ``max_range_items``; ``lipsum`` is gone;
- ``*`` and ``**`` may not build a string, list or number past ``max_output_chars``;
- the output stops at ``max_output_chars``.

Every failure is an ``UnsupportedRequest`` that says what the template did.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError, safe_range

from desktop_worker.errors import UnsupportedRequest

__all__ = ["ChatTemplate", "TemplateLimits"]


@dataclass(frozen=True, slots=True)
class TemplateLimits:
    max_output_chars: int = 8 << 20
    max_range_items: int = 1_000_000


class _TemplateRaised(Exception):
    """The template's own ``raise_exception(message)``."""


class _IgnoreGenerationTags(jinja2.ext.Extension):
    """Hugging Face's ``{% generation %}...{% endgeneration %}`` marks, rendered as their body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _Sandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, with unsafe attributes fatal and ``*``/``**`` bounded."""

    intercepted_binops = frozenset({"*", "**"})

    def __init__(self, limits: TemplateLimits) -> None:
        super().__init__(
            loader=jinja2.BaseLoader(),
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_IgnoreGenerationTags, jinja2.ext.loopcontrols],
        )
        self.limits = limits
        self.globals.pop("lipsum", None)
        self.filters["tojson"] = _tojson

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context: Context, operator_: str, left: Any, right: Any) -> Any:
        cap = self.limits.max_output_chars
        if operator_ == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(times, int) \
                        and len(seq) * times > cap:
                    raise SecurityError(f"'*' would build {len(seq) * times:,} items")
            return operator.mul(left, right)
        if isinstance(left, int) and isinstance(right, int) and right > 0 \
                and abs(left) > 1 and right * max(abs(left).bit_length(), 1) > cap:
            raise SecurityError(f"'**' would build a number of about {right:,} digits")
        return operator.pow(left, right)


class _RangeBudget:
    """``range`` for one render: jinja2's sandboxed range (at most ``MAX_RANGE`` items), and
    every range made counts against one budget."""

    def __init__(self, max_items: int) -> None:
        self.left = max_items

    def __call__(self, *args: int) -> range:
        made = safe_range(*args)
        self.left -= len(made)
        if self.left < 0:
            raise SecurityError("the template's ranges hold too many items in all")
        return made


class ChatTemplate:
    """One model's chat template, compiled once, rendered per conversation."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "",
                 limits: TemplateLimits | None = None) -> None:
        self.limits = limits or TemplateLimits()
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _Sandbox(self.limits).from_string(source)
        except jinja2.TemplateError as exc:
            raise UnsupportedRequest(f"the model's chat template cannot be read: {exc}") from exc

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text of ``messages`` (``extra``: ``tools``, ``tool_choice`` ...)."""
        context = {
            "tools": None, "tool_choice": None, "functions": None, "function_call": None,
            **extra,
            "messages": messages,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_generation_prompt": add_generation_prompt,
            "raise_exception": _raise_exception,
            "strftime_now": _strftime_now,
            "range": _RangeBudget(self.limits.max_range_items),
        }
        try:
            return "".join(self._pieces(context))
        except _TemplateRaised as exc:
            raise UnsupportedRequest(
                f"the model's chat template refused the messages: {exc}") from exc
        except SecurityError as exc:
            raise UnsupportedRequest(
                f"the model's chat template tried something its sandbox forbids ({exc}); "
                "nothing was run") from exc
        except UnsupportedRequest:
            raise
        except Exception as exc:  # a Jinja2 error or one the template's own code raised
            raise UnsupportedRequest(
                f"the model's chat template failed on the messages: {exc}") from exc

    def _pieces(self, context: dict[str, Any]) -> Iterator[str]:
        written = 0
        for piece in self._template.generate(context):
            written += len(piece)
            if written > self.limits.max_output_chars:
                raise SecurityError(
                    f"the prompt passed {self.limits.max_output_chars:,} characters")
            yield piece


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)
