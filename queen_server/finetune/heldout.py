"""A job's training file split into what its worker trains on and what checks its adapter
(issue 37), read from the blob store; the rule is ``checks.HoldOut``.

``split_of`` reads the file once for the order (what is served: its examples, bytes, sha256
and longest line); ``served`` streams the same bytes to the worker; ``held_lines`` reads the
held-out lines back for the check (or a validation file's sampled lines). A job that holds
nothing back (a ``validation_file``, or the check switched off) is served its file as
uploaded, with the file's own record.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from queen_server.files.blobs import chunks
from queen_server.finetune.checks import HoldOut, is_example, served_line

if TYPE_CHECKING:
    from queen_server.files.service import Files
    from queen_server.settings import QueenSettings


@dataclass(frozen=True, slots=True)
class Split:
    """What the worker is served: ``examples`` lines of ``size_bytes`` bytes with this
    ``sha256``; ``held``: the held-out examples' indexes (empty: the file as uploaded)."""

    held: frozenset[int]
    examples: int
    sha256: str
    size_bytes: int
    longest_line_bytes: int


def holdout_of(settings: QueenSettings) -> HoldOut:
    return HoldOut(settings.finetune_holdout_fraction, settings.finetune_check_examples)


def held_of(row: Any, record: Any, holdout: HoldOut) -> frozenset[int]:
    """The training-file examples job ``row`` holds back (none with a validation file)."""
    if row.validation_file is not None:
        return frozenset()
    return holdout.indexes(record.examples, row.seed)


async def lines(files: Files, location: str) -> AsyncIterator[bytes]:
    """A stored file's lines, without their ``\\n``."""
    pending = b""
    async for piece in chunks(await files.blobs.open(location)):
        parts = (pending + piece).split(b"\n")
        pending = parts.pop()
        for line in parts:
            yield line
    if pending:
        yield pending


async def served(files: Files, location: str, held: Collection[int]) -> AsyncIterator[bytes]:
    """The bytes of a split's served part: every example not in ``held``, one a line."""
    index = 0
    async for line in lines(files, location):
        if not is_example(line):
            continue
        if index not in held:
            yield served_line(line)
        index += 1


async def split_of(files: Files, record: Any, held: frozenset[int]) -> Split:
    """What a worker is served of ``record`` holding back ``held``."""
    if not held:
        longest = 0
        async for line in lines(files, record.location):
            longest = max(longest, len(line))
        return Split(held, record.examples, record.sha256, record.bytes, longest)
    digest, size, count, longest = hashlib.sha256(), 0, 0, 0
    async for line in served(files, record.location, held):
        digest.update(line)
        size += len(line)
        count += 1
        longest = max(longest, len(line) - 1)
    return Split(held, count, digest.hexdigest(), size, longest)


async def held_lines(files: Files, location: str, indexes: Collection[int]) -> list[bytes]:
    """The examples of a stored file at ``indexes``, in file order."""
    found: list[bytes] = []
    index = 0
    async for line in lines(files, location):
        if not is_example(line):
            continue
        if index in indexes:
            found.append(line)
        index += 1
    return found
