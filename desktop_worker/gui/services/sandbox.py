"""What the engine's sandbox holds on this machine, in the owner's words (issue 34): the Hardware
tab's "Engine sandbox" box, and the notice when an engine process crashed. Widget-free.

The worker runs llama.cpp (and so every model file, prompt, grammar and group command it is
sent) only in engine processes of its own, each confined before it reads any of them; the rows
say, per protection, whether this machine's kernel gave it (``Confinement``, as the device probe's
engine process found it).
"""

from __future__ import annotations

from dataclasses import dataclass

from shared_schema.engine_ipc import Confinement

YES, NO = "yes", "no"


@dataclass(frozen=True)
class SandboxSummary:
    headline: str
    rows: list[tuple[str, str]]
    notes: list[str]
    holds: bool


def sandbox_summary(confinement: Confinement | None, *, checked: bool = False) -> SandboxSummary:
    """``checked``: the probe has run (None then: the sandbox could not be started)."""
    if confinement is None:
        if checked:
            return SandboxSummary("The engine's sandbox could not be checked: model groups are "
                                  "off. The Logs tab says why.", [], [], False)
        return SandboxSummary("Checking the engine's sandbox…", [], [], False)
    if confinement.os != "linux":
        return SandboxSummary(
            "Models run in a separate process, but this system's sandbox is not used yet: a "
            "crash in a model ends only that process, but it runs with your user's rights. "
            "Model groups are off.", [], list(confinement.notes), False)
    rows = [
        ("Runs programs or new processes", NO if confinement.seccomp else "not prevented"),
        ("Reads your files (keys, documents)", NO if confinement.filesystem
         else "not prevented"),
        ("Writes outside its own scratch folder", NO if confinement.filesystem
         else "not prevented"),
        ("Opens network connections", NO if confinement.network else "not prevented"),
        ("Signals or reads your other programs", NO if confinement.signals and
         confinement.filesystem else "not fully prevented"),
        ("Memory", "limited to each model's share" if confinement.rlimits else "not limited"),
        ("Model groups", "allowed: the sandbox holds" if confinement.holds_for_groups
         else "off: the sandbox does not fully hold here"),
    ]
    if confinement.holds:
        headline = ("Models run in sandboxed processes: they cannot read your files, open "
                    "connections or start programs.")
    else:
        headline = ("Models run in separate processes, but part of the sandbox is missing on "
                    "this machine (see below).")
    return SandboxSummary(headline, rows, list(confinement.notes), confinement.holds)


def crash_text(model: str, reason: str) -> str:
    """The notice's text when an engine process ended mid-work."""
    return (f"The engine serving {model} stopped ({reason}). Only that sandboxed process "
            "ended: the request went on elsewhere, and Apiary keeps earning.")
