"""The Earnings and Models tabs say who pays, how and when, and what each model earns and why
(issue 35), against real queens: one whose operator pays by hand (with the operator's note),
one that pays over Lightning (a fake LNbits and LNURL service speaking the real formats, a real
payout), and one that pays nothing. The worker serves the real SmolLM2 file imported under a
local name, which the queen cannot read on the hub."""

from __future__ import annotations

import asyncio

from PySide6.QtCore import Qt

from desktop_worker.gui.services.earnings import MANUAL
from queen_server.billing import ledger
from queen_server.payouts.lightning import NoneBackend
from queen_server.payouts.runner import PayoutRunner
from tests.desktop_worker.gui.conftest import MODEL, MODEL_NAME, open_app, until
from tests.support.fake_lightning import FakeLnbits, FakeLnurlServer
from tests.support.queen import running_queen

NOTE = "Paid by hand every Friday; ask bob@queen.example"
ONE_SAT = 1_000  # msat


async def earning(app, queen) -> None:
    """Start earning with the imported SmolLM2 and read the queen's answer with its prices."""
    await asyncio.to_thread(app.models.store.import_file, MODEL, MODEL_NAME)
    app.launch()
    app.header.toggle.click()
    await until(lambda: app.controller.link_state == "connected", 30, "connected")
    await queen.wait_until(lambda: MODEL_NAME in queen.state.registry.model_names(), 10)
    async with asyncio.timeout(10):
        while MODEL_NAME not in app.earnings.prices:
            await app.earnings.refresh()
            await asyncio.sleep(0.05)


async def credit(queen, pubkey: str, msat: int, txn: str) -> None:
    """Earnings ready to pay, posted to the queen's ledger as a settled job's would be."""
    await queen.state.billing.ledger.post(ledger.Posting(txn, "charge", (
        (ledger.DEPOSITS, -msat), (ledger.worker_available(pubkey), msat))))


async def test_an_operator_who_pays_by_hand(tmp_path, settings_for, qtbot):
    async with (running_queen(tmp_path, auth="keys", payout_note=NOTE, payout_threshold_sats=1,
                              unverified_price_class=None) as queen,
                open_app(settings_for(queen_url=queen.ws_url, ln_url="me@wallet.example"),
                         earnings_interval_s=3600) as app):
        await earning(app, queen)
        view = app.window.earnings
        pubkey = app.identity().pubkey
        await credit(queen, pubkey, ONE_SAT, "earned:1")
        await app.earnings.refresh()
        assert view.terms.isVisibleTo(view)
        assert view.terms.text() == f"{MANUAL} The operator says: \u201c{NOTE}\u201d"
        assert view.threshold.text() == ("You are owed 1 sat. Once you are owed 1 sat, the queen "
                                         "asks its operator to pay you, by hand.")
        assert view.eta.text() == ("You have reached 1 sat: the queen asks its operator to pay "
                                   "you by hand.")
        # The imported file is priced by its size, not as the largest class, and says so.
        assert view.model_prices.text().startswith(f"{MODEL_NAME} earns you ")
        assert "(the tiny class): the queen could not read this model on the hub, so it " \
               "prices it by the size of your file." in view.model_prices.text()
        models = app.window.models
        row = models.names().index(MODEL_NAME)
        assert models.table.item(row, models.table.columnCount() - 1).text().startswith("tiny: ")
        models.table.selectRow(row)
        assert models.price.text() == view.model_prices.text()
        # The queen's words (the note, names, classes) are shown as text, never as markup.
        for label in (view.terms, view.model_prices, models.price):
            assert label.textFormat() == Qt.TextFormat.PlainText
        # The queen's payout pass records what is due for the operator: shown in words.
        runner = PayoutRunner(queen.state.settings, queen.state.db.engine,
                              queen.state.billing.ledger, NoneBackend(), None)
        assert (await runner.run_once()).manual == 1
        await app.earnings.refresh()
        [(_when, amount, state, meaning)] = view.payout_rows()
        assert (amount, state) == ("1 sat", "Due by hand")
        assert meaning == "the operator pays this by hand: ask them if it has not arrived"


async def test_a_queen_that_pays_over_lightning(tmp_path, settings_for, qtbot):
    with FakeLnurlServer() as lnurl, FakeLnbits(network=lnurl) as lnbits:
        address = lnurl.address("alice")
        async with (running_queen(tmp_path, auth="keys", lightning_backend="lnbits",
                                  lnbits_url=lnbits.url, lnbits_admin_key=lnbits.admin_key,
                                  lnurl_insecure_hosts="127.0.0.1", payout_threshold_sats=1,
                                  payout_interval_s=0.2) as queen,
                    open_app(settings_for(queen_url=queen.ws_url, ln_url=address),
                             earnings_interval_s=3600) as app):
            await earning(app, queen)
            view = app.window.earnings
            assert view.terms.text() == f"Paid to {address} over Lightning, automatically."
            assert view.eta.text().startswith("Next automatic payout when you reach 1 sat (")
            await credit(queen, app.identity().pubkey, 2 * ONE_SAT, "earned:2")
            # The queen's own payout pass pays it; the answer shows it once the ledger has it.
            async with asyncio.timeout(20):
                while app.earnings.earnings.paid_msat != 2 * ONE_SAT:
                    await app.earnings.refresh()
                    await asyncio.sleep(0.1)
            assert len(lnbits.sent) == 1
            [(_when, amount, state, _meaning)] = view.payout_rows()
            assert (amount, state) == ("2 sats", "Paid")
            assert view.cards["paid"].value.text() == "2 sats"


async def test_a_queen_that_pays_nothing_says_the_models_earn_nothing(tmp_path, settings_for,
                                                                      qtbot):
    async with (running_queen(tmp_path, auth="open") as queen,
                open_app(settings_for(queen_url=queen.ws_url), earnings_interval_s=3600) as app):
        await asyncio.to_thread(app.models.store.import_file, MODEL, MODEL_NAME)
        app.launch()
        app.header.toggle.click()
        await until(lambda: app.earnings.payout_mode == "none", 30, "the welcome's terms")
        view = app.window.earnings
        assert view.not_paying.isVisibleTo(view)
        assert not view.figures.isVisibleTo(view)  # no terms, no prices, no zeros
        models = app.window.models
        models.table.selectRow(models.names().index(MODEL_NAME))
        assert models.price.text() == ("This queen does not pay its workers, so this model "
                                       "earns nothing here.")
