"""The generation loop: prompts in, chat-completion chunks out, over one llama.cpp context.

One loop serves chat and text completions, every choice and every feature: the prompt is
evaluated (reusing the context's cached prefix, so the n choices of one prompt read it once),
then per step the choice's ``SamplerChain`` picks a token in C, its log probability is read
from the last position's logits when asked, and ``TextStream`` decides which text may go out.
Chunks have the shapes of wire15: choices one after another, ``index`` set, the role on a
choice's first chunk, a finish chunk per choice. Blocking; runs in a worker thread.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp import Llama

from desktop_worker.engine.logprobs import Scorer
from desktop_worker.engine.sampler import SamplerChain
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


def evaluate_prompt(llama: Llama, tokens: Sequence[int]) -> None:
    """Evaluate ``tokens`` into the context, keeping the longest cached prefix (at least the
    last token is evaluated again: its logits are the first step's)."""
    cached = llama.n_tokens
    limit = min(cached, len(tokens) - 1)
    common = 0
    if limit > 0:
        same = llama.input_ids[:limit] == np.asarray(tokens[:limit], dtype=llama.input_ids.dtype)
        common = limit if same.all() else int(np.argmin(same))
    if common > 0 and llama._ctx.kv_cache_seq_rm(-1, common, -1):
        llama.n_tokens = common
    else:
        llama.reset()
        common = 0
    llama.eval(list(tokens[common:]))


class Generation:
    """The choices of one job on one ``Llama``; ``counts`` holds its usage when it ends."""

    def __init__(self, llama: Llama, settings: GenerationSettings, grammar: str | None,
                 cancel: threading.Event, pieces: Pieces) -> None:
        self.llama = llama
        self.settings = settings
        self.grammar = grammar
        self.cancel = cancel
        self.pieces = pieces
        self.counts = Counts()
        self._vocab = llama._model.vocab
        self._n_vocab = llama.n_vocab()
        settings.check_vocabulary(self._n_vocab)

    def run(self, prompts: Sequence[Prompt]) -> Iterator[dict[str, Any]]:
        """Every choice's chunks: prompt by prompt, ``n`` choices each."""
        n = self.settings.n
        for prompt_index, prompt in enumerate(prompts):
            if len(prompt.tokens) >= self.llama.n_ctx():
                raise UnsupportedRequest(
                    f"the prompt is {len(prompt.tokens)} tokens, which does not fit this "
                    f"worker's context of {self.llama.n_ctx()} tokens with room to answer")
            self.counts.prompt_tokens += len(prompt.tokens)
            for i in range(n):
                yield from self._choice(prompt, prompt_index * n + i, choice_seed(
                    self.settings.seed, i))
                if self.cancel.is_set():
                    return

    def _choice(self, prompt: Prompt, index: int, seed: int) -> Iterator[dict[str, Any]]:
        settings, llama = self.settings, self.llama
        budget = llama.n_ctx() - len(prompt.tokens)
        if settings.max_tokens is not None:
            budget = min(budget, settings.max_tokens)
        chain = SamplerChain(self._vocab, self._n_vocab, llama.n_ctx(), settings, seed,
                             self.grammar)
        try:
            if prompt.delivered and chain.constrained:
                chain.accept_prefix(prompt.delivered)
            evaluate_prompt(llama, prompt.tokens)
            scorer = (Scorer(settings.logit_bias, settings.top_logprobs, self.pieces)
                      if settings.logprobs else None)
            stream: TextStream[dict[str, Any] | None] = TextStream(settings.stops)
            emitter = _Emitter(index, settings.logprobs)
            finish = "length"
            ctx = llama._ctx.ctx
            for step in range(budget):
                if self.cancel.is_set():
                    return
                token = chain.sample(ctx)
                if llama_cpp.llama_vocab_is_eog(self._vocab, token):
                    finish = "stop"
                    break
                self.counts.completion_tokens += 1
                piece = self.pieces(token)
                entry = None
                if scorer is not None:
                    logits = np.ctypeslib.as_array(
                        llama_cpp.llama_get_logits_ith(ctx, -1), shape=(self._n_vocab,))
                    entry = scorer.score(logits, token, piece)
                released = stream.push(piece, entry)
                if (chunk := emitter.content(released)) is not None:
                    yield chunk
                if released.stopped:
                    finish = "stop"
                    break
                if step + 1 < budget:
                    llama.eval([token])
            if (chunk := emitter.content(stream.finish(), last=True)) is not None:
                yield chunk
            yield from emitter.finish(finish)
        finally:
            chain.close()


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
