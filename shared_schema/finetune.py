"""OpenAI's fine-tuning shapes, as the queen serves them (issue 37): the create request, the
``fine_tuning.job`` object, its events and checkpoints, and their list pages.

The request holds exactly what the queen honours (``WireModel``: anything else is refused by
name): ``method`` ``supervised`` only (``dpo`` and ``reinforcement`` are refused), no
``integrations``. The answers are what the official SDK's types parse.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from shared_schema.base import WireModel

Status = Literal["validating_files", "queued", "running", "succeeded", "failed", "cancelled"]
FINISHED: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})
SUFFIX = r"^[a-zA-Z0-9_-]{1,64}$"  # kept in the model's name: ft:<base>:<suffix>:<id>
MAX_EPOCHS = 50
MAX_BATCH_SIZE = 256
MAX_LR_MULTIPLIER = 10.0
MAX_METADATA = 16


class Hyperparameters(WireModel):
    """Each "auto" or absent value is the queen's default (``finetune.plan``)."""

    batch_size: Literal["auto"] | int | None = None
    learning_rate_multiplier: Literal["auto"] | float | None = None
    n_epochs: Literal["auto"] | int | None = None

    @field_validator("batch_size")
    @classmethod
    def _batch(cls, value: Any) -> Any:
        if isinstance(value, int) and not 1 <= value <= MAX_BATCH_SIZE:
            raise ValueError(f"batch_size must be between 1 and {MAX_BATCH_SIZE}")
        return value

    @field_validator("n_epochs")
    @classmethod
    def _epochs(cls, value: Any) -> Any:
        if isinstance(value, int) and not 1 <= value <= MAX_EPOCHS:
            raise ValueError(f"n_epochs must be between 1 and {MAX_EPOCHS}")
        return value

    @field_validator("learning_rate_multiplier")
    @classmethod
    def _rate(cls, value: Any) -> Any:
        if isinstance(value, int | float) and not 0 < value <= MAX_LR_MULTIPLIER:
            raise ValueError(f"learning_rate_multiplier must be above 0 and at most "
                             f"{MAX_LR_MULTIPLIER:g}")
        return value


class SupervisedMethod(WireModel):
    hyperparameters: Hyperparameters | None = None


class Method(WireModel):
    type: Literal["supervised"]
    supervised: SupervisedMethod | None = None


class FineTuningJobCreate(WireModel):
    """``POST /v1/fine_tuning/jobs``."""

    model: str = Field(min_length=1, max_length=256)
    training_file: str = Field(min_length=1, max_length=128)
    validation_file: str | None = Field(default=None, max_length=128)
    suffix: str | None = Field(default=None, pattern=SUFFIX)
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)
    method: Method | None = None
    hyperparameters: Hyperparameters | None = None  # OpenAI's older place for them
    metadata: dict[str, str] | None = None
    integrations: list[Any] | None = None

    @field_validator("integrations")
    @classmethod
    def _no_integrations(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise ValueError("this queen runs no integrations (Weights and Biases)")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return value
        if len(value) > MAX_METADATA:
            raise ValueError(f"at most {MAX_METADATA} metadata keys")
        for key, item in value.items():
            if len(key) > 64 or len(item) > 512:
                raise ValueError("metadata keys are at most 64 characters, values 512")
        return value

    @model_validator(mode="after")
    def _one_place(self) -> FineTuningJobCreate:
        given = self.method.supervised.hyperparameters if (
            self.method is not None and self.method.supervised is not None) else None
        if given is not None and self.hyperparameters is not None:
            raise ValueError("give the hyperparameters in method.supervised.hyperparameters "
                             "or in hyperparameters, not both")
        return self

    @property
    def asked(self) -> Hyperparameters:
        """The hyperparameters asked for, wherever they were given."""
        if self.method is not None and self.method.supervised is not None \
                and self.method.supervised.hyperparameters is not None:
            return self.method.supervised.hyperparameters
        return self.hyperparameters or Hyperparameters()


class JobError(WireModel):
    code: str
    message: str
    param: str | None = None


class ResolvedHyperparameters(WireModel):
    batch_size: int
    learning_rate_multiplier: float
    n_epochs: int


class ResolvedMethod(WireModel):
    type: Literal["supervised"] = "supervised"
    supervised: dict[str, Any]


class FineTuningJob(WireModel):
    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    error: JobError | None = None
    fine_tuned_model: str | None = None
    finished_at: int | None = None
    hyperparameters: ResolvedHyperparameters
    method: ResolvedMethod
    model: str
    organization_id: str
    result_files: list[str] = Field(default_factory=list)
    seed: int
    status: Status
    trained_tokens: int | None = None
    training_file: str
    validation_file: str | None = None
    estimated_finish: int | None = None
    integrations: list[Any] | None = None
    metadata: dict[str, str] | None = None
    user_provided_suffix: str | None = None


class JobEvent(WireModel):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: Literal["info", "warn", "error"]
    message: str
    data: dict[str, Any] | None = None
    type: Literal["message", "metrics"] = "message"


class CheckpointMetrics(WireModel):
    step: float | None = None
    train_loss: float | None = None
    valid_loss: float | None = None


class JobCheckpoint(WireModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    metrics: CheckpointMetrics
    step_number: int


class Page(WireModel):
    """A list page: ``{"object": "list", "data": [...], "has_more": ...}``."""

    object: Literal["list"] = "list"
    data: list[Any]
    has_more: bool = False
