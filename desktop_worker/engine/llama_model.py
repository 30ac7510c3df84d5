"""One loaded llama.cpp context: blocking chat generation and embeddings, with true usage.

Everything here blocks and runs in a worker thread, never on the event loop. One context
serves one generation at a time; ``ModelPool`` hands contexts out.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp
from llama_cpp import Llama
from llama_cpp.llama_chat_format import (
    ChatFormatterResponse,
    Jinja2ChatFormatter,
    chat_formatter_to_chat_completion_handler,
)

from desktop_worker.engine.fitting import LoadPlan
from desktop_worker.errors import ModelLoadError, UnsupportedRequest

log = logging.getLogger(__name__)


@dataclass
class Meter:
    """Counts a generation's tokens as llama.cpp sees them."""

    prompt_tokens: int = 0
    sampled: list[int] = field(default_factory=list)


class MeteredLlama(Llama):
    """``Llama`` that records the prompt length and every sampled token of a generation.

    llama-cpp-python reports no usage for streamed completions; this makes usage exact for
    both modes at the cost of one list append per token.
    """

    meter: Meter

    def generate(self, tokens: Sequence[int], *args: Any, **kwargs: Any) -> Iterator[int]:
        meter = self.meter = Meter(prompt_tokens=len(tokens))
        append = meter.sampled.append
        for token in super().generate(tokens, *args, **kwargs):
            append(token)
            yield token

    def continuation_handler(self, prefill: str) -> Any:
        """A chat handler whose prompt is the usual one (ending with the assistant's turn opened)
        plus ``prefill``: the model continues that text instead of starting a new answer."""
        template = self.metadata.get("tokenizer.chat_template")
        if not template:
            raise UnsupportedRequest("this model has no chat template in its metadata, so it "
                                     "cannot continue another worker's answer")
        eos_id, bos_id = self.token_eos(), self.token_bos()
        vocab = self._model
        formatter = Jinja2ChatFormatter(
            template=template,
            eos_token=vocab.token_get_text(eos_id) if eos_id != -1 else "",
            bos_token=vocab.token_get_text(bos_id) if bos_id != -1 else "",
            stop_token_ids=[eos_id],
        )
        return chat_formatter_to_chat_completion_handler(_Prefilled(formatter, prefill))

    def completion_tokens(self) -> int:
        sampled = self.meter.sampled
        if sampled and llama_cpp.llama_vocab_is_eog(self._model.vocab, sampled[-1]):
            return len(sampled) - 1
        return len(sampled)


class _Prefilled:
    """A chat formatter that appends already-written assistant text after the prompt."""

    def __init__(self, inner: Jinja2ChatFormatter, prefill: str) -> None:
        self.inner = inner
        self.prefill = prefill

    def __call__(self, **kwargs: Any) -> ChatFormatterResponse:
        response = self.inner(**kwargs)
        response.prompt += self.prefill
        return response


def _text(content: Any) -> str:
    """OpenAI message content (a string or a list of parts) as plain text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = [part.get("text", "") for part in content if isinstance(part, dict)]
    if len(parts) != len(content) or any(
        part.get("type") not in (None, "text") for part in content
    ):
        raise UnsupportedRequest("only text message content is supported")
    return "".join(parts)


def sampling_args(request: dict[str, Any]) -> dict[str, Any]:
    """Map an OpenAI chat request onto ``create_chat_completion`` arguments (OpenAI defaults)."""
    max_tokens = request.get("max_completion_tokens") or request.get("max_tokens")
    args: dict[str, Any] = {
        "messages": [
            {"role": m["role"], "content": _text(m.get("content"))}
            for m in request.get("messages", [])
        ],
        "temperature": 1.0 if request.get("temperature") is None else request["temperature"],
        "top_p": 1.0 if request.get("top_p") is None else request["top_p"],
        "max_tokens": max_tokens,
        "stop": request.get("stop") or [],
        "seed": request.get("seed"),
    }
    for name in ("presence_penalty", "frequency_penalty"):
        if request.get(name) is not None:
            args[name] = request[name]
    return args


class LlamaContext:
    """A model loaded into one llama.cpp context."""

    def __init__(
        self,
        name: str,
        path: Path,
        plan: LoadPlan,
        *,
        n_threads: int | None = None,
        embedding: bool = False,
    ) -> None:
        self.name = name
        self.plan = plan
        self.embedding = embedding
        kwargs: dict[str, Any] = {
            "model_path": str(path),
            "n_ctx": plan.n_ctx,
            "n_gpu_layers": plan.n_gpu_layers,
            "n_threads": n_threads,
            "n_threads_batch": n_threads,
            "verbose": False,
        }
        if embedding:
            kwargs.update(embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN)
        try:
            self.llama = MeteredLlama(**kwargs)
        except (ValueError, RuntimeError, OSError) as exc:
            raise ModelLoadError(f"llama.cpp could not load {name}: {exc}") from exc
        self.busy = threading.Lock()

    def close(self) -> None:
        self.llama.close()

    def stream_chat(
        self, request: dict[str, Any], cancel: threading.Event, continuation: str | None = None
    ) -> Iterator[dict[str, Any]]:
        """Yield OpenAI chunk dicts as tokens are produced; stops within a token of ``cancel``.

        With ``continuation`` (assistant text another worker already delivered), the model goes
        on from the end of that text; the chunks carry only the new text. After the generator
        ends, ``usage()`` gives the true token counts (the continuation counts as prompt).
        """
        llama = self.llama
        llama.meter = Meter()
        try:
            if continuation:
                handler = llama.continuation_handler(continuation)
                chunks = handler(llama=llama, **sampling_args(request), stream=True)
            else:
                chunks = llama.create_chat_completion(**sampling_args(request), stream=True)
        except ValueError as exc:  # e.g. the prompt does not fit the context
            raise UnsupportedRequest(str(exc)) from exc
        try:
            for chunk in chunks:
                if cancel.is_set():
                    break
                yield chunk
        except ValueError as exc:
            raise UnsupportedRequest(str(exc)) from exc
        finally:
            chunks.close()

    def usage(self) -> dict[str, int]:
        prompt = self.llama.meter.prompt_tokens
        completion = self.llama.completion_tokens()
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def embed(self, inputs: list[str]) -> tuple[list[list[float]], int]:
        """One mean-pooled vector per input, and the number of tokens read."""
        if not self.embedding:
            raise UnsupportedRequest("this context was not loaded for embeddings")
        try:
            vectors, tokens = self.llama.embed(inputs, return_count=True)
        except (ValueError, RuntimeError) as exc:
            raise UnsupportedRequest(f"embedding failed: {exc}") from exc
        return [list(map(float, vector)) for vector in vectors], int(tokens)
