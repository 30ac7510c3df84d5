"""``GroupServe.share_mb`` (issue 34): one bounded share per served device, or none from an
older queen; an older worker ignores it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from shared_schema import GroupServe, decode, encode
from shared_schema.groups import MAX_SHARE_MB

BASE = {"group": "0123456789abcdef", "head": "w_head", "token": "ab" * 32, "layers": 12,
        "model": "m"}


def test_a_share_per_device_goes_over_the_wire_and_back() -> None:
    serve = GroupServe(**BASE, devices=2, share_mb=[1024, 0])
    back = decode(encode(serve))
    assert back == serve
    assert GroupServe(**BASE).share_mb is None  # an older queen's


@pytest.mark.parametrize("share", [[1, 2], [-1], [MAX_SHARE_MB + 1], []])
def test_a_share_that_is_not_one_bounded_figure_per_device_is_refused(share: list[int]) -> None:
    with pytest.raises(ValidationError):
        GroupServe(**BASE, devices=1, share_mb=share)
