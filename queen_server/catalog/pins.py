"""Pins that outlive the queen (issue 39, "One reading"): the reading each hub name is pinned to,
kept in the database, so that a restart, or another replica on the same database, uses the same
file, size and price until the operator re-pins the name, even if the hub changed meanwhile.

``PinStore`` is what the catalog needs: ``claim`` (pin a name to a reading unless it is pinned
already, and return the pin that holds: the first writer's, whichever replica or run it was)
and ``set`` (the operator's re-pin). ``DatabasePins`` keeps them in ``model_pins``; without a
database the catalog keeps its pins in memory only. The reading is stored whole, as JSON
(``facts_to_json``/``facts_from_json``), so a pinned name needs no hub to be served.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy import select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import SQLAlchemyError

from queen_server.catalog.facts import ModelFacts
from queen_server.storage.engine import DatabaseError
from queen_server.storage.tables import ModelPin
from shared_schema.gguf_shape import GgufShape

if TYPE_CHECKING:
    from queen_server.storage.engine import Database

log = logging.getLogger(__name__)


class PinStore(Protocol):
    async def get(self, name: str) -> ModelFacts | None: ...
    async def claim(self, name: str, facts: ModelFacts) -> ModelFacts: ...
    async def set(self, name: str, facts: ModelFacts) -> None: ...


def facts_to_json(facts: ModelFacts) -> str:
    return json.dumps(asdict(facts), sort_keys=True)


def facts_from_json(text: str) -> ModelFacts:
    """A stored reading; ``ValueError`` (from ``json`` or the fields) for a damaged one."""
    raw: dict[str, Any] = json.loads(text)
    shape = raw.pop("shape", None)
    raw["paths"] = tuple(raw["paths"])
    raw["sha256s"] = tuple(raw["sha256s"])
    if shape is not None:
        shape["layer_bytes"] = tuple(shape["layer_bytes"])
        raw["shape"] = GgufShape(**shape)
    try:
        return ModelFacts(**raw)
    except TypeError as exc:
        raise ValueError(f"a stored pin does not read as a model's facts: {exc}") from exc


class DatabasePins:
    """``PinStore`` on the queen's database (table ``model_pins``, migration 0014)."""

    def __init__(self, database: Database) -> None:
        self.database = database

    async def get(self, name: str) -> ModelFacts | None:
        try:
            async with self.database.engine.connect() as conn:
                stored = await conn.scalar(select(ModelPin.facts).where(ModelPin.name == name))
        except SQLAlchemyError as exc:
            raise DatabaseError(f"cannot read the pin of {name}: {exc}") from exc
        if stored is None:
            return None
        try:
            return facts_from_json(stored)
        except ValueError:
            log.exception("the stored pin of %s is damaged: it is read from the hub again", name)
            return None

    async def claim(self, name: str, facts: ModelFacts) -> ModelFacts:
        insert = pg_insert if self.database.dialect == "postgresql" else sqlite_insert
        try:
            async with self.database.engine.begin() as conn:
                await conn.execute(insert(ModelPin).values(
                    name=name, facts=facts_to_json(facts), pinned_at=datetime.now(UTC),
                    pinned_by="first reading").on_conflict_do_nothing(index_elements=["name"]))
                stored = await conn.scalar(select(ModelPin.facts).where(ModelPin.name == name))
        except SQLAlchemyError as exc:
            raise DatabaseError(f"cannot pin {name}: {exc}") from exc
        if stored is None:  # not reached: the row was just written or found
            return facts
        try:
            return facts_from_json(stored)
        except ValueError:
            log.exception("the stored pin of %s is damaged: pinning it to the hub's reading", name)
            await self.set(name, facts)
            return facts

    async def set(self, name: str, facts: ModelFacts) -> None:
        values = {"facts": facts_to_json(facts), "pinned_at": datetime.now(UTC),
                  "pinned_by": "operator"}
        try:
            async with self.database.engine.begin() as conn:
                changed = await conn.execute(update(ModelPin).where(ModelPin.name == name)
                                             .values(**values))
                if not changed.rowcount:
                    await conn.execute(ModelPin.__table__.insert().values(name=name, **values))
        except SQLAlchemyError as exc:
            raise DatabaseError(f"cannot re-pin {name}: {exc}") from exc
