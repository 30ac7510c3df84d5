"""``device_free_mb`` on the hello and the status (issue 19): each device a worker gives a model
group, MB, in its device order. A claim, bounded like every other: at most
``MAX_MEMBER_DEVICES`` entries, at least one, each a whole number of MB from 0 to
``MAX_VRAM_MB``; None (an older worker, or one that joins no group) is fine."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from pydantic import ValidationError

from shared_schema import Hello, Status, decode
from shared_schema.errors import ProtocolError
from shared_schema.groups import MAX_MEMBER_DEVICES
from shared_schema.hardware import MAX_VRAM_MB
from shared_schema.parsing import parse_hello

HELLO = {"type": "hello", "protocol": 2, "worker_version": "x", "pubkey": "1" * 64,
         "signature": "0" * 128, "cpu_count": 1, "disk_space": 1, "vram": 0}

BAD = [
    [8000] * (MAX_MEMBER_DEVICES + 1),  # 17 devices
    [8000, -1],  # a negative
    [],  # none at all: say None instead
    [MAX_VRAM_MB + 1],  # more than any machine holds
    [True],  # not a number of MB
    ["8000"],
    [8000.5],
    [8000.0],
    [None],
    "8000",
]


@pytest.mark.parametrize("model", [Hello, Status])
def test_the_bounds_hold_on_the_hello_and_the_status(model: Any) -> None:
    base: dict[str, Any] = HELLO if model is Hello else {"type": "status"}
    assert model.model_validate(base).device_free_mb is None  # an older worker
    assert model.model_validate({**base, "device_free_mb": None}).device_free_mb is None
    most = [0, MAX_VRAM_MB] + [8000] * (MAX_MEMBER_DEVICES - 2)
    assert model.model_validate({**base, "device_free_mb": most}).device_free_mb == most
    for bad in BAD:
        with pytest.raises(ValidationError):
            model.model_validate({**base, "device_free_mb": bad})


@pytest.mark.parametrize("bad", BAD)
def test_a_malformed_figure_is_a_protocol_error_on_the_wire(bad: Any) -> None:
    """What the queen's link reads: a status through ``decode`` (answered ``invalid_message``,
    counted as a bad frame) and a hello through ``parse_hello`` (refused with that code)."""
    with pytest.raises(ProtocolError) as status:
        decode(orjson.dumps({"type": "status", "device_free_mb": bad}))
    assert status.value.code == "invalid_message"
    assert status.value.message.startswith("device_free_mb")
    with pytest.raises(ProtocolError) as hello:
        parse_hello({**HELLO, "device_free_mb": bad})
    assert hello.value.code == "invalid_message"
    assert "device_free_mb" in hello.value.message


def test_a_good_figure_survives_the_wire() -> None:
    status = decode(orjson.dumps({"type": "status", "device_free_mb": [8000, 0]}))
    assert isinstance(status, Status)
    assert status.device_free_mb == [8000, 0]
    assert decode(status.model_dump_json()) == status
