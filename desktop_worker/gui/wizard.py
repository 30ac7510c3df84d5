"""The first-run wizard: the payout address (skippable), which queen to join (with a real test of
the connection), the detected hardware and how much of the disk models may take, a model that
fits it (the small model that comes with Apiary, or a .gguf the owner has), then Start Earning.
The pages are in ``wizard_pages.py``; what they say and decide, in ``services/first_run.py``.

The queen (issue 35): the field starts empty, with a placeholder saying what to paste, unless an
installer named its queen (``resources/default-queen.txt``) or the settings name one; the
developer default ``ws://127.0.0.1:8000/worker`` is never shown. Testing is optional, but a test
that fails holds Next until the address changes or a test passes.

The disk (issue 34): the hardware page shows the quota for models, by default half the free disk
(``default_quota_gb``, filled in once the hardware is known), which the owner may change; Finish
saves it (``WizardChoices.disk_settings``). Apiary always leaves 10 % of the disk, 10-50 GB
free besides.

After the queen step the wizard asks that queen what its developers ask for (``GET
/worker/demand``, in the background with a short timeout): the in-demand models that fit this
machine come first, pinned to the file the queen routes to; with no demand (none yet, an older
queen that answers 404, or one out of reach) the built-in list alone. It also asks whether
anything can be downloaded now (``hub_check``): when not, the small model that comes with Apiary
(``resources.bundled_model``; imported on Start, no download) goes first, with the reason.

A local file (the bundled model or the owner's .gguf) that the queen's demand lists by sha256 is
imported under the queen's hub name (``WizardChoices.local_name``), so that the queen prices it
by its own reading of the hub rather than as "unverified".

Finishing does the work with the wizard still open: the model is downloaded (or imported) with
its progress on the last page, and a failure stays there in plain words with a Retry, so the
owner is never left at "Not earning" without knowing why; going Back and choosing something else
clears it. "Start Earning" starts; "Finish without starting" does the same but does not start;
Cancel stops a download in progress.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection
from dataclasses import replace
from pathlib import Path

from PySide6.QtGui import QPixmap
from PySide6.QtWidgets import QWidget, QWizard

from desktop_worker.gui.common import spawn
from desktop_worker.gui.services.advice import (
    CatalogModel,
    fitting_models,
    need_mb,
    usable_vram_mb,
)
from desktop_worker.gui.services.demand import demand_rows, wizard_models
from desktop_worker.gui.services.first_run import (
    WizardChoices,
    hub_offline_note,
    queen_prefill,
    ready_summary,
    same_attempt,
)
from desktop_worker.gui.services.models import demand_name_for
from desktop_worker.gui.wizard_pages import (
    HardwarePage,
    ModelPage,
    PayoutPage,
    QueenPage,
    ReadyPage,
    hardware_summary,
)
from desktop_worker.hardware import HardwareReport
from desktop_worker.link_probe import ProbeResult
from desktop_worker.resources import bundled_model, resources_dir
from desktop_worker.settings import DEFAULT_QUEEN_FILE
from shared_schema import Demand

__all__ = [
    "FINISH_WITHOUT_STARTING",
    "FirstRunWizard",
    "HardwarePage",
    "ModelPage",
    "PayoutPage",
    "QueenPage",
    "ReadyPage",
    "WizardChoices",
    "hardware_summary",
]

log = logging.getLogger(__name__)

FINISH_WITHOUT_STARTING = QWizard.WizardButton.CustomButton1
DEMAND_WAIT_S = 10.0  # at Start, how long a demand still on its way is waited for

Finisher = Callable[[WizardChoices], Awaitable[str | None]]


def shipped_default_queen() -> bool:
    """Whether this install names its queen (``resources/default-queen.txt``)."""
    return (resources_dir() / DEFAULT_QUEEN_FILE).is_file()


class FirstRunWizard(QWizard):
    """``finish(choices)`` does the work (save, download or import, start) and returns None or
    the reason it failed, shown on the last page with Retry. ``cancel_work`` stops it."""

    def __init__(
        self,
        ln_url: str | None,
        queen_url: str,
        finish: Finisher,
        parent: QWidget | None = None,
        *,
        logo: QPixmap | None = None,
        tester: Callable[[str], Awaitable[ProbeResult]] | None = None,
        cancel_work: Callable[[], None] = lambda: None,
        demand_source: Callable[[str], Awaitable[Demand | None]] | None = None,
        held: Callable[[], Collection[str]] = frozenset,
        disk_quota_gb: float | None = None,
        hub_check: Callable[[], Awaitable[str | None]] | None = None,
        find_bundled: Callable[[], Path | None] = bundled_model,
    ) -> None:
        """``demand_source(queen_url)``: the queen's demand or None (``fetch_demand``);
        ``held()``: the models already here (not offered again); ``disk_quota_gb``: a quota
        already chosen (None: the default, half the free disk, once the hardware is known);
        ``hub_check()``: why nothing can be downloaded now, or None
        (``ModelsService.hub_problem``; None: not asked); ``find_bundled()``: the small model
        that comes with Apiary (None: this install has none, and it is not offered)."""
        super().__init__(parent)
        self.setWindowTitle("Set up Apiary")
        self.setWizardStyle(QWizard.WizardStyle.ModernStyle)
        if logo is not None:
            self.setPixmap(QWizard.WizardPixmap.LogoPixmap, logo)
        self.payout = PayoutPage(ln_url)
        self.queen = QueenPage(queen_prefill(queen_url, shipped_default=shipped_default_queen()),
                               tester)
        self.hardware = HardwarePage(disk_quota_gb)
        bundled = find_bundled()
        log.info("the model that comes with Apiary: %s", bundled or "none in this install")
        self.model = ModelPage(bundled)
        self.ready = ReadyPage()
        for page in (self.payout, self.queen, self.hardware, self.model, self.ready):
            self.addPage(page)
        self.setButtonText(QWizard.WizardButton.FinishButton, "Start Earning")
        self.setButtonText(FINISH_WITHOUT_STARTING, "Finish without starting")
        self.currentIdChanged.connect(self._page_changed)
        self.customButtonClicked.connect(self._custom)
        self.ready.retry.clicked.connect(self.retry)
        self.finisher = finish
        self.cancel_work = cancel_work
        self.busy = False
        self.failure: str | None = None
        self._failed: WizardChoices | None = None  # the choices whose attempt failed
        self._last_start = True
        self.suggestion: CatalogModel = fitting_models(None)[0]
        self.demand_source = demand_source
        self.held = held
        self.demand: Demand | None = None
        self.demand_url: str | None = None  # the queen the demand shown came from
        self.demand_task: asyncio.Task[None] | None = None
        self.hub_check = hub_check
        self.hub_problem: str | None = None  # why nothing can be downloaded now (None: it can)
        self.hub_task: asyncio.Task[None] | None = None
        self._report: HardwareReport | None = None
        self._cap: int | None = None
        self.show_hardware(None)
        self.resize(640, 460)

    # --- pages ------------------------------------------------------------------------------

    def show_hardware(self, report: HardwareReport | None, cap_mb: int | None = None) -> None:
        self.hardware.summary.setText(hardware_summary(report))
        self.hardware.show_disk(report)
        self._report, self._cap = report, cap_mb
        self.show_models()

    def show_models(self) -> None:
        """The choices: the in-demand models that fit first (if the queen sent demand), then
        the built-in ones that fit."""
        report, cap_mb = self._report, self._cap
        in_demand = wizard_models(demand_rows(self.demand, report, cap_mb=cap_mb,
                                              held=set(self.held())))
        names = {m.name for m in in_demand}
        choices = [*in_demand, *(m for m in fitting_models(report, cap_mb)
                                 if m.name not in names)]
        self.suggestion = choices[0]
        if in_demand:
            count = "a model that fits" if len(in_demand) == 1 \
                else f"{len(in_demand)} models that fit"
            self.model.demand_note.setText(
                f"Developers on this queen ask for {count} your machine, listed first: "
                "serving what is in demand keeps your worker busy.")
        elif self.demand_url is not None and self.demand_task is None:
            self.model.demand_note.setText(
                "The queen has no demand to show that fits this machine (or is an older queen): "
                "these are well-known models that fit.")
        self.model.show_choices(choices)
        need = need_mb(self.suggestion.size_bytes)
        vram = usable_vram_mb(report, cap_mb)
        if report is None:
            self.model.fit.setText("")
        elif vram is not None:
            self.model.fit.setText(f"The suggestion needs about {need:,} MB of memory to serve; "
                                   f"{vram:,} MB of VRAM is free, so it runs on your GPU.")
        else:
            self.model.fit.setText(f"The suggestion needs about {need:,} MB of memory and runs "
                                   f"on the CPU ({report.cpu_count} threads): small models "
                                   "answer fast enough to earn there.")

    def _page_changed(self, _page_id: int) -> None:
        page = self.currentPage()
        if page in (self.hardware, self.model):
            if self.queen.url != self.demand_url:
                self.load_demand()
            if self.hub_task is None and self.hub_check is not None:
                self.hub_task = spawn(self._check_hub())
        last = page is self.ready
        self.setOption(QWizard.WizardOption.HaveCustomButton1, last)
        if last and not self.busy:
            choices = self.choices(True)
            self.ready.summary.setText(ready_summary(choices))
            if self.failure is not None and not same_attempt(self._failed, choices):
                self.failure = None  # that error was about other choices
                self.ready.clear()

    def load_demand(self) -> None:
        """Ask the queen chosen what is in demand, in the background (never blocking)."""
        url = self.queen.url
        if self.demand_source is None or url is None:
            return
        self.demand_url = url
        if self.demand_task is not None:
            self.demand_task.cancel()
        self.model.demand_note.setText("Asking the queen which models are in demand…")
        self.demand_task = spawn(self._load_demand(url))

    async def _load_demand(self, url: str) -> None:
        assert self.demand_source is not None
        try:
            demand = await self.demand_source(url)
        except Exception:  # never let the queen's answer break the wizard
            log.exception("asking %s for its demand failed", url)
            demand = None
        if url != self.demand_url:
            return  # the owner chose another queen meanwhile
        self.demand = demand
        self.demand_task = None
        self.show_models()

    async def _check_hub(self) -> None:
        """Whether anything can be downloaded now; when not, the bundled model goes first."""
        assert self.hub_check is not None
        try:
            problem = await self.hub_check()
        except Exception:  # a check that broke must not break the wizard: offer as online
            log.exception("checking the model hub failed")
            problem = None
        self.hub_problem = problem
        self.model.show_offline(hub_offline_note(problem,
                                                 bundled=self.model.bundled is not None))

    def choices(self, start: bool) -> WizardChoices:
        page = self.model
        own, bundled = page.own.isChecked(), page.bundled_chosen()
        local = page.local_file if own else page.bundled_path if bundled else None
        return WizardChoices(
            ln_url=self.payout.field.value(),
            queen_url=self.queen.url or "",
            model=None if own or bundled else page.chosen_model(),
            local_file=local,
            start=start,
            disk_quota_gb=self.hardware.quota_gb(),
            bundled=bundled,
            images=self.hardware.images.isChecked(),
        )

    # --- finishing ----------------------------------------------------------------------------

    def accept(self) -> None:
        """Start Earning: do the work with the wizard open; it closes only when it worked."""
        self.run(start=True)

    def _custom(self, which: int) -> None:
        if which == FINISH_WITHOUT_STARTING.value:
            self.run(start=False)

    def retry(self) -> None:
        self.run(start=self._last_start)

    def run(self, *, start: bool) -> None:
        if self.busy:
            return
        self._last_start = start
        spawn(self._finish(self.choices(start)))

    async def _finish(self, choices: WizardChoices) -> str | None:
        self.busy = True
        self.failure = None
        self._buttons(False)
        self.ready.working("Getting ready…")
        try:
            problem = await self.finisher(await self._hub_named(choices))
        finally:
            self.busy = False
            self._buttons(True)
        if problem is None:
            super().accept()
        else:
            self.failure = problem
            self._failed = choices
            self.ready.failed(problem)
        return problem

    async def _hub_named(self, choices: WizardChoices) -> WizardChoices:
        """A local file the queen's demand lists by sha256 goes in under the queen's hub name
        (priced by the queen's own reading); one already here under that name is not copied
        again. Other choices are unchanged."""
        if choices.local_file is None:
            return choices
        task = self.demand_task
        if task is not None:  # the queen's answer is on its way: it may name this file
            self.ready.working("Asking the queen which models it knows…")
            await asyncio.wait([task], timeout=DEMAND_WAIT_S)
        self.ready.working(f"Checking whether the queen knows {choices.local_file.name}…")
        name = await demand_name_for(choices.local_file, self.demand)
        if name is None:
            return choices
        log.info("%s is %s on the queen: imported under that name", choices.local_file, name)
        if name in self.held():
            return replace(choices, local_file=None, local_name=name, bundled=False)
        self.ready.working(f"The queen knows this file as {name}: importing it under that "
                           "name, so that the queen prices it by its own reading…")
        return replace(choices, local_name=name)

    def _buttons(self, enabled: bool) -> None:
        for which in (QWizard.WizardButton.FinishButton, QWizard.WizardButton.BackButton,
                      FINISH_WITHOUT_STARTING):
            button = self.button(which)
            if button is not None:
                button.setEnabled(enabled)
        self.ready.retry.setEnabled(enabled)

    def done(self, result: int) -> None:
        """Closed: what it still asked in the background is no longer wanted."""
        for task in (self.demand_task, self.hub_task):
            if task is not None and not task.done():
                task.cancel()
        super().done(result)

    def reject(self) -> None:
        """Cancel: while a download runs, it is cancelled (the wizard says so and stays)."""
        if self.busy:
            self.cancel_work()
            return
        super().reject()
