"""One choice's llama.cpp sampler chain, built from the request's settings.

The chain is llama.cpp's own (``llama_sampler_chain``): logit bias, then presence/frequency
penalties, then the grammar, then greedy (temperature 0) or top-k 40 / top-p / min-p 0.05 /
temperature / seeded draw (llama-cpp-python's defaults, which the worker has always used). It
runs in C over the whole vocabulary; Python sees one token per step.

A greedy chain with nothing before it (no logit bias, penalties or grammar) is llama.cpp's
greedy sampler alone: the first token of the highest logit. ``sample`` reads that from the
logits row itself (``numpy.argmax``, which also takes the first of equal maxima) instead of
``llama_sampler_sample``, which copies the whole vocabulary into a new candidate array first:
about 5 against 52 us a token on the 2-core development VM, for every stream of every step
(``bench/step_cost.py``). The greedy sampler keeps no state, so there is nothing to accept.

The grammar sampler is kept out of the chain. Applying a grammar to the whole vocabulary each
step halves the speed (bench/grammar_cost.py), so, as llama.cpp's own ``common_sampler`` does,
the chain first picks a token freely and the grammar checks only that one; only when it
rejects it is the grammar applied to every candidate and the chain run again. The same check
guards a continuation's tokens: accepting a token the grammar rejects throws a C++ exception
inside llama.cpp, which aborts the process.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Sequence

import llama_cpp
import numpy as np

from desktop_worker.engine.settings import GenerationSettings
from desktop_worker.errors import UnsupportedRequest

log = logging.getLogger(__name__)

TOP_K = 40
MIN_P = 0.05


TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)],
                      align=True)  # llama_token_data


def fill_candidates(data: np.ndarray, ids: np.ndarray, logits: np.ndarray,
                    candidates: llama_cpp.llama_token_data_array
                    ) -> llama_cpp.llama_token_data_array:
    """``candidates`` over ``data`` (a ``TOKEN_DATA`` array the size of the vocabulary) holding
    every token with its logit, unsorted, none selected: what a sampler's ``apply`` takes."""
    data["id"] = ids
    data["logit"] = logits
    data["p"] = 0.0
    candidates.data = data.ctypes.data_as(llama_cpp.llama_token_data_p)
    candidates.size = data.size
    candidates.selected = -1
    candidates.sorted = False
    return candidates


def logits_row(ctx: llama_cpp.llama_context_p, output: int, n_vocab: int) -> np.ndarray:
    """The logits of output ``output`` of the last decode, as a view (valid until the next
    decode); ``RuntimeError`` when llama.cpp has none there."""
    pointer = llama_cpp.llama_get_logits_ith(ctx, output)
    if not pointer:
        raise RuntimeError(f"llama.cpp has no logits for output {output} of the last decode")
    # A ctypes array type made once per vocabulary size: 1.3 us a row, where
    # ``np.ctypeslib.as_array`` makes one each call (13 us).
    return np.frombuffer(_row_type(n_vocab).from_address(ctypes.addressof(pointer.contents)),
                         dtype=np.float32)


@functools.cache
def _row_type(n_vocab: int) -> type[ctypes.Array[ctypes.c_float]]:
    return ctypes.c_float * n_vocab


class SamplerChain:
    """A sampler chain for one choice; ``close`` frees it (and every sampler in it)."""

    def __init__(
        self,
        vocab: llama_cpp.llama_vocab_p,
        n_vocab: int,
        n_ctx: int,
        settings: GenerationSettings,
        seed: int,
        grammar: str | None,
    ) -> None:
        self._chain = llama_cpp.llama_sampler_chain_init(
            llama_cpp.llama_sampler_chain_default_params())
        self._grammar: llama_cpp.llama_sampler_p | None = None
        self._n_vocab = n_vocab
        self._ids = np.arange(n_vocab, dtype=np.int32)
        self._data = np.zeros(n_vocab, dtype=TOKEN_DATA)
        self._candidates = llama_cpp.llama_token_data_array()
        self._check = llama_cpp.llama_token_data_array()
        self._candidate = llama_cpp.llama_token_data()
        self._argmax = False  # the chain is the greedy sampler alone: ``sample`` reads argmax
        try:
            self._build(vocab, n_vocab, n_ctx, settings, seed, grammar)
        except BaseException:
            self.close()
            raise

    def _add(self, sampler: llama_cpp.llama_sampler_p) -> None:
        llama_cpp.llama_sampler_chain_add(self._chain, sampler)

    def _build(self, vocab: llama_cpp.llama_vocab_p, n_vocab: int, n_ctx: int,
               settings: GenerationSettings, seed: int, grammar: str | None) -> None:
        if settings.logit_bias:
            biases = (llama_cpp.llama_logit_bias * len(settings.logit_bias))()
            for i, (token, bias) in enumerate(settings.logit_bias.items()):
                biases[i].token = token
                biases[i].bias = bias
            self._add(llama_cpp.llama_sampler_init_logit_bias(
                n_vocab, len(settings.logit_bias), biases))
        if settings.presence_penalty or settings.frequency_penalty:
            # Over every token of the answer (the window is the whole context), as OpenAI's.
            self._add(llama_cpp.llama_sampler_init_penalties(
                n_vocab, n_ctx, 1.0, settings.frequency_penalty, settings.presence_penalty))
        if grammar is not None:
            sampler = llama_cpp.llama_sampler_init_grammar(
                vocab, grammar.encode("utf-8"), b"root")
            if not sampler:
                raise UnsupportedRequest("llama.cpp refused the grammar made from the "
                                         "response_format schema")
            self._grammar = sampler
        if settings.temperature <= 0:
            self._argmax = (not settings.logit_bias and grammar is None
                            and not (settings.presence_penalty or settings.frequency_penalty))
            self._add(llama_cpp.llama_sampler_init_greedy())
            return
        self._add(llama_cpp.llama_sampler_init_top_k(TOP_K))
        self._add(llama_cpp.llama_sampler_init_top_p(settings.top_p, 1))
        self._add(llama_cpp.llama_sampler_init_min_p(MIN_P, 1))
        self._add(llama_cpp.llama_sampler_init_temp(settings.temperature))
        self._add(llama_cpp.llama_sampler_init_dist(seed))

    @property
    def constrained(self) -> bool:
        return self._grammar is not None

    def sample(self, ctx: llama_cpp.llama_context_p, output: int = -1) -> int:
        """Sample (and accept) a token from the logits of output ``output`` of the last
        decode (-1: its last)."""
        if self._argmax:
            return int(logits_row(ctx, output, self._n_vocab).argmax())
        if self._grammar is None:
            return int(llama_cpp.llama_sampler_sample(self._chain, ctx, output))
        logits = logits_row(ctx, output, self._n_vocab)
        token = self._pick(logits, constrained=False)
        if not self.allows(token):
            token = self._pick(logits, constrained=True)
        llama_cpp.llama_sampler_accept(self._grammar, token)
        llama_cpp.llama_sampler_accept(self._chain, token)
        return token

    def _pick(self, logits: np.ndarray, *, constrained: bool) -> int:
        """The chain's choice over every token (the grammar applied first when
        ``constrained``), without accepting it."""
        data = self._data
        candidates = fill_candidates(data, self._ids, logits, self._candidates)
        if constrained:
            llama_cpp.llama_sampler_apply(self._grammar, ctypes.byref(candidates))
        llama_cpp.llama_sampler_apply(self._chain, ctypes.byref(candidates))
        if not 0 <= candidates.selected < candidates.size:
            raise RuntimeError("llama.cpp's sampler chain selected no token")
        return int(data["id"][candidates.selected])

    def allows(self, token: int) -> bool:
        """Whether the grammar (if any) accepts ``token`` next: its ``apply`` on a one-candidate
        array, which marks a rejected token with a logit of minus infinity."""
        if self._grammar is None:
            return True
        self._candidate.id = token
        self._candidate.logit = 0.0
        self._candidate.p = 0.0
        self._check.data = ctypes.pointer(self._candidate)
        self._check.size = 1
        self._check.selected = -1
        self._check.sorted = False
        llama_cpp.llama_sampler_apply(self._grammar, ctypes.byref(self._check))
        return self._candidate.logit != float("-inf")

    def accept_prefix(self, tokens: Sequence[int]) -> None:
        """Feed already-written tokens (a continuation) through the chain: the grammar must
        accept each, checked before it is accepted; ``UnsupportedRequest`` at the first one
        it rejects."""
        for position, token in enumerate(tokens):
            if not self.allows(token):
                raise UnsupportedRequest(
                    "the continuation cannot start an answer of the requested format (the "
                    f"grammar rejects its token {position + 1} of {len(tokens)})")
            llama_cpp.llama_sampler_accept(self._grammar, token)  # type: ignore[arg-type]
            llama_cpp.llama_sampler_accept(self._chain, token)

    def close(self) -> None:
        if self._grammar is not None:
            llama_cpp.llama_sampler_free(self._grammar)
            self._grammar = None
        if self._chain is not None:
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None
