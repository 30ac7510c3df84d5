"""How numbers read in the app."""

from __future__ import annotations

import pytest

from desktop_worker.gui.common import duration, size
from desktop_worker.gui.units import sats


@pytest.mark.parametrize(("msat", "text"), [
    (0, "0 sats"), (8, "0.008 sats"), (1000, "1 sat"), (1500, "1.5 sats"), (42_000, "42 sats"),
    (99_999, "99.999 sats"), (123_456, "123 sats"), (12_345_000, "12,345 sats"),
])
def test_sats(msat, text):
    assert sats(msat) == text


def test_sizes_and_durations():
    assert size(98_362_432) == "93.8 MB"
    assert size(None) == "?"
    assert duration(3.21) == "3.2 s"
    assert duration(125) == "2 min 5 s"
    assert duration(7300) == "2 h 1 min"
    assert duration(None) == "?"
