"""Text completions (``POST /v1/completions``) on the swarm's chat-shaped answers.

A text completion job goes to a worker with the ``completions`` capability as a chat-shaped
worker request (``worker_request``: the raw ``prompt`` instead of messages, logprobs in the chat
form), and its answer comes back in the same chat shapes as a chat job's, so the relay, the books
and failover are shared. ``CompletionShaper`` turns those shapes into OpenAI's legacy
``text_completion`` objects: ``delta.content`` becomes ``text``, chat logprobs become the
``tokens``/``token_logprobs``/``top_logprobs``/``text_offset`` lists, and ``echo`` puts the
prompt before each choice's text.

The queen cannot detokenize, so ``echo`` of a prompt given as token ids is refused
(``echo_problem``); ``echo`` with ``logprobs`` is refused by the request model itself (workers
score the tokens they make, not the prompt's).
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable
from typing import Any

from queen_server.shaping.base import Event
from shared_schema.openai_requests import CompletionRequest

TEXT_COMPLETION = "text_completion"
# OpenAI's default ``max_tokens`` for text completions (chat has none).
DEFAULT_MAX_TOKENS = 16
FINISH_REASONS = frozenset({"stop", "length", "content_filter"})

# Sampling fields the worker honours as the client gave them (chat-shaped names already).
_PASSED_ON = ("temperature", "top_p", "stop", "seed", "n", "presence_penalty",
              "frequency_penalty", "logit_bias")


# --- the request ------------------------------------------------------------------------------


def worker_request(req: CompletionRequest) -> dict[str, Any]:
    """The worker's request for ``req`` (``Job.openai_req`` of a ``/v1/completions`` job).

    ``max_tokens`` is always set (16 when not given, OpenAI's default), so the hold and the
    worker see the same limit. ``logprobs: k`` goes out as the chat form (``logprobs: true,
    top_logprobs: k``). ``echo``, ``best_of``, ``suffix``, ``user`` and ``stream_options`` stay
    on the queen: the shaper and the books use them, a worker has nothing to do with them.
    """
    out: dict[str, Any] = {
        "model": req.model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens or DEFAULT_MAX_TOKENS,
    }
    for name in _PASSED_ON:
        value = getattr(req, name)
        if value is not None:
            out[name] = value
    if req.logprobs is not None:
        out["logprobs"] = True
        out["top_logprobs"] = req.logprobs
    out["stream"] = req.stream
    return out


def echo_problem(req: CompletionRequest) -> str | None:
    """Why ``req``'s ``echo`` cannot be honoured (the message of a 400 with param ``echo``), or
    None. The queen holds no tokenizer, so it cannot turn a token-id prompt back into text."""
    if req.echo and any(not isinstance(prompt, str) for prompt in req.prompts):
        return ("'echo' is not supported with a prompt given as token ids: this server cannot "
                "turn token ids back into text; send the prompt as text")
    return None


def prompt_texts(req: CompletionRequest) -> list[str]:
    """One text per prompt, for the billing hold's estimate (``estimate_prompt_tokens``: a token
    per character): a text prompt as it is, a token-id prompt as a placeholder of its length."""
    return [prompt if isinstance(prompt, str) else " " * len(prompt) for prompt in req.prompts]


# --- logprobs ---------------------------------------------------------------------------------


def _token_bytes(entry: dict[str, Any]) -> bytes:
    raw = entry.get("bytes")
    if isinstance(raw, list):
        try:
            return bytes(raw)
        except (TypeError, ValueError):
            pass
    return str(entry.get("token", "")).encode("utf-8", "surrogatepass")


def completion_logprobs(entries: Iterable[dict[str, Any]], start: int) -> dict[str, Any]:
    """Chat logprobs entries (``logprobs.content``) as a text completion's ``logprobs``.

    ``text_offset`` counts characters from the start of the choice's text; ``start`` is where
    the first entry's token begins. Offsets follow the tokens' bytes (decoded as the worker
    decodes them), so a token that is half of a character adds nothing until its other half.
    ``top_logprobs`` maps each alternative's text to its logprob, with the chosen token always
    in it (as OpenAI's: up to ``logprobs`` + 1 entries); the most likely wins a duplicate text.
    """
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    offset = start
    for entry in entries:
        token = str(entry.get("token", ""))
        logprob = float(entry.get("logprob", 0.0))
        tokens.append(token)
        token_logprobs.append(logprob)
        text_offset.append(offset)
        offset += len(decoder.decode(_token_bytes(entry)))
        alternatives: dict[str, float] = {}
        for alt in entry.get("top_logprobs") or []:
            alternatives.setdefault(str(alt.get("token", "")), float(alt.get("logprob", 0.0)))
        alternatives.setdefault(token, logprob)
        top_logprobs.append(alternatives)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def _finish_reason(value: Any) -> str | None:
    if value is None:
        return None
    return value if value in FINISH_REASONS else "stop"


# --- the shaper -------------------------------------------------------------------------------


class CompletionShaper:
    """One ``/v1/completions`` request's answer: chat chunks in, ``text_completion`` out.

    Stream chunks carry one choice each, as OpenAI's do (``finish_reason`` null until the
    choice's last chunk). Choice ``i`` answers prompt ``i // n``: the worker already numbers
    choices ``prompt_index * n + choice``.
    """

    def __init__(self, req: CompletionRequest, completion_id: str, created: int,
                 model: str) -> None:
        problem = echo_problem(req)
        if problem is not None:
            raise ValueError(problem)
        self._id = completion_id
        self._created = created
        self._model = model
        self._n = req.choices
        self._echo: list[str] | None = (
            [prompt for prompt in req.prompts if isinstance(prompt, str)] if req.echo else None)
        self._logprobs = req.logprobs is not None
        self._include_usage = bool(req.stream_options and req.stream_options.include_usage)
        # Characters of each choice's text sent so far (the echoed prompt included).
        self._sent: dict[int, int] = {}

    @property
    def sse_done(self) -> bool:
        return True

    def _head(self) -> dict[str, Any]:
        return {"id": self._id, "object": TEXT_COMPLETION, "created": self._created,
                "model": self._model}

    def _prompt_of(self, index: int) -> str:
        if self._echo is None:
            return ""
        prompt = index // self._n
        return self._echo[prompt] if 0 <= prompt < len(self._echo) else ""

    def opening(self) -> list[Event]:
        return []

    def chunk(self, chunk: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        for choice in chunk.get("choices") or []:
            index = int(choice.get("index", 0))
            content = (choice.get("delta") or {}).get("content") or ""
            finish = _finish_reason(choice.get("finish_reason"))
            entries = (choice.get("logprobs") or {}).get("content") or []
            first = index not in self._sent
            prefix = self._prompt_of(index) if first else ""
            before = self._sent.get(index, 0)
            text = prefix + content
            self._sent[index] = before + len(text)
            if not text and not entries and finish is None:
                continue  # a role-only opening: nothing a text completion shows
            logprobs = (completion_logprobs(entries, before + len(prefix))
                        if self._logprobs else None)
            data = self._head()
            data["choices"] = [{"text": text, "index": index, "logprobs": logprobs,
                                "finish_reason": finish}]
            events.append((None, data))
        return events

    def closing(self, usage: dict[str, int]) -> list[Event]:
        if not self._include_usage:
            return []
        data = self._head()
        data["choices"] = []
        data["usage"] = dict(usage)
        return [(None, data)]

    def failed(self, error: dict[str, Any]) -> list[Event]:
        return [(None, error)]

    def whole(self, answer: dict[str, Any]) -> dict[str, Any]:
        choices = []
        for choice in sorted(answer.get("choices") or [], key=lambda c: int(c.get("index", 0))):
            index = int(choice.get("index", 0))
            prefix = self._prompt_of(index)
            content = (choice.get("message") or {}).get("content") or ""
            logprobs = None
            if self._logprobs:
                entries = (choice.get("logprobs") or {}).get("content") or []
                logprobs = completion_logprobs(entries, len(prefix))
            choices.append({"text": prefix + content, "index": index, "logprobs": logprobs,
                            "finish_reason": _finish_reason(choice.get("finish_reason")) or "stop"})
        data = self._head()
        data["choices"] = choices
        if answer.get("usage") is not None:
            data["usage"] = answer["usage"]
        return data
