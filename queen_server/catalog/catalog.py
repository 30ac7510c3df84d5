"""The queen's own readings of the models its workers serve, kept fresh and cached by sha256.

``refresh(name)`` starts a reading in the background (a hub name that has none, or an old one);
``settle(name)`` does that and waits a bounded time for it, which is what a billed request does
before it is priced. A reading lists the repo, picks the file the worker would load, and reads
its GGUF header with Range requests (2 MiB first, more only if a vocabulary makes the header
longer, never past ``max_header_bytes``). A header already read under the same sha256 is not read
again, whichever name or repo it came from. Failures are remembered too: a lasting one (no such
repo) until ``ttl_s``, one that may pass (the hub out of reach) until ``retry_s``; in both cases
the model is priced as unverified, and a fresh failure never erases an earlier good reading of
the same name unless the hub said the name is gone.

One reading (issue 39): the first good reading of a name is its **pin**, and it is the only
reading the rest of the queen sees (``facts``, ``parameter_count``, ``same_file``): routing (the
file a worker must hold), pricing (the parameter count) and audits (the file an auditor must
hold) all use it. Later readings (every ``ttl_s``) are kept apart (``latest``, ``hub_moved``)
so the operator sees a repo that changed under the same name, and nothing moves until the
operator re-pins the name (``repin``: the admin API, page or CLI), which is logged.

Names the queen cannot read (local names, an imported file's) are unverified unless the
operator pins them to a list of sha256s (``local_pins``, ``APIARY_LOCAL_MODEL_PINS``): a holder
whose file is on the list serves the name and is audited by holders of that same file, and
one holding any other file does not serve it at all (``served_files``). The operator's pin is
then the name's one reading: a hub name pinned so (a queen that cannot reach the hub) is never
read on the hub.

Pinned readings are also kept by the sha256 of the file read (``same_file``): a worker that
imported that very file under a name of its own can then be priced by the queen's reading of it
(``queen_server.quoting``). ``version`` changes whenever a reading or a pin does, for callers
that cache what they derive from them.

Remembered failures are the queen's negative cache: a name the hub lacks is answered from it
(``remembered_failure``) with no hub request until it expires, so a flood of made-up names costs
one hub request per name per ``ttl_s`` (``retry_s`` for a hub out of reach). They are kept apart
from the good readings, each bounded by ``max_entries``, so that made-up names never push a real
model's reading out.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

from queen_server.catalog.facts import (
    HeaderFacts,
    ModelFacts,
    RemoteFile,
    RepoFiles,
    diffusion_facts,
    header_facts,
    hub_name,
    model_facts,
    pick_file,
)
from queen_server.catalog.pins import PinStore
from queen_server.errors import ModelUnverified, QueenError
from shared_schema.errors import (
    AmbiguousFilter,
    GgufTruncated,
    InvalidGgufFile,
    ModelNameError,
    NoMatchingFile,
)
from shared_schema.gguf import parse_gguf_header

__all__ = ["FileReader", "ModelCatalog", "Reading"]

logger = logging.getLogger(__name__)

FIRST_READ_BYTES = 2 << 20
# A worker's hello may list many names; the queen reads ahead only this many of them at once,
# so that a worker listing thousands of made-up names cannot make it fetch thousands of headers
# (the others are read when a client asks for them).
PREFETCH_PER_WORKER = 16

# verified: a hub name the queen read and pinned; operator: a local name the operator pinned to
# sha256s; local: a local name with no pin; pending: being read; unverified: could not be read.
Status = Literal["verified", "operator", "unverified", "pending", "local"]


class FileReader(Protocol):
    """What the catalog needs from the hub (``HubFiles``); blocking, run in a thread."""

    def listing(self, repo_id: str) -> RepoFiles: ...

    def read_prefix(self, repo_id: str, commit: str, path: str, nbytes: int) -> bytes: ...


@dataclass(frozen=True, slots=True)
class Reading:
    facts: ModelFacts | None
    problem: str | None
    expires: float
    error: ModelUnverified | None = None  # why the last reading failed (typed, for refusals)


class ModelCatalog:
    def __init__(
        self,
        reader: FileReader,
        *,
        ttl_s: float = 3600.0,
        retry_s: float = 300.0,
        wait_s: float = 10.0,
        max_header_bytes: int = 64 << 20,
        max_entries: int = 10_000,
        concurrency: int = 4,
        local_pins: Mapping[str, Iterable[str]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        pins: PinStore | None = None,
    ) -> None:
        self.reader = reader
        # Where pins outlive this queen (``catalog.pins``: the database, shared by replicas);
        # None: in memory only.
        self.pin_store = pins
        self.ttl_s = ttl_s
        self.retry_s = retry_s
        self.wait_s = wait_s
        self.max_header_bytes = max_header_bytes
        self.max_entries = max_entries
        self.clock = clock
        self._readings: OrderedDict[str, Reading] = OrderedDict()  # with facts
        self._failures: OrderedDict[str, Reading] = OrderedDict()  # without: the negative cache
        # The first good reading of each name: the file it stays pinned to (issue 17) until the
        # operator re-pins it (issue 39), so a repo that changes later changes neither what
        # workers fetch, what routing accepts, the price nor the file an audit looks for.
        self._pins: OrderedDict[str, ModelFacts] = OrderedDict()
        self._headers: OrderedDict[str, HeaderFacts] = OrderedDict()  # by sha256
        # Pinned readings by the sha256 of the file a worker loads (the first part).
        self._by_file: OrderedDict[str, ModelFacts] = OrderedDict()
        # Local names the operator vouches for: the sha256s of the files that may serve them.
        self.local_pins: dict[str, frozenset[str]] = {
            name: frozenset(sha.lower() for sha in shas)
            for name, shas in (local_pins or {}).items()}
        self.version = 0  # changes whenever a reading is remembered or a pin set
        self._pending: dict[str, asyncio.Task[None]] = {}
        self._local: set[str] = set()  # names seen that are not hub names
        self._gate = asyncio.Semaphore(concurrency)
        self.header_reads = 0  # Range requests made (for tests and /metrics-like counts)

    # --- what the rest of the queen asks --------------------------------------------------------

    def facts(self, name: str) -> ModelFacts | None:
        """The one reading of ``name`` the queen uses: its pin (None: none yet, or not a hub
        name). Later readings of the hub never change it; ``repin`` does."""
        return self._pins.get(name)

    def latest(self, name: str) -> ModelFacts | None:
        """The queen's latest good reading of the hub for ``name``, which may differ from its
        pin when the repo changed (shown to the operator; used for nothing else)."""
        reading = self._readings.get(name)
        return reading.facts if reading is not None else None

    def hub_moved(self, name: str) -> ModelFacts | None:
        """The latest reading when it names other files than the pin (the operator may
        re-pin to it), else None."""
        pinned, latest = self._pins.get(name), self.latest(name)
        if pinned is None or latest is None or latest.sha256s == pinned.sha256s:
            return None
        return latest

    def parameter_count(self, name: str) -> int | None:
        facts = self.facts(name)
        return facts.parameter_count if facts is not None else None

    def same_file(self, sha256: str) -> ModelFacts | None:
        """The pinned reading of a hub model whose file has this sha256 (the first part of a
        split model), under whatever name it was read; None if none."""
        return self._by_file.get(sha256)

    def status(self, name: str) -> Status:
        if name in self.local_pins:
            return "operator"
        if hub_name(name) is None:
            return "local"
        if name in self._pins:
            return "verified"
        return "pending" if name in self._pending else "unverified"

    def verified(self, name: str) -> bool:
        """Whether the queen knows which file(s) may serve ``name``: a hub name it read and
        pinned, or a local name the operator pinned. Only such a model can be audited."""
        return name in self._pins or name in self.local_pins

    def served_files(self, name: str) -> frozenset[str | None] | None:
        """The sha256s of the files that may serve ``name`` (routing leaves other holders
        out), None for any. A hub pin admits a worker naming no file (older workers did
        not; the audits re-score its answers against the pinned file); an operator's pin of
        a local name admits only the files it lists."""
        local = self.local_pins.get(name)
        if local is not None:
            return local
        pinned = self._pins.get(name)
        return frozenset((pinned.sha256, None)) if pinned is not None else None

    def audit_file(self, name: str, worker_sha256: str | None) -> str | None:
        """The file an audit of an answer for ``name`` must be re-scored on (its auditor must
        hold it): a hub name's pinned file; a local name's file when the operator pinned it
        and the worker holds it. None: the answer cannot be audited (no case is made)."""
        local = self.local_pins.get(name)
        if local is not None:
            return worker_sha256 if worker_sha256 in local else None
        pinned = self._pins.get(name)
        return pinned.sha256 if pinned is not None else None

    def pin(self, name: str) -> ModelFacts | None:
        """The file ``name`` is pinned to (``facts``; None: none)."""
        return self._pins.get(name)

    async def repin(self, name: str, wait_s: float | None = None) -> tuple[ModelFacts | None,
                                                                         ModelFacts]:
        """Read ``name`` on the hub now and pin it to what the hub holds (the operator's
        explicit, logged act): returns the old pin and the new one. Raises
        ``ModelUnverified`` (the old pin stays) when the name cannot be read."""
        if hub_name(name) is None or name in self.local_pins:
            raise ModelUnverified(f"'{name}' is not a hub model name the queen reads: the "
                                  "operator pins it to sha256s with APIARY_LOCAL_MODEL_PINS",
                                  lasting=True, kind="invalid")
        await self.awaited(name, wait_s)  # a reading under way may be of the older files
        try:
            facts = await asyncio.wait_for(self._read(name),
                                           self.wait_s if wait_s is None else wait_s)
        except TimeoutError as exc:
            raise ModelUnverified(f"the hub did not answer for {name} in time", lasting=False,
                                  kind="unreachable") from exc
        if facts is None:
            reading = self._failures.get(name)
            raise (reading.error if reading is not None and reading.error is not None else
                   ModelUnverified(f"cannot read {name}", lasting=False, kind="unreachable"))
        old = self._pins.get(name)
        if self.pin_store is not None:
            await self.pin_store.set(name, facts)  # stored first: a failure leaves the old pin
        self._set_pin(name, facts)
        logger.warning("re-pinned %s by the operator: %s -> %s (%s parameters)", name,
                       ", ".join(old.sha256s) if old is not None else "no pin",
                       ", ".join(facts.sha256s), f"{facts.parameter_count:,}")
        return old, facts

    async def resolve(self, name: str, wait_s: float | None = None) -> ModelFacts:
        """The pinned facts of a hub name, reading it first if need be (waiting up to
        ``wait_s``, default the catalog's). Raises ``ModelUnverified`` with its ``kind`` when
        the name cannot be resolved (``unreachable`` while a reading is still under way)."""
        pinned = self._pins.get(name)
        if pinned is not None:
            self.refresh(name)
            return pinned
        if hub_name(name) is None or name in self.local_pins:
            raise ModelUnverified(f"'{name}' is not a hub model name (hf-user/hf-repo:filter)",
                                  lasting=True, kind="invalid")
        await self.settle(name, wait_s)
        pinned = self._pins.get(name)
        if pinned is not None:
            return pinned
        reading = self._reading(name)
        if reading is not None and reading.error is not None:
            raise reading.error
        raise ModelUnverified(f"the hub has not answered for {name} yet", lasting=False,
                              kind="unreachable")

    def known(self, name: str) -> bool:
        """Whether the queen has read ``name`` (well or not), or never will (not a hub name):
        its price then needs no hub request."""
        return name in self._readings or name in self._failures or hub_name(name) is None

    async def awaited(self, name: str, wait_s: float | None = None) -> None:
        """Wait up to ``wait_s`` (default the catalog's) for a reading of ``name`` already
        under way; starts none (no hub request is made for the caller)."""
        task = self._pending.get(name)
        if task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task),
                                       self.wait_s if wait_s is None else wait_s)

    def remembered_failure(self, name: str) -> ModelUnverified | None:
        """Why ``name`` could not be read, while that failure is remembered (the negative
        cache: asking again reads nothing until it expires); None when the name is pinned,
        has a good reading, is being read, or its failure has expired."""
        reading = self._failures.get(name)
        if (reading is None or reading.error is None or name in self._pins
                or name in self._pending or reading.expires <= self.clock()):
            return None
        return reading.error

    def problem(self, name: str) -> str | None:
        reading = self._reading(name)
        return reading.problem if reading is not None else None

    def refresh(self, name: str) -> None:
        """Start reading ``name`` in the background if it is a hub name with no fresh reading
        (needs a running event loop)."""
        reading = self._reading(name)  # on every request: set and dict lookups first
        if name in self._pending or name in self._local or (
                reading is not None and reading.expires > self.clock()):
            return
        if hub_name(name) is None or name in self.local_pins:  # nothing to read, ever
            if len(self._local) >= self.max_entries:  # kept apart from the readings, so that
                self._local.clear()  # made-up names never push a real reading out
            self._local.add(name)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # called outside the queen's loop (a script, a sync test)
            return
        task = loop.create_task(self._read(name))
        self._pending[name] = task
        task.add_done_callback(lambda _t: self._pending.pop(name, None))

    def prefetch(self, names: Iterable[str]) -> None:
        """``refresh`` the first ``PREFETCH_PER_WORKER`` of a worker's names, so that the queen
        has read them before the first request comes."""
        for name in itertools.islice(names, PREFETCH_PER_WORKER):
            self.refresh(name)

    async def settle(self, name: str, wait_s: float | None = None) -> None:
        """``refresh``, then wait up to ``wait_s`` (default the catalog's) for a reading in
        progress."""
        self.refresh(name)
        await self.awaited(name, wait_s)

    async def close(self) -> None:
        tasks = list(self._pending.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- reading --------------------------------------------------------------------------------

    async def _read(self, name: str) -> ModelFacts | None:
        """Read ``name`` on the hub and remember the reading (pinned if it is the name's
        first good one); the facts, or None when it failed."""
        parsed = hub_name(name)
        assert parsed is not None
        if name not in self._pins:
            await self._adopt_stored_pin(name)  # a restart's, or another replica's
        now = self.clock()
        try:
            async with self._gate:
                listing = await asyncio.to_thread(self.reader.listing, parsed.repo_id)
                try:
                    _, remotes = pick_file(listing, parsed)
                except ModelNameError as exc:
                    raise _name_problem(parsed.repo_id, exc) from exc
                headers = [await self._header(listing, remote) for remote in remotes]
        except ModelUnverified as exc:
            old = self._reading(name)
            keep = old.facts if old is not None and not exc.lasting else None
            wait = self.ttl_s if exc.lasting else self.retry_s
            logger.warning("cannot read %s (%s); %s", name, exc,
                           "it stays as pinned" if name in self._pins
                           else "priced as unverified until it can be read")
            self._remember(name, Reading(keep, str(exc), now + wait, exc))
            return None
        facts = model_facts(name, listing, remotes, headers)
        logger.info("read %s: %s parameters in %s (sha256 %s…)", name,
                    f"{facts.parameter_count:,}", ", ".join(facts.paths), facts.sha256[:12])
        self._remember(name, Reading(facts, None, now + self.ttl_s))
        pinned = self._pins.get(name)
        if pinned is None:
            pinned = await self._claim_pin(name, facts)
        if pinned.sha256s != facts.sha256s:
            logger.warning("the hub now holds other files for %s (%s) than its pin (%s): it "
                           "stays pinned until the operator re-pins it", name,
                           facts.sha256[:12], pinned.sha256[:12])
        return facts

    async def _adopt_stored_pin(self, name: str) -> None:
        """Pin ``name`` to the reading stored for it, if any (the hub is read after, for
        ``hub_moved``; an unreachable hub then leaves the name pinned, not unverified)."""
        if self.pin_store is None:
            return
        try:
            stored = await self.pin_store.get(name)
        except QueenError as exc:
            logger.warning("cannot read the stored pin of %s (%s): reading the hub", name, exc)
            return
        if stored is not None and name not in self._pins:
            self._set_pin(name, stored)
            logger.info("%s is pinned to %s (stored)", name, stored.sha256[:12])

    async def _claim_pin(self, name: str, facts: ModelFacts) -> ModelFacts:
        """Pin ``name`` to its first good reading, or to the stored one if another replica
        stored one first; in memory only when the store cannot be written."""
        kept = facts
        if self.pin_store is not None:
            try:
                kept = await self.pin_store.claim(name, facts)
            except QueenError as exc:
                logger.warning("cannot store the pin of %s (%s): pinned in memory only", name,
                               exc)
        if name not in self._pins:  # a re-pin may have come meanwhile
            self._set_pin(name, kept)
        return self._pins[name]

    def _set_pin(self, name: str, facts: ModelFacts) -> None:
        old = self._pins.get(name)
        if old is not None and self._by_file.get(old.sha256) is old:
            del self._by_file[old.sha256]
        self._pins[name] = facts
        self._pins.move_to_end(name)
        _trim(self._pins, self.max_entries)
        self._by_file[facts.sha256] = facts
        self._by_file.move_to_end(facts.sha256)
        _trim(self._by_file, self.max_entries)
        self.version += 1

    async def _header(self, listing: RepoFiles, remote: RemoteFile) -> HeaderFacts:
        assert remote.sha256 is not None  # pick_file refuses files with none
        known = self._headers.get(remote.sha256)
        if known is not None:
            self._headers.move_to_end(remote.sha256)
            return known
        size = remote.size
        nbytes = min(FIRST_READ_BYTES, self.max_header_bytes, size or FIRST_READ_BYTES)
        while True:
            self.header_reads += 1
            data = await asyncio.to_thread(
                self.reader.read_prefix, listing.repo_id, listing.commit, remote.path, nbytes)
            file_size = len(data) if len(data) < nbytes else (size or 1 << 62)
            try:
                try:
                    facts = header_facts(parse_gguf_header(data, remote.path, file_size),
                                         size or file_size)
                except GgufTruncated:
                    raise
                except InvalidGgufFile as exc:  # not an LLM's: a diffusion model's (issue 38)?
                    facts = diffusion_facts(data, remote.path, size or file_size, exc)
            except GgufTruncated as exc:
                if nbytes >= self.max_header_bytes:
                    raise ModelUnverified(
                        f"{remote.path}: its header is longer than {self.max_header_bytes:,} "
                        "bytes (APIARY_MAX_HEADER_BYTES)", lasting=True) from exc
                nbytes = min(max(exc.needed, 2 * nbytes), self.max_header_bytes)
                continue
            except InvalidGgufFile as exc:
                raise ModelUnverified(str(exc), lasting=True) from exc
            self._headers[remote.sha256] = facts
            _trim(self._headers, self.max_entries)
            return facts

    def _reading(self, name: str) -> Reading | None:
        reading = self._readings.get(name)
        return reading if reading is not None else self._failures.get(name)

    def _remember(self, name: str, reading: Reading) -> None:
        kept, other = ((self._readings, self._failures) if reading.facts is not None
                       else (self._failures, self._readings))
        other.pop(name, None)
        kept[name] = reading
        self.version += 1
        kept.move_to_end(name)
        _trim(kept, self.max_entries)


def _name_problem(repo_id: str, exc: ModelNameError) -> ModelUnverified:
    """Why a repo's listing gives no single, pinned model file for a filter."""
    kind, candidates = "invalid", None
    if isinstance(exc, AmbiguousFilter):
        kind, candidates = "ambiguous", exc.candidates
    elif isinstance(exc, NoMatchingFile):
        kind, candidates = "no_match", exc.candidates
    elif "no sha256" in str(exc):
        kind = "unpinned"
    return ModelUnverified(f"{repo_id}: {exc}", lasting=True, kind=kind, candidates=candidates)


def _trim(cache: OrderedDict[str, object], limit: int) -> None:
    while len(cache) > limit:
        cache.popitem(last=False)
