"""What a training attempt is given, decided without I/O (issue 37): its ``TrainOrder`` (window,
learning rate, the queen's token bound, where to read and write), the token that opens its
transfers, and the most bytes one of its uploads may be.

The transfer token is an HMAC, under a secret every replica reads from the database, of the
attempt's wire id and its worker's key: any replica can check it, it opens only that attempt's
transfers, and the HTTP side honours it only while that attempt is its job's current one and
running (``transfers``).

The learning rate: LoRA on small models trains well at about 1e-4 to 1e-3 with AdamW; the base
rate is ``finetune_base_learning_rate`` (2e-4), times the job's resolved multiplier, capped at
the wire's 1.0.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from queen_server.finetune.plan import TEMPLATE_TOKENS_PER_EXAMPLE
from shared_schema.training import (
    MAX_WINDOW_TOKENS,
    WINDOW_TOKENS,
    ResumeFrom,
    TrainOrder,
    Transfer,
    train_job_id,
)

TRANSFER_SECRET = "fine_tuning_transfers"  # its name among the database's shared secrets
ROUTE = "/apiary/train"  # the transfers' routes: ROUTE/<wire id>/data, /resume, /upload/<name>


def data_url(wire_id: str) -> str:
    return f"{ROUTE}/{wire_id}/data"


def resume_url(wire_id: str) -> str:
    return f"{ROUTE}/{wire_id}/resume"


def upload_url(wire_id: str) -> str:
    return f"{ROUTE}/{wire_id}/upload"


def transfer_token(secret: bytes, wire_id: str, worker_key: str) -> str:
    """The bearer token of attempt ``wire_id`` on the worker ``worker_key``."""
    return hmac.new(secret, f"{wire_id}\n{worker_key}".encode(), hashlib.sha256).hexdigest()


def token_matches(secret: bytes, wire_id: str, worker_key: str, token: str) -> bool:
    return hmac.compare_digest(transfer_token(secret, wire_id, worker_key).encode(),
                               token.encode("utf-8", "replace"))


def window_tokens(longest_example_bytes: int, model_context: int | None) -> int:
    """The training window: the longest example's bound (a token is at least a byte, plus the
    template's allowance), rounded up to ``WINDOW_TOKENS``, within the model's context (and
    the wire's ``MAX_WINDOW_TOKENS``)."""
    bound = longest_example_bytes + TEMPLATE_TOKENS_PER_EXAMPLE
    window = -(-bound // WINDOW_TOKENS) * WINDOW_TOKENS
    ceiling = MAX_WINDOW_TOKENS
    if model_context:
        ceiling = min(ceiling, max(WINDOW_TOKENS, model_context // WINDOW_TOKENS * WINDOW_TOKENS))
    return max(WINDOW_TOKENS, min(window, ceiling))


def upload_limit_bytes(model_bytes: int, factor: float, floor_bytes: int) -> int:
    """The most bytes one upload may be: a LoRA adapter (with its optimizer state, in a
    checkpoint) is a fraction of its base at the ranks the queen orders, so ``factor`` times
    the base's size, and never less than ``floor_bytes``."""
    return max(floor_bytes, int(model_bytes * factor))


@dataclass(frozen=True, slots=True)
class OrderFacts:
    """What an order is made of: the job (a ``fine_tuning_jobs`` row's values), its training
    file, the worker's model context, and the checkpoint to resume from."""

    job_id: str
    model: str
    n_epochs: int
    batch_size: int
    learning_rate_multiplier: float
    seed: int
    bound_tokens: int
    examples: int
    file_sha256: str
    file_bytes: int
    longest_example_bytes: int
    model_context: int | None
    attempt: int
    resume: ResumeFrom | None = None


def train_order(facts: OrderFacts, *, token: str, base_learning_rate: float,
                progress_every_steps: int, checkpoint_every_steps: int) -> TrainOrder:
    wire_id = train_job_id(facts.job_id, facts.attempt)
    return TrainOrder(
        job=facts.job_id, model=facts.model, n_epochs=facts.n_epochs,
        batch_size=facts.batch_size,
        learning_rate=min(1.0, base_learning_rate * facts.learning_rate_multiplier),
        seed=facts.seed, n_ctx=window_tokens(facts.longest_example_bytes, facts.model_context),
        progress_every_steps=progress_every_steps, checkpoint_every_steps=checkpoint_every_steps,
        max_trained_tokens=facts.bound_tokens, examples=facts.examples,
        data=Transfer(url=data_url(wire_id), sha256=facts.file_sha256,
                      size_bytes=facts.file_bytes),
        upload=upload_url(wire_id), token=token, resume=facts.resume)
