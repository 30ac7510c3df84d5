"""The owner controls' errors. Built on the worker's own (``desktop_worker.errors``), so the
CLI and the app handle them as they handle every other worker error."""

from __future__ import annotations

from desktop_worker.errors import WorkerError


class OwnerControlError(WorkerError):
    """Base class for the owner controls' errors."""


class ActiveHoursError(OwnerControlError, ValueError):
    """An ``active_hours`` setting cannot be read; ``str()`` says what is wrong and the form
    expected ("22:00-07:00", or several ranges separated by commas). A ``ValueError`` too, so
    validators that expect one (pydantic's) can raise it as it is."""
