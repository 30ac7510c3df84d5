"""One choice's generation, token by token: what the batch engine (``engine.batch``) runs
for every sequence it holds.

Chat and text completions, every feature: per step the choice's ``SamplerChain`` picks a token
in C from the logits the engine computed for it, its log probability is read from those logits
when asked, and ``TextStream`` decides which text may go out. Chunks have the shapes of wire15:
``index`` set, the role on a choice's first chunk, a finish chunk per choice (the choices of
one job run side by side, so their chunks interleave, as OpenAI's do). Blocking; runs in the
engine's thread.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import llama_cpp

from desktop_worker.engine.logprobs import Scorer
from desktop_worker.engine.sampler import SamplerChain, logits_row
from desktop_worker.engine.settings import GenerationSettings, choice_seed
from desktop_worker.engine.text import Released, TextStream
from desktop_worker.errors import UnsupportedRequest

log = logging.getLogger(__name__)

CHUNK = "chat.completion.chunk"
ASSISTANT = "assistant"


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt's tokens; ``delivered``: its trailing tokens that are answer text another
    worker already sent (a continuation), which a grammar must accept first."""

    tokens: list[int]
    delivered: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Counts:
    """True token counts of a job: each prompt once, every choice's sampled tokens (the end of
    generation token not counted)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


class Pieces:
    """Token id -> its bytes (``llama_token_to_piece``), cached: the vocabulary is fixed."""

    def __init__(self, vocab: llama_cpp.llama_vocab_p) -> None:
        self._vocab = vocab
        self._buffer = ctypes.create_string_buffer(256)
        self._cache: dict[int, bytes] = {}

    def __call__(self, token: int) -> bytes:
        piece = self._cache.get(token)
        if piece is None:
            size = llama_cpp.llama_token_to_piece(self._vocab, token, self._buffer, 256, 0, False)
            piece = self._buffer.raw[:max(size, 0)]
            self._cache[token] = piece
        return piece


class Choice:
    """One choice of one job as the batch engine runs it (``engine.batch``): its sampler
    chain, log probabilities, stop strings and chunks. ``advance`` takes the logits the engine
    computed for it (output ``index`` of the last decode) and returns the chunks to send and the
    token to evaluate next, or None once the choice ended (``finished``)."""

    def __init__(self, index: int, prompt: Prompt, settings: GenerationSettings,
                 grammar: str | None, seed: int, *, vocab: llama_cpp.llama_vocab_p,
                 n_vocab: int, n_ctx: int, pieces: Pieces) -> None:
        self.index = index
        self.prompt = prompt
        self._vocab = vocab
        self._n_vocab = n_vocab
        self._pieces = pieces
        budget = n_ctx - len(prompt.tokens)
        if settings.max_tokens is not None:
            budget = min(budget, settings.max_tokens)
        self.budget = budget
        self.completion_tokens = 0
        self.finished = False
        self.chain = SamplerChain(vocab, n_vocab, n_ctx, settings, seed, grammar)
        try:
            if prompt.delivered and self.chain.constrained:
                self.chain.accept_prefix(prompt.delivered)
        except BaseException:
            self.chain.close()
            raise
        self._scorer = (Scorer(settings.logit_bias, settings.top_logprobs, pieces)
                        if settings.logprobs else None)
        self._stream: TextStream[dict[str, Any] | None] = TextStream(settings.stops)
        self._emitter = _Emitter(index, settings.logprobs)

    def advance(self, ctx: llama_cpp.llama_context_p, output: int
                ) -> tuple[list[dict[str, Any]], int | None]:
        """Sample from output ``output`` of the last decode: the chunks it releases, and the
        token to evaluate next (None: the choice ended, its finish chunk is in the list)."""
        if self.budget <= 0:
            return self.end("length"), None
        token = self.chain.sample(ctx, output)
        if llama_cpp.llama_vocab_is_eog(self._vocab, token):
            return self.end("stop"), None
        self.completion_tokens += 1
        piece = self._pieces(token)
        entry = None
        if self._scorer is not None:
            logits = logits_row(ctx, output, self._n_vocab)
            entry = self._scorer.score(logits, token, piece)
        released = self._stream.push(piece, entry)
        chunks = [chunk] if (chunk := self._emitter.content(released)) is not None else []
        if released.stopped:
            return chunks + self.end("stop"), None
        if self.completion_tokens >= self.budget:
            return chunks + self.end("length"), None
        return chunks, token

    def end(self, reason: str) -> list[dict[str, Any]]:
        """The last chunks: text held back for a stop string that never came, then the
        finish."""
        self.finished = True
        chunks: list[dict[str, Any]] = []
        if (chunk := self._emitter.content(self._stream.finish(), last=True)) is not None:
            chunks.append(chunk)
        chunks.extend(self._emitter.finish(reason))
        return chunks

    def close(self) -> None:
        self.chain.close()


def job_choices(prompts: Sequence[Prompt], settings: GenerationSettings, grammar: str | None,
                *, vocab: llama_cpp.llama_vocab_p, n_vocab: int, n_ctx: int,
                pieces: Pieces) -> list[Choice]:
    """Every choice of a job (prompt by prompt, ``n`` each, ``index`` in that order), or
    ``UnsupportedRequest`` naming what cannot be served (nothing is left open then)."""
    settings.check_vocabulary(n_vocab)
    choices: list[Choice] = []
    try:
        for prompt_index, prompt in enumerate(prompts):
            if len(prompt.tokens) >= n_ctx:
                raise UnsupportedRequest(
                    f"the prompt is {len(prompt.tokens)} tokens, which does not fit this "
                    f"worker's context of {n_ctx} tokens with room to answer")
            if not prompt.tokens:
                raise UnsupportedRequest("the prompt is empty")
            for i in range(settings.n):
                choices.append(Choice(prompt_index * settings.n + i, prompt, settings, grammar,
                                      choice_seed(settings.seed, i), vocab=vocab,
                                      n_vocab=n_vocab, n_ctx=n_ctx, pieces=pieces))
    except BaseException:
        for choice in choices:
            choice.close()
        raise
    return choices


class _Emitter:
    """Turns one choice's released tokens into chunks: the role on the first, log
    probabilities with the text they belong to, the finish last."""

    def __init__(self, index: int, logprobs: bool) -> None:
        self.index = index
        self.logprobs = logprobs
        self.opened = False
        self._entries: list[dict[str, Any]] = []  # released with no text yet

    def content(self, released: Released[dict[str, Any] | None],
                last: bool = False) -> dict[str, Any] | None:
        for entry, text in released.tokens:
            if entry is not None:
                entry["token"] = text
                self._entries.append(entry)
        text = released.text
        if not text and not (last and self._entries):
            return None
        delta: dict[str, Any] = {"content": text}
        if not self.opened:
            delta = {"role": ASSISTANT, "content": text}
            self.opened = True
        choice: dict[str, Any] = {"index": self.index, "delta": delta}
        if self.logprobs:
            choice["logprobs"] = {"content": self._entries}
            self._entries = []
        choice["finish_reason"] = None
        return {"object": CHUNK, "choices": [choice]}

    def finish(self, reason: str) -> Iterator[dict[str, Any]]:
        if not self.opened:
            self.opened = True
            yield {"object": CHUNK, "choices": [{"index": self.index, "delta": {
                "role": ASSISTANT, "content": ""}, "finish_reason": None}]}
        yield {"object": CHUNK, "choices": [
            {"index": self.index, "delta": {}, "finish_reason": reason}]}
