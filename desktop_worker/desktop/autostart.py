"""Run at login, the way each OS expects it.

* Linux (and other XDG desktops): ``$XDG_CONFIG_HOME/autostart/apiary-worker.desktop``, a
  Desktop Entry (freedesktop.org Desktop Entry and Autostart specs).
* Windows: the value ``ApiaryWorker`` under
  ``HKCU\\Software\\Microsoft\\Windows\\CurrentVersion\\Run``.
* macOS: the LaunchAgent ``~/Library/LaunchAgents/net.apiary.worker.plist`` with ``RunAtLoad``.

Each is an ``Autostart``: ``is_enabled()`` and ``set_enabled(enabled)``. The quoting of the
command is pure (``desktop_exec``, ``subprocess.list2cmdline``) and the I/O sits in the classes,
each of which takes the place it writes to, so tests point them at a temporary dir or a fake
registry.
"""

from __future__ import annotations

import logging
import os
import plistlib
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from desktop_worker.errors import AutostartError
from desktop_worker.resources import resources_dir

__all__ = [
    "DESKTOP_FILE_NAME",
    "LAUNCH_AGENT_LABEL",
    "RUN_KEY",
    "RUN_VALUE_NAME",
    "Autostart",
    "LinuxAutostart",
    "MacAutostart",
    "RunKey",
    "WindowsAutostart",
    "autostart_for_platform",
    "default_command",
    "desktop_entry",
    "desktop_exec",
]

log = logging.getLogger(__name__)

DESKTOP_FILE_NAME = "apiary-worker.desktop"
RUN_KEY = r"Software\Microsoft\Windows\CurrentVersion\Run"
RUN_VALUE_NAME = "ApiaryWorker"
LAUNCH_AGENT_LABEL = "net.apiary.worker"

APP_NAME = "Apiary Worker"
APP_COMMENT = "Earn sats by serving AI models on this computer's GPU"


class Autostart(Protocol):
    def is_enabled(self) -> bool: ...

    def set_enabled(self, enabled: bool) -> None: ...


def default_command() -> list[str]:
    """How to start this app again: the frozen executable, or this Python with ``-m``."""
    if getattr(sys, "frozen", False):
        return [sys.executable]
    return [sys.executable, "-m", "desktop_worker"]


def autostart_for_platform(
    command: list[str] | None = None, platform: str = sys.platform
) -> Autostart:
    """The ``Autostart`` for ``platform`` (``sys.platform`` values); XDG for anything not
    Windows or macOS."""
    command = list(command) if command is not None else default_command()
    if platform in ("win32", "cygwin"):
        return WindowsAutostart(command)
    if platform == "darwin":
        return MacAutostart(command)
    return LinuxAutostart(command)


# --- Linux: an XDG autostart Desktop Entry --------------------------------------------------

# Characters that make an Exec argument need double quotes (Desktop Entry spec, "The Exec key").
_RESERVED = set(" \t\n\"'\\><~|&;$*?#()`")
# Inside double quotes these four must be backslash-escaped.
_ESCAPED_IN_QUOTES = set('"`$\\')


def desktop_exec(command: Sequence[str]) -> str:
    """``command`` as the value of a Desktop Entry ``Exec`` key.

    Per the spec: an argument with a reserved character is double-quoted, with ``"`` `` ` ``
    ``$`` and ``\\`` backslash-escaped inside; a literal ``%`` is ``%%`` (field codes); and then
    the string-value escapes apply on top (``\\`` becomes ``\\\\``, newline ``\\n``...), which is
    why a quoted backslash ends up as four.
    """
    if not command:
        raise AutostartError("the command to run at login is empty")
    args = []
    for arg in command:
        arg = arg.replace("%", "%%")
        if arg == "" or any(ch in _RESERVED for ch in arg):
            arg = '"' + "".join("\\" + ch if ch in _ESCAPED_IN_QUOTES else ch for ch in arg) + '"'
        args.append(arg)
    return _escape_string_value(" ".join(args))


def _escape_string_value(text: str) -> str:
    return (
        text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
    )


def desktop_entry(command: Sequence[str], icon: str) -> str:
    """The text of the autostart ``.desktop`` file."""
    lines = [
        "[Desktop Entry]",
        "Type=Application",
        "Version=1.0",
        f"Name={APP_NAME}",
        f"Comment={APP_COMMENT}",
        f"Exec={desktop_exec(command)}",
        f"Icon={_escape_string_value(icon)}",
        "Terminal=false",
        "Categories=Network;",
        "X-GNOME-Autostart-enabled=true",
    ]
    return "\n".join(lines) + "\n"


def _default_icon() -> str:
    icon = resources_dir() / "icons" / "app.svg"
    return str(icon) if icon.exists() else "apiary-worker"


class LinuxAutostart:
    """``$XDG_CONFIG_HOME/autostart/apiary-worker.desktop`` (``~/.config`` when unset)."""

    def __init__(
        self, command: list[str], config_home: Path | None = None, *, icon: str | None = None
    ) -> None:
        self.command = list(command)
        if config_home is None:
            xdg = os.environ.get("XDG_CONFIG_HOME", "").strip()
            # The spec: a relative XDG_CONFIG_HOME is invalid and is ignored.
            config_home = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".config"
        self.path = config_home / "autostart" / DESKTOP_FILE_NAME
        self.icon = icon if icon is not None else _default_icon()

    def is_enabled(self) -> bool:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return False
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("cannot read %s: %s", self.path, exc)
            return False
        values = dict(
            line.split("=", 1) for line in text.splitlines() if "=" in line and line[:1] != "#"
        )
        return (
            values.get("Hidden", "false").strip() != "true"
            and values.get("X-GNOME-Autostart-enabled", "true").strip() != "false"
        )

    def set_enabled(self, enabled: bool) -> None:
        try:
            if enabled:
                _write_atomically(self.path, desktop_entry(self.command, self.icon).encode())
                log.info("run at login: on (%s)", self.path)
            else:
                self.path.unlink(missing_ok=True)
                log.info("run at login: off (removed %s)", self.path)
        except OSError as exc:
            raise AutostartError(f"cannot change run at login ({self.path}): {exc}") from exc


# --- Windows: the HKCU Run key ----------------------------------------------------------------


class RunKey(Protocol):
    """The few operations on ``HKCU\\...\\Run`` that autostart needs."""

    def get(self, name: str) -> str | None: ...

    def set(self, name: str, value: str) -> None: ...

    def delete(self, name: str) -> None: ...


class _WinregRunKey:
    """``RunKey`` on the real registry (``winreg``, imported only here, on Windows)."""

    def __init__(self) -> None:
        import winreg  # type: ignore[import-not-found]  # Windows only

        self._winreg = winreg

    def get(self, name: str) -> str | None:
        winreg = self._winreg
        try:
            with winreg.OpenKey(winreg.HKEY_CURRENT_USER, RUN_KEY, 0, winreg.KEY_READ) as key:
                value, _kind = winreg.QueryValueEx(key, name)
        except FileNotFoundError:
            return None
        return str(value)

    def set(self, name: str, value: str) -> None:
        winreg = self._winreg
        with winreg.CreateKeyEx(winreg.HKEY_CURRENT_USER, RUN_KEY, 0, winreg.KEY_SET_VALUE) as key:
            winreg.SetValueEx(key, name, 0, winreg.REG_SZ, value)

    def delete(self, name: str) -> None:
        winreg = self._winreg
        try:
            with winreg.OpenKey(winreg.HKEY_CURRENT_USER, RUN_KEY, 0, winreg.KEY_SET_VALUE) as key:
                winreg.DeleteValue(key, name)
        except FileNotFoundError:
            pass


class WindowsAutostart:
    """The value ``ApiaryWorker`` under ``HKCU\\Software\\Microsoft\\Windows\\CurrentVersion\\Run``.

    ``registry`` is anything with ``get``/``set``/``delete`` of a named string value
    (``RunKey``); by default the real one through ``winreg``.
    """

    def __init__(self, command: list[str], registry: RunKey | None = None) -> None:
        self.command = list(command)
        self._registry = registry

    @property
    def registry(self) -> RunKey:
        if self._registry is None:
            try:
                self._registry = _WinregRunKey()
            except ImportError as exc:
                raise AutostartError("the Windows registry is not available here") from exc
        return self._registry

    @property
    def command_line(self) -> str:
        """The command as Windows parses it back (``CommandLineToArgvW`` quoting)."""
        return subprocess.list2cmdline(self.command)

    def is_enabled(self) -> bool:
        try:
            return bool(self.registry.get(RUN_VALUE_NAME))
        except OSError as exc:
            log.warning("cannot read the Run key: %s", exc)
            return False

    def set_enabled(self, enabled: bool) -> None:
        try:
            if enabled:
                self.registry.set(RUN_VALUE_NAME, self.command_line)
            else:
                self.registry.delete(RUN_VALUE_NAME)
        except OSError as exc:
            raise AutostartError(f"cannot change run at login (the Run key): {exc}") from exc
        log.info("run at login: %s (HKCU Run key, %s)", "on" if enabled else "off",
                 RUN_VALUE_NAME)


# --- macOS: a LaunchAgent ---------------------------------------------------------------------


class MacAutostart:
    """``~/Library/LaunchAgents/net.apiary.worker.plist``: launchd starts it at the next login."""

    def __init__(self, command: list[str], agents_dir: Path | None = None) -> None:
        self.command = list(command)
        agents_dir = agents_dir or Path.home() / "Library" / "LaunchAgents"
        self.path = agents_dir / f"{LAUNCH_AGENT_LABEL}.plist"

    def agent(self) -> dict[str, object]:
        return {
            "Label": LAUNCH_AGENT_LABEL,
            "ProgramArguments": self.command,
            "RunAtLoad": True,
            "ProcessType": "Interactive",
        }

    def is_enabled(self) -> bool:
        try:
            with self.path.open("rb") as handle:
                agent = plistlib.load(handle)
        except FileNotFoundError:
            return False
        except (OSError, plistlib.InvalidFileException, ValueError) as exc:
            log.warning("cannot read %s: %s", self.path, exc)
            return False
        return isinstance(agent, dict) and agent.get("Disabled") is not True

    def set_enabled(self, enabled: bool) -> None:
        try:
            if enabled:
                _write_atomically(self.path, plistlib.dumps(self.agent()))
            else:
                self.path.unlink(missing_ok=True)
        except OSError as exc:
            raise AutostartError(f"cannot change run at login ({self.path}): {exc}") from exc
        log.info("run at login: %s (%s)", "on" if enabled else "off", self.path)


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
