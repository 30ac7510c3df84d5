"""Audits of images (issue 38) against a real queen and scripted image workers over real
websockets: a drawn job is rendered again from the same order by another holder of the file and
the images compared. An honest worker passes and reaches good standing; a worker that returns
random pixels, a blank image or another model's image is flagged by a trusted auditor's renders,
out of routing, its audited jobs refunded and its escrow forfeited; a lone untrusted auditor's
failing verdict counts for nothing until an independent second agrees; the measure itself
tells honest renders from every cheat."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from queen_server.billing import ledger
from queen_server.images.audits import image_distance, image_verdict
from shared_schema.capabilities import AUDITOR, IMAGE
from shared_schema.images import ImageOrder
from tests.queen_server.audits.test_independent_auditors import seen
from tests.support.image_workers import IMAGE_MODEL, IMAGE_SHA256, ImageWorker, picture
from tests.support.queen import QueenHarness, running_queen

# Every job of a new worker is drawn; the scripted workers' model is on no hub here, so the
# operator pins its file (else no audit could be made, as for text).
AUDIT_ALL = {"audit_new_rate": 1.0, "audit_base_rate": 1.0,
             "local_model_pins": {IMAGE_MODEL: [IMAGE_SHA256]}}
EXTRA = {"seed": 41, "steps": 4}
ORDER = ImageOrder(model=IMAGE_MODEL, prompt="x", width=64, height=64, steps=4, guidance=7.0,
                   sampler="euler_a", seed=41, n=1)


@pytest.fixture
async def queen(tmp_path, db_url):
    async with running_queen(tmp_path, auth="keys", db=db_url, files_dir=tmp_path / "files",
                             escrow_jobs=20, **AUDIT_ALL) as queen:
        yield queen


async def funded(queen: QueenHarness, sats: int) -> tuple[openai.AsyncOpenAI, int]:
    secret, key_id = await queen.funded_key(sats)
    return queen.client(api_key=secret), key_id


async def trusted_image_auditor(queen: QueenHarness) -> ImageWorker:
    auditor = ImageWorker(queen.ws_url, capabilities=[IMAGE, AUDITOR])
    queen.state.audits.trusted = frozenset({auditor.pubkey})
    return await auditor.start()


async def generate(queen: QueenHarness, client: openai.AsyncOpenAI, **kwargs: Any) -> None:
    """One image request, and the audit it drew finished."""
    await client.images.generate(model=IMAGE_MODEL, prompt="a hive", size="64x64",
                                 extra_body=EXTRA, **kwargs)
    await queen.state.image_audits.idle()


def test_the_measure_tells_an_honest_render_from_every_cheat() -> None:
    honest = picture(ORDER, 41)
    assert image_distance(honest, picture(ORDER, 41)) == 0.0
    verdict, distances = image_verdict([honest], [picture(ORDER, 41)], 0.05)
    assert not verdict.failed
    assert distances == [0.0]
    for cheat in (picture(ORDER, 42), picture(ORDER, 41, model="another/model"),
                  picture(ORDER, 41, size=(64, 32))):
        verdict, distances = image_verdict([cheat], [honest], 0.05)
        assert verdict.failed, distances
        assert "from the auditor's render" in verdict.reason


async def test_an_honest_worker_passes_its_image_audits_and_reaches_good_standing(queen):
    auditor = await trusted_image_auditor(queen)
    worker = await ImageWorker(queen.ws_url).start()
    client, _ = await funded(queen, 1000)
    for _ in range(10):  # a pass weighs as an honest text answer's typical score: 10 to good
        await generate(queen, client)
    standing = queen.state.audits.standing(worker.pubkey)
    assert standing.audited == 10
    assert standing.failed == 0
    assert standing.state == "good"
    assert [order.seed for order in auditor.orders] == [41] * 10  # the same order again
    assert auditor.orders[0] == worker.orders[0]
    rows = await queen.state.audits.store.recent(10)
    assert all(row.auditor_trusted and not row.failed and row.z == 0.0 for row in rows)
    await worker.stop()
    await auditor.stop()


@pytest.mark.parametrize("behaviour", ["noise", "blank", "other_model"])
async def test_a_cheat_is_flagged_refunded_and_forfeits_its_escrow(queen, behaviour):
    auditor = await trusted_image_auditor(queen)
    cheat = await ImageWorker(queen.ws_url, behaviour=behaviour).start()
    client, key_id = await funded(queen, 1000)
    for _ in range(6):
        if queen.state.audits.standing(cheat.pubkey).state == "flagged":
            break
        await generate(queen, client)
    standing = queen.state.audits.standing(cheat.pubkey)
    assert standing.state == "flagged"
    assert standing.failed == standing.audited
    assert queen.state.registry.get(cheat.pubkey).flagged
    with pytest.raises(openai.NotFoundError):  # out of routing: it was the only holder
        await client.images.generate(model=IMAGE_MODEL, prompt="a hive", size="64x64")
    rows = await queen.state.audits.store.recent(10)
    assert rows
    assert all(row.failed and row.refunded for row in rows)
    money = await queen.state.billing.ledger.balances()
    assert money[ledger.key_available(key_id)] == 1000 * 1000  # every audited job refunded
    assert money.get(ledger.worker_pending(cheat.pubkey), 0) == 0  # its escrow forfeited
    assert (await queen.state.billing.ledger.check()).clean
    await cheat.stop()
    await auditor.stop()


async def test_one_untrusted_auditors_word_never_fails_a_job(queen):
    """A hostile auditor (it renders another model's image) fails an honest worker's job: with
    no second auditor independent of it, the job counts for nothing, and with an honest second
    the two disagree and the job counts for nothing either way."""
    # Independent of each other: other /24s, first seen hours apart.
    honest = await (await seen(queen, ImageWorker(queen.ws_url, source_host="127.0.1.1"),
                               10)).start()
    liar = await (await seen(queen, ImageWorker(queen.ws_url, behaviour="other_model",
                                                source_host="127.0.2.1"), 3)).start()
    client, _ = await funded(queen, 1000)
    for _ in range(6):
        await generate(queen, client)
    # The audits did run: each of the six jobs was rendered again by the other worker.
    assert len(honest.orders) + len(liar.orders) == 12
    for worker in (honest, liar):
        standing = queen.state.audits.standing(worker.pubkey)
        assert standing.state != "flagged"
    rows = await queen.state.audits.store.recent(20)
    assert not [row for row in rows if row.failed]  # one untrusted word failed nothing
    # Every audit of the honest worker by the liar was inconclusive or confirmed by no one.
    assert queen.state.audits.standing(honest.pubkey).failed == 0
    await honest.stop()
    await liar.stop()


async def test_a_model_the_queen_cannot_pin_is_never_audited(tmp_path) -> None:
    """A worker naming a file the queen did not read and the operator did not pin: its jobs
    are served but make no audit (an auditor holding "the same" file proves nothing)."""
    async with running_queen(tmp_path, auth="keys", files_dir=tmp_path / "files",
                             audit_new_rate=1.0, audit_base_rate=1.0) as queen:
        auditor = await trusted_image_auditor(queen)
        worker = await ImageWorker(queen.ws_url).start()
        client, _ = await funded(queen, 1000)
        await generate(queen, client)
        assert auditor.orders == []
        assert queen.state.audits.standing(worker.pubkey).audited == 0
        await worker.stop()
        await auditor.stop()
