"""What a training attempt's reports mean, decided without I/O (issue 37): whether a
``TrainReport`` or the final ``Result`` is a claim the queen can accept, the event it becomes
(as OpenAI words them), when the job will likely finish, and what it is billed for.

Every number a worker sends is a claim. ``AttemptProgress`` holds what the attempt claimed so
far and refuses a claim that goes backwards (a step or a trained-token count below the last),
past the queen's own bound on the job's tokens (``max_trained_tokens``), or past its own
total; the runner fails such an attempt as a lying worker's (retryable on another worker).
"""

from __future__ import annotations

from dataclasses import dataclass

from shared_schema.protocol import TrainReport
from shared_schema.training import checkpoint_name


class Lie(ValueError):
    """A claim the queen refuses: the attempt fails, as a lying worker's."""


@dataclass(frozen=True, slots=True)
class Accepted:
    """A report the queen keeps: its event (message, data) and, when it named one, the
    checkpoint upload to look for."""

    message: str
    data: dict[str, float | int]
    checkpoint: str | None


def step_message(step: int, total_steps: int, loss: float) -> str:
    """OpenAI's words for a step's metrics event."""
    return f"Step {step}/{total_steps}: training loss={loss:.4f}"


class AttemptProgress:
    """One attempt's claims so far: it starts from its resume point (step and tokens), and
    each report must go on from the last."""

    def __init__(self, bound_tokens: int, *, step: int = 0, trained_tokens: int = 0,
                 started_s: float = 0.0) -> None:
        self.bound_tokens = bound_tokens
        self.start_step = step
        self.step = step
        self.trained_tokens = trained_tokens
        self.total_steps: int | None = None
        self.started_s = started_s
        self.loss: float | None = None

    def report(self, report: TrainReport) -> Accepted:
        """Accept ``report`` or raise ``Lie``."""
        if report.step < self.step:
            raise Lie(f"the worker reported step {report.step} after step {self.step}")
        if report.trained_tokens < self.trained_tokens:
            raise Lie(f"the worker reported {report.trained_tokens} trained tokens after "
                      f"{self.trained_tokens}")
        if report.trained_tokens > self.bound_tokens:
            raise Lie(f"the worker reported {report.trained_tokens} trained tokens, past the "
                      f"job's bound of {self.bound_tokens}")
        if report.step > report.total_steps:
            raise Lie(f"the worker reported step {report.step} of {report.total_steps}")
        checkpoint = None
        if report.checkpoint is not None:
            if report.checkpoint.name != checkpoint_name(report.step):
                raise Lie(f"the worker named the checkpoint of step {report.step} "
                          f"{report.checkpoint.name!r}, not {checkpoint_name(report.step)!r}")
            checkpoint = report.checkpoint.name
        self.step, self.trained_tokens = report.step, report.trained_tokens
        self.total_steps, self.loss = report.total_steps, report.loss
        data: dict[str, float | int] = {
            "step": report.step, "total_steps": report.total_steps, "epoch": report.epoch,
            "train_loss": report.loss, "trained_tokens": report.trained_tokens}
        return Accepted(step_message(report.step, report.total_steps, report.loss), data,
                        checkpoint)

    def finish_s(self, now_s: float) -> float | None:
        """When the attempt will likely end (a clock in seconds like ``now_s``), from its pace
        since it started; None before it took a step."""
        done = self.step - self.start_step
        if self.total_steps is None or done <= 0:
            return None
        per_step = (now_s - self.started_s) / done
        return now_s + per_step * max(0, self.total_steps - self.step)

    def final_tokens(self, claimed: int) -> int:
        """The tokens a finished attempt is billed for: its claim, never below what it reported
        (a ``Lie``) and never past the queen's bound."""
        if claimed < self.trained_tokens:
            raise Lie(f"the worker's result claims {claimed} trained tokens after reporting "
                      f"{self.trained_tokens}")
        return min(claimed, self.bound_tokens)
