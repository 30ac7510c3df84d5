"""The queen's bound on what an answer can have cost: a worker's usage is a claim, not the bill.

Every token of every tokenizer decodes to at least one byte, except special tokens. So the
completion of an answer has at most as many tokens as the UTF-8 bytes the client was delivered,
plus the stop string that ended it (generated, not delivered), plus one end-of-turn token. The
prompt has at most as many tokens as the bytes of its messages, plus what the model's chat
template adds: a few tokens of framing per message, and a fixed allowance the operator sets
(``template_allowance_tokens``: a default system prompt, a date line).

``Meter`` holds one request's bounds; ``bill`` turns a worker's claim into the usage the queen
charges, credits, ranks by and reports to the client: the claim where it is lower, the bound
where the claim is higher. A worker can only lower its own pay. Pure functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from queen_server.swarm.jobs import choices_in
from shared_schema import Usage

# Tokens a chat template may add around each message (role markers, separators).
PER_MESSAGE_TOKENS = 8
# The end-of-turn token that ends an answer (special: it decodes to no byte).
END_TOKENS = 1
# Tokens an embedding model may add around each input (BOS, EOS, a separator).
PER_INPUT_TOKENS = 2


def utf8_bytes(text: str) -> int:
    """Bytes of ``text`` as UTF-8 (a lone surrogate from JSON counts as the 3 bytes it takes)."""
    if text.isascii():
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


def content_text(content: Any) -> str:
    """The text of a message's ``content``: a string, or the ``text`` of its parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def estimate_prompt_tokens(texts: Iterable[str]) -> int:
    """What a hold reserves for a prompt: a token per character, plus a few tokens of chat
    template framing per message (an estimate; ``Meter.prompt_bound`` is the bound)."""
    return sum(len(text) + PER_MESSAGE_TOKENS for text in texts)


def stop_bytes(stop: Any) -> int:
    """The longest stop string the request gave, in bytes (it may end the answer undelivered)."""
    if isinstance(stop, str):
        return utf8_bytes(stop)
    if isinstance(stop, list):
        return max((utf8_bytes(item) for item in stop if isinstance(item, str)), default=0)
    return 0


@dataclass(frozen=True, slots=True)
class Meter:
    """One request's bounds: the prompt's tokens, and what an answer's end can add to the bytes
    delivered (the longest stop string and the end token)."""

    prompt_bound: int
    prompt_estimate: int  # charged for the prompt of an answer the client left (no usage came)
    end_allowance: int  # tokens an answer's end may add past the bytes delivered

    @classmethod
    def for_chat(cls, request: Mapping[str, Any], template_allowance: int) -> Meter:
        messages = request.get("messages") or []
        bound = template_allowance
        estimate = 0
        for message in messages:  # one pass: this runs for every request
            if not isinstance(message, Mapping):
                continue
            text = content_text(message.get("content"))
            framing = utf8_bytes(str(message.get("role") or ""))
            name = message.get("name")
            if name:
                framing += utf8_bytes(str(name))
            bound += utf8_bytes(text) + framing + PER_MESSAGE_TOKENS
            estimate += len(text) + PER_MESSAGE_TOKENS
        return cls(bound, min(bound, estimate), end_allowance(request))

    @classmethod
    def for_completions(cls, request: Mapping[str, Any], template_allowance: int) -> Meter:
        """A text completion's prompts: text (bytes bound its tokens, plus a BOS) or token ids
        (their count is exact); each prompt is read once, whatever ``n`` is."""
        prompt = request.get("prompt")
        prompts = [prompt] if isinstance(prompt, str) or _is_ids(prompt) else list(prompt or [])
        bound = template_allowance
        estimate = 0
        for item in prompts:
            if isinstance(item, str):
                bound += utf8_bytes(item) + PER_INPUT_TOKENS
                estimate += len(item) + PER_INPUT_TOKENS
            elif isinstance(item, list):
                bound += len(item)
                estimate += len(item)
        return cls(bound, min(bound, estimate), end_allowance(request))

    @classmethod
    def for_embeddings(cls, request: Mapping[str, Any]) -> Meter:
        """Inputs are strings (bytes bound them) or lists of token ids (their length is exact)."""
        inputs = request.get("input")
        items = [inputs] if isinstance(inputs, str) or _is_ids(inputs) else list(inputs or [])
        bound = 0
        for item in items:
            bound += PER_INPUT_TOKENS + (utf8_bytes(item) if isinstance(item, str)
                                         else len(item) if isinstance(item, list) else 0)
        return cls(bound, bound, 0)

    def completion_bound(self, delivered_bytes: int) -> int:
        """The most completion tokens an answer whose client got ``delivered_bytes`` can hold."""
        return delivered_bytes + self.end_allowance

    def bill(self, claimed: Usage, delivered_bytes: int) -> Usage:
        """The usage charged for a worker's claim: never more than the bounds (the claim
        itself when it is within them, as an honest worker's is)."""
        if (claimed.prompt_tokens <= self.prompt_bound
                and claimed.completion_tokens <= delivered_bytes + self.end_allowance
                and claimed.total_tokens == claimed.prompt_tokens + claimed.completion_tokens):
            return claimed
        prompt = min(claimed.prompt_tokens, self.prompt_bound)
        completion = min(claimed.completion_tokens, self.completion_bound(delivered_bytes))
        return counted(prompt, completion)


def end_allowance(request: Mapping[str, Any]) -> int:
    """Tokens the ends of a request's answers may add past the bytes delivered: per choice, the
    longest stop string and the end token."""
    stop = request.get("stop")
    end = END_TOKENS if stop is None else stop_bytes(stop) + END_TOKENS
    return end * choices_in(request)


def counted(prompt: int, completion: int) -> Usage:
    """A usage the queen computed itself. (Plain construction: pydantic's ``model_construct``
    measured slower than validating three ints.)"""
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(item, int) and not isinstance(item, bool) for item in value)


# A meter that bounds nothing: for callers that have no request to read (tests of the books).
UNBOUNDED = Meter(prompt_bound=2**62, prompt_estimate=0, end_allowance=2**62)
