"""A secret the queen's replicas share (issue 36's cache scopes): made once, at random, and the
same for every replica on the database, even when they ask at the same moment."""

from __future__ import annotations

import asyncio

from queen_server.storage.engine import Database


async def test_every_replica_on_the_database_gets_the_same_secret(db_url: str) -> None:
    replicas = [Database(db_url) for _ in range(3)]
    try:
        await replicas[0].upgrade()
        first = await asyncio.gather(*(db.shared_secret("cache_scope") for db in replicas))
        assert len(first[0]) == 32
        assert first == [first[0]] * 3  # one winner of the race, read by all
        again = await replicas[1].shared_secret("cache_scope")
        assert again == first[0]  # the same ever after (a restart, a new replica)
        other = await replicas[2].shared_secret("something_else")
        assert other != first[0]  # each name its own random secret
    finally:
        for db in replicas:
            await db.close()
