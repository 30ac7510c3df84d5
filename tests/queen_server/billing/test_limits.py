"""One queen's key limits (``InProcessKeyLimits``) on a clock the test moves."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from queen_server.billing.keys import KeyRecord
from queen_server.billing.limits import InProcessKeyLimits
from queen_server.errors import RateLimited


def record(rpm_limit: int | None = None, concurrency_limit: int | None = None) -> KeyRecord:
    return KeyRecord(id=7, name="k", prefix="sk-", created_at=datetime.now(UTC), revoked=False,
                     rpm_limit=rpm_limit, concurrency_limit=concurrency_limit, budget_msat=None)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_the_minute_slides_and_says_when_to_come_back():
    clock = Clock()
    limits = InProcessKeyLimits(clock)
    key = record(rpm_limit=2)
    await limits.release(await limits.admit(key))
    clock.now += 30
    await limits.release(await limits.admit(key))
    with pytest.raises(RateLimited) as caught:
        await limits.admit(key)
    assert caught.value.code == "rate_limit_exceeded"
    assert caught.value.headers["Retry-After"] == "31"  # the first leaves the window in 30 s
    clock.now += 30  # the first request is 60 s old: out of the window
    assert await limits.admit(key) is not None


async def test_concurrency_is_freed_by_release_and_a_cancel_uncounts_the_minute():
    limits = InProcessKeyLimits(Clock())
    key = record(rpm_limit=2, concurrency_limit=1)
    lease = await limits.admit(key)
    with pytest.raises(RateLimited) as caught:
        await limits.admit(key)
    assert caught.value.code == "concurrency_limit_exceeded"
    await limits.cancel(lease)  # refused for money, say: as if it never came
    await limits.cancel(lease)  # twice is harmless
    await limits.release(await limits.admit(key))
    await limits.release(await limits.admit(key))  # the second of two in the minute
    with pytest.raises(RateLimited):
        await limits.admit(key)


async def test_a_key_without_limits_is_not_counted():
    limits = InProcessKeyLimits(Clock())
    assert await limits.admit(record()) is None
    await limits.release(None)
    await limits.cancel(None)
