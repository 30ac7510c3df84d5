"""Audits of images (issue 38): a drawn image job is rendered again, from the same order (model
file, prompt, seed, steps, guidance, sampler, size), by another worker that holds the same
file, and the images are compared.

stable-diffusion.cpp renders an order to the same pixels on one build whatever the thread count
(``tests/desktop_worker/engine/test_diffusion.py``; an H200's CUDA build too), so an honest
worker's images and the auditor's are identical on one kind of backend; another seed, prompt or
model, random pixels or a blank image differ by 0.10 or more in ``image_distance`` (the mean
absolute difference per pixel and channel, as a share of 255) on the test model. An image
further than ``image_audit_max_distance`` (0.05) from the auditor's fails the job. The band
between different backends (CPU and CUDA) is not measured yet: auditors of the worker's own kind
(with or without an NVIDIA GPU) are asked first.

Only a job whose file the queen can pin is audited (``ModelCatalog.audit_file``: a hub name's file
the queen read, or a local name's file on the operator's list), as for text: a worker cannot escape
by naming a file nobody else holds. The verdicts feed the same sequential test, refunds and
consequences as text's (``AuditService.record_verdict``), with the same defences: one untrusted
auditor's failing verdict counts only once a second auditor, independent of it and of the worker,
agrees (else the job says nothing); a flag needs a trusted auditor's evidence or ``MIN_ACCUSERS``
accusers'.
Draws follow the worker's audit rate (``AuditService.wants``: every job of a new worker at first).
"""

from __future__ import annotations

import asyncio
import io
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from PIL import Image, ImageChops, ImageStat

from queen_server.audits.decision import CLIP, Verdict
from queen_server.audits.service import AUDITOR_SCAN
from queen_server.images.delivery import check_delivery
from queen_server.swarm.relay import collect
from shared_schema.capabilities import IMAGE
from shared_schema.images import IMAGES_URL, ImageOrder

if TYPE_CHECKING:
    from queen_server.audits.service import AuditService
    from queen_server.swarm.dispatch import Dispatcher
    from queen_server.swarm.metering import Meter
    from queen_server.swarm.registry import Registry
    from queen_server.swarm.worker import Worker

log = logging.getLogger(__name__)

AUDIT_JOB = "imgaudit-"
MAX_AUDITORS = 3  # auditors tried for one job (one may fail, one may need a second opinion)


def image_distance(a: bytes, b: bytes) -> float:
    """How far two encoded images are apart: the mean absolute difference per pixel and RGB
    channel, as a share of 255 (0: the same pixels; 1: black against white). Images of
    different sizes are 1.0 apart."""
    with Image.open(io.BytesIO(a)) as first, Image.open(io.BytesIO(b)) as second:
        if first.size != second.size:
            return 1.0
        difference = ImageChops.difference(first.convert("RGB"), second.convert("RGB"))
    means = ImageStat.Stat(difference).mean
    return float(sum(means) / len(means) / 255.0)


def image_verdict(delivered: list[bytes], rendered: list[bytes],
                  max_distance: float) -> tuple[Verdict, list[float]]:
    """The verdict on a worker's images against the auditor's renders of the same order, and
    each image's distance. Honest work passes (suspicion 0: evidence of honesty); one image
    past ``max_distance`` fails the job with the test's heaviest weight."""
    distances = [image_distance(ours, theirs) for ours, theirs in zip(delivered, rendered,
                                                                      strict=True)]
    worst = max(range(len(distances)), key=distances.__getitem__)
    if distances[worst] <= max_distance:
        return Verdict(0.0), distances
    return Verdict(CLIP, True, f"image {worst} is {distances[worst]:.3f} from the auditor's render "
                               f"of the same order (at most {max_distance} is honest)"), distances


def same_kind(a: Worker, b: Worker) -> bool:
    """Whether two workers render on the same kind of backend (both with NVIDIA GPUs, or both
    without), as their hellos say."""
    return bool(a.gpus) == bool(b.gpus)


class ImageAudits:
    """Draws delivered image jobs and audits them in the background."""

    def __init__(self, audits: AuditService, registry: Registry, dispatcher: Dispatcher,
                 meter: Callable[[ImageOrder], Meter], max_distance: float,
                 audit_file: Callable[[str, str | None], str | None]) -> None:
        """``meter(order)``: the bill of an order (the audit's own job is billed to no one;
        ``collect`` needs a meter). ``audit_file(model, worker_sha256)``: the file the order
        must be rendered again from (``ModelCatalog.audit_file``: the hub file the queen read,
        or a local name's file the operator pinned); None: the job cannot be audited."""
        self.audits = audits
        self.audit_file = audit_file
        self.registry = registry
        self.dispatcher = dispatcher
        self.meter = meter
        self.max_distance = max_distance
        self._tasks: set[asyncio.Task[None]] = set()
        # One audit at a time per auditor: a trusted auditor audits only, so audits of jobs
        # served back to back wait their turn instead of finding its slot busy.
        self._turns: dict[str, asyncio.Lock] = {}

    def consider(self, request_id: str, order: ImageOrder, worker_key: str,
                 images: list[bytes], key_id: int | None, charged_msat: int) -> bool:
        """Draw this delivered job against its worker's audit rate; True if it will be
        audited. O(1) when not drawn."""
        worker = self.registry.get(worker_key)
        held = worker.models.get(order.model) if worker is not None else None
        sha256 = (self.audit_file(order.model, held.sha256)
                  if worker is not None and held is not None else None)
        if worker is None or sha256 is None:
            return False  # no pinned file to render the same order from: unverifiable
        if not self.audits.wants(worker_key):
            return False
        task = asyncio.create_task(
            self._audit(request_id, order, worker, sha256, images, key_id, charged_msat),
            name=f"image audit {request_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def stop(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def idle(self) -> None:
        """Wait for the audits under way (the tests' and a stopping queen's)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def auditors(self, model: str, sha256: str, worker: Worker,
                 exclude: Iterable[str]) -> list[Worker]:
        """Who may render the order again: image workers holding the same file, not the worker,
        not flagged, independent of it (unless the operator trusts them); trusted auditors
        first, then those of the worker's own kind of backend. Looks at the trusted auditors
        and at most ``AUDITOR_SCAN`` holders, however many hold the model."""
        skip = set(exclude) | {worker.key}
        found = []
        scan = itertools.chain(self.audits.trusted_auditors(),
                               itertools.islice(self.registry.holders(model), AUDITOR_SCAN))
        for other in scan:
            held = other.models.get(model)
            if (other.key in skip or held is None or held.sha256 != sha256
                    or IMAGE not in other.capabilities or other.flagged
                    or not self.audits.auditor_eligible(other.key)):
                continue
            if (not self.audits.is_trusted(other)
                    and self.audits.dependence(worker, other) is not None):
                continue  # maybe one party with the worker: its word proves nothing
            found.append(other)
        found.sort(key=lambda other: (not self.audits.is_trusted(other),
                                      not same_kind(worker, other)))
        return found

    async def _render(self, auditor: Worker, order: ImageOrder) -> list[bytes] | None:
        """The auditor's images of the order; None when it could not render them."""
        job_id = AUDIT_JOB + secrets.token_hex(12)
        try:
            run = await self.dispatcher.start_on(auditor, job_id, order.model, IMAGES_URL,
                                                 order.model_dump(mode="json"))
            collected = await collect(run, self.dispatcher, self.meter(order))
            return check_delivery(order, collected.result.data)
        except Exception as exc:  # a bad delivery, a failure: another auditor may do
            log.info("image audit: %s could not render the order: %s", auditor.public_id, exc)
            return None

    async def _audit(self, request_id: str, order: ImageOrder, worker: Worker, sha256: str,
                     images: list[bytes], key_id: int | None, charged_msat: int) -> None:
        started = time.monotonic()
        tried: set[str] = set()
        first: Worker | None = None  # an untrusted auditor whose failing verdict awaits a second
        for _ in range(MAX_AUDITORS):
            candidates = self.auditors(order.model, sha256, worker, tried)
            if first is not None:
                candidates = [c for c in candidates if self.audits.is_trusted(c)
                              or self.audits.dependence(first, c) is None]
            if not candidates:
                break
            auditor = candidates[0]
            tried.add(auditor.key)
            async with self._turns.setdefault(auditor.key, asyncio.Lock()):
                rendered = await self._render(auditor, order)
            if rendered is None:
                continue
            verdict, distances = image_verdict(images, rendered, self.max_distance)
            trusted = self.audits.is_trusted(auditor)
            if verdict.failed and not trusted and first is None:
                first = auditor  # one untrusted word never fails a job: ask another
                continue
            accusers: set[str] = set()
            if first is not None and not verdict.failed:
                verdict = Verdict(None, False, "two auditors disagreed")
            elif verdict.failed:
                accusers = {""} if trusted else {auditor.key, *([first.key] if first else [])}
            await self.audits.record_verdict(
                worker.key, verdict, evidence(request_id, order, sha256, auditor, trusted,
                                              verdict, distances, key_id, charged_msat,
                                              time.monotonic() - started),
                auditor.key, trusted, accusers=accusers)
            log.info("image audit of %s on %s by %s: %s (distances %s)", request_id,
                     worker.public_id, auditor.public_id,
                     "FAILED: " + verdict.reason if verdict.failed else "passed",
                     ", ".join(f"{d:.3f}" for d in distances))
            return
        log.info("image audit of %s: no %sauditor could render the order", request_id,
                 "second " if first is not None else "")


def evidence(request_id: str, order: ImageOrder, sha256: str, auditor: Worker, trusted: bool,
             verdict: Verdict, distances: list[float], key_id: int | None, charged_msat: int,
             seconds: float) -> dict[str, object]:
    """The ``audits`` row of an image audit: images counted where text counts tokens, the worst
    distance where text keeps its z."""
    failing = sum(1 for distance in distances if distance > 0)
    return {"request_id": request_id, "auditor_key": auditor.key, "auditor_trusted": trusted,
            "model": order.model, "sha256": sha256, "temperature": 0.0,
            "answer_tokens": order.n, "claimed_tokens": order.n, "positions": order.n,
            "claimed_prompt_tokens": None, "prompt_tokens": None, "mismatches": failing,
            "z": max(distances), "suspicion": verdict.suspicion, "failed": verdict.failed,
            "reason": verdict.reason[:500], "key_id": key_id, "charged_msat": charged_msat,
            "audit_tokens": 0, "audit_s": round(seconds, 3)}
