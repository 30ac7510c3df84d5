"""OpenAI answer and chunk shapes as they cross the wire, in one place for both sides.

``answer_problem`` is the queen's check of what a worker's job frame carries, before it is
relayed to a client.
"""

from __future__ import annotations

from shared_schema.protocol import Chunk, JobError, Result

# More tokens than any one job can have: a usage past it is a lie (and past 64 bits, a crash).
MAX_TOKENS = 2**31 - 1


def answer_problem(message: Chunk | Result | JobError, *, embeddings: bool = False) -> str | None:
    """What is wrong with the OpenAI payload a job frame carries, or None.

    ``Chunk.data`` and ``Result.data`` are relayed to the client nearly untouched, so the parts
    the queen reads (choices, deltas, messages, embeddings) must have the types OpenAI gives
    them, and every integer must fit 64 bits. An embeddings job's result must carry its vectors
    (``data``); a chat job's result may be empty when the answer was streamed in chunks. Plain
    checks, not a pydantic model: this runs for every streamed token.
    """
    if isinstance(message, JobError):
        return None
    if isinstance(message, Result):
        usage = message.usage
        if max(usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) > MAX_TOKENS:
            return f"'usage' counts more than {MAX_TOKENS} tokens"
    data = message.data
    if not _fits_json(data):
        return "an integer in 'data' is past 64 bits"
    if "choices" in data:
        choices = data["choices"]
        if not isinstance(choices, list):
            return "'choices' is not a list"
        inner = "delta" if isinstance(message, Chunk) else "message"
        for choice in choices:
            if not isinstance(choice, dict):
                return "a choice is not an object"
            if not _is_int(choice.get("index", 0)):
                return "a choice's 'index' is not an integer"
            if not isinstance(choice.get("finish_reason"), str | None):
                return "a choice's 'finish_reason' is not a string"
            part = choice.get(inner)
            if not isinstance(part, dict):
                return f"a choice's '{inner}' is missing or not an object"
            if not isinstance(part.get("content"), str | None) or not isinstance(
                    part.get("role"), str | None):
                return f"a choice's '{inner}' has a 'content' or 'role' that is not a string"
    items = data.get("data")
    if isinstance(message, Result) and (items is not None or embeddings):
        if not isinstance(items, list):
            return "'data' is not a list"
        for item in items:
            if not isinstance(item, dict):
                return "an embedding is not an object"
            if not _is_int(item.get("index")):
                return "an embedding's 'index' is not an integer"
            vector = item.get("embedding")
            if not isinstance(vector, list) or not all(
                    isinstance(x, float) or _is_int(x) for x in vector):
                return "an embedding is not a list of numbers"
    return None


def _fits_json(value: object) -> bool:
    """Whether every integer in a decoded payload fits the 64 bits the relay can encode."""
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is dict:
            stack.extend(item.values())  # type: ignore[attr-defined]
        elif kind is list:
            stack.extend(item)  # type: ignore[call-overload]
        elif kind is int and not _INT_MIN <= item < _UINT_END:  # type: ignore[operator]
            return False
    return True


_INT_MIN, _UINT_END = -(2**63), 2**64


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
