"""What a job's request asks of generation, read once into plain values.

The queen validates every request before it sends it, but a worker must never crash on a bad
one: each value is checked again here and a bad one is an ``UnsupportedRequest`` (a
non-retryable ``invalid_request`` job error) that names the field. Everything here is pure: no
model, no llama.cpp, so it is tested on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from desktop_worker.errors import UnsupportedRequest

MAX_CHOICES = 8
MAX_TOP_LOGPROBS = 20
MAX_STOPS = 4
# llama.cpp's "pick a random seed" value: never sent as a client's own seed.
RANDOM_SEED = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class GenerationSettings:
    """Sampling and output settings of one job, with OpenAI's defaults filled in."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    stops: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    response_format: dict[str, Any] | None = None

    def check_vocabulary(self, n_vocab: int) -> None:
        """A ``logit_bias`` key outside the model's vocabulary is the client's mistake (and
        llama.cpp would write past its logits array)."""
        for token in self.logit_bias:
            if not 0 <= token < n_vocab:
                raise UnsupportedRequest(f"logit_bias names token {token}, which is not in this "
                                         f"model's vocabulary (ids 0 to {n_vocab - 1})")


def _number(request: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = request.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise UnsupportedRequest(f"'{name}' must be a number from {low:g} to {high:g}")
    return float(value)


def _integer(request: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = request.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UnsupportedRequest(f"'{name}' must be an integer from {low} to {high}")
    return value


def _stops(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if (not isinstance(stops, list) or len(stops) > MAX_STOPS
            or not all(isinstance(stop, str) for stop in stops)):
        raise UnsupportedRequest(f"'stop' must be a string or a list of at most {MAX_STOPS}")
    return tuple(stop for stop in stops if stop)


def _logit_bias(value: Any) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UnsupportedRequest("'logit_bias' must map token ids to biases")
    out: dict[int, float] = {}
    for key, bias in value.items():
        if not isinstance(key, str) or not key.isdigit():
            raise UnsupportedRequest(f"logit_bias key {str(key)[:40]!r} is not a token id")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise UnsupportedRequest(f"the bias of token {key} must be from -100 to 100")
        out[int(key)] = float(bias)
    return out


def _response_format(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object",
                                                                 "json_schema"):
        raise UnsupportedRequest("'response_format' type must be text, json_object or "
                                 "json_schema")
    if value["type"] == "text":
        return None
    if value["type"] == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise UnsupportedRequest("'response_format.json_schema.schema' must be an object")
    return value


def read_settings(request: dict[str, Any]) -> GenerationSettings:
    """The settings of a chat or text completion request (worker fields, see wire15)."""
    max_tokens = _integer(request, "max_completion_tokens", 1, 2**31 - 1)
    if max_tokens is None:
        max_tokens = _integer(request, "max_tokens", 1, 2**31 - 1)
    logprobs = request.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise UnsupportedRequest("'logprobs' must be true or false (the chat form)")
    seed = _integer(request, "seed", -(2**63), 2**64 - 1)
    return GenerationSettings(
        temperature=_number(request, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(request, "top_p", 1.0, 0.0, 1.0),
        max_tokens=max_tokens,
        stops=_stops(request.get("stop")),
        seed=seed,
        presence_penalty=_number(request, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(request, "frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=_logit_bias(request.get("logit_bias")),
        n=_integer(request, "n", 1, MAX_CHOICES) or 1,
        logprobs=bool(logprobs),
        top_logprobs=(_integer(request, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0)
        if logprobs else 0,
        response_format=_response_format(request.get("response_format")),
    )


def choice_seed(seed: int | None, index: int) -> int:
    """The 32-bit seed llama.cpp's sampler gets for choice ``index``: ``seed + index`` (so each
    choice differs and a repeated request repeats), or llama.cpp's random seed without one."""
    if seed is None:
        return RANDOM_SEED
    value = (seed + index) % 2**32
    return value - 1 if value == RANDOM_SEED else value


def message_text(content: Any) -> str:
    """OpenAI message content (a string or a list of text parts) as plain text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(
            isinstance(part, dict) and part.get("type") in (None, "text")
            and isinstance(part.get("text", ""), str) for part in content):
        raise UnsupportedRequest("only text message content is supported")
    return "".join(part.get("text", "") for part in content)


def chat_messages(request: dict[str, Any]) -> list[dict[str, str]]:
    """The conversation as role + text turns, for the model's chat template."""
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        raise UnsupportedRequest("'messages' must be a non-empty list")
    out = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise UnsupportedRequest("each message needs a 'role'")
        out.append({"role": message["role"], "content": message_text(message.get("content"))})
    return out


def completion_prompts(request: dict[str, Any]) -> list[str | list[int]]:
    """A text completion's prompts: one per entry, each text or token ids (see wire15)."""
    prompt = request.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise UnsupportedRequest("'prompt' must be a string, a list of strings, a list of "
                                 "token ids or a list of token-id lists")
    if all(_is_token(item) for item in prompt):
        return [list(prompt)]
    prompts: list[str | list[int]] = []
    for item in prompt:
        if isinstance(item, str):
            prompts.append(item)
        elif isinstance(item, list) and item and all(_is_token(token) for token in item):
            prompts.append(list(item))
        else:
            raise UnsupportedRequest("each prompt must be a string or a non-empty list of "
                                     "token ids")
    return prompts


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_token_ids(tokens: list[int], n_vocab: int, what: str) -> list[int]:
    """``tokens`` if every id is in the model's vocabulary; ``UnsupportedRequest`` naming
    ``what`` ("the prompt", "an embeddings input") otherwise."""
    if any(not 0 <= token < n_vocab for token in tokens):
        raise UnsupportedRequest(f"{what} has a token id outside this model's vocabulary (ids 0 "
                                 f"to {n_vocab - 1})")
    return tokens
