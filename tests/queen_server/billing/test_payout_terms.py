"""How a queen pays, told to its workers in their signed earnings answer and to anyone on the
landing page: automatically over Lightning, by its operator's hand (with the operator's note),
or not at all; where the queen sends the worker's payouts; and each of the worker's models with
its price and why. Real queens over real sockets, read with the worker's own client."""

from __future__ import annotations

import html

import httpx
import pytest
from pydantic import ValidationError

from desktop_worker.earnings import fetch_earnings
from desktop_worker.identity import WorkerIdentity
from queen_server.settings import QueenSettings
from tests.support.queen import running_queen
from tests.support.workers import ECHO_MODEL, ScriptedWorker

ADDRESS = "worker@wallet.example"
NOTE = "Paid by hand every Friday; ask bob@queen.example"


async def earnings_of(queen, worker: ScriptedWorker):
    return await fetch_earnings(queen.ws_url, WorkerIdentity(worker.key))


async def test_a_manual_queen_says_its_operator_pays_by_hand(tmp_path):
    async with running_queen(tmp_path, auth="keys", payout_note=NOTE,
                             payout_threshold_sats=500) as queen:
        worker = await ScriptedWorker(queen.ws_url, ln_url=ADDRESS).start()
        try:
            earnings = await earnings_of(queen, worker)
            assert earnings.pays_workers is True
            assert (earnings.payout_mode, earnings.payout_note) == ("manual", NOTE)
            assert earnings.payout_address == ADDRESS
            assert earnings.payout_threshold_msat == 500_000
            assert earnings.payout_interval_s == queen.state.settings.payout_interval_s
            [model] = earnings.models
            assert model.name == ECHO_MODEL
            # On no hub: running_queen's class for unverified models (tiny: no file is less).
            assert (model.price.size_class, model.price.basis) == ("tiny", "unverified")
            assert model.price.reason.startswith("unverified: the queen could not read")
            share = queen.state.settings.worker_share
            assert model.earn_msat_per_1k_tokens == int(
                model.price.completion_msat_per_1k * share)
            async with httpx.AsyncClient(base_url=queen.base_url) as http:
                landing = html.unescape((await http.get("/")).text)
            assert "its operator pays by hand" in landing
            assert f"The operator says: {NOTE}" in landing
        finally:
            await worker.stop()


async def test_a_lightning_queen_says_it_pays_automatically_to_the_address_it_holds(tmp_path):
    async with running_queen(tmp_path, auth="keys", lightning_backend="lnbits",
                             lnbits_url="http://127.0.0.1:9", lnbits_admin_key="k") as queen:
        worker = await ScriptedWorker(queen.ws_url, ln_url=ADDRESS).start()
        bare = await ScriptedWorker(queen.ws_url).start()  # no payout address: "don't pay me"
        try:
            earnings = await earnings_of(queen, worker)
            assert (earnings.payout_mode, earnings.payout_address) == ("lightning", ADDRESS)
            assert earnings.payout_note is None
            assert (await earnings_of(queen, bare)).payout_address is None
            async with httpx.AsyncClient(base_url=queen.base_url) as http:
                landing = html.unescape((await http.get("/")).text)
            assert "over Lightning, automatically" in landing
        finally:
            await worker.stop()
            await bare.stop()


async def test_an_open_queen_says_it_does_not_pay(tmp_path):
    async with running_queen(tmp_path, auth="open", payout_note=NOTE) as queen:
        worker = await ScriptedWorker(queen.ws_url, ln_url=ADDRESS).start()
        try:
            earnings = await earnings_of(queen, worker)
            assert (earnings.pays_workers, earnings.payout_mode) == (False, "none")
            assert earnings.payout_address is None  # nothing will ever be sent there
            assert [m.earn_msat_per_1k_tokens for m in earnings.models] == [0]
        finally:
            await worker.stop()


async def test_a_stopped_worker_reads_its_terms_without_models(tmp_path):
    async with running_queen(tmp_path, auth="keys") as queen:
        worker = await ScriptedWorker(queen.ws_url, ln_url=ADDRESS).start()
        await worker.stop()
        await queen.wait_until(lambda: queen.state.registry.get(worker.pubkey) is None, 10)
        earnings = await earnings_of(queen, worker)
        assert earnings.models == []
        assert earnings.payout_address == ADDRESS  # from the queen's records


@pytest.mark.parametrize("note", ["two\nlines", "bell\x07", "x" * 161])
def test_the_operator_note_is_one_short_line(note):
    with pytest.raises(ValidationError, match="payout_note"):
        QueenSettings(payout_note=note)
    assert QueenSettings(payout_note="  spaced   out ").payout_note == "spaced out"
    assert QueenSettings(payout_note="   ").payout_note is None
