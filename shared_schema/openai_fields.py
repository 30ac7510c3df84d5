"""Every field of OpenAI's request schemas, and what the queen does with it: the one list.

A field is **honoured** (it does what OpenAI documents), **accepted with no effect** (OpenAI
defines it as an identifier or a hint that changes nothing in the answer: ``user``,
``prompt_cache_key``), accepted **only** with the value the queen can honour (``store: false``),
or **refused** with a 400 whose ``param`` names it and whose message says why. A field OpenAI
does not define is refused as unrecognised, as OpenAI itself does. Nothing is dropped silently.

The request models (``openai_requests``, ``responses``) hold exactly the fields this list does
not refuse; tests/shared_schema/test_openai_fields.py walks the list against them and against the
installed ``openai`` SDK's own parameter lists, so a field OpenAI adds shows up as a failing test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["honoured", "no_effect", "only", "refused"]


@dataclass(frozen=True, slots=True)
class FieldRule:
    kind: Kind
    note: str = ""


def honoured(note: str = "") -> FieldRule:
    return FieldRule("honoured", note)


def no_effect(note: str) -> FieldRule:
    return FieldRule("no_effect", note)


def only(note: str) -> FieldRule:
    return FieldRule("only", note)


def refused(note: str) -> FieldRule:
    return FieldRule("refused", note)


_NO_STORE = "the queen keeps no completions or responses"
_IDENTIFIER = "an identifier of the end user, for abuse tracking; the answer does not depend on it"
_CACHE_HINT = ("a hint for prompt caching; workers reuse cached prompt prefixes per API key, "
               "and a chat's next turn goes back to the worker that holds its history")

CHAT: dict[str, FieldRule] = {
    "model": honoured(),
    "messages": honoured("text content; tool calls and tool results; no images or audio"),
    "stream": honoured(),
    "stream_options": honoured("include_usage; include_obfuscation has no effect"),
    "max_tokens": honoured(),
    "max_completion_tokens": honoured(),
    "temperature": honoured(),
    "top_p": honoured(),
    "stop": honoured("up to 4 sequences"),
    "seed": honoured("same seed, same worker build: same answer"),
    "n": honoured(f"up to {8} choices, made one after another, each billed"),
    "presence_penalty": honoured(),
    "frequency_penalty": honoured(),
    "logit_bias": honoured("token ids of the model's own vocabulary"),
    "logprobs": honoured(),
    "top_logprobs": honoured("0-20, with logprobs: true"),
    "response_format": honoured("text, json_object and json_schema, enforced by a grammar"),
    "tools": honoured("function tools, answered with a grammar-constrained call"),
    "tool_choice": honoured("none, auto, required or a named function"),
    "parallel_tool_calls": honoured("false: at most one call per answer"),
    "user": no_effect(_IDENTIFIER),
    "safety_identifier": no_effect(_IDENTIFIER),
    "prompt_cache_key": no_effect(_CACHE_HINT),
    "store": only(f"false: {_NO_STORE}"),
    "service_tier": only("auto or default: the swarm has one tier"),
    "modalities": only('["text"]: workers answer in text'),
    "metadata": refused(f"metadata is kept with stored completions, and {_NO_STORE}"),
    "audio": refused("workers answer in text only"),
    "prediction": refused("predicted outputs are not supported"),
    "reasoning_effort": refused("the models served here have no reasoning setting"),
    "verbosity": refused("the models served here have no verbosity setting"),
    "web_search_options": refused("workers have no web access"),
    "moderation": refused("the queen runs no moderation"),
    "prompt_cache_retention": refused("prompt caching cannot be configured"),
    "prompt_cache_options": refused("prompt caching cannot be configured"),
    "functions": refused("deprecated by OpenAI; send 'tools' instead"),
    "function_call": refused("deprecated by OpenAI; send 'tool_choice' instead"),
}

COMPLETIONS: dict[str, FieldRule] = {
    "model": honoured(),
    "prompt": honoured("a string, a list of strings, token ids, or a list of token-id lists"),
    "stream": honoured(),
    "stream_options": honoured("include_usage"),
    "max_tokens": honoured("16 when not given, as OpenAI's default"),
    "temperature": honoured(),
    "top_p": honoured(),
    "stop": honoured("up to 4 sequences"),
    "seed": honoured(),
    "n": honoured("up to 8 choices per prompt"),
    "best_of": only("equal to n: every choice made is returned"),
    "presence_penalty": honoured(),
    "frequency_penalty": honoured(),
    "logit_bias": honoured(),
    "logprobs": honoured("0-5, for the generated tokens (not with echo)"),
    "echo": honoured("the prompt text before the completion (not with logprobs)"),
    "suffix": only("null: inserting text before a suffix (fill-in-the-middle) is not "
                   "supported"),
    "user": no_effect(_IDENTIFIER),
}

EMBEDDINGS: dict[str, FieldRule] = {
    "model": honoured(),
    "input": honoured("strings, token ids, or lists of token ids"),
    "encoding_format": honoured("float or base64"),
    "dimensions": refused("vectors come in the model's own size; shortening them is not "
                          "supported"),
    "user": no_effect(_IDENTIFIER),
}

RESPONSES: dict[str, FieldRule] = {
    "model": honoured(),
    "input": honoured("text, or messages, function calls and their outputs"),
    "instructions": honoured(),
    "max_output_tokens": honoured(),
    "temperature": honoured(),
    "top_p": honoured(),
    "stream": honoured("the response.* events"),
    "stream_options": honoured("include_obfuscation has no effect"),
    "tools": honoured("function tools only"),
    "tool_choice": honoured("none, auto, required or a named function"),
    "parallel_tool_calls": honoured("false: at most one call per response"),
    "text": honoured("format: text, json_object or json_schema"),
    "user": no_effect(_IDENTIFIER),
    "safety_identifier": no_effect(_IDENTIFIER),
    "prompt_cache_key": no_effect(_CACHE_HINT),
    "store": only(f"false: {_NO_STORE}"),
    "service_tier": only("auto or default"),
    "truncation": only("disabled: an input too long for the model is an error"),
    "include": only("empty: no extra output data is available"),
    "metadata": refused(f"metadata is kept with stored responses, and {_NO_STORE}"),
    "previous_response_id": refused(f"{_NO_STORE}; send the whole conversation as input"),
    "conversation": refused(f"{_NO_STORE}; send the whole conversation as input"),
    "background": refused("responses are answered while the request is open"),
    "background_options": refused("responses are answered while the request is open"),
    "reasoning": refused("the models served here have no reasoning setting"),
    "top_logprobs": refused("log probabilities are served by /v1/chat/completions"),
    "max_tool_calls": refused("built-in tools are not supported"),
    "prompt": refused("stored prompt templates are not supported"),
    "context_management": refused("context management is not supported"),
    "moderation": refused("the queen runs no moderation"),
    "access_programs": refused("not supported"),
    "image": refused("workers answer in text only"),
    "prompt_cache_retention": refused("prompt caching cannot be configured"),
    "prompt_cache_options": refused("prompt caching cannot be configured"),
}

IMAGES: dict[str, FieldRule] = {
    "model": honoured("a diffusion model a connected worker with the image capability holds"),
    "prompt": honoured("up to 4,000 characters (the model's text encoder reads its first 77 "
                       "tokens)"),
    "n": honoured("up to 4 images, seeds seed, seed + 1, ..."),
    "size": honoured("WIDTHxHEIGHT, each side a multiple of 64 from 64 to 2048, at most "
                     "2,097,152 pixels; auto is 512x512"),
    "response_format": honoured("b64_json (the default) or url (kept by the queen for a "
                                "limited time)"),
    "output_format": honoured("png, jpeg or webp"),
    "output_compression": honoured("jpeg and webp only"),
    "quality": honoured("the number of steps: low 10, auto/standard/medium 20, high/hd 30, "
                        "xhigh 40, max 50 (steps overrides it)"),
    "background": only("auto or opaque: diffusion models render opaque images"),
    "stream": only("false: images are answered whole"),
    "user": no_effect(_IDENTIFIER),
    "safety_identifier": no_effect(_IDENTIFIER),
    "style": refused("a DALL-E 3 setting; say the style in the prompt"),
    "moderation": refused("the queen runs no moderation"),
    "partial_images": refused("images are answered whole, not streamed"),
    "complexity": refused("an SVG setting; images are raster images"),
    "frame_count": refused("animated images are not supported"),
    "frame_duration_ms": refused("animated images are not supported"),
    "svg": refused("SVG output is not supported"),
    # Apiary's extra fields (the openai SDK sends them with extra_body)
    "seed": honoured("Apiary's extra: the first image's seed, 0 to 2**32 - 1 (drawn when left "
                     "out, and answered in apiary.seed)"),
    "steps": honoured("Apiary's extra: sampling steps, 1 to 100"),
    "negative_prompt": honoured("Apiary's extra: what the image should not show"),
    "guidance": honoured("Apiary's extra: the classifier-free guidance scale, 0 to 30 "
                         "(default 7)"),
    "sampler": honoured("Apiary's extra: euler, euler_a (default), heun, dpm2, dpm++2m, "
                        "dpm++2mv2 or lcm"),
}

ENDPOINTS: dict[str, dict[str, FieldRule]] = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETIONS,
    "/v1/embeddings": EMBEDDINGS,
    "/v1/responses": RESPONSES,
    "/v1/images/generations": IMAGES,
}


FINE_TUNING_JOBS: dict[str, FieldRule] = {
    "model": honoured("a base model a connected worker that trains holds"),
    "training_file": honoured("one of the caller's files with purpose fine-tune"),
    "validation_file": honoured("one of the caller's files with purpose fine-tune"),
    "suffix": honoured("up to 64 letters, digits, '-' and '_'"),
    "seed": honoured(),
    "method": honoured("supervised only"),
    "hyperparameters": honoured("batch_size, learning_rate_multiplier, n_epochs"),
    "metadata": honoured("kept and shown on the job"),
    "integrations": refused("this queen runs no integrations (Weights and Biases)"),
}


def refusal(fields: dict[str, FieldRule], name: str) -> tuple[str, str]:
    """The message and code of the 400 for a top-level field ``name`` that the request model
    does not hold: why it is refused, or that OpenAI defines no such field."""
    rule = fields.get(name)
    if rule is not None and rule.kind == "refused":
        return f"'{name}' is not supported by this server: {rule.note}.", "unsupported_parameter"
    if rule is not None:  # honoured fields the model holds never get here
        return f"Invalid value for '{name}': {rule.note}.", "invalid_value"
    return f"Unrecognized request argument supplied: {name}", "unknown_parameter"
