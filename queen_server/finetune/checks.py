"""A fine-tuning job's result checked before it succeeds, decided without I/O (issue 37): which
examples are held out of the training file, what one held-out example asks a scorer, and the
loss rule.

**Held out.** A job without a ``validation_file`` trains on its training file minus a slice:
``HoldOut.indexes`` picks ``fraction`` of its examples (at least 1, at most ``most``, never
all), by the job's seed, so every replica (the order, the data route, the check) derives the
same slice from the job's row and nothing is stored. The data a worker GETs is the other
examples, each line as uploaded plus ``\\n`` (``served_line``); blank lines are not examples
and are dropped with the slice. With a ``validation_file``, that file (sampled to ``most``
by the same rule) is the held-out set and the training file is served whole.

**One example.** A held-out line's last assistant message with text is the answer; the
messages before it (and the example's ``tools``) are the request (``ScoreRequest``). Its
answer is cut so prompt and answer fit the scorer's context: a token is at least a byte of
text, plus the template's allowance per message (``plan.TEMPLATE_TOKENS_PER_MESSAGE``).

**The rule.** A model's loss is the mean negative log-probability of the answer tokens over
all scored examples (token-weighted, as a training loss is). The adapter learned when its loss
is below the base's by more than ``margin`` (relative): ``adapter < base * (1 - margin)``.
A margin of 1 % keeps an adapter that changed nothing (the same loss, up to float noise)
from passing, yet any real training on the data passes easily (on SmolLM2 a few epochs
take the loss down by tens of percent).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from queen_server.finetune.plan import TEMPLATE_TOKENS_PER_EXAMPLE, TEMPLATE_TOKENS_PER_MESSAGE

BOM = b"\xef\xbb\xbf"
MIN_ANSWER_BYTES = 1


@dataclass(frozen=True, slots=True)
class HoldOut:
    """How many examples a job holds back: ``fraction`` of them, at least 1, at most
    ``most`` (0: none, and no check)."""

    fraction: float
    most: int

    def count(self, examples: int) -> int:
        if self.most <= 0 or examples < 2:
            return 0
        wanted = max(1, int(examples * self.fraction))
        return min(wanted, self.most, examples - 1)

    def indexes(self, examples: int, seed: int) -> frozenset[int]:
        """The held-out examples' indexes (0-based, among the file's non-blank lines)."""
        return frozenset(random.Random(seed).sample(range(examples), self.count(examples)))

    def sample(self, examples: int, seed: int) -> frozenset[int]:
        """A validation file's examples to score: all of them up to ``most``, else ``most``
        chosen by the seed."""
        if self.most <= 0:
            return frozenset()
        if examples <= self.most:
            return frozenset(range(examples))
        return frozenset(random.Random(seed).sample(range(examples), self.most))


def is_example(line: bytes) -> bool:
    """Whether a line of a training file is an example (not blank)."""
    return bool(line.strip())


def served_line(line: bytes) -> bytes:
    """A kept example as the worker gets it: its bytes (no line end) and ``\\n``."""
    return line.rstrip(b"\r") + b"\n"


@dataclass(frozen=True, slots=True)
class ScoreRequest:
    """What one held-out example asks a scorer: the chat request before the answer, and the
    answer (the last assistant message's text)."""

    messages: tuple[dict[str, Any], ...]
    answer: str
    tools: tuple[dict[str, Any], ...] = ()

    def request(self, model: str) -> dict[str, Any]:
        """The original request of a score job: greedy, so the worker scores at temperature
        1 without sampled statistics."""
        body: dict[str, Any] = {"model": model, "messages": list(self.messages),
                                "temperature": 0}
        if self.tools:
            body["tools"] = list(self.tools)
        return body


def example_of(line: bytes) -> ScoreRequest | None:
    """The score request of a held-out line; None when it has no assistant text to score
    after at least one message (such an example teaches nothing measurable here)."""
    try:
        row = json.loads(line.removeprefix(BOM))
    except (ValueError, UnicodeDecodeError):
        return None
    messages = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(messages, list):
        return None
    for at in range(len(messages) - 1, 0, -1):
        message = messages[at]
        if (isinstance(message, dict) and message.get("role") == "assistant"
                and isinstance(message.get("content"), str) and message["content"]):
            before = tuple(m for m in messages[:at] if isinstance(m, dict))
            tools = row.get("tools") if isinstance(row.get("tools"), list) else []
            return ScoreRequest(before, message["content"],
                                tuple(t for t in tools if isinstance(t, dict)))
    return None


def prompt_bound_tokens(example: ScoreRequest) -> int:
    """The most tokens the example's prompt can be (a token is at least a byte)."""
    text = json.dumps([list(example.messages), list(example.tools)], ensure_ascii=False)
    return (len(text.encode("utf-8")) + TEMPLATE_TOKENS_PER_EXAMPLE
            + TEMPLATE_TOKENS_PER_MESSAGE * (len(example.messages) + 1))


def fitted(example: ScoreRequest, context_tokens: int | None) -> ScoreRequest | None:
    """``example`` with its answer cut to fit ``context_tokens`` (whole characters); None
    when even the prompt does not leave room for an answer."""
    if not context_tokens:
        return example
    room = context_tokens - prompt_bound_tokens(example)
    if room < MIN_ANSWER_BYTES:
        return None
    data = example.answer.encode("utf-8")
    if len(data) <= room:
        return example
    answer = data[:room].decode("utf-8", "ignore")
    return ScoreRequest(example.messages, answer, example.tools) if answer else None


@dataclass(frozen=True, slots=True)
class Scored:
    """One example's answer scored by one model: its tokens' log-probabilities."""

    logprobs: tuple[float, ...]


def mean_loss(scores: Sequence[Scored]) -> float:
    """The mean negative log-probability of every answer token of ``scores``."""
    tokens = [logprob for score in scores for logprob in score.logprobs]
    if not tokens:
        raise ValueError("no answer tokens were scored")
    return -sum(tokens) / len(tokens)


def mismatched(base: Sequence[Scored], adapter: Sequence[Scored]) -> int | None:
    """The first example whose two scores count different answer tokens (the same text under
    the same tokenizer cannot), or None: a scorer that did is not believed."""
    if len(base) != len(adapter):
        return min(len(base), len(adapter))
    for at, (one, other) in enumerate(zip(base, adapter, strict=True)):
        if len(one.logprobs) != len(other.logprobs):
            return at
    return None


@dataclass(frozen=True, slots=True)
class Verdict:
    base_loss: float
    adapter_loss: float
    examples: int
    learned: bool

    @property
    def message(self) -> str:
        if self.learned:
            return (f"Held-out check passed on {self.examples} example(s): validation loss "
                    f"{self.adapter_loss:.4f} (base model {self.base_loss:.4f})")
        return (f"The adapter did not learn: held-out loss {self.adapter_loss:.4f} vs base "
                f"{self.base_loss:.4f} on {self.examples} example(s)")

    def data(self, step: int) -> dict[str, Any]:
        """The metrics event's data, in OpenAI's names (``full_valid_loss``) and the base's."""
        return {"step": step, "full_valid_loss": self.adapter_loss,
                "base_full_valid_loss": self.base_loss, "valid_examples": self.examples}


def judge(base: Sequence[Scored], adapter: Sequence[Scored], margin: float) -> Verdict:
    """The loss rule: the adapter learned when its loss is below ``base * (1 - margin)``."""
    base_loss, adapter_loss = mean_loss(base), mean_loss(adapter)
    return Verdict(base_loss, adapter_loss, len(base),
                   adapter_loss < base_loss * (1.0 - margin))
