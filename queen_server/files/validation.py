"""What a fine-tuning upload must be, checked line by line (pure: bytes in, a summary or an error
out; no I/O).

The format is OpenAI's chat fine-tuning JSONL: UTF-8, one example per line, each
``{"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}`` with at
least one assistant message; an assistant message may carry ``"weight": 0`` (not learned) or
``1``. Blank lines are skipped; a UTF-8 byte order mark on the first line is allowed. The file
must hold at least ``MIN_EXAMPLES`` examples (OpenAI's minimum) and at most
``limits.max_examples``, in at most ``limits.max_bytes`` bytes. Every error names its line.

``TrainingFileCheck`` takes the lines one at a time, so an upload is checked as it is read from
disk, never held whole in memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from queen_server.errors import InvalidRequest
from queen_server.files.errors import FileTooLarge, InvalidTrainingFile
from shared_schema.files import FINE_TUNE, OPENAI_PURPOSES

MIN_EXAMPLES = 10  # OpenAI's minimum for a training file
ROLES = ("system", "user", "assistant")
BOM = b"\xef\xbb\xbf"
# Keys OpenAI defines in other kinds of fine-tuning file, each with why it is refused here.
_OTHER_EXAMPLE_KEYS = {
    "tools": "tool calling is not trained by this queen: write plain chat messages",
    "functions": "function calling is not trained by this queen: write plain chat messages",
    "parallel_tool_calls": "tool calling is not trained by this queen",
    "input": "preference (DPO) examples are not trained by this queen: write 'messages'",
    "preferred_output": "preference (DPO) examples are not trained by this queen",
    "non_preferred_output": "preference (DPO) examples are not trained by this queen",
}
_OTHER_MESSAGE_KEYS = {
    "name": "participant names are not trained by this queen",
    "tool_calls": "tool calls are not trained by this queen",
    "tool_call_id": "tool results are not trained by this queen",
    "function_call": "function calls are not trained by this queen",
    "refusal": "write the refusal as the assistant's content",
}
_OTHER_ROLES = {
    "developer": "write it as a 'system' message",
    "tool": "tool results are not trained by this queen",
    "function": "function results are not trained by this queen",
}


@dataclass(frozen=True, slots=True)
class FileLimits:
    max_bytes: int = 64 * 1024 * 1024
    max_examples: int = 50_000
    min_examples: int = MIN_EXAMPLES


@dataclass(frozen=True, slots=True)
class TrainingFileSummary:
    examples: int
    bytes: int


def check_purpose(purpose: str) -> str:
    """``purpose`` if the queen keeps files of it (``fine-tune`` only), else a 400 naming
    ``purpose`` that says whether it is another of OpenAI's purposes or no purpose at all."""
    if purpose == FINE_TUNE:
        return purpose
    if purpose in OPENAI_PURPOSES:
        why = f"'{purpose}' is one of OpenAI's purposes, but this queen keeps files only"
    else:
        why = f"'{purpose}' is not a file purpose; this queen keeps files only"
    raise InvalidRequest(f"Invalid value for 'purpose': {why} for fine-tuning, "
                         f"purpose '{FINE_TUNE}'.", param="purpose")


def example_problem(example: Any) -> str | None:
    """Why one decoded line is not a chat training example, or None if it is one."""
    if not isinstance(example, dict):
        return (f"an example is a JSON object with 'messages', not {_json_kind(example)}")
    for key in example:
        if key != "messages":
            why = _OTHER_EXAMPLE_KEYS.get(key)
            return (f"'{key}' is not supported: {why}" if why is not None
                    else f"unknown key '{key}': an example has only 'messages'")
    messages = example.get("messages")
    if messages is None:
        return "'messages' is missing"
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list of messages"
    assistants = learned = 0
    for index, message in enumerate(messages):
        problem = _message_problem(message, f"messages[{index}]")
        if problem is not None:
            return problem
        if message["role"] == "assistant":
            assistants += 1
            learned += message.get("weight", 1)
    if not assistants:
        return "no assistant message: an example needs at least one, to learn from"
    if not learned:
        return "every assistant message has weight 0: the example teaches nothing"
    return None


def _message_problem(message: Any, where: str) -> str | None:
    if not isinstance(message, dict):
        return f"{where} must be an object with 'role' and 'content', not {_json_kind(message)}"
    role = message.get("role")
    if role is None:
        return f"{where}.role is missing"
    if role not in ROLES:
        if isinstance(role, str) and role in _OTHER_ROLES:
            return f"{where}.role '{role}' is not supported: {_OTHER_ROLES[role]}"
        return f"{where}.role must be 'system', 'user' or 'assistant', not {_shown(role)}"
    for key in message:
        if key in ("role", "content") or (key == "weight" and role == "assistant"):
            continue
        if key == "weight":
            return f"{where}.weight is only allowed on assistant messages"
        why = _OTHER_MESSAGE_KEYS.get(key)
        return (f"{where}.{key} is not supported: {why}" if why is not None
                else f"{where} has an unknown key '{key}' (a message has role, content and, "
                     f"on an assistant message, weight)")
    if "content" not in message:
        return f"{where}.content is missing"
    content = message["content"]
    if isinstance(content, list):
        return f"{where}.content must be a string: content parts (images, audio) are not trained"
    if not isinstance(content, str):
        return f"{where}.content must be a string, not {_json_kind(content)}"
    weight = message.get("weight", 1)
    if type(weight) is not int or weight not in (0, 1):
        return f"{where}.weight must be 0 or 1, not {_shown(weight)}"
    return None


class TrainingFileCheck:
    """A training file checked as its lines come in: ``feed`` each line (bytes, with or
    without its newline), then ``finish``. Raises ``InvalidTrainingFile`` naming the line, or
    ``FileTooLarge`` once the bytes pass the limit."""

    def __init__(self, limits: FileLimits) -> None:
        self.limits = limits
        self.line = 0
        self.examples = 0
        self.bytes = 0

    def feed(self, raw: bytes) -> None:
        self.line += 1
        self.bytes += len(raw)
        if self.bytes > self.limits.max_bytes:
            raise FileTooLarge(f"The file is over the limit of {self.limits.max_bytes} bytes "
                               "(APIARY_FILES_MAX_BYTES).")
        if self.line == 1 and raw.startswith(BOM):
            raw = raw[len(BOM):]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidTrainingFile(f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at column "
                                      f"{exc.start + 1})", line=self.line) from None
        if not text.strip():
            return
        self.examples += 1
        if self.examples > self.limits.max_examples:
            raise InvalidTrainingFile(f"the file has more than {self.limits.max_examples} "
                                      "examples, the limit (APIARY_FILES_MAX_EXAMPLES)",
                                      line=self.line)
        try:
            example = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise InvalidTrainingFile(f"not valid JSON ({exc.msg} at column {exc.colno})",
                                      line=self.line) from None
        problem = example_problem(example)
        if problem is not None:
            raise InvalidTrainingFile(problem, line=self.line)

    def finish(self) -> TrainingFileSummary:
        if self.examples < self.limits.min_examples:
            raise InvalidTrainingFile(
                f"The file has {self.examples} example{'s' * (self.examples != 1)}; a training "
                f"file needs at least {self.limits.min_examples}, one JSON object per line.")
        return TrainingFileSummary(self.examples, self.bytes)


def check_training_file(lines: Iterable[bytes], limits: FileLimits) -> TrainingFileSummary:
    """A whole file, line by line (a binary file object is an iterable of its lines)."""
    check = TrainingFileCheck(limits)
    for line in lines:
        check.feed(line)
    return check.finish()


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"


def _shown(value: Any) -> str:
    """A value as the error quotes it: strings and numbers themselves (cut at 40 characters),
    anything else by its kind."""
    if isinstance(value, str):
        text = repr(value)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        text = str(value)
    else:
        text = orjson.dumps(value).decode() if value is None or isinstance(value, bool) else (
            _json_kind(value))
    return text if len(text) <= 40 else text[:37] + "..."
