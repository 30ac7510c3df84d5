"""Tool calls for models that only write text: the call format, the history, and the answer.

Workers never see ``tools``: the queen sends a system message describing the tools and the
format (``ToolPlan.instructions``) and a ``json_schema`` response_format (``ToolPlan.schema``)
the worker turns into a grammar, so the model can only write a well-formed answer: one JSON
object, keys in this order (llama.cpp's converter keeps required properties in the schema's
order, so the stream parser knows what comes first)::

    {"content": "prose"}                                     (tool_choice "auto" only)
    {"tool_calls": [{"name": "get_weather", "arguments": {...}}, ...]}

``arguments`` is held to the function's own ``parameters`` (moved into the schema's ``$defs``,
``$ref``s rewritten), ``name`` to a ``const``, the list to one item when ``parallel_tool_calls``
is false. ``CallStream`` reads that JSON as it streams into OpenAI chat deltas (each call's
arguments are the raw JSON text of its ``arguments`` value, so the fragments concatenate to a JSON
object); ``answer_message`` reads a whole answer the same way. ``worker_messages`` renders the
conversation as plain text turns, an earlier call as the JSON the model would have written.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

logger = logging.getLogger(__name__)

Mode = Literal["auto", "required", "function"]
# What a tool without ``parameters`` takes: nothing (as OpenAI defines it).
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
# Keys whose values are data, not subschemas: a "$ref" inside them is left as it is.
_DATA_KEYS = frozenset({"const", "enum", "default", "examples"})


@dataclass(frozen=True)
class ToolPlan:
    """How one tools request goes out to a worker, and how its answer is read back."""

    schema: dict[str, Any]
    instructions: str
    names: tuple[str, ...]  # the functions the answer may call
    mode: Mode  # "auto": prose or calls; "required": calls; "function": calls of names[0]
    parallel: bool  # False: at most one call per answer

    @property
    def response_format(self) -> dict[str, Any]:
        """The worker request's ``response_format``."""
        return {"type": "json_schema",
                "json_schema": {"name": "tool_call", "schema": self.schema, "strict": True}}


def plan(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
         parallel_tool_calls: bool | None) -> ToolPlan | None:
    """The plan for a request's ``tools``/``tool_choice``/``parallel_tool_calls`` (as the chat
    request gives them), or None when the request goes out plain (no tools, or "none")."""
    if not tools or tool_choice == "none":
        return None
    functions = [tool["function"] for tool in tools]
    mode: Mode = "auto"
    if tool_choice == "required":
        mode = "required"
    elif isinstance(tool_choice, dict):
        wanted = tool_choice["function"]["name"]
        functions = [fn for fn in functions if fn["name"] == wanted]
        if not functions:
            raise ValueError(f"tool_choice names '{wanted}', which is not one of the tools")
        mode = "function"
    parallel = parallel_tool_calls is not False
    defs: dict[str, Any] = {}
    calls = [_call_schema(fn, index, defs) for index, fn in enumerate(functions)]
    calls_schema: dict[str, Any] = {
        "type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        "minItems": 1}
    if not parallel:
        calls_schema["maxItems"] = 1
    body: dict[str, Any] = _object({"tool_calls": calls_schema})
    if mode == "auto":
        body = {"anyOf": [_object({"content": {"type": "string"}}), body]}
    return ToolPlan(schema={"$defs": defs, **body},
                    instructions=_instructions(functions, mode, parallel),
                    names=tuple(fn["name"] for fn in functions), mode=mode, parallel=parallel)


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def _call_schema(function: dict[str, Any], index: int, defs: dict[str, Any]) -> dict[str, Any]:
    """One call of ``function``; its parameters go into ``defs`` as ``fn<index>``."""
    params = dict(function.get("parameters") or NO_PARAMETERS)  # the caller's stays as it is
    key = f"fn{index}"
    moved: dict[str, str] = {}  # JSON-pointer prefix of a local definition -> its new key
    for container in ("$defs", "definitions"):
        local = params.pop(container, None) if isinstance(params, dict) else None
        if not isinstance(local, dict):
            if local is not None:
                params[container] = local  # not definitions: leave the schema as it was
            continue
        for name, sub in local.items():
            new_key = f"{key}-def{len(moved)}"
            moved[f"/{container}/" + name.replace("~", "~0").replace("/", "~1")] = new_key
            defs[new_key] = sub
    defs[key] = params
    for new_key in [key, *moved.values()]:
        defs[new_key] = _rewrite_refs(defs[new_key], key, moved)
    return _object({"name": {"type": "string", "const": function["name"]},
                    "arguments": {"$ref": f"#/$defs/{key}"}})


def _rewrite_refs(node: Any, key: str, moved: dict[str, str]) -> Any:
    """``node`` with every local ``$ref`` pointing where its target now lives."""
    if isinstance(node, list):
        return [_rewrite_refs(item, key, moved) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for name, value in node.items():
        if name == "$ref" and isinstance(value, str) and (value == "#" or
                                                          value.startswith("#/")):
            out[name] = _moved_ref(value[1:], key, moved)
        elif name in _DATA_KEYS:
            out[name] = value
        else:
            out[name] = _rewrite_refs(value, key, moved)
    return out


def _moved_ref(fragment: str, key: str, moved: dict[str, str]) -> str:
    for prefix, new_key in moved.items():
        if fragment == prefix or fragment.startswith(prefix + "/"):
            return f"#/$defs/{new_key}{fragment[len(prefix):]}"
    return f"#/$defs/{key}{fragment}"


def _instructions(functions: list[dict[str, Any]], mode: Mode, parallel: bool) -> str:
    lines = ["You can call tools (functions). The tools, one per line, as JSON:"]
    for fn in functions:
        entry: dict[str, Any] = {"name": fn["name"]}
        if fn.get("description"):
            entry["description"] = fn["description"]
        entry["parameters"] = fn.get("parameters") or NO_PARAMETERS
        lines.append(json.dumps(entry, ensure_ascii=False))
    lines += ["", "Answer with a single JSON object and nothing else.",
              'To call tools, answer {"tool_calls": [{"name": "<tool name>", "arguments": '
              "{<the arguments, matching the tool's parameters>}}]}."]
    lines.append("You may call several tools at once: put one item per call in the list."
                 if parallel else "Call one tool at a time: the list holds exactly one call.")
    lines.append({"auto": 'To answer without calling a tool, answer {"content": "<your answer>"}.',
                  "required": "You must call at least one tool.",
                  "function": f'You must call the tool "{functions[0]["name"]}".'}[mode])
    lines.append('The results of your calls come back in a user message starting with '
                 '"Tool result".')
    return "\n".join(lines)


# --- the conversation, as plain text turns ---------------------------------------------------


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part["text"] for part in content if part.get("type", "text") == "text")


def _call_json(calls: list[dict[str, Any]]) -> str:
    """Earlier calls as the model writes them in the call format."""
    rendered = []
    for call in calls:
        function = call["function"]
        try:
            arguments: Any = json.loads(function.get("arguments") or "{}")
        except ValueError:
            arguments = function.get("arguments")
        rendered.append({"name": function["name"], "arguments": arguments})
    return json.dumps({"tool_calls": rendered}, ensure_ascii=False)


def worker_messages(messages: list[dict[str, Any]], plan: ToolPlan | None) -> list[dict[str, str]]:
    """The conversation as ``{"role", "content": str}`` turns any chat template renders:
    ``plan.instructions`` first in the system message, earlier calls as call-format JSON,
    tool results as user turns (consecutive results in one turn) naming the function and call."""
    names: dict[str, str] = {}
    out: list[dict[str, str]] = []
    results: list[str] = []

    def flush_results() -> None:
        if results:
            out.append({"role": "user", "content": "\n\n".join(results)})
            results.clear()

    for message in messages:
        role = message["role"]
        if role == "tool":
            call_id = message.get("tool_call_id") or ""
            name = names.get(call_id)
            label = f"{name}, call id {call_id}" if name else f"call id {call_id}"
            results.append(f"Tool result ({label}):\n{_text(message.get('content'))}")
            continue
        flush_results()
        content = _text(message.get("content"))
        if role == "assistant" and message.get("tool_calls"):
            for call in message["tool_calls"]:
                names[call["id"]] = call["function"]["name"]
            calls = _call_json(message["tool_calls"])
            content = f"{content}\n\n{calls}" if content else calls
        out.append({"role": "system" if role == "developer" else role, "content": content})
    flush_results()
    if plan is not None:
        if out and out[0]["role"] == "system":
            first = out[0]["content"]
            out[0] = {"role": "system",
                      "content": f"{plan.instructions}\n\n{first}" if first else plan.instructions}
        else:
            out.insert(0, {"role": "system", "content": plan.instructions})
    return out


# --- the answer ---------------------------------------------------------------------------------


def answer_message(text: str, plan: ToolPlan, finish_reason: str) -> tuple[dict[str, Any], str]:
    """A whole answer's text -> (OpenAI assistant message, finish_reason). Calls whose
    arguments were cut off are left out; what prose there is stays."""
    stream = CallStream(plan)
    deltas = stream.feed(text)
    more, reason = stream.finish(finish_reason)
    deltas += more
    content = "".join(delta.get("content", "") for delta in deltas)
    calls = [{"id": call.id, "type": "function",
              "function": {"name": call.name, "arguments": "".join(call.arguments)}}
             for call in stream.complete_calls()]
    if not calls:
        return {"role": "assistant", "content": content}, reason
    return {"role": "assistant", "content": content or None, "tool_calls": calls}, reason


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(slots=True)
class StreamedCall:
    """One call as the stream reads it."""

    name: str | None = None
    id: str = ""
    index: int = -1  # set when its first delta goes out (once the name is complete)
    arguments: list[str] = field(default_factory=list)  # the arguments' JSON text, as it came
    done: bool = False  # the arguments value is complete


# Parser states.
_START, _KEY_OR_END, _KEY, _COLON, _VALUE, _AFTER, _STRING, _ESCAPE, _UNICODE, _LITERAL, \
    _RAW, _DONE, _PROSE, _BROKEN = range(14)
# What a value is to the reader.
_SKIP, _ROOT, _CONTENT, _CALLS, _CALL, _NAME, _ARGS, _KEYNAME = range(8)
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_WHITESPACE = " \t\n\r"
_PLAIN_STRING = re.compile(r'[^"\\]+')
_PLAIN_RAW = re.compile(r'[^"\\{}\[\]]+')
_LITERAL_CHARS = re.compile(r"[^\s,}\]]+")


class CallStream:
    """One choice's streamed JSON text -> OpenAI chat deltas, incrementally.

    A pushdown reader that looks at each character once (runs of plain string characters are
    taken with one regex match), so a whole answer costs O(length) however it is split. It
    keeps to the call format but reads any JSON: unknown keys are skipped, and text that does
    not start with ``{`` is passed through as prose."""

    def __init__(self, plan: ToolPlan | None = None) -> None:
        self._plan = plan
        self._state = _START
        self._stack: list[tuple[str, int]] = []  # ("{" or "[", what it is)
        self._role = _SKIP  # what the value being read is
        self._text: list[str] = []  # the decoded string (content as it comes, name, key)
        self._hex = ""
        self._high: int | None = None  # a high surrogate waiting for its low half
        self._raw_depth = 0  # the arguments value: its nesting, and where in it the reader is
        self._raw_string = self._raw_escape = self._raw_literal = False
        self._call: StreamedCall | None = None
        self._calls: list[StreamedCall] = []
        self._sent = 0  # calls whose first delta went out
        self._ids: set[str] = set()
        self._out: list[dict[str, Any]] = []
        self._content: list[str] = []
        self._args: list[str] = []

    def complete_calls(self) -> list[StreamedCall]:
        """The calls whose name and arguments are complete (the arguments are JSON), in order."""
        return [call for call in self._calls
                if call.index >= 0 and call.done and _is_json("".join(call.arguments))]

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas for the next piece of the answer's text."""
        i, n = 0, len(text)
        while i < n:
            i = self._step(text, i, n)
        return self._deltas()

    def finish(self, finish_reason: str) -> tuple[list[dict[str, Any]], str]:
        """The last deltas and the choice's finish_reason: "tool_calls" when the answer is
        whole and made calls, the worker's own reason (e.g. "length") otherwise."""
        if self._state == _DONE and self.complete_calls():
            return self._deltas(), "tool_calls"
        if self._state == _BROKEN:
            logger.warning("a tool-call answer was not the JSON its grammar allows")
        return self._deltas(), finish_reason

    # --- output ---

    def _deltas(self) -> list[dict[str, Any]]:
        self._flush()
        out, self._out = self._out, []
        return out

    def _flush(self) -> None:
        if self._content:
            self._out.append({"content": "".join(self._content)})
            self._content = []
        if self._args and self._call is not None:
            fragment = "".join(self._args)
            self._out.append({"tool_calls": [{"index": self._call.index,
                                              "function": {"arguments": fragment}}]})
            self._args = []

    def _say(self, text: str) -> None:
        if self._args:
            self._flush()
        self._content.append(text)

    def _argue(self, text: str) -> None:
        call = self._call
        assert call is not None
        call.arguments.append(text)
        if call.index >= 0:
            if self._content:
                self._flush()
            self._args.append(text)

    def _open_call(self, call: StreamedCall) -> None:
        """The call's first delta, once its name is complete (and its arguments so far)."""
        self._flush()
        call.index = self._sent
        self._sent += 1
        call.id = new_call_id()
        while call.id in self._ids:
            call.id = new_call_id()
        self._ids.add(call.id)
        if self._plan is not None and call.name not in self._plan.names:
            logger.warning("a tool-call answer called %r, which the request did not offer",
                           call.name)
        self._out.append({"tool_calls": [{"index": call.index, "id": call.id,
                                          "type": "function",
                                          "function": {"name": call.name, "arguments": ""}}]})
        self._args = list(call.arguments)

    # --- reading ---

    def _step(self, text: str, i: int, n: int) -> int:
        """Read from ``text[i]``; the index of the first character not yet read."""
        state = self._state
        if state in (_STRING, _RAW, _PROSE, _LITERAL):
            return self._run(text, i)
        char = text[i]
        if state in (_DONE, _BROKEN):
            return n
        if state == _ESCAPE:
            self._escape(char)
            return i + 1
        if state == _UNICODE:
            self._hex += char
            if len(self._hex) == 4:
                self._unicode()
            return i + 1
        if char in _WHITESPACE:
            return i + 1
        if state == _START:
            if char == "{":
                self._stack.append(("{", _ROOT))
                self._state = _KEY_OR_END
                return i + 1
            self._state = _PROSE
            return i
        if state in (_KEY_OR_END, _KEY):
            if char == '"':
                self._begin_string(_KEYNAME)
            elif char == "}" and state == _KEY_OR_END:
                self._close(char)
            else:
                self._state = _BROKEN
            return i + 1
        if state == _COLON:
            self._state = _VALUE if char == ":" else _BROKEN
            return i + 1
        if state == _VALUE:
            return self._value(char, i)
        # _AFTER
        kind, role = self._stack[-1]
        if char == ",":
            if kind == "{":
                self._state = _KEY
            else:
                self._role = _CALL if role == _CALLS else _SKIP
                self._state = _VALUE
        elif char in "}]":
            self._close(char)
        else:
            self._state = _BROKEN
        return i + 1

    def _value(self, char: str, i: int) -> int:
        role = self._role
        if role == _ARGS:
            self._state = _RAW
            self._raw_depth = 0
            self._raw_string = self._raw_escape = False
            self._raw_literal = char not in '{["'
            return i
        if char == "{":
            self._stack.append(("{", _CALL if role == _CALL else _SKIP))
            if role == _CALL:
                self._call = StreamedCall()
                self._calls.append(self._call)
            self._state = _KEY_OR_END
        elif char == "[":
            self._stack.append(("[", _CALLS if role == _CALLS else _SKIP))
            self._role = _CALL if role == _CALLS else _SKIP
            self._state = _VALUE
        elif char == '"':
            self._begin_string(role if role in (_CONTENT, _NAME) else _SKIP)
        elif char in "]}":
            self._close(char)  # an empty array: "[" then "]"
        else:
            self._state = _LITERAL
            return i
        return i + 1

    def _close(self, char: str) -> None:
        if not self._stack or self._stack[-1][0] != ("{" if char == "}" else "["):
            self._state = _BROKEN
            return
        _, role = self._stack.pop()
        if role == _CALL and self._call is not None:
            call = self._call
            if call.index >= 0 and not call.arguments:
                call.arguments.append("{}")  # a call written without arguments takes none
                self._args.append("{}")
                call.done = True
            self._flush()
            self._call = None
        self._state = _AFTER if self._stack else _DONE

    def _begin_string(self, role: int) -> None:
        self._role = role
        self._state = _STRING
        self._text = []
        self._high = None

    def _run(self, text: str, i: int) -> int:
        state = self._state
        if state == _PROSE:
            self._say(text[i:])
            return len(text)
        if state == _LITERAL:
            match = _LITERAL_CHARS.match(text, i)
            if match is None:  # the literal ended: its delimiter is read as what follows
                self._state = _AFTER
                return i
            return match.end()
        if state == _RAW:
            return self._raw(text, i)
        match = _PLAIN_STRING.match(text, i)
        if match is not None:
            self._decoded(match.group())
            return match.end()
        if text[i] == "\\":
            self._state = _ESCAPE
        else:
            self._end_string()
        return i + 1

    def _raw(self, text: str, i: int) -> int:
        """The arguments value, passed through as it is until it ends."""
        if self._raw_literal:
            match = _LITERAL_CHARS.match(text, i)
            if match is not None:
                self._argue(match.group())
                return match.end()
            self._end_arguments()
            return i
        if self._raw_string:
            match = None if self._raw_escape else _PLAIN_STRING.match(text, i)
            if match is not None:
                self._argue(match.group())
                return match.end()
            char = text[i]
            if self._raw_escape:
                self._raw_escape = False
            elif char == "\\":
                self._raw_escape = True
            else:
                self._raw_string = False
            self._argue(char)
            if not self._raw_string and self._raw_depth == 0:
                self._end_arguments()  # the arguments were a bare string
            return i + 1
        match = _PLAIN_RAW.match(text, i)
        if match is not None:
            self._argue(match.group())
            return match.end()
        char = text[i]
        self._argue(char)
        if char == '"':
            self._raw_string = True
        elif char in "{[":
            self._raw_depth += 1
        else:
            self._raw_depth -= 1
            if self._raw_depth <= 0:
                self._end_arguments()
        return i + 1

    def _end_arguments(self) -> None:
        call = self._call
        if call is not None:
            call.done = True
        self._state = _AFTER

    def _escape(self, char: str) -> None:
        self._hex, self._state = "", (_UNICODE if char == "u" else _STRING)
        if char != "u":
            self._decoded(_ESCAPES.get(char, char))

    def _unicode(self) -> None:
        self._state = _STRING
        try:
            code = int(self._hex, 16)
        except ValueError:
            code = 0xFFFD
        if 0xD800 <= code < 0xDC00:
            if self._high is not None:
                self._decoded("")  # the waiting high half had no low half
            self._high = code
            return
        if 0xDC00 <= code < 0xE000:
            if self._high is None:
                self._decoded("\ufffd")
                return
            code = 0x10000 + ((self._high - 0xD800) << 10) + (code - 0xDC00)
            self._high = None
        self._decoded(chr(code))

    def _decoded(self, text: str) -> None:
        if self._high is not None:
            self._high = None
            text = "\ufffd" + text  # a high surrogate with no low half
        if self._role == _CONTENT:
            self._say(text)
        elif self._role != _SKIP:
            self._text.append(text)

    def _end_string(self) -> None:
        if self._high is not None:
            self._decoded("")
        role = self._role
        value = "".join(self._text)
        self._text = []
        self._state = _AFTER
        if role == _KEYNAME:
            self._state = _COLON
            self._role = _key_role(self._stack[-1][1], value)
        elif role == _NAME and self._call is not None and self._call.index < 0:
            self._call.name = value
            self._open_call(self._call)


def _key_role(container: int, key: str) -> int:
    """What the value of ``key`` in a ``container`` object is to the reader."""
    if container == _ROOT:
        return {"content": _CONTENT, "tool_calls": _CALLS}.get(key, _SKIP)
    if container == _CALL:
        return {"name": _NAME, "arguments": _ARGS}.get(key, _SKIP)
    return _SKIP
