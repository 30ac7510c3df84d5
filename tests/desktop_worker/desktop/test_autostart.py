"""Run at login: the XDG autostart entry for real in a temporary XDG dir, the Windows Run key
and the macOS LaunchAgent against fakes of the registry and a temporary LaunchAgents dir."""

from __future__ import annotations

import configparser
import logging
import plistlib
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from desktop_worker.desktop import autostart
from desktop_worker.desktop.autostart import (
    LinuxAutostart,
    MacAutostart,
    WindowsAutostart,
    autostart_for_platform,
    default_command,
    desktop_exec,
)
from desktop_worker.errors import AutostartError

SPACED = ["/opt/My Apps/apiary worker/bin/python3", "-m", "desktop_worker"]


def read_entry(path: Path) -> configparser.SectionProxy:
    parser = configparser.ConfigParser(interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read(path, encoding="utf-8")
    return parser["Desktop Entry"]


def unescape_string_value(value: str) -> str:
    """The Desktop Entry string-value escapes: \\s \\n \\t \\r \\\\."""
    out, chars = [], iter(value)
    for ch in chars:
        if ch == "\\":
            nxt = next(chars)
            out.append({"s": " ", "n": "\n", "t": "\t", "r": "\r", "\\": "\\"}[nxt])
        else:
            out.append(ch)
    return "".join(out)


def parse_exec(value: str) -> list[str]:
    """An Exec value back to its arguments, by the spec (string escapes, then quoting, then
    ``%%``); written here from the spec, independently of the code under test."""
    text = unescape_string_value(value)
    args: list[str] = []
    current: list[str] | None = None
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == " ":
            if current is not None:
                args.append("".join(current))
                current = None
        elif ch == '"':
            current = current if current is not None else []
            i += 1
            while text[i] != '"':
                if text[i] == "\\":
                    i += 1
                    assert text[i] in '"`$\\', f"bad escape in {value!r}"
                current.append(text[i])
                i += 1
        else:
            assert ch not in "\"'\\><~|&;$*?#()`\t\n", f"unquoted reserved {ch!r} in {value!r}"
            current = (current if current is not None else []) + [ch]
        i += 1
    if current is not None:
        args.append("".join(current))
    return [arg.replace("%%", "%") for arg in args]


def test_linux_entry_is_written_and_removed(tmp_path: Path) -> None:
    entry = LinuxAutostart(SPACED, config_home=tmp_path, icon="/opt/My Apps/icons/app.svg")
    assert entry.path == tmp_path / "autostart" / "apiary-worker.desktop"
    assert not entry.is_enabled()
    entry.set_enabled(True)
    assert entry.is_enabled()

    section = read_entry(entry.path)
    assert section["Type"] == "Application"
    assert section["Name"] == "Apiary Worker"
    assert section["Terminal"] == "false"
    assert section["X-GNOME-Autostart-enabled"] == "true"
    assert section["Icon"] == "/opt/My Apps/icons/app.svg"
    assert section["Comment"]
    assert shlex.split(section["Exec"]) == SPACED
    assert parse_exec(section["Exec"]) == SPACED

    entry.set_enabled(True)  # idempotent, and no temp files left behind
    assert [p.name for p in entry.path.parent.iterdir()] == ["apiary-worker.desktop"]
    entry.set_enabled(False)
    assert not entry.path.exists()
    assert not entry.is_enabled()
    entry.set_enabled(False)  # already off: fine


@pytest.mark.skipif(shutil.which("desktop-file-validate") is None,
                    reason="desktop-file-utils is not installed")
def test_linux_entry_passes_desktop_file_validate(tmp_path: Path) -> None:
    entry = LinuxAutostart([*SPACED, "--odd", "50% $HOME \"q\" back\\slash"],
                           config_home=tmp_path, icon="apiary-worker")
    entry.set_enabled(True)
    checked = subprocess.run(["desktop-file-validate", str(entry.path)],
                             capture_output=True, text=True, timeout=30, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "error" not in (checked.stdout + checked.stderr).lower()


def test_linux_follows_xdg_config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert LinuxAutostart(SPACED).path == tmp_path / "xdg" / "autostart" / "apiary-worker.desktop"
    monkeypatch.setenv("XDG_CONFIG_HOME", "relative/is/ignored")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert LinuxAutostart(SPACED).path == (
        tmp_path / "home" / ".config" / "autostart" / "apiary-worker.desktop"
    )


def test_linux_respects_an_entry_the_desktop_hid(tmp_path: Path) -> None:
    entry = LinuxAutostart(SPACED, config_home=tmp_path)
    entry.set_enabled(True)
    entry.path.write_text(entry.path.read_text() + "Hidden=true\n")
    assert not entry.is_enabled()
    entry.set_enabled(True)  # turning it on again writes a fresh entry
    assert entry.is_enabled()


def test_linux_write_failure_is_an_autostart_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the config dir should be")
    entry = LinuxAutostart(SPACED, config_home=blocker)
    with pytest.raises(AutostartError, match="cannot change run at login"):
        entry.set_enabled(True)
    assert not entry.is_enabled()


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (["/usr/bin/apiary-worker"], "/usr/bin/apiary-worker"),
        (SPACED, '"/opt/My Apps/apiary worker/bin/python3" -m desktop_worker'),
        (["/bin/x", "100%"], "/bin/x 100%%"),
        (["/bin/x", "$HOME"], '/bin/x "\\\\$HOME"'),
        (["/bin/x", "a\\b"], '/bin/x "a\\\\\\\\b"'),  # four backslashes, as the spec says
        (["/bin/x", ""], '/bin/x ""'),
    ],
)
def test_exec_quoting_follows_the_spec(command: list[str], expected: str) -> None:
    assert desktop_exec(command) == expected
    assert parse_exec(expected) == command


@given(st.lists(st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=30),
                min_size=1, max_size=5))
def test_exec_round_trips_any_arguments(command: list[str]) -> None:
    assert parse_exec(desktop_exec(command)) == command


def test_an_empty_command_is_refused() -> None:
    with pytest.raises(AutostartError):
        desktop_exec([])


class FakeRunKey:
    """The Run key as a dict, with the RunKey methods."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.fail: OSError | None = None

    def get(self, name: str) -> str | None:
        if self.fail:
            raise self.fail
        return self.values.get(name)

    def set(self, name: str, value: str) -> None:
        if self.fail:
            raise self.fail
        self.values[name] = value

    def delete(self, name: str) -> None:
        if self.fail:
            raise self.fail
        self.values.pop(name, None)


def test_windows_run_key() -> None:
    registry = FakeRunKey()
    command = [r"C:\Program Files\Apiary\apiary-worker.exe", "--minimized"]
    entry = WindowsAutostart(command, registry=registry)
    assert not entry.is_enabled()
    entry.set_enabled(True)
    assert registry.values == {
        "ApiaryWorker": '"C:\\Program Files\\Apiary\\apiary-worker.exe" --minimized'
    }
    assert entry.is_enabled()
    entry.set_enabled(False)
    assert registry.values == {}
    assert not entry.is_enabled()
    entry.set_enabled(False)


def test_windows_registry_errors(caplog: pytest.LogCaptureFixture) -> None:
    registry = FakeRunKey()
    registry.fail = PermissionError(13, "Access is denied")
    entry = WindowsAutostart(["C:\\apiary.exe"], registry=registry)
    with pytest.raises(AutostartError, match="Access is denied"):
        entry.set_enabled(True)
    with caplog.at_level(logging.WARNING, logger=autostart.__name__):
        assert not entry.is_enabled()
    assert "Access is denied" in caplog.text


@pytest.mark.skipif(sys.platform == "win32", reason="checks the error off Windows")
def test_windows_without_winreg_is_a_clear_error() -> None:
    with pytest.raises(AutostartError, match="registry is not available"):
        WindowsAutostart(["C:\\apiary.exe"]).set_enabled(True)


def test_mac_launch_agent(tmp_path: Path) -> None:
    agents = tmp_path / "Library" / "LaunchAgents"
    entry = MacAutostart(SPACED, agents_dir=agents)
    assert entry.path == agents / "net.apiary.worker.plist"
    assert not entry.is_enabled()
    entry.set_enabled(True)
    with entry.path.open("rb") as handle:
        agent = plistlib.load(handle)
    assert agent["Label"] == "net.apiary.worker"
    assert agent["ProgramArguments"] == SPACED
    assert agent["RunAtLoad"] is True
    assert entry.is_enabled()
    entry.set_enabled(False)
    assert not entry.path.exists()
    assert not entry.is_enabled()


def test_mac_unreadable_agent_reads_as_off(tmp_path: Path) -> None:
    entry = MacAutostart(SPACED, agents_dir=tmp_path)
    entry.path.write_bytes(b"not a plist")
    assert not entry.is_enabled()
    entry.set_enabled(True)
    assert entry.is_enabled()


@pytest.mark.parametrize(
    ("platform", "kind"),
    [
        ("linux", LinuxAutostart),
        ("freebsd14", LinuxAutostart),
        ("win32", WindowsAutostart),
        ("darwin", MacAutostart),
    ],
)
def test_autostart_for_platform(platform: str, kind: type) -> None:
    chosen = autostart_for_platform(["/x/apiary"], platform=platform)
    assert isinstance(chosen, kind)
    assert chosen.command == ["/x/apiary"]  # type: ignore[attr-defined]
    assert autostart_for_platform(platform=platform).command == default_command()  # type: ignore[attr-defined]


def test_default_command(monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_command() == [sys.executable, "-m", "desktop_worker"]
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    assert default_command() == [sys.executable]


def test_the_default_command_really_starts_the_worker() -> None:
    """``python -m desktop_worker`` is the same CLI as ``apiary-worker``."""
    ran = subprocess.run([*default_command(), "--version"], capture_output=True, text=True,
                         timeout=60, check=False)
    assert ran.returncode == 0, ran.stderr
    assert "apiary-worker" in ran.stdout + ran.stderr
