"""Which workers may take a job, and how routing scores them: the dispatcher's rules for "can
anyone serve this?", for filtering free workers, and for the speed score, apart from its I/O.

``Eligibility`` answers from the registry's per-model worker *profiles* (legacy or not,
capabilities, the file's sha256) and never looks at every worker: a 404 when nobody holds the
model (or only holders of another file than the one the name is pinned to, issue 17), a 400
naming the field when no holder has a capability the request needs, and the filter a job's
free worker must pass (workers it already failed on, legacy workers for billed jobs, the
capabilities, the pinned file, a twin for a continuation). ``Scores`` is routing's score: seconds
per token on the model's size class (a newcomer's: the class's median, recomputed at most once
a second), times the worker's audit ``trust``.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Collection, Mapping

from queen_server.errors import InvalidRequest, ModelNotFound, WorkerFailed
from queen_server.swarm.registry import Profile, Registry
from queen_server.swarm.worker import Worker
from shared_schema import CAPABILITY_CONTINUE
from shared_schema.capabilities import IMAGE


class Eligibility:
    def __init__(self, registry: Registry,
                 pinned: Callable[[str], Collection[str | None] | None] = lambda _model: None,
                 ) -> None:
        """``pinned(model)``: the sha256s of the files a model name may be served from (its
        hub pin, issue 17, or the operator's pin of a local name, issue 39; ``None`` in it
        admits a worker that names no file), or None for any; workers holding another file
        under that name are not used for it."""
        self.registry = registry
        self.pinned = pinned

    def servable(self, model: str) -> list[Profile]:
        """The profiles of the workers that could serve ``model``, less those that hold another
        file than the ones the name is pinned to. (For a hub pin a worker that names no sha256
        stays: older workers did not; the audits re-score its answers against the pinned
        file.)"""
        profiles = self.registry.profiles(model)
        allowed = self.pinned(model) if profiles else None
        if allowed is None:
            return profiles
        return [profile for profile in profiles if profile[2] in allowed]

    def require_servable(self, model: str, needs: Mapping[str, str] | None = None) -> None:
        """404 ``model_not_found`` unless some connected worker could serve ``model``; 400
        naming the field when none of them has the capabilities ``needs`` asks for. O(the
        distinct kinds of worker), never O(workers)."""
        profiles = self.servable(model)
        if not profiles:
            raise ModelNotFound(
                f"The model '{model}' is not served by any connected worker.", param="model"
            )
        self.check_kind(model, needs)
        if needs:
            check_capable(model, profiles, needs)

    def check_kind(self, model: str, needs: Mapping[str, str] | None) -> None:
        """A 400 for a text request to a model its holders hold only as a diffusion model, and
        for an image request to a model no holder holds as one (issue 38). O(1)."""
        images = self.registry.image_holders(model)
        if needs and IMAGE in needs:
            if images == 0 and self.registry.holder_count(model) > 0:
                raise InvalidRequest(
                    f"The model '{model}' is a text model: /v1/images/generations needs a "
                    "diffusion model.", param="model", code="model_not_image")
        elif images and images == self.registry.holder_count(model):
            raise InvalidRequest(
                f"The model '{model}' makes images: use /v1/images/generations.",
                param="model", code="model_makes_images")

    def filter(self, model: str, tried: set[str], accept: Callable[[Worker], bool] | None,
                legacy_ok: bool, needs: Mapping[str, str] | None,
                ) -> Callable[[Worker], bool] | None:
        """Which free workers will do for this job (None: any)."""
        allowed = self.pinned(model)
        wanted = frozenset(needs) if needs else None
        # Issue 38: an image job goes only to a holder of the model as a diffusion model, and a
        # text job, where some holder holds the name as one, only to the others.
        image = wanted is not None and IMAGE in wanted
        kinds = image or self.registry.image_holders(model) > 0
        if (not tried and accept is None and legacy_ok and wanted is None and allowed is None
                and not kinds):
            return None

        def ok(worker: Worker) -> bool:
            if worker.key in tried or (not legacy_ok and worker.legacy):
                return False
            if wanted is not None and not wanted <= worker.capabilities:
                return False
            held = worker.models.get(model)
            if allowed is not None and held is not None and held.sha256 not in allowed:
                return False
            if kinds and (held.kind == "image" if held is not None else False) != image:
                return False
            return accept is None or accept(worker)

        return ok

    def untried_left(self, model: str, tried: set[str]) -> bool:
        """Whether a worker that could serve ``model`` has not failed this job yet: looks at
        no more than ``len(tried) + 1`` of them."""
        registry = self.registry
        pool = itertools.chain(registry.holders(model), registry.fetchers())
        return any(worker.key not in tried for worker in itertools.islice(pool, len(tried) + 1))

    def check_servable(self, model: str, tried: set[str], last_error: str,
                        accept: Callable[[Worker], bool] | None, legacy_ok: bool,
                        needs: Mapping[str, str] | None) -> None:
        """Fail a job that no connected worker could take at all (before it waits for one)."""
        if accept is not None:  # a twin for a failover: rare, so the holders are scanned
            twins = [worker for worker in self.registry.holders(model)
                     if worker.key not in tried and accept(worker)]
            if not twins:
                raise WorkerFailed(
                    "the worker was lost mid-answer and no other connected worker holds the "
                    f"same model file to continue it; last error: {last_error}",
                    code="worker_lost",
                )
            return
        profiles = self.servable(model)
        if not legacy_ok:  # a billed job under legacy_workers="unbilled" only
            profiles = [profile for profile in profiles if not profile[0]]
            if not profiles and not tried:
                raise ModelNotFound(
                    f"The model '{model}' is not served by any connected worker that takes "
                    "billed requests.", param="model",
                )
        if not profiles:
            if tried:
                raise WorkerFailed(
                    f"no other worker can serve this model; last error: {last_error}"
                )
            self.require_servable(model)
        if needs and not tried:
            check_capable(model, profiles, needs)

    @staticmethod
    def twin(model: str, sha256: str) -> Callable[[Worker], bool]:
        """Whether a worker can continue another's answer: it holds the same file."""
        def twin(worker: Worker) -> bool:
            held = worker.models.get(model)
            return (CAPABILITY_CONTINUE in worker.capabilities and held is not None
                    and held.sha256 == sha256)
        return twin


class Scores:
    """Routing's speed score (``capacity.FreeIndex.score``)."""

    def __init__(self, speeds_for: Callable[[str], Mapping[str, float]],
                 size_class_of: Callable[[str], str],
                 speed_at: Callable[[str, str, int], float | None] | None = None) -> None:
        """``speeds_for(size_class)``: the unloaded records; ``speed_at(size_class, key,
        jobs)``: what a new stream gets as a worker's ``jobs``-th job at once (None: unloaded
        records only)."""
        self.speeds_for = speeds_for
        self.size_class_of = size_class_of
        self.speed_at = speed_at
        self._medians: dict[str, tuple[int, float, float]] = {}

    def score(self, worker: Worker, model: str) -> float:
        """Routing's score of a worker for a model: the seconds per token a new job would get
        there on the model's size class, at the load it would run with (``routing.rank``; a
        newcomer's: the class's median, shared among its jobs), times its audit ``trust``."""
        size_class = self.size_class_of(model)
        jobs = worker.active_jobs + 1
        if self.speed_at is not None:
            speed = self.speed_at(size_class, worker.key, jobs)
        else:
            speed = self.speeds_for(size_class).get(worker.key)
        if speed is None:
            speed = self.typical(size_class, self.speeds_for(size_class)) * jobs
        return speed * worker.trust

    def typical(self, size_class: str, speeds: Mapping[str, float]) -> float:
        """The median speed of a size class, recomputed at most once a second (sorting
        thousands of records on every job, while a large swarm's newcomers get their first
        records, would make each job O(N)), or at once when the class had no record: a
        newcomer is scored at it."""
        now = time.monotonic()
        cached = self._medians.get(size_class)
        if cached is not None and (cached[0] > 0 or not speeds) and now - cached[1] < 1.0:
            return cached[2]
        median = statistics.median(speeds.values()) if speeds else 1.0
        self._medians[size_class] = (len(speeds), now, median)
        return median


def check_capable(model: str, profiles: list[Profile], needs: Mapping[str, str]) -> None:
    """400 naming the first field no worker of ``model`` can honour (the request asks for
    something only newer workers do; none is connected)."""
    for capability, param in needs.items():
        if not any(capability in profile[1] for profile in profiles):
            raise InvalidRequest(
                f"'{param}' is not supported by any connected worker serving '{model}' (it "
                f"needs workers with the '{capability}' capability; try again later or without "
                f"'{param}').", param=param, code="unsupported_by_workers")
    if not any(needs.keys() <= profile[1] for profile in profiles):
        fields = ", ".join(f"'{param}'" for param in dict.fromkeys(needs.values()))
        raise InvalidRequest(
            f"No connected worker serving '{model}' supports {fields} together.",
            param=next(iter(needs.values())), code="unsupported_by_workers")
