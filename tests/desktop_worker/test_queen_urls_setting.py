"""Several queen URLs (replicas of one queen, issue 18) in the worker's settings: from
``APIARY_QUEEN_URL`` comma-separated, ``--queen`` repeated or comma-separated, each normalised;
the first stays ``queen_url`` (what the app shows and edits)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from desktop_worker.cli import build_parser, settings_from
from desktop_worker.errors import QueenAddressError
from desktop_worker.queen_url import parse_queen_urls
from desktop_worker.settings import DEVELOPER_QUEEN_URL, WorkerSettings
from tests.support.config_home import config_home  # noqa: F401 (autouse)

A, B = "wss://queen.example/worker", "wss://q2.example:8443/worker"


PLAIN_B = "ws://q2.example:8443/worker"  # no scheme and a port other than 443: plain ws


@pytest.mark.parametrize(("given", "urls"), [
    ("queen.example, https://q2.example:8443/", [A, B]),
    (["queen.example", "wss://q2.example:8443/worker/"], [A, B]),
    (["queen.example,q2.example:8443", "queen.example"], [A, PLAIN_B]),  # no duplicates
    (" queen.example ,, q2.example:8443 ,", [A, PLAIN_B]),
])
def test_lists_are_read_in_order_each_normalised(given: str | list[str],
                                                 urls: list[str]) -> None:
    assert parse_queen_urls(given) == urls


@pytest.mark.parametrize(("given", "says"), [
    ("", "empty"), (" , ,", "empty"), ([], "empty"),
    ("queen.example, ftp://files.example", "ftp:// is not a queen address"),
    ("queen.example,has space.example", "has a space"),
    ([7], "is not a queen address"),
])
def test_a_bad_entry_is_named(given: object, says: str) -> None:
    with pytest.raises(QueenAddressError, match=says):
        parse_queen_urls(given)  # type: ignore[arg-type]


def test_the_environment_takes_a_comma_separated_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APIARY_QUEEN_URL", "queen.example,wss://q2.example:8443/worker")
    settings = WorkerSettings()
    assert settings.queen_url == A
    assert settings.queen_urls == [A, B]
    assert settings.link_urls == [A, B]


def test_one_url_is_a_list_of_one_and_the_default_is_unchanged() -> None:
    assert WorkerSettings().link_urls == [DEVELOPER_QUEEN_URL]
    one = WorkerSettings(queen_url="https://queen.example")
    assert (one.queen_url, one.link_urls) == (A, [A])


def test_a_bad_url_in_the_environment_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APIARY_QUEEN_URL", "queen.example,gopher://old.example")
    with pytest.raises(ValidationError, match="gopher:// is not a queen address"):
        WorkerSettings()


def test_a_bad_url_in_settings_json_is_skipped_not_fatal(
        config_home: Path) -> None:  # noqa: F811
    config_home.mkdir(parents=True)
    (config_home / "settings.json").write_text(json.dumps({"queen_url": "gopher://x"}))
    assert WorkerSettings().queen_url == DEVELOPER_QUEEN_URL


def test_the_app_replacing_the_queen_drops_the_old_replicas() -> None:
    """The app changes the queen with ``model_copy`` (no validation): the link then dials the
    new queen alone, never the old queen's other replicas."""
    settings = WorkerSettings(queen_url=f"{A},{B}")
    moved = settings.model_copy(update={"queen_url": "ws://other.lan:8000/worker"})
    assert moved.link_urls == ["ws://other.lan:8000/worker"]
    assert settings.link_urls == [A, B]


def test_queen_is_repeatable_and_comma_separated_on_the_command_line() -> None:
    args = build_parser().parse_args(["--headless", "--queen", "queen.example", "--queen",
                                      "wss://q2.example:8443/worker,queen.example"])
    assert settings_from(args).link_urls == [A, B]
    single = settings_from(build_parser().parse_args(["--queen", "ws://127.0.0.1:9/worker"]))
    assert single.link_urls == ["ws://127.0.0.1:9/worker"]
