"""What the first-run wizard decides, widget-free: what the queen field starts with, whether a
failed connection test holds the owner on that page, what the model page says when the hub
cannot be reached (and whether the small model that comes with Apiary goes first), the Ready
page's summary, and whether an error shown there still belongs to the choices on show. No Qt
and no I/O: table-tested (``tests/desktop_worker/gui/test_first_run_text.py``).

The queen field: the developer default (``ws://127.0.0.1:8000/worker``, what the settings fall
back to when no ``resources/default-queen.txt`` names the operator's queen) is never shown to a
newcomer: the field starts empty, with a placeholder that says what to paste. A queen named by
``default-queen.txt`` (an installer built for one queen), ``APIARY_QUEEN_URL`` or the saved
settings is shown as it is.

The connection test is optional: an untested address may go on (the queen may not be up yet,
or the owner sets up offline). A test that fails holds Next until the address changes or a
test passes (``QUEEN_TEST_NOTE`` says so on the page).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from desktop_worker.gui.services.advice import CatalogModel
from desktop_worker.link_probe import ProbeResult
from desktop_worker.settings import DEVELOPER_QUEEN_URL

__all__ = [
    "BUNDLED_LABEL",
    "QUEEN_PLACEHOLDER",
    "QUEEN_TEST_NOTE",
    "WizardChoices",
    "hub_offline_note",
    "next_blocked_by",
    "probe_outcome_text",
    "queen_prefill",
    "ready_summary",
    "same_attempt",
]

QUEEN_PLACEHOLDER = "Paste the queen's address, e.g. https://queen.example.com"
QUEEN_EMPTY = ("Paste the address its operator gave you: a queen's landing page shows it under "
               "\"Run a worker\".")
QUEEN_TEST_NOTE = ("Testing is optional: you may go on with an address you have not tested (a "
                   "queen that is not up yet, say). After a test fails, Next waits until you "
                   "change the address or a test passes.")
BUNDLED_LABEL = "Use the small model that comes with Apiary: works offline, earns little"


@dataclass(frozen=True)
class WizardChoices:
    """What the owner chose. ``model`` and ``local_file`` are exclusive; neither: add one later.
    ``local_name``: the name to import ``local_file`` under (None: its file name); the wizard
    sets it to a hub name when the queen's demand lists that very file (by sha256), so that the
    queen prices it by its own reading. ``bundled``: ``local_file`` is the model that comes with
    Apiary."""

    ln_url: str | None
    queen_url: str
    model: CatalogModel | None
    local_file: Path | None
    start: bool
    disk_quota_gb: float | None = None  # None: not shown yet (the save picks the default)
    local_name: str | None = None
    bundled: bool = False
    images: bool = False  # make images too (issue 38): the owner ticked it

    def disk_settings(self) -> dict[str, float | bool]:
        """The hardware page's settings to save with the choices: the disk quota (none when
        the owner saw none), and whether to make images when the owner ticked it."""
        out: dict[str, float | bool] = {}
        if self.disk_quota_gb is not None:
            out["disk_quota_gb"] = self.disk_quota_gb
        if self.images:
            out["images"] = True
        return out


# --- the queen page ------------------------------------------------------------------------------


def queen_prefill(current: str, *, shipped_default: bool) -> str:
    """What the queen field starts with: ``current``, unless it is only the developer default
    (no ``default-queen.txt`` shipped: ``shipped_default`` False), which starts empty."""
    if current.strip() == DEVELOPER_QUEEN_URL and not shipped_default:
        return ""
    return current


def next_blocked_by(last: ProbeResult | None) -> bool:
    """Whether the last connection test (of the address shown; None: untested) holds Next."""
    return last is not None and not last.ok


def probe_outcome_text(outcome: ProbeResult) -> str:
    """The line under the field after a test; a failure says what lets the owner on."""
    if outcome.ok:
        return f"✓ {outcome.message}"
    return (f"✗ {outcome.message}\nNext waits until you change the address or a test "
            "passes.")


# --- the model page ------------------------------------------------------------------------------


def hub_offline_note(problem: str | None, *, bundled: bool) -> str:
    """The model page's line when nothing can be downloaded now (``problem``: why, from
    ``ModelsService.hub_problem``); empty while the hub answers (or has not been asked)."""
    if problem is None:
        return ""
    if bundled:
        return (f"Nothing can be downloaded right now: {problem}. The small model that comes "
                "with Apiary needs no download, so it is selected first; it earns little. You "
                "can add bigger models later in the Models tab.")
    return (f"Nothing can be downloaded right now: {problem}. Choose a .gguf file you already "
            "have, or add a model later in the Models tab.")


# --- the Ready page ------------------------------------------------------------------------------


def ready_summary(choices: WizardChoices) -> str:
    """What Start Earning will do, in plain words."""
    if choices.bundled and choices.local_file is not None:
        model = (f"the small model that comes with Apiary ({choices.local_file.name}, copied "
                 "into your models: no download)")
    elif choices.local_file is not None:
        model = f"import {choices.local_file.name}"
    elif choices.model is not None:
        model = f"serve {choices.model.label} (downloaded now if it is not here yet)"
    else:
        model = "add a model later in the Models tab (nothing to serve until then)"
    paid = choices.ln_url or "nobody (no payout address yet)"
    text = f"Queen: {choices.queen_url}\nModel: {model}\nEarnings paid to: {paid}"
    if choices.disk_quota_gb is not None:
        limit = (f"up to {choices.disk_quota_gb:,.0f} GB" if choices.disk_quota_gb
                 else "no limit")
        text += f"\nDisk for models: {limit}; at least 10 GB of it always stays free"
    return text


def same_attempt(failed: WizardChoices | None, now: WizardChoices) -> bool:
    """Whether ``now`` would repeat the attempt that ``failed`` (Start or Finish without
    starting alike): only then does its error, with Retry, stay on the Ready page."""
    if failed is None:
        return False
    return replace(failed, start=True, local_name=None) == replace(now, start=True,
                                                                   local_name=None)
