"""The OpenAI API shapes Apiary answers and relays: chat completions, embeddings, models, errors.

The request bodies are ``shared_schema.openai_requests``' (every field honoured or refused, the
list in ``shared_schema.openai_fields``).
"""

from __future__ import annotations

from datetime import date, datetime
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from shared_schema.base import LenientModel, WireModel

# More tokens than any one job can have: a count past it is a lie (and past 64 bits, a crash of
# the JSON encoder), so requests and workers' answers are refused past it.
MAX_TOKENS = 2**31 - 1
# Token ids and seeds as llama.cpp and every tokenizer take them.
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKENS)]


class Usage(WireModel):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(default=0, ge=0)
    total_tokens: int = Field(ge=0)


class ReportedUsage(Usage):
    """Usage inside an OpenAI answer, which may carry details (``prompt_tokens_details``)."""

    model_config = ConfigDict(extra="allow")


# --- chat completions -------------------------------------------------------------------------


class AssistantMessage(LenientModel):
    role: str = "assistant"
    content: str | None = None


class ChoiceLogprobs(LenientModel):
    """A choice's log probabilities: one entry per token (``token``, ``logprob``, ``bytes``,
    ``top_logprobs``), as OpenAI's chat answers carry them."""

    content: list[dict[str, Any]] | None = None


class Choice(LenientModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(LenientModel):
    """A whole chat answer. The original system's bare answers lack id/model/created."""

    id: str = ""
    object: Literal["chat.completion"] = "chat.completion"
    created: int = 0
    model: str = ""
    choices: list[Choice] = Field(min_length=1)
    usage: ReportedUsage | None = None


class Delta(LenientModel):
    role: str | None = None
    content: str | None = None


class ChunkChoice(LenientModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(LenientModel):
    id: str = ""
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = 0
    model: str = ""
    choices: list[ChunkChoice] = Field(default_factory=list)
    usage: ReportedUsage | None = None


# --- embeddings -------------------------------------------------------------------------------


class Embedding(LenientModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(LenientModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(LenientModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str = ""
    usage: EmbeddingUsage = Field(default_factory=EmbeddingUsage)


# --- models and errors ------------------------------------------------------------------------


class ModelPrice(WireModel):
    """What a model costs, in millisatoshis per 1,000 tokens, and why."""

    size_class: str
    prompt_msat_per_1k: int = Field(ge=0)
    completion_msat_per_1k: int = Field(ge=0)
    basis: str | None = Field(
        default=None, description="Why this class: operator (the operator's price file names "
        "the model), verified (the queen read the model's file on the hub), same_file (its "
        "workers hold a file the queen read on the hub under another name), file_size (bounded "
        "by the size of the file its workers report) or unverified (the class for models the "
        "queen cannot read, by default the largest); null from an older queen.")
    reason: str | None = Field(default=None, description="The same in words, e.g. \"unverified: "
                               "the queen could not read this model's file on the hub, so it "
                               "is priced as the largest class (xxl)\".")


class ModelAvailability(WireModel):
    """Apiary's extension to a model card: who serves it right now, and its price."""

    workers: int = Field(ge=0)
    loaded_on: int = Field(ge=0)
    parameter_count: int | None = Field(
        default=None, description="As the queen read it from the model file's GGUF header on "
        "the hub; null until it has (workers' own counts are never shown or used).")
    size_bytes: int | None = None
    sha256: str | None = Field(default=None, description="The file the queen read (the first "
                               "part of a split model).")
    verified: bool = Field(default=False, description="Whether the queen knows which file "
                           "serves this name: a hub file it read and pinned itself (its size "
                           "and price come from that reading), or a local name's file the "
                           "operator pinned by sha256. Unverified models are priced as such.")
    audited: bool = Field(default=False, description="Whether answers of this model are "
                          "re-scored by the audits. Only verified models can be (an auditor "
                          "must hold the same file); an unverified one never is.")
    price: ModelPrice | None = None
    kind: Literal["text", "image"] = Field(
        default="text", description="image: a diffusion model, served at "
        "/v1/images/generations (issue 38); text: chat, completions and embeddings.")
    status: Literal["ready", "loading"] = Field(
        default="ready", description="loading: the queen is placing it on a worker (issue 17).")
    progress: float | None = Field(default=None, ge=0, le=1,
                                   description="Of the download, while loading.")
    estimated_time: float | None = Field(
        default=None, ge=0, description="Seconds until it should be ready, while loading.")


class ModelCard(WireModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "apiary"
    apiary: ModelAvailability | None = None


class ModelList(WireModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(WireModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(WireModel):
    error: ErrorDetail


# --- a worker's earnings (Apiary's own endpoint, GET /worker/earnings) -------------------------


class PayoutView(WireModel):
    id: int
    amount_msat: int = Field(ge=0)
    state: str = Field(description="recorded, invoiced, paid, failed or manual")
    updated_at: datetime
    detail: str = ""


class DailyEarning(WireModel):
    day: date
    earned_msat: int = Field(ge=0)


class JobEarning(WireModel):
    job_id: str = Field(description="The queen's request id; the worker saw it as "
                        "``<job_id>.<attempt>``.")
    earned_msat: int = Field(ge=0)
    settled_at: datetime


class AuditStanding(WireModel):
    """A worker's audit record on this queen: how many of its answers were re-scored on another
    worker holding the same model file, how many did not match, and the verdict so far."""

    state: str = Field(description="unknown (not enough audits yet), good, or flagged (no jobs "
                       "are sent, payouts are held, escrow forfeited, until an admin clears it)")
    audited: int = Field(ge=0)
    failed: int = Field(ge=0)
    payouts_held: bool = False
    flagged_reason: str | None = Field(default=None, description="The newest failed audit's "
                                       "reason, when flagged.")


class WorkerModelPrice(WireModel):
    """One of the worker's models as this queen prices it (``WorkerEarnings.models``)."""

    name: str = Field(min_length=1)
    price: ModelPrice
    earn_msat_per_1k_tokens: int = Field(
        ge=0, description="What the worker earns per 1,000 completion tokens of it, after the "
        "queen's fee (0: the queen does not pay).")


PAYOUT_MODES = ("lightning", "manual", "none")


class WorkerEarnings(WireModel):
    worker_id: str
    jobs_settled: int = Field(ge=0)
    escrow_jobs_left: int = Field(ge=0, description="Jobs until pending earnings are released.")
    pending_msat: int = Field(ge=0)
    available_msat: int = Field(ge=0)
    paid_msat: int = Field(ge=0)
    today_msat: int = Field(ge=0)
    total_msat: int = Field(ge=0)
    recent_payouts: list[PayoutView] = Field(default_factory=list)
    week_msat: int = Field(default=0, ge=0, description="Earned in the last 7 days (UTC), today "
                           "included.")
    daily: list[DailyEarning] = Field(
        default_factory=list, description="Earnings per UTC day over the last 30 days, oldest "
        "first, days with nothing included.")
    recent_jobs: list[JobEarning] = Field(
        default_factory=list, description="What the latest settled jobs earned, newest first.")
    pays_workers: bool | None = Field(
        default=None, description="Whether this queen pays its workers (keys required and a "
        "ledger kept); null from an older queen.")
    payout_threshold_msat: int | None = Field(
        default=None, ge=0, le=2**63 - 1, description="A payout is sent once a worker is owed "
        "this much; null when the queen does not say.")
    audit: AuditStanding | None = Field(
        default=None, description="This worker's audit standing; null from an older queen.")
    payout_mode: str | None = Field(
        default=None, description="How this queen pays: lightning (automatically, to the "
        "worker's payout address), manual (its operator pays by hand) or none (it does not "
        "pay); null from an older queen. A worker treats a mode it does not know as unsaid.")
    payout_note: str | None = Field(
        default=None, description="The operator's word to its workers about payouts "
        "(APIARY_PAYOUT_NOTE): who pays, how, when, whom to ask.")
    payout_address: str | None = Field(
        default=None, description="The payout address this queen holds for the worker (from "
        "its hello): where its payouts go. Null: none, so it is not paid.")
    payout_interval_s: float | None = Field(
        default=None, gt=0, description="How often the queen pays what is due.")
    models: list[WorkerModelPrice] = Field(
        default_factory=list, description="The worker's models on this queen (those it holds "
        "now, connected), each with its price and why.")
