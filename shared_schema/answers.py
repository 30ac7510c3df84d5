"""OpenAI answer and chunk shapes as they cross the wire, in one place for both sides.

The worker builds its answers here (a whole chat answer from its chunks, the checkpoint of a plain
answer, an embeddings list), and the queen builds what it relays here (the chunks of a whole
answer, the finish and usage chunks, its own id/model/created stamp, the embeddings answer in the
client's encoding). ``answer_problem`` is the queen's check of what a worker's job frame carries,
before it is relayed to a client; it reads the same fields these builders write. ``answer_check``
is that check with the job's bounds on log probabilities (``LogprobLimits``), and the weight of
the ones the frame carries, which the queen charges against the job's budget.

Every shape is a plain ``dict``, not a pydantic model: the queen relays chunks per streamed token,
and a dict costs nothing to pass on. Each builder's output validates against its model in
``shared_schema.openai_types`` (``ChatCompletion``, ``ChatCompletionChunk``,
``EmbeddingResponse``); tests/shared_schema/test_answers.py holds them to it. Key order is part of
the shape: clients see these dicts serialized as they are built, so builders keep the order the
bytes on the wire have always had.
"""

from __future__ import annotations

import base64
import math
import sys
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from shared_schema.openai_types import MAX_TOKENS
from shared_schema.protocol import Chunk, JobError, Result, Usage

# The ``object`` of each shape, as OpenAI names it.
CHAT_ANSWER = "chat.completion"
CHAT_CHUNK = "chat.completion.chunk"
EMBEDDING_LIST = "list"
EMBEDDING = "embedding"

ASSISTANT = "assistant"
STOP = "stop"  # the finish reason when a worker gave none


class AnswerStamp:
    """What every chunk and answer of one completion carries: the queen's completion id, its
    creation time and the model name the client asked for (workers' own values are replaced, so
    a client sees one id across every worker that served its answer)."""

    __slots__ = ("created", "id", "model")

    def __init__(self, completion_id: str, model: str, created: int) -> None:
        self.id = completion_id
        self.model = model
        self.created = created

    def stamp(self, data: dict[str, Any], kind: str) -> dict[str, Any]:
        """Set ``id``, ``object`` (``kind``), ``created`` and ``model`` on ``data``, in place
        (keys already there keep their place); runs for every relayed chunk."""
        data["id"] = self.id
        data["object"] = kind
        data["created"] = self.created
        data["model"] = self.model
        return data

    def answer(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """A stamped whole chat answer (``chat.completion``) of ``choices``, without usage."""
        data = self.stamp({}, CHAT_ANSWER)
        data["choices"] = choices
        return data


# --- chat chunks ------------------------------------------------------------------------------


def delta_choice(
    delta: dict[str, Any], finish_reason: str | None = None, index: int = 0
) -> dict[str, Any]:
    """One choice of a chunk: a piece of the message (``delta``), or its end (``finish_reason``)."""
    return {"index": index, "delta": delta, "finish_reason": finish_reason}


def chat_chunk(
    choices: list[dict[str, Any]], usage: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A ``chat.completion.chunk`` of ``choices`` (and ``usage``), not yet stamped."""
    data: dict[str, Any] = {"choices": choices}
    if usage is not None:
        data["usage"] = usage
    return data


def opening_chunk(
    content: str | None = "", role: str = ASSISTANT, index: int = 0
) -> dict[str, Any]:
    """The first chunk of a choice: its role, with the first content."""
    return chat_chunk([delta_choice({"role": role, "content": content}, None, index)])


def content_chunk(content: str, index: int = 0) -> dict[str, Any]:
    """A chunk of content only."""
    return chat_chunk([delta_choice({"content": content}, None, index)])


def finish_chunk(finish_reason: str = STOP, index: int = 0) -> dict[str, Any]:
    """The last chunk of a choice: an empty delta and why the answer ended."""
    return chat_chunk([delta_choice({}, finish_reason, index)])


def usage_chunk(usage: dict[str, Any]) -> dict[str, Any]:
    """The chunk after the last one when the client asked for usage: no choices, the usage."""
    return chat_chunk([], usage)


def usage_counts(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """A chat usage object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def checkpoint_chunk(
    pieces: list[str], logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The text of a worker's plain answer so far (choice 0), in one chunk the queen keeps
    (never relays): if this worker is lost, another continues the answer from there. ``usage``
    counts its tokens (one per piece, or one per log probability entry when the answer carries
    them: those are exactly its tokens), which the queen credits to this worker. ``logprobs``:
    the ``logprobs.content`` entries of that text, when the client asked for them."""
    data = {"object": CHAT_CHUNK, **content_chunk("".join(pieces))}
    if logprobs is not None:
        delta = data["choices"][0]["delta"]
        data["choices"][0] = {"index": 0, "delta": delta, "logprobs": {"content": logprobs},
                              "finish_reason": None}
    data["usage"] = usage_counts(0, len(pieces) if logprobs is None else len(logprobs))
    return data


# --- whole chat answers -----------------------------------------------------------------------


def message_choice(
    content: str, finish_reason: str = STOP, index: int = 0, role: str = ASSISTANT
) -> dict[str, Any]:
    """One choice of a whole answer: the message and why it ended."""
    return {"index": index, "message": {"role": role, "content": content},
            "finish_reason": finish_reason}


def answer_from_chunks(chunks: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """A whole chat answer from its chunks (a worker's answer to a client that did not ask for
    a stream): per choice ``index`` (choice 0 when there are none), its text, the last finish
    reason given ("stop" if none) and, when the chunks carried them, its log probabilities
    (then every choice has ``logprobs``)."""
    texts: dict[int, list[str]] = {}
    finishes: dict[int, str] = {}
    logprobs: dict[int, list[Any]] = {}
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            index = choice.get("index", 0)
            text = texts.setdefault(index, [])
            content = (choice.get("delta") or {}).get("content")
            if content:
                text.append(content)
            if choice.get("finish_reason"):
                finishes[index] = choice["finish_reason"]
            entries = (choice.get("logprobs") or {}).get("content")
            if isinstance(entries, list):
                logprobs.setdefault(index, []).extend(entries)
    # Workers have always sent this key order, and the queen relays the answer as it comes.
    choices = []
    for index in sorted(texts) or [0]:
        out: dict[str, Any] = {
            "index": index, "finish_reason": finishes.get(index, STOP),
            "message": {"role": ASSISTANT, "content": "".join(texts.get(index, []))}}
        if logprobs:
            out["logprobs"] = {"content": logprobs.get(index, [])}
        choices.append(out)
    return {"object": CHAT_ANSWER, "choices": choices}


def chunks_from_answer(answer: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole chat answer, as the chunks a streaming worker would have sent (not yet stamped):
    per choice, its role and whole content, then its finish."""
    out = []
    for choice in answer.get("choices") or []:
        index = choice.get("index", 0)
        message = choice.get("message") or {}
        opening = opening_chunk(message.get("content", ""), message.get("role", ASSISTANT),
                                index)
        if choice.get("logprobs") is not None:
            opening["choices"][0]["logprobs"] = choice["logprobs"]
        out.append(opening)
        out.append(finish_chunk(choice.get("finish_reason") or STOP, index))
    return out


# --- embeddings -------------------------------------------------------------------------------


def embedding_list(model: str, vectors: list[list[float]]) -> dict[str, Any]:
    """A worker's embeddings answer: one float vector per input, in order (no usage: the
    ``Result`` frame carries it)."""
    return {"object": EMBEDDING_LIST, "model": model, "data": [
        {"object": EMBEDDING, "index": i, "embedding": vector}
        for i, vector in enumerate(vectors)]}


def embeddings_answer(
    result: Result, model: str, encoding_format: str, usage: Usage | None = None
) -> dict[str, Any]:
    """The answer to an embeddings request from a worker's result: the worker's float vectors in
    the encoding the client asked for ("float" or "base64"), the client's model name, and the
    usage (prompt tokens only): ``usage`` as billed, else the result's own."""
    data = dict(result.data)
    data["object"] = EMBEDDING_LIST
    data["model"] = model
    if encoding_format == "base64":
        data["data"] = [
            {**item, "embedding": floats_to_base64(item.get("embedding") or [])}
            for item in data.get("data") or []
        ]
    usage = result.usage if usage is None else usage
    data["usage"] = {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.total_tokens}
    return data


def floats_to_base64(values: list[float]) -> str:
    """OpenAI's base64 embedding encoding: little-endian float32."""
    packed = array("f", values)
    if sys.byteorder != "little":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


# --- the queen's check of a worker's frame ----------------------------------------------------

# Log probabilities (``logprobs.content``: an entry per token, each with its ``top_logprobs``
# alternatives) are kept by the queen for the whole answer, and a decoded entry takes far more
# memory than its JSON: ``{"token":"","logprob":0}`` is 25 characters and about 190 bytes of
# Python objects, an entry with its two lists about 300. So each entry and alternative weighs
# ``LOGPROB_ENTRY_WEIGHT`` characters, and each item of its ``bytes`` list
# ``LOGPROB_BYTE_WEIGHT`` (a pointer), on top of the frame's own length: what the queen charges
# against the job's budget covers what it keeps.
LOGPROB_ENTRY_WEIGHT = 320
LOGPROB_BYTE_WEIGHT = 8
# The longest token text and ``bytes`` list an entry may carry: vocabulary pieces are a few
# dozen bytes (the queen's budget allows 128 each), and a token's released text may add the
# bytes of a character it completes.
LOGPROB_TOKEN_CHARS = 256
LOGPROB_TOKEN_BYTES = 256
_ENTRY_KEYS = frozenset({"token", "logprob", "bytes", "top_logprobs"})
_ALTERNATIVE_KEYS = frozenset({"token", "logprob", "bytes"})


@dataclass(frozen=True, slots=True)
class LogprobLimits:
    """What one job's answer may carry in log probabilities. ``top``: the alternatives the
    request asked for per token (``top_logprobs``; each token may have one more, its own),
    None when it asked for no log probabilities (then none may come). ``end_tokens``: per
    choice, the entries a frame may carry past its text's UTF-8 bytes (every token is at least a
    byte of text, but for the stop string's tokens, never delivered, and the end token)."""

    top: int | None
    end_tokens: int = 1


def answer_problem(message: Chunk | Result | JobError, *, embeddings: bool = False) -> str | None:
    """What is wrong with the OpenAI payload a job frame carries, or None.

    ``Chunk.data`` and ``Result.data`` are relayed to the client nearly untouched, so the parts
    the queen reads (choices, deltas, messages, embeddings) must have the types OpenAI gives
    them, and every integer must fit 64 bits. An embeddings job's result must carry its vectors
    (``data``); a chat job's result may be empty when the answer was streamed in chunks.

    The fields checked are the ones the builders above write (a chunk's choice has a ``delta``,
    see ``delta_choice``; an answer's a ``message``, see ``message_choice``; an embedding its
    ``index`` and vector, see ``embedding_list``), with the types ``openai_types`` gives them.
    Plain checks with literal keys, not a pydantic model: this runs for every streamed token.
    """
    return answer_check(message, embeddings=embeddings)[0]


def answer_check(message: Chunk | Result | JobError, *, embeddings: bool = False,
                 logprobs: LogprobLimits | None = None) -> tuple[str | None, int]:
    """``answer_problem``, and the weight of the log probabilities the frame carries (0 when
    it carries none). With ``logprobs`` (the job's limits), each choice's entries are held to
    them: none unless asked; no more than its text's bytes can carry (``end_tokens`` past
    them); each a ``token`` of at most ``LOGPROB_TOKEN_CHARS`` characters, a finite
    ``logprob``, ``bytes`` of at most ``LOGPROB_TOKEN_BYTES`` bytes and at most ``top`` + 1
    alternatives of the same form, with no other fields. Without, only their shape."""
    if isinstance(message, JobError):
        return None, 0
    if isinstance(message, Result):
        usage = message.usage
        if max(usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) > MAX_TOKENS:
            return f"'usage' counts more than {MAX_TOKENS} tokens", 0
    data = message.data
    if not _fits_json(data):
        return "an integer in 'data' is past 64 bits", 0
    weight = 0
    if "choices" in data:
        choices = data["choices"]
        if not isinstance(choices, list):
            return "'choices' is not a list", 0
        inner = "delta" if isinstance(message, Chunk) else "message"
        for choice in choices:
            if not isinstance(choice, dict):
                return "a choice is not an object", 0
            if not _is_int(choice.get("index", 0)):
                return "a choice's 'index' is not an integer", 0
            if not isinstance(choice.get("finish_reason"), str | None):
                return "a choice's 'finish_reason' is not a string", 0
            part = choice.get(inner)
            if not isinstance(part, dict):
                return f"a choice's '{inner}' is missing or not an object", 0
            content = part.get("content")
            if not isinstance(content, str | None) or not isinstance(part.get("role"), str | None):
                return f"a choice's '{inner}' has a 'content' or 'role' that is not a string", 0
            found = choice.get("logprobs")
            if found is None:
                continue
            entries = found.get("content") if isinstance(found, dict) else ()
            if not isinstance(entries, list | None):
                return "a choice's 'logprobs' is not an object with a 'content' list", 0
            if logprobs is not None and entries:
                checked = _entries_weight(entries, logprobs, content or "")
                if isinstance(checked, str):
                    return checked, 0
                weight += checked
    items = data.get("data")
    if isinstance(message, Result) and (items is not None or embeddings):
        if not isinstance(items, list):
            return "'data' is not a list", 0
        for item in items:
            if not isinstance(item, dict):
                return "an embedding is not an object", 0
            if not _is_int(item.get("index")):
                return "an embedding's 'index' is not an integer", 0
            vector = item.get("embedding")
            if not isinstance(vector, list) or not all(
                    isinstance(x, float) or _is_int(x) for x in vector):
                return "an embedding is not a list of numbers", 0
    return None, weight


def _entries_weight(entries: list[Any], limits: LogprobLimits, text: str) -> int | str:
    """The weight of one choice's log-probability entries, or what is wrong with them."""
    if limits.top is None:
        return "it carries log probabilities the request did not ask for"
    text_bytes = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    if len(entries) > text_bytes + limits.end_tokens:
        return (f"it carries {len(entries)} log-probability entries with {text_bytes} bytes of "
                "text (a token is at least a byte)")
    most = limits.top + 1
    weight = 0
    for entry in entries:
        checked = _token_weight(entry, _ENTRY_KEYS)
        if isinstance(checked, str):
            return checked
        weight += checked
        alternatives = entry.get("top_logprobs")
        if alternatives is None:
            continue
        if type(alternatives) is not list or len(alternatives) > most:
            return (f"a log-probability entry's 'top_logprobs' is not a list of at most {most} "
                    f"(the request asked for {limits.top})")
        for alternative in alternatives:
            checked = _token_weight(alternative, _ALTERNATIVE_KEYS)
            if isinstance(checked, str):
                return checked
            weight += checked
    return weight


def _token_weight(entry: object, keys: frozenset[str]) -> int | str:
    """The weight of one log-probability entry or alternative, or what is wrong with it."""
    if type(entry) is not dict:
        return "a log-probability entry is not an object"
    if not entry.keys() <= keys:
        return f"a log-probability entry has fields other than {', '.join(sorted(keys))}"
    token = entry.get("token")
    if type(token) is not str or len(token) > LOGPROB_TOKEN_CHARS:
        return (f"a log-probability entry's 'token' is not a string of at most "
                f"{LOGPROB_TOKEN_CHARS} characters")
    logprob = entry.get("logprob")
    if type(logprob) not in (float, int) or not math.isfinite(logprob):
        return "a log-probability entry's 'logprob' is not a finite number"
    pieces = entry.get("bytes")
    if pieces is None:
        return LOGPROB_ENTRY_WEIGHT
    if type(pieces) is not list or len(pieces) > LOGPROB_TOKEN_BYTES or not all(
            type(byte) is int and 0 <= byte < 256 for byte in pieces):
        return (f"a log-probability entry's 'bytes' is not a list of at most "
                f"{LOGPROB_TOKEN_BYTES} bytes")
    return LOGPROB_ENTRY_WEIGHT + LOGPROB_BYTE_WEIGHT * len(pieces)


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
