"""What generation did to each row of logits beyond the model, replayed for a re-scoring audit
(issue 39): the request's logit bias, its presence and frequency penalties over the answer so
far, and its ``response_format`` grammar.

The worker's sampler chain (``sampler.SamplerChain``) adds the bias, subtracts the penalties
(llama.cpp's ``penalties`` sampler: ``count * frequency + (count > 0) * presence`` for each
token already in the answer, the window the whole context) and, where a grammar is asked,
keeps the tokens it allows. ``ScoreConstraints`` does the same to a row of logits given the
answer's tokens before it (``row``), then takes the answer's next token (``accept``). An answer
the grammar cannot take (text no honest worker under that format could have written) is noted
at the token where it breaks (``broken_at``); the grammar is then dropped, so the rest of the
answer is still scored. Blocking (llama.cpp's grammar over the whole vocabulary each row).
"""

from __future__ import annotations

import ctypes
from collections import Counter

import llama_cpp
import numpy as np
import numpy.typing as npt

from desktop_worker.engine.logprobs import Bias
from desktop_worker.engine.sampler import TOKEN_DATA, fill_candidates
from desktop_worker.engine.settings import GenerationSettings
from desktop_worker.errors import UnsupportedRequest

Logits = npt.NDArray[np.float32]
Mask = npt.NDArray[np.bool_]


class ScoreConstraints:
    """One score job's bias, penalties and grammar, row by row; ``close`` frees the grammar."""

    def __init__(self, settings: GenerationSettings, vocab: llama_cpp.llama_vocab_p,
                 n_vocab: int, grammar: str | None) -> None:
        self._bias = Bias(settings.logit_bias)
        self._presence = float(settings.presence_penalty or 0.0)
        self._frequency = float(settings.frequency_penalty or 0.0)
        self._counts: Counter[int] = Counter()
        self._n_vocab = n_vocab
        self._grammar: llama_cpp.llama_sampler_p | None = None
        self.broken_at: int | None = None  # the answer token the grammar refused
        self._taken = 0
        if grammar is not None:
            sampler = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode("utf-8"),
                                                           b"root")
            if not sampler:
                raise UnsupportedRequest("llama.cpp refused the grammar made from the "
                                         "response_format schema")
            self._grammar = sampler
            self._ids = np.arange(n_vocab, dtype=np.int32)
            self._data = np.zeros(n_vocab, dtype=TOKEN_DATA)
            self._candidates = llama_cpp.llama_token_data_array()

    def row(self, logits: Logits) -> tuple[Logits, Mask | None]:
        """The row as the chain saw it before choosing (bias and penalties applied), and the
        tokens the grammar allows next (None: every token)."""
        adjusted = self._bias(logits)
        if self._counts and (self._presence or self._frequency):
            if adjusted is logits:
                adjusted = logits.copy()
            ids = np.fromiter(self._counts.keys(), dtype=np.int64, count=len(self._counts))
            counts = np.fromiter(self._counts.values(), dtype=np.float32,
                                 count=len(self._counts))
            adjusted[ids] -= counts * np.float32(self._frequency) + np.float32(self._presence)
        if self._grammar is None:
            return adjusted, None
        return adjusted, self._allowed(adjusted)

    def _allowed(self, logits: Logits) -> Mask:
        data = self._data
        candidates = fill_candidates(data, self._ids, logits, self._candidates)
        llama_cpp.llama_sampler_apply(self._grammar, ctypes.byref(candidates))
        allowed = np.zeros(self._n_vocab, dtype=bool)
        allowed[data["id"][np.isfinite(data["logit"])]] = True
        return allowed

    def continue_from(self, delivered: list[int]) -> None:
        """The text another worker delivered before the answer (a failover's continuation), fed
        as generation feeds it (``SamplerChain.accept_prefix``): counted for the penalties and
        taken by the grammar; ``UnsupportedRequest`` where the grammar refuses it (the earlier
        worker's text, not this answer, broke the format: nothing here to judge)."""
        for position, token in enumerate(delivered):
            self._counts[token] += 1
            if self._grammar is None:
                continue
            if not self._allows(token):
                raise UnsupportedRequest(
                    f"the text before the answer leaves the requested format at its token "
                    f"{position + 1}: there is no answer under that format to score")
            llama_cpp.llama_sampler_accept(self._grammar, token)

    def _allows(self, token: int) -> bool:
        """Whether the grammar takes ``token`` next (its ``apply`` on one candidate)."""
        one = llama_cpp.llama_token_data(id=token, logit=0.0, p=0.0)
        check = llama_cpp.llama_token_data_array(data=ctypes.pointer(one), size=1, selected=-1,
                                                 sorted=False)
        llama_cpp.llama_sampler_apply(self._grammar, ctypes.byref(check))
        return one.logit != float("-inf")

    def accept(self, token: int, allowed: Mask | None) -> None:
        """The answer's next token: counted for the penalties and, when the grammar allows it,
        taken by the grammar (llama.cpp aborts the process on a token its grammar refuses, so
        a refused one ends the grammar instead, noted in ``broken_at``)."""
        self._counts[token] += 1
        if self._grammar is not None:
            if allowed is not None and allowed[token]:
                llama_cpp.llama_sampler_accept(self._grammar, token)
            else:
                self.broken_at = self._taken
                self._drop_grammar()
        self._taken += 1

    def _drop_grammar(self) -> None:
        if self._grammar is not None:
            llama_cpp.llama_sampler_free(self._grammar)
            self._grammar = None

    def close(self) -> None:
        self._drop_grammar()
