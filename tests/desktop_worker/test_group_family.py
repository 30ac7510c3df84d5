"""The owner's family code (issue 34): normalised as pasted, too short to be secret refused, and
what the hello says differs at every queen while the same code agrees across machines."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from desktop_worker.group_family import family_tag, new_family_code, normalise_family_code
from desktop_worker.settings import WorkerSettings


def test_a_new_code_reads_aloud_and_is_new_each_time() -> None:
    code = new_family_code()
    assert len(normalise_family_code(code)) == 24
    assert code.count("-") == 5
    assert code != new_family_code()


def test_the_same_code_however_pasted_is_one_family_at_one_queen() -> None:
    code = new_family_code()
    pasted = code.upper().replace("-", " ")
    origin = "https://queen.example"
    assert family_tag(code, origin) == family_tag(pasted, origin)
    assert len(family_tag(code, origin)) == 32
    assert family_tag(code, origin) != family_tag(code, "https://other.example")
    assert family_tag(code, origin) != family_tag(new_family_code(), origin)


def test_a_short_code_is_refused_saying_why(tmp_path) -> None:
    with pytest.raises(ValueError, match="at least 16"):
        normalise_family_code("our-rigs")
    with pytest.raises(ValidationError):
        WorkerSettings(models_dir=tmp_path, group_family="our-rigs")
    assert WorkerSettings(models_dir=tmp_path, group_family=" ").group_family is None
