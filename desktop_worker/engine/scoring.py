"""Re-scoring audits (issue 16): the log-probabilities of an answer another worker delivered,
in one teacher-forced pass, without generating.

A ``score`` job (``Job.openai_url == SCORE_URL``) carries the original request, its kind and
the delivered text. The auditor builds the same prompt generation would (``LlamaContext``
does that part, with the generation engine's own prompt code), tokenizes the answer as the
continuation of that prompt, and evaluates prompt + answer in llama batches that ask for
logits only at the positions that predict an answer token (and the one after the last, for
the end-of-generation score). Each row of logits is turned into two scalars at once, so the
memory is one row, never ``answer x vocabulary`` floats (nor ``logits_all=True``).

The log-probabilities are at temperature 1 over the row as generation's sampler chain saw it
(``constraints.ScoreConstraints``: the request's ``logit_bias`` added, its presence and
frequency penalties over the answer so far subtracted, and under a ``response_format`` only
the tokens its grammar allows, issue 39): at temperature 0 an honest answer's every token is
then the top choice, constrained or not. A token the grammar refuses scores ``MASKED_LOGPROB``
and the score says where the answer broke the format (``format_broken_at``); the queen's
decision rule reads the numbers, this module only measures them.

For a sampled request (temperature T > 0) the same pass also gives, per answer token x, the
statistic the queen's calibrated test needs (``tempered_stats``): ``lp = log p_T(x)`` (the
full-vocabulary softmax of logits / T, no truncation) and, under the distribution q the honest
worker's sampler really draws from (``sampler.SamplerChain``: logit bias, top-k 40, top-p on
the renormalised top 40 at temperature 1, min-p 0.05 relative to the top token, temperature,
draw; ``sampling_support`` is its support S), ``mu = sum_S q(y) log p_T(y)`` and
``var = sum_S q(y) (log p_T(y) - mu)^2``. Under a grammar the chain draws freely first and
draws again from the allowed tokens only when the grammar refuses its pick (as llama.cpp's
``common_sampler`` does), so q is that mixture and ``p_T`` is over the allowed tokens. An
honest answer's ``sum(lp - mu)`` has mean 0 and variance ``sum(var)``; text the chain did not
draw falls far below. At the end position every end-of-generation token is one outcome ("the
answer ended here"). Each row costs one ``argpartition`` for the top 40 and one log-sum-exp
over the vocabulary at T (under a grammar, twice, and the grammar over the vocabulary).

Reading the request (``read_score_request``) and turning logits into scores
(``token_score``) are pure; ``teacher_forced`` is the llama.cpp edge. Blocking; runs in a
worker thread.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import llama_cpp
import numpy as np
import numpy.typing as npt
from llama_cpp import Llama

from desktop_worker.engine.constraints import Mask, ScoreConstraints
from desktop_worker.engine.logprobs import log_softmax
from desktop_worker.engine.sampler import MIN_P, TOP_K, logits_row
from desktop_worker.engine.scores import (
    KINDS,
    MAX_ANSWER_CHARS,
    Score,
    ScoreRequest,
    read_score_request,
)
from desktop_worker.errors import EngineError, UnsupportedRequest
from shared_schema.audits import SCORE_OBJECT, SCORE_URL

# What a token the grammar refuses scores (a finite stand-in for minus infinity: JSON has none)
MASKED_LOGPROB = -1.0e4

__all__ = ["KINDS", "MASKED_LOGPROB", "MAX_ANSWER_CHARS", "SCORE_OBJECT", "SCORE_URL",
           "Sampling", "Score",
           "ScoreRequest", "check_fits",
           "end_score", "end_tokens", "read_score_request", "sampling_support",
           "teacher_forced", "tempered_stats", "token_score"]


@dataclass(frozen=True, slots=True)
class Sampling:
    """The request's sampling settings as the worker's own chain reads them (temperature > 0;
    at 0 the chain is greedy and there is nothing to compute)."""

    temperature: float
    top_p: float = 1.0


def check_fits(prompt_tokens: int, answer_tokens: int, n_ctx: int) -> None:
    """Refuse an answer that is empty as tokens or does not fit the context with its prompt
    (generation never delivers one: it stops at the context's end)."""
    if answer_tokens == 0:
        raise UnsupportedRequest("the answer has no tokens: there is nothing to score")
    if prompt_tokens + answer_tokens > n_ctx:
        raise UnsupportedRequest(
            f"the prompt ({prompt_tokens} tokens) and the answer ({answer_tokens} tokens) do "
            f"not fit this worker's context of {n_ctx} tokens")


def token_score(logits: npt.NDArray[np.float32], token: int) -> tuple[float, bool, float]:
    """The log-probability of ``token`` at temperature 1 under ``logits``, whether it is the
    top choice (a tie with the top counts as top: greedy could have picked it), and the top
    choice's log-probability."""
    logprobs = log_softmax(logits)
    best = int(np.argmax(logits))
    return (_finite(float(logprobs[token])), bool(logits[token] >= logits[best]),
            _finite(float(logprobs[best])))


def _finite(logprob: float) -> float:
    """A log-probability at most 0, and ``MASKED_LOGPROB`` for minus infinity."""
    return min(0.0, max(MASKED_LOGPROB, logprob))


def end_score(logits: npt.NDArray[np.float32],
              end_tokens: Sequence[int]) -> tuple[float | None, float]:
    """The log-probability of ending here, of any of the model's end-of-generation tokens
    (``None`` for a model that names none), and the top single token's (both at temperature
    1): ending was the greedy choice when the first is at least the second."""
    logprobs = log_softmax(logits)
    best = min(0.0, float(logprobs.max()))
    ids = np.asarray(sorted(set(end_tokens)), dtype=np.int64)
    if not ids.size:
        return None, best
    return _finite(float(np.logaddexp.reduce(logprobs[ids]))), best


def sampling_support(logits: npt.NDArray[np.float32], top_p: float) -> npt.NDArray[np.int64]:
    """The token ids llama.cpp's chain (``SamplerChain``, temperature > 0) can draw from under
    ``logits`` (the logit bias already added), most likely first: the top ``TOP_K``; then, when
    ``top_p`` < 1, the shortest prefix whose probabilities (softmax of those at temperature 1)
    add up to at least ``top_p`` (at least one); then those whose logit is at least the top's
    plus ``log(MIN_P)``. In float32, as llama.cpp computes it. llama.cpp breaks exact ties (at
    the 40th place, or across the top-p cut) by its sort's whim; here the lower id wins."""
    values = np.asarray(logits, dtype=np.float32)
    k = min(TOP_K, values.size)
    if k < values.size:
        part = np.argpartition(values, values.size - k)[values.size - k:]
        kth = values[part].min()
        above = part[values[part] > kth]
        ties = np.flatnonzero(values == kth)[:k - above.size]
        part = np.concatenate([above, ties])
    else:
        part = np.arange(values.size)
    order = part[np.lexsort((part, -values[part]))].astype(np.int64)
    top = values[order]
    if top_p < 1.0:
        weights = np.exp(top - top[0])
        probs = weights / np.float32(weights.sum(dtype=np.float32))
        reached = np.flatnonzero(np.cumsum(probs, dtype=np.float32) >= np.float32(top_p))
        keep = int(reached[0]) + 1 if reached.size else order.size
        order, top = order[:keep], top[:keep]
    floor = top[0] + np.float32(np.log(np.float32(MIN_P)))
    return order[:max(1, int(np.count_nonzero(top >= floor)))]


def tempered_stats(logits: npt.NDArray[np.float32], outcome: int | Sequence[int],
                   sampling: Sampling, allowed: Mask | None = None) -> tuple[float, float, float]:
    """``(lp, mu, var)`` of ``outcome`` under ``logits`` (the logit bias and penalties already
    applied) at ``sampling``: ``lp = log p_T(outcome)`` over the whole vocabulary (over the
    tokens ``allowed`` by a grammar, when there is one); ``mu`` and ``var``, the mean and
    variance of ``log p_T(y)`` for ``y`` drawn as the chain draws (q, on ``sampling_support``;
    under a grammar, the free draw where the grammar allows it, else the draw again among the
    allowed tokens). ``outcome`` is a token, or a set of tokens taken as one outcome (the end
    of generation: their probabilities summed, in p_T and in q). A token outside the support
    still has a finite ``lp``, below what the chain ever draws."""
    if allowed is None or not allowed.any():
        support = sampling_support(logits, sampling.top_p)
        weights = _chain_weights(logits, support, sampling)
        scaled = np.multiply(logits, 1.0 / sampling.temperature, dtype=np.float64)
    else:
        free = sampling_support(logits, sampling.top_p)
        free_weights = _chain_weights(logits, free, sampling)
        kept = allowed[free]
        refused = float(free_weights[~kept].sum())
        masked = np.where(allowed, logits, np.float32(-np.inf)).astype(np.float32)
        again = sampling_support(masked, sampling.top_p)
        again = again[allowed[again]]
        support, inverse = np.unique(np.concatenate([free[kept], again]), return_inverse=True)
        weights = np.zeros(support.size)
        np.add.at(weights, inverse, np.concatenate(
            [free_weights[kept], refused * _chain_weights(masked, again, sampling)]))
        scaled = np.multiply(masked, 1.0 / sampling.temperature, dtype=np.float64)
    peak = float(scaled[support].max())
    log_norm = peak + np.log(np.exp(scaled - peak).sum())
    values = scaled[support] - log_norm  # log p_T of each token the chain may draw
    if isinstance(outcome, int | np.integer):
        lp = float(scaled[int(outcome)] - log_norm)
    else:
        ids = np.asarray(sorted(set(outcome)), dtype=np.int64)
        lp = float(np.logaddexp.reduce(scaled[ids]) - log_norm)
        member = np.isin(support, ids)
        if member.any():
            values = np.append(values[~member], lp)
            weights = np.append(weights[~member], weights[member].sum())
    mu = float(weights @ values)
    var = float(weights @ np.square(values - mu))
    return _finite(lp), min(0.0, mu), max(0.0, var)


def _chain_weights(logits: npt.NDArray[np.float32], support: npt.NDArray[np.int64],
                   sampling: Sampling) -> npt.NDArray[np.float64]:
    """q on ``support``: the chain's draw, ``logits / T`` renormalised there."""
    scaled = np.multiply(logits[support], 1.0 / sampling.temperature, dtype=np.float64)
    weights = np.exp(scaled - scaled.max())
    return weights / weights.sum()


def end_tokens(llama: Llama) -> list[int]:
    """The model's end-of-generation tokens (every id llama.cpp says ends a generation)."""
    vocab = llama._model.vocab
    return [token for token in range(llama.n_vocab())
            if llama_cpp.llama_vocab_is_eog(vocab, token)]


def teacher_forced(
    llama: Llama,
    prompt: Sequence[int],
    answer: Sequence[int],
    constraints: ScoreConstraints,
    cancel: threading.Event,
    ends: Sequence[int],
    sampling: Sampling | None = None,
) -> Score | None:
    """Evaluate ``prompt + answer`` from an empty cache, ``n_batch`` tokens per decode, with
    logits only where the next token is an answer token (or the end), each row as the request's
    ``constraints`` shaped it; ``None`` if cancelled between decodes. With ``sampling`` (a
    request at temperature > 0), the sampled scores too. The context is left empty
    (``n_tokens == 0``) for the next job."""
    tokens = [*prompt, *answer]
    first = len(prompt) - 1  # the position whose logits predict answer[0]
    n_vocab = llama.n_vocab()
    ctx = llama._ctx.ctx
    batch = llama._batch
    raw = batch.batch
    score = Score(prompt_tokens=len(prompt),
                  temperature=sampling.temperature if sampling else 0.0,
                  constraints_replayed=True)
    llama._ctx.kv_cache_clear()
    llama.reset()
    try:
        for start in range(0, len(tokens), llama.n_batch):
            if cancel.is_set():
                return None
            chunk = tokens[start:start + llama.n_batch]
            batch.reset()
            raw.n_tokens = len(chunk)
            for i, token in enumerate(chunk):
                raw.token[i] = token
                raw.pos[i] = start + i
                raw.seq_id[i][0] = 0
                raw.n_seq_id[i] = 1
                raw.logits[i] = start + i >= first
            llama._ctx.decode(batch)
            for i in range(len(chunk)):
                position = start + i
                if position < first:
                    continue
                logits, allowed = constraints.row(logits_row(ctx, i, n_vocab))
                seen = logits if allowed is None else np.where(
                    allowed, logits, np.float32(-np.inf)).astype(np.float32)
                target = position + 1 - len(prompt)  # the answer token these logits predict
                if target < len(answer):
                    logprob, top, best = token_score(seen, answer[target])
                    score.logprobs.append(logprob)
                    score.argmax.append(top)
                    score.best_logprobs.append(best)
                    if sampling is not None:
                        lp, mu, var = tempered_stats(logits, answer[target], sampling, allowed)
                        score.sampled_logprobs.append(lp)
                        score.expected.append(mu)
                        score.variances.append(var)
                    constraints.accept(answer[target], allowed)
                else:
                    score.end_logprob, score.end_best_logprob = end_score(seen, ends)
                    if sampling is not None and ends:
                        score.sampled_end = tempered_stats(logits, ends, sampling, allowed)
        score.format_broken_at = constraints.broken_at
    except RuntimeError as exc:  # llama_decode failed (out of memory): another worker may not
        raise EngineError(f"scoring failed in llama.cpp: {exc}") from exc
    finally:
        batch.reset()
        llama._ctx.kv_cache_clear()
        llama.reset()
    return score
