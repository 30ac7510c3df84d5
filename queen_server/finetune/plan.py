"""What a fine-tuning job will be, decided before anything runs (pure; issue 37): its
hyperparameters ("auto" resolved from the data), the name of the model it makes, the most
tokens it can train (the queen's own bound, from the file's bytes, never a worker's word) and
what that costs, and which status may follow which.

A trained-token claim is bounded like a usage claim (``swarm.metering``): a token is at least
one byte of the rendered examples, plus a template allowance per message, so one epoch trains
at most ``bound_tokens`` tokens and a job ``epochs`` times that. The hold is that bound's price;
the charge is the worker's count, capped by it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from shared_schema.finetune import FINISHED, Hyperparameters, ResolvedHyperparameters, Status

# Per message: the chat template's role markers and separators, in tokens (as the usage bound).
TEMPLATE_TOKENS_PER_MESSAGE = 8
TEMPLATE_TOKENS_PER_EXAMPLE = 16
TARGET_EXAMPLES_SEEN = 100  # "auto" epochs: about this many examples seen in all
MAX_AUTO_EPOCHS = 10
MAX_AUTO_BATCH = 8
FT_NAME = re.compile(r"^ft:(?P<base>.+):(?P<suffix>[a-zA-Z0-9_-]{0,64}):(?P<id>[a-z0-9]{8,})$")

NEXT: dict[str, frozenset[str]] = {
    "validating_files": frozenset({"queued", "failed", "cancelled"}),
    "queued": frozenset({"running", "failed", "cancelled"}),
    # back to "queued": its worker was lost, and it resumes on another from its checkpoint
    "running": frozenset({"queued", "succeeded", "failed", "cancelled"}),
}


class InvalidTransition(ValueError):
    """A status that may not follow the job's current one (a finished job never changes)."""


def advance(current: Status, to: Status) -> Status:
    """``to`` when it may follow ``current``; else ``InvalidTransition``."""
    if current in FINISHED or to not in NEXT.get(current, frozenset()):
        raise InvalidTransition(f"a {current} job cannot become {to}")
    return to


@dataclass(frozen=True, slots=True)
class TrainingData:
    """What the queen read of a validated training file: its examples, messages and bytes."""

    examples: int
    messages: int
    text_bytes: int  # UTF-8 bytes of every message's content

    @property
    def bound_tokens(self) -> int:
        """The most tokens one epoch over this data can be: one per byte, plus the template."""
        return (self.text_bytes + TEMPLATE_TOKENS_PER_MESSAGE * self.messages
                + TEMPLATE_TOKENS_PER_EXAMPLE * self.examples)


def resolve(asked: Hyperparameters, data: TrainingData) -> ResolvedHyperparameters:
    """Each "auto" (or absent) value decided from the data: enough epochs that about
    ``TARGET_EXAMPLES_SEEN`` examples are seen (at most ``MAX_AUTO_EPOCHS``), a batch of about
    a twentieth of the examples (1 to ``MAX_AUTO_BATCH``), the base learning rate."""
    examples = max(1, data.examples)
    epochs = asked.n_epochs if isinstance(asked.n_epochs, int) else min(
        MAX_AUTO_EPOCHS, max(1, math.ceil(TARGET_EXAMPLES_SEEN / examples)))
    batch = asked.batch_size if isinstance(asked.batch_size, int) else min(
        MAX_AUTO_BATCH, max(1, examples // 20))
    rate = (float(asked.learning_rate_multiplier)
            if isinstance(asked.learning_rate_multiplier, int | float) else 1.0)
    return ResolvedHyperparameters(batch_size=min(batch, examples), n_epochs=epochs,
                                   learning_rate_multiplier=rate)


def bound_trained_tokens(data: TrainingData, epochs: int) -> int:
    """The most trained tokens a job over ``data`` can claim."""
    return data.bound_tokens * epochs


def training_cost_msat(tokens: int, msat_per_1k: int) -> int:
    """The price of ``tokens`` trained tokens, rounded up to a whole msat."""
    return -(-max(0, tokens) * msat_per_1k // 1000)


def fine_tuned_name(base: str, suffix: str | None, job_id: str) -> str:
    """``ft:<base>:<suffix>:<id>``: the model a job makes (the job id's hex part)."""
    return f"ft:{base}:{suffix or ''}:{short_id(job_id)}"


def short_id(job_id: str) -> str:
    return job_id.removeprefix("ftjob-")[:12].lower()


def parse_fine_tuned(name: str) -> tuple[str, str, str] | None:
    """(base, suffix, id) of an ``ft:`` name; None for any other name."""
    found = FT_NAME.match(name)
    return (found["base"], found["suffix"], found["id"]) if found else None
