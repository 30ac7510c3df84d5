"""Log probabilities of sampled tokens, in OpenAI's chat ``logprobs`` shape.

Read from the logits of the last position after each step (``llama_get_logits_ith``), not from
``logits_all=True``, which would keep ``n_ctx x n_vocab`` floats. The probabilities are the
model's own distribution with the request's ``logit_bias`` added (the distribution the request
defines), before temperature and top-p: so at temperature 0 the chosen token is the top one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt


def log_softmax(logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    """Natural-log probabilities of ``logits`` (stable: shifted by the maximum)."""
    values = logits.astype(np.float64)
    shifted = values - values.max()
    return shifted - np.log(np.exp(shifted).sum())


def top_indices(logprobs: npt.NDArray[np.float64], k: int) -> list[int]:
    """The ``k`` most likely token ids, most likely first (ties by lower id)."""
    if k <= 0:
        return []
    k = min(k, logprobs.size)
    part = np.argpartition(-logprobs, k - 1)[:k]
    return sorted((int(i) for i in part), key=lambda i: (-logprobs[i], i))


def _entry(text: str, logprob: float, piece: bytes) -> dict[str, Any]:
    return {"token": text, "logprob": min(0.0, float(logprob)), "bytes": list(piece)}


class Bias:
    """The request's ``logit_bias``, added to a row of logits (a copy) when there is one: the
    distribution sampling drew from, which both logprobs and re-scoring report."""

    def __init__(self, logit_bias: dict[int, float]) -> None:
        self._ids = np.fromiter(logit_bias.keys(), dtype=np.int64, count=len(logit_bias))
        self._values = np.fromiter(logit_bias.values(), dtype=np.float32,
                                   count=len(logit_bias))

    def __call__(self, logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        if not self._ids.size:
            return logits
        biased = logits.copy()
        biased[self._ids] += self._values
        return biased


class Scorer:
    """Builds one ``TokenLogprob`` per sampled token of a choice."""

    def __init__(self, logit_bias: dict[int, float], top: int,
                 piece: Callable[[int], bytes]) -> None:
        self.top = top
        self.piece = piece
        self._bias = Bias(logit_bias)

    def score(self, logits: npt.NDArray[np.float32], token: int, piece: bytes) -> dict[str, Any]:
        """The entry of ``token`` (its ``token`` text is set when its text is released)."""
        logprobs = log_softmax(self._bias(logits))
        entry = _entry(piece.decode("utf-8", errors="replace"), logprobs[token], piece)
        entry["top_logprobs"] = [
            _entry((alt := self.piece(i)).decode("utf-8", errors="replace"), logprobs[i], alt)
            for i in top_indices(logprobs, self.top)
        ]
        return entry
