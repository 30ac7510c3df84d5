"""What a fine-tuning job will be, decided before it runs (``finetune.plan``)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from queen_server.finetune.plan import (
    InvalidTransition,
    TrainingData,
    advance,
    bound_trained_tokens,
    fine_tuned_name,
    parse_fine_tuned,
    resolve,
    training_cost_msat,
)
from shared_schema.finetune import FineTuningJobCreate, Hyperparameters

FORTY = TrainingData(examples=40, messages=120, text_bytes=4_000)


def test_auto_hyperparameters_follow_the_data():
    auto = resolve(Hyperparameters(), FORTY)
    assert auto.n_epochs == 3  # about 100 examples seen
    assert auto.batch_size == 2
    assert auto.learning_rate_multiplier == 1.0
    assert resolve(Hyperparameters(), TrainingData(5_000, 10_000, 10**6)).n_epochs == 1
    assert resolve(Hyperparameters(), TrainingData(10, 20, 100)).n_epochs == 10  # capped
    asked = resolve(Hyperparameters(n_epochs=7, batch_size=64, learning_rate_multiplier=0.5),
                    FORTY)
    assert (asked.n_epochs, asked.batch_size, asked.learning_rate_multiplier) == (7, 40, 0.5)


def test_the_trained_token_bound_is_the_queens_own():
    """One token per byte plus the template: a worker's claim above it is never billed."""
    assert FORTY.bound_tokens == 4_000 + 8 * 120 + 16 * 40
    assert bound_trained_tokens(FORTY, 3) == 3 * FORTY.bound_tokens
    assert training_cost_msat(1_001, 1_000) == 1_001
    assert training_cost_msat(1, 3) == 1  # rounded up: never free
    assert training_cost_msat(-5, 1_000) == 0


def test_statuses_follow_openais_order_and_a_finished_job_never_changes():
    assert advance("validating_files", "queued") == "queued"
    assert advance("running", "queued") == "queued"  # its worker was lost: it resumes
    for finished in ("succeeded", "failed", "cancelled"):
        with pytest.raises(InvalidTransition):
            advance(finished, "running")  # type: ignore[arg-type]
    with pytest.raises(InvalidTransition):
        advance("queued", "succeeded")  # never without running


def test_the_fine_tuned_models_name_round_trips():
    name = fine_tuned_name("smollm2-135m", "zorbania", "ftjob-0123456789abcdef")
    assert name == "ft:smollm2-135m:zorbania:0123456789ab"
    assert parse_fine_tuned(name) == ("smollm2-135m", "zorbania", "0123456789ab")
    assert parse_fine_tuned(fine_tuned_name("org/model:q4", None, "ftjob-abcdef012345")) == (
        "org/model:q4", "", "abcdef012345")
    assert parse_fine_tuned("smollm2-135m") is None


def test_the_request_holds_only_what_the_queen_honours():
    base = {"model": "m", "training_file": "file-abc"}
    assert FineTuningJobCreate.model_validate(base).asked == Hyperparameters()
    for bad in ({"method": {"type": "dpo"}}, {"integrations": [{"type": "wandb"}]},
                {"suffix": "no spaces"}, {"hyperparameters": {"n_epochs": 0}},
                {"hyperparameters": {"learning_rate_multiplier": 0}},
                {"unknown_field": 1},
                {"hyperparameters": {"n_epochs": 2},
                 "method": {"type": "supervised",
                            "supervised": {"hyperparameters": {"n_epochs": 3}}}}):
        with pytest.raises(ValidationError):
            FineTuningJobCreate.model_validate({**base, **bad})
