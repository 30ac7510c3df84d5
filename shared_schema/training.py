"""Fine-tuning on workers, on the wire (issue 37): the training job the queen gives a worker with
the ``train`` capability, the progress the worker reports, and what it delivers.

A training job is an ordinary ``Job`` whose ``openai_url`` is ``TRAIN_URL`` and whose
``openai_req`` is a ``TrainOrder``. Its id is ``TRAIN_JOB_PREFIX`` + the fine-tuning job's id +
``"-"`` + the attempt (a job whose worker is lost resumes on another as its next attempt). It
takes one of the worker's job slots until it ends, like any job; a ``Cancel`` stops it between
two steps.

Files do not travel over the websocket (a training file may be larger than a frame, an adapter
too): the worker reads the training rows from ``TrainOrder.data`` (and, resuming, the
checkpoint from ``TrainOrder.resume``) and writes each checkpoint and the final adapter with
``PUT TrainOrder.upload + "/" + name``, all on the queen's own origin (the URLs are paths, joined
to the origin the worker's websocket reached) and with ``Authorization: Bearer
TrainOrder.token``: a token for this attempt only, which no other job, worker or attempt can
use. Every transfer names its sha256 and size; a reader checks both.

While it trains the worker sends ``TrainReport`` frames (``shared_schema.protocol``): at least
every ``progress_every_steps`` steps, and once for each checkpoint it uploaded (naming it). It
ends with a ``Result`` whose ``data`` is a ``TrainResultData`` (the adapter it uploaded) and whose
``usage.prompt_tokens`` (and ``total_tokens``) is the tokens it trained on, or a ``JobError``.
Every number is a claim: the queen bills no more than its own bound (``max_trained_tokens``),
keeps only checkpoints and adapters it received and hashed itself, and fails an attempt whose
reports go backwards.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator

from shared_schema.base import WireModel

TRAIN_URL = "/apiary/train"
TRAIN_ORDER = "apiary.train_order"
TRAIN_RESULT = "apiary.train_result"
TRAIN_JOB_PREFIX = "train-"
# A training window is a multiple of this many tokens (llama.cpp pads its training graphs to it).
WINDOW_TOKENS = 256
MAX_WINDOW_TOKENS = 32_768
MAX_RANK = 256
# The longest path the queen gives for a transfer, and the longest file name in an upload.
MAX_PATH_CHARS = 512
UPLOAD_NAME = r"^[a-z0-9][a-z0-9._-]{0,63}\.gguf$"
SHA256 = r"^[0-9a-f]{64}$"

# What a train child needs besides the weights (Python, numpy, llama.cpp's buffers): the same
# allowance as any engine child's (``desktop_worker.sandbox.policy.RUNTIME_ALLOWANCE_MB``).
TRAIN_RUNTIME_MB = 1536

Sha256 = Annotated[str, Field(pattern=SHA256)]
Steps = Annotated[int, Field(ge=0, le=100_000_000)]
Tokens = Annotated[int, Field(ge=0, le=10**12)]


def train_job_id(job_id: str, attempt: int) -> str:
    """The wire id of attempt ``attempt`` of fine-tuning job ``job_id``."""
    return f"{TRAIN_JOB_PREFIX}{job_id}-{attempt}"


def parse_train_job_id(wire_id: str) -> tuple[str, int] | None:
    """``(fine-tuning job id, attempt)`` of a training job's wire id; None for any other id."""
    found = re.fullmatch(rf"{re.escape(TRAIN_JOB_PREFIX)}(.+)-(\d{{1,6}})", wire_id)
    return (found.group(1), int(found.group(2))) if found else None


def train_memory_mb(parameter_count: int) -> int:
    """The memory a worker needs to train a LoRA adapter on a base of ``parameter_count``
    parameters: llama.cpp trains on an F32 copy (4 bytes a parameter), with half as much again
    for activations and gradients, plus the engine's runtime (the train child's limit,
    ``desktop_worker.sandbox.policy.TrainLimits``)."""
    f32_mb = -(-parameter_count * 4 // 2**20)
    return f32_mb + f32_mb // 2 + TRAIN_RUNTIME_MB


def checkpoint_name(step: int) -> str:
    """The upload name of the checkpoint taken after ``step``."""
    return f"checkpoint-{step:08d}.gguf"


ADAPTER_NAME = "adapter.gguf"


class Transfer(WireModel):
    """A file the worker reads from the queen: its path on the queen's origin, its sha256 and
    its size (the reader stops past it and checks the hash)."""

    url: str = Field(min_length=1, max_length=MAX_PATH_CHARS, pattern=r"^/")
    sha256: Sha256
    size_bytes: int = Field(ge=0, le=2**40)


class ResumeFrom(Transfer):
    """A checkpoint of this job (a GGUF LoRA adapter) to go on from: taken after ``step``, when
    ``trained_tokens`` had been trained."""

    step: Steps
    trained_tokens: Tokens


class TrainOrder(WireModel):
    """A training job's ``openai_req``: train a LoRA adapter of rank ``rank`` on ``model`` (the
    base, as the worker holds it) from the rows of ``data`` (OpenAI's chat fine-tuning JSONL,
    already checked by the queen), ``n_epochs`` passes, at most ``batch_size`` examples packed
    into each window of ``n_ctx`` tokens, one optimizer step per window, AdamW at
    ``learning_rate``, shuffled by ``seed``. Stop past ``max_trained_tokens`` (the queen's bound:
    it pays no more)."""

    object: Literal["apiary.train_order"] = TRAIN_ORDER
    job: str = Field(min_length=1, max_length=128)  # the fine-tuning job (``ftjob-...``)
    model: str = Field(min_length=1, max_length=512)
    n_epochs: int = Field(ge=1, le=50)
    batch_size: int = Field(ge=1, le=256)
    learning_rate: float = Field(gt=0, le=1.0, allow_inf_nan=False)
    seed: int = Field(ge=0, le=2**31 - 1)
    rank: int = Field(default=8, ge=1, le=MAX_RANK)
    n_ctx: int = Field(default=WINDOW_TOKENS, ge=WINDOW_TOKENS, le=MAX_WINDOW_TOKENS)
    progress_every_steps: int = Field(default=25, ge=1, le=1000)
    checkpoint_every_steps: int = Field(default=100, ge=1, le=1_000_000)
    max_trained_tokens: Tokens
    examples: int = Field(ge=1, le=10_000_000)
    data: Transfer
    upload: str = Field(min_length=1, max_length=MAX_PATH_CHARS, pattern=r"^/")
    token: str = Field(min_length=16, max_length=256)
    resume: ResumeFrom | None = None

    @field_validator("n_ctx")
    @classmethod
    def _window(cls, value: int) -> int:
        if value % WINDOW_TOKENS:
            raise ValueError(f"n_ctx must be a multiple of {WINDOW_TOKENS}")
        return value


class Uploaded(WireModel):
    """A file the worker has PUT to ``TrainOrder.upload``: its name, sha256 and size, for the
    queen to compare with what it received."""

    name: str = Field(pattern=UPLOAD_NAME)
    sha256: Sha256
    size_bytes: int = Field(ge=1, le=2**40)


class TrainResultData(WireModel):
    """A training job's ``Result.data``: the final adapter (uploaded as ``ADAPTER_NAME``), the
    optimizer steps taken, the last loss."""

    object: Literal["apiary.train_result"] = TRAIN_RESULT
    adapter: Uploaded
    steps: Steps
    loss: float = Field(ge=0, allow_inf_nan=False)


class AdapterRef(WireModel):
    """A fine-tuned model a job names (issue 37): serve ``name`` (the ``ft:`` name the job's
    request uses) as the base model ``base`` (as workers hold it) plus this LoRA adapter, read
    from the queen's origin at ``file.url`` with ``Authorization: Bearer token`` (its sha256
    and size checked; a worker keeps it by sha256 and fetches it once). Sent in ``Job.adapter``
    only to workers with the ``lora`` capability that hold the base; a score job of an audited
    fine-tuned answer carries the same reference, so the auditor scores the same model."""

    name: str = Field(min_length=4, max_length=512, pattern=r"^ft:")
    base: str = Field(min_length=1, max_length=512)
    file: Transfer
    token: str = Field(min_length=16, max_length=256)
    scale: float = Field(default=1.0, ge=0.0, le=16.0, allow_inf_nan=False)
