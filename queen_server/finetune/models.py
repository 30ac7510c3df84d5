"""Fine-tuned models as the queen serves them (issue 37): each ``ft:`` name of a job that
succeeded, its base, its owner and its adapter, kept in memory for an O(1) lookup per request.

A fine-tuned model is its owner's alone (the key that made the job): ``find`` answers only for
that owner, and another's name reads as no model at all (the caller cannot tell it from a name
nobody made). The map is loaded whole at the start, refreshed every
``finetune_models_refresh_s`` (other replicas' jobs and deletions), and asked of the database
once on a miss for a name that parses as ``ft:`` (a job that just succeeded on another replica).
A model its owner deleted is marked in its job's row (``model_deleted_at``) and dropped here at
once; other replicas drop it at their next refresh, and its adapter's transfer (``adapters``)
reads the row itself, so it is refused everywhere at once.

A worker given a job for a fine-tuned model gets an ``AdapterRef``: the adapter's place on the
queen's origin (``ADAPTER_ROUTE/<job id>/<worker key>``) and a token, an HMAC under the secret
every replica reads from the database (``orders.TRANSFER_SECRET``) of the job, the adapter's
sha256 and the worker's key: any replica can check it, and it opens that adapter for that
worker only.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from queen_server.finetune.plan import parse_fine_tuned
from queen_server.finetune.store import as_utc
from shared_schema.training import AdapterRef, Transfer

if TYPE_CHECKING:
    from queen_server.finetune.store import JobStore

log = logging.getLogger(__name__)

ADAPTER_ROUTE = "/apiary/adapters"  # ADAPTER_ROUTE/<job id>/<worker key>
JOB_ID = re.compile(r"^ftjob-[0-9a-f]{24}$")
WORKER_KEY = re.compile(r"^[0-9a-f]{16,128}$")


def adapter_url(job_id: str, worker_key: str) -> str:
    return f"{ADAPTER_ROUTE}/{job_id}/{worker_key}"


def adapter_token(secret: bytes, job_id: str, sha256: str, worker_key: str) -> str:
    """The bearer token that opens job ``job_id``'s adapter (``sha256``) to ``worker_key``."""
    message = f"adapter\n{job_id}\n{sha256}\n{worker_key}".encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def adapter_token_matches(secret: bytes, job_id: str, sha256: str, worker_key: str,
                          token: str) -> bool:
    return hmac.compare_digest(adapter_token(secret, job_id, sha256, worker_key).encode(),
                               token.encode("utf-8", "replace"))


@dataclass(frozen=True, slots=True)
class FineTunedModel:
    """A served fine-tuned model: its ``ft:`` name, base, owner and adapter."""

    name: str
    base: str
    owner: str
    job_id: str
    created: int  # when its job finished (Unix seconds)
    sha256: str
    size_bytes: int

    def ref(self, secret: bytes, worker_key: str) -> AdapterRef:
        """What a job for this model tells the worker ``worker_key`` (``Job.adapter``)."""
        return AdapterRef(
            name=self.name, base=self.base,
            file=Transfer(url=adapter_url(self.job_id, worker_key), sha256=self.sha256,
                          size_bytes=self.size_bytes),
            token=adapter_token(secret, self.job_id, self.sha256, worker_key))


def model_of(row: Any) -> FineTunedModel | None:
    """The served model of a job row; None unless it succeeded with an adapter, and its model
    was not deleted."""
    name = row.fine_tuned_model
    if (row.status != "succeeded" or not name or row.model_deleted_at is not None
            or not row.adapter_sha256 or row.adapter_size_bytes is None):
        return None
    parsed = parse_fine_tuned(name)
    finished = as_utc(row.finished_at)
    return FineTunedModel(
        name=name, base=parsed[0] if parsed is not None else row.model, owner=row.owner,
        job_id=row.id, created=int(finished.timestamp()) if finished is not None else 0,
        sha256=row.adapter_sha256, size_bytes=int(row.adapter_size_bytes))


class FineTunedModels:
    """The served fine-tuned models, by name and by owner."""

    def __init__(self, store: JobStore, refresh_s: float,
                 secret: Callable[[], bytes | None]) -> None:
        self.store = store
        self.refresh_s = refresh_s
        self.secret = secret  # the transfers' shared secret (None until the queen starts)
        self._by_name: dict[str, FineTunedModel] = {}
        self._by_owner: dict[str, dict[str, FineTunedModel]] = {}
        self._poller: asyncio.Task[None] | None = None

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.refresh()
        self._poller = asyncio.create_task(self._poll(), name="fine-tuned models")

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except Exception:
                log.exception("reloading the fine-tuned models failed")

    async def refresh(self) -> None:
        """Reload every served model (other replicas' new ones and deletions)."""
        models = [model for row in await self.store.served_models()
                  if (model := model_of(row)) is not None]
        by_name = {model.name: model for model in models}
        by_owner: dict[str, dict[str, FineTunedModel]] = {}
        for model in models:
            by_owner.setdefault(model.owner, {})[model.name] = model
        self._by_name, self._by_owner = by_name, by_owner

    # --- lookups --------------------------------------------------------------------------------

    async def find(self, owner: str, name: str) -> FineTunedModel | None:
        """``owner``'s fine-tuned model ``name``; None for another's, a deleted one, or none
        (the same answer: nobody learns that another's model exists). O(1) when known; a
        miss for an ``ft:`` name asks the database once (a job just finished elsewhere)."""
        model = self._by_name.get(name)
        if model is None and parse_fine_tuned(name) is not None:
            row = await self.store.by_model(name)
            model = model_of(row) if row is not None else None
            if model is not None:
                self._add(model)
        return model if model is not None and model.owner == owner else None

    def served(self, name: str) -> FineTunedModel | None:
        """The served model ``name``, whoever owns it (the audits' lookup: never answer a
        caller with it); None once deleted here or unknown. O(1), no database read."""
        return self._by_name.get(name)

    def owned(self, owner: str) -> list[FineTunedModel]:
        """``owner``'s served fine-tuned models, oldest first."""
        return sorted(self._by_owner.get(owner, {}).values(),
                      key=lambda model: (model.created, model.name))

    async def added(self, name: str) -> None:
        """A job here just succeeded with model ``name``: serve it at once."""
        row = await self.store.by_model(name)
        model = model_of(row) if row is not None else None
        if model is not None:
            self._add(model)

    async def delete(self, owner: str, name: str) -> FineTunedModel | None:
        """Delete ``owner``'s model ``name`` (no longer served or listed, its adapter no longer
        sent); None when it is not ``owner``'s served model."""
        model = await self.find(owner, name)
        if model is None or not await self.store.delete_model(owner, model.job_id):
            return None
        self._drop(model)
        log.info("fine-tuned model %s deleted by its owner", name)
        return model

    def ref(self, model: FineTunedModel) -> Callable[[str], AdapterRef]:
        """The ``Job.adapter`` each worker (by key) gets for ``model``."""
        secret = self.secret()
        if secret is None:  # not reached once the queen started: it reads the secret first
            raise RuntimeError("the adapters' secret is not read yet")
        return lambda worker_key: model.ref(secret, worker_key)

    def _add(self, model: FineTunedModel) -> None:
        self._by_name[model.name] = model
        self._by_owner.setdefault(model.owner, {})[model.name] = model

    def _drop(self, model: FineTunedModel) -> None:
        self._by_name.pop(model.name, None)
        owned = self._by_owner.get(model.owner)
        if owned is not None:
            owned.pop(model.name, None)
            if not owned:
                del self._by_owner[model.owner]
