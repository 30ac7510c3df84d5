"""A ``JobSink`` that records what a ``JobRunner`` sends for a job: its chunks, its result or its
error (either of which ends the job and sets ``done``)."""

from __future__ import annotations

import asyncio
from typing import Any

from shared_schema import Usage


class RecordingSink:
    def __init__(self) -> None:
        self.chunks: list[dict[str, Any]] = []
        self.results: list[tuple[dict[str, Any], Usage]] = []
        self.errors: list[tuple[str, str, bool]] = []
        self.done = asyncio.Event()

    async def chunk(self, job_id: str, data: dict[str, Any]) -> None:
        self.chunks.append(data)

    async def result(self, job_id: str, data: dict[str, Any], usage: Usage) -> None:
        self.results.append((data, usage))
        self.done.set()

    async def error(self, job_id: str, code: str, message: str, retryable: bool) -> None:
        self.errors.append((code, message, retryable))
        self.done.set()
