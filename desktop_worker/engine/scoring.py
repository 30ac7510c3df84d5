"""Re-scoring audits (issue 16): the log-probabilities of an answer another worker delivered,
in one teacher-forced pass, without generating.

A ``score`` job (``Job.openai_url == SCORE_URL``) carries the original request, its kind and
the delivered text. The auditor builds the same prompt generation would (``LlamaContext``
does that part, with the generation engine's own prompt code), tokenizes the answer as the
continuation of that prompt, and evaluates prompt + answer in llama batches that ask for
logits only at the positions that predict an answer token (and the one after the last, for
the end-of-generation score). Each row of logits is turned into two scalars at once, so the
memory is one row, never ``answer x vocabulary`` floats (nor ``logits_all=True``).

The log-probabilities are at temperature 1 with the request's ``logit_bias`` added (the
distribution the request defines, as ``logprobs.Scorer`` reports it): at temperature 0 an
honest answer's every token is then the top choice. Grammars and repetition penalties are
not applied, so a constrained or penalised answer can fall off the top choice now and then;
the queen's decision rule reads the numbers, this module only measures them.

Reading the request (``read_score_request``) and turning logits into scores
(``token_score``) are pure; ``teacher_forced`` is the llama.cpp edge. Blocking; runs in a
worker thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import llama_cpp
import numpy as np
import numpy.typing as npt
from llama_cpp import Llama

from desktop_worker.engine.logprobs import log_softmax
from desktop_worker.errors import EngineError, UnsupportedRequest

SCORE_URL = "/apiary/score"
SCORE_OBJECT = "apiary.score"
KINDS = ("chat", "completions")
# The longest answer text read (characters): far above any context this worker loads, so a
# hostile job cannot make the tokenizer chew on megabytes before the length check refuses it.
MAX_ANSWER_CHARS = 4_000_000


@dataclass(frozen=True, slots=True)
class ScoreRequest:
    """What a score job asks: the original request, its kind and the delivered answer."""

    kind: str  # "chat" or "completions"
    request: dict[str, Any]
    answer: str


@dataclass(slots=True)
class Score:
    """The scores of one answer: per answer token, its log-probability and whether it was the
    model's top choice, and the top choice's log-probability (``best_logprobs``: a delivered
    token a hair below the top is a near-tie that another machine's arithmetic may flip, which
    the queen can tell from a real miss); ``end_logprob``: the log-probability of the model
    ending right after the answer (its end-of-generation tokens; a truncated answer scores low
    here), ``None`` when the model names no such token."""

    prompt_tokens: int
    logprobs: list[float] = field(default_factory=list)
    argmax: list[bool] = field(default_factory=list)
    best_logprobs: list[float] = field(default_factory=list)
    end_logprob: float | None = None

    @property
    def answer_tokens(self) -> int:
        return len(self.logprobs)

    def data(self) -> dict[str, Any]:
        """The Result's ``data``."""
        return {"object": SCORE_OBJECT, "prompt_tokens": self.prompt_tokens,
                "answer_tokens": self.answer_tokens, "logprobs": self.logprobs,
                "argmax": self.argmax, "best_logprobs": self.best_logprobs,
                "end_logprob": self.end_logprob}

    def usage(self) -> dict[str, int]:
        """Every token evaluated is prompt work; nothing is generated."""
        evaluated = self.prompt_tokens + self.answer_tokens
        return {"prompt_tokens": evaluated, "completion_tokens": 0, "total_tokens": evaluated}


def read_score_request(raw: dict[str, Any]) -> ScoreRequest:
    """A score job's fields, checked: a bad one is the queen's mistake, refused by name."""
    kind = raw.get("kind")
    if kind not in KINDS:
        raise UnsupportedRequest(f"a score job's 'kind' must be one of {', '.join(KINDS)}, "
                                 f"not {str(kind)[:40]!r}")
    request = raw.get("request")
    if not isinstance(request, dict):
        raise UnsupportedRequest("a score job's 'request' must be the original request object")
    answer = raw.get("answer")
    if not isinstance(answer, str):
        raise UnsupportedRequest("a score job's 'answer' must be the delivered text")
    if not answer:
        raise UnsupportedRequest("a score job's 'answer' is empty: there is nothing to score")
    if len(answer) > MAX_ANSWER_CHARS:
        raise UnsupportedRequest(f"a score job's 'answer' is {len(answer)} characters, over "
                                 f"the {MAX_ANSWER_CHARS} this worker reads")
    return ScoreRequest(kind, request, answer)


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
    return (min(0.0, float(logprobs[token])), bool(logits[token] >= logits[best]),
            min(0.0, float(logprobs[best])))


def end_score(logits: npt.NDArray[np.float32], end_tokens: Sequence[int]) -> float | None:
    """The log-probability of ending here: of any of the model's end-of-generation tokens
    (``None`` for a model that names none)."""
    ids = np.asarray(sorted(set(end_tokens)), dtype=np.int64)
    if not ids.size:
        return None
    logprobs = log_softmax(logits)
    return min(0.0, float(np.logaddexp.reduce(logprobs[ids])))


def end_tokens(llama: Llama) -> list[int]:
    """The model's end-of-generation tokens (every id llama.cpp says ends a generation)."""
    vocab = llama._model.vocab
    return [token for token in range(llama.n_vocab())
            if llama_cpp.llama_vocab_is_eog(vocab, token)]


def teacher_forced(
    llama: Llama,
    prompt: Sequence[int],
    answer: Sequence[int],
    bias: Callable[[npt.NDArray[np.float32]], npt.NDArray[np.float32]],
    cancel: threading.Event,
    ends: Sequence[int],
) -> Score | None:
    """Evaluate ``prompt + answer`` from an empty cache, ``n_batch`` tokens per decode, with
    logits only where the next token is an answer token (or the end); ``None`` if cancelled
    between decodes. The context is left empty (``n_tokens == 0``) for the next job."""
    tokens = [*prompt, *answer]
    first = len(prompt) - 1  # the position whose logits predict answer[0]
    n_vocab = llama.n_vocab()
    ctx = llama._ctx.ctx
    batch = llama._batch
    raw = batch.batch
    score = Score(prompt_tokens=len(prompt))
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
                logits = bias(np.ctypeslib.as_array(
                    llama_cpp.llama_get_logits_ith(ctx, i), shape=(n_vocab,)))
                target = position + 1 - len(prompt)  # the answer token these logits predict
                if target < len(answer):
                    logprob, top, best = token_score(logits, answer[target])
                    score.logprobs.append(logprob)
                    score.argmax.append(top)
                    score.best_logprobs.append(best)
                else:
                    score.end_logprob = end_score(logits, ends)
    except RuntimeError as exc:  # llama_decode failed (out of memory): another worker may not
        raise EngineError(f"scoring failed in llama.cpp: {exc}") from exc
    finally:
        batch.reset()
        llama._ctx.kv_cache_clear()
        llama.reset()
    return score
