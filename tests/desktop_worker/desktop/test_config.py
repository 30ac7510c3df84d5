"""settings.json: saved by the app, read back by the app and by ``--headless``, under flags and
env, and never a crash when it is damaged."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import platformdirs
import pytest
from pydantic import ValidationError

from desktop_worker import settings as worker_settings
from desktop_worker.cli import build_parser, settings_from
from desktop_worker.desktop import config
from desktop_worker.desktop.config import APP_EDITABLE_FIELDS, save_settings
from desktop_worker.errors import ConfigError
from desktop_worker.settings import WorkerSettings, config_dir, config_path, load_saved


def write_saved(data: object) -> Path:
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def test_config_dir_comes_from_the_env_or_platformdirs(
    config_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert config_dir() == config_home
    assert config_path() == config_home / "settings.json"
    assert WorkerSettings().key_path == config_home / "worker_key.pem"
    monkeypatch.delenv("APIARY_CONFIG_DIR")
    assert config_dir() == Path(platformdirs.user_config_dir("apiary", appauthor=False))


def test_new_fields_and_their_limits() -> None:
    settings = WorkerSettings()
    assert settings.vram_cap_mb is None
    assert settings.start_earning_at_launch is False
    assert settings.first_run_done is False
    assert settings.key_store == "auto"
    assert WorkerSettings(vram_cap_mb=256).vram_cap_mb == 256
    with pytest.raises(ValidationError, match="vram_cap_mb"):
        WorkerSettings(vram_cap_mb=255)
    with pytest.raises(ValidationError, match="key_store"):
        WorkerSettings(key_store="vault")


def test_settings_survive_a_restart(tmp_path: Path) -> None:
    edited = WorkerSettings(
        queen_url="wss://queen.example.com/worker",
        ln_url="alice@example.com",
        models=["org/repo:Q4_K_M", "org/other:q8_0"],
        models_dir=tmp_path / "my models",
        disk_quota_gb=12.5,
        vram_cap_mb=4096,
        threads=3,
        start_earning_at_launch=True,
        first_run_done=True,
        max_jobs=4,  # not app-editable: not saved by default
    )
    path = save_settings(edited)
    assert path == config_path()
    on_disk = json.loads(path.read_text(encoding="utf-8"))
    assert set(on_disk) == set(APP_EDITABLE_FIELDS)
    assert on_disk["models_dir"] == str(tmp_path / "my models")

    restarted = WorkerSettings()
    for name in APP_EDITABLE_FIELDS:
        assert getattr(restarted, name) == getattr(edited, name), name
    assert restarted.max_jobs is None  # automatic (issue 36): the default, not the 4 above
    assert load_saved() == on_disk
    assert list(path.parent.iterdir()) == [path]  # no temp file left behind


def test_saving_some_fields_keeps_the_rest() -> None:
    write_saved({"queen_url": "ws://a.example:1/worker", "threads": 2, "from_a_newer_app": [1]})
    save_settings(WorkerSettings(threads=6, ln_url="bob@example.org"), ["threads", "max_jobs"])
    assert load_saved() == {
        "queen_url": "ws://a.example:1/worker",
        "threads": 6,
        "max_jobs": None,
        "from_a_newer_app": [1],
    }
    # Clearing a setting is saved too (null), and reads back as cleared.
    save_settings(WorkerSettings(threads=None), ["threads"])
    assert load_saved()["threads"] is None
    assert WorkerSettings().threads is None


def test_precedence_flags_over_env_over_file_over_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert WorkerSettings().threads is None
    write_saved({"threads": 3, "queen_url": "ws://file.example/worker", "models": ["a/b:q4"]})
    assert WorkerSettings().threads == 3
    assert WorkerSettings().models == ["a/b:q4"]
    monkeypatch.setenv("APIARY_THREADS", "5")
    monkeypatch.setenv("APIARY_MODELS", "c/d:q8, e/f:q2")
    assert WorkerSettings().threads == 5
    assert WorkerSettings().models == ["c/d:q8", "e/f:q2"]
    assert WorkerSettings(threads=7).threads == 7
    # What nobody overrides still comes from the file.
    assert WorkerSettings(threads=7).queen_url == "ws://file.example/worker"


def test_headless_reads_the_file_under_its_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    write_saved({"threads": 3, "queen_url": "ws://file.example/worker", "max_jobs": 2})
    monkeypatch.setenv("APIARY_MAX_JOBS", "3")
    args = build_parser().parse_args(["--headless", "--threads", "9"])
    settings = settings_from(args)
    assert settings.threads == 9
    assert settings.max_jobs == 3
    assert settings.queen_url == "ws://file.example/worker"


@pytest.mark.parametrize(
    "content", [b"{not json", b"[1, 2]", b'"text"', b"\xff\xfe\x00", b""], ids=repr
)
def test_a_corrupt_file_is_moved_aside(content: bytes, caplog: pytest.LogCaptureFixture) -> None:
    path = config_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger=worker_settings.__name__):
        assert load_saved() == {}
    assert "is corrupt" in caplog.text
    assert not path.exists()
    assert path.with_name("settings.json.bad").read_bytes() == content
    assert WorkerSettings().queen_url == "ws://127.0.0.1:8000/worker"  # the default
    # The next save starts a fresh file.
    save_settings(WorkerSettings(threads=2), ["threads"])
    assert load_saved() == {"threads": 2}


def test_a_corrupt_file_never_stops_the_settings(caplog: pytest.LogCaptureFixture) -> None:
    write_saved(["not", "an", "object"])
    with caplog.at_level(logging.WARNING, logger=worker_settings.__name__):
        settings = WorkerSettings(threads=4)
    assert settings.threads == 4
    assert settings.queen_url == "ws://127.0.0.1:8000/worker"
    assert config_path().with_name("settings.json.bad").exists()


def test_a_bad_value_is_skipped_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    write_saved({
        "threads": 0,
        "vram_cap_mb": "lots",
        "key_store": "vault",
        "disk_quota_gb": 20,
        "queen_url": "ws://ok.example/worker",
        "no_such_setting": True,
    })
    with caplog.at_level(logging.WARNING, logger=worker_settings.__name__):
        settings = WorkerSettings()
    assert settings.threads is None
    assert settings.vram_cap_mb is None
    assert settings.key_store == "auto"
    assert settings.disk_quota_gb == 20
    assert settings.queen_url == "ws://ok.example/worker"
    for name in ("threads=0", "vram_cap_mb='lots'", "key_store='vault'"):
        assert name in caplog.text
    assert "no_such_setting" not in caplog.text  # ignored quietly (a newer app's setting)
    assert config_path().exists()  # the file is kept: only the bad values are skipped


def test_unknown_field_is_refused_and_nothing_is_written() -> None:
    with pytest.raises(ConfigError, match="no_such_setting"):
        save_settings(WorkerSettings(), ["threads", "no_such_setting"])
    assert not config_path().exists()


def test_a_failed_write_leaves_the_old_file(monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_saved({"threads": 2})
    before = path.read_bytes()

    def refuse(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(config.os, "replace", refuse)
    with pytest.raises(ConfigError, match="No space left on device"):
        save_settings(WorkerSettings(threads=8))
    assert path.read_bytes() == before
    assert list(path.parent.iterdir()) == [path]
