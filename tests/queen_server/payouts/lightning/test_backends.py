"""Paying invoices through LNbits (the fake), at most once, and reconciling after a crash."""

from __future__ import annotations

import asyncio
import hashlib

import httpx
import pytest

from queen_server.payouts.lightning import (
    Invoice,
    LightningBackend,
    LnbitsBackend,
    NoneBackend,
    PayoutAddress,
    fetch_invoice,
)
from tests.support.fake_lightning import FakeLnbits, FakeLnurlServer, make_invoice


@pytest.fixture
def backend(lnbits: FakeLnbits, client: httpx.AsyncClient) -> LnbitsBackend:
    return LnbitsBackend(lnbits.url, lnbits.admin_key, client)


@pytest.fixture
async def invoice(alice: PayoutAddress, client: httpx.AsyncClient) -> Invoice:
    return await fetch_invoice(alice, 21_000, client)


def _proves(preimage: str | None, invoice: Invoice) -> bool:
    return preimage is not None and (
        hashlib.sha256(bytes.fromhex(preimage)).hexdigest() == invoice.payment_hash
    )


async def test_pay_then_status(
    backend: LnbitsBackend,
    lnbits: FakeLnbits,
    lnurl_server: FakeLnurlServer,
    invoice: Invoice,
) -> None:
    balance = lnbits.balance_msat
    result = await backend.pay(invoice, idempotency_key="payout-1")

    assert result.status == "paid"
    assert result.payment_hash == invoice.payment_hash
    assert result.preimage == lnurl_server.invoice(invoice.payment_hash).preimage
    assert _proves(result.preimage, invoice)
    assert result.fee_msat == lnbits.fee_msat
    assert lnbits.sent == [invoice.payment_hash]
    assert lnbits.balance_msat == balance - 21_000 - lnbits.fee_msat
    assert lnbits.payments[invoice.payment_hash].extra == {"apiary_payout": "payout-1"}
    assert lnurl_server.invoice(invoice.payment_hash).paid

    status = await backend.status(invoice.payment_hash)
    assert (status.status, status.preimage, status.fee_msat) == ("paid", result.preimage, 1_000)


async def test_paying_twice_pays_once(
    backend: LnbitsBackend, lnbits: FakeLnbits, invoice: Invoice
) -> None:
    first = await backend.pay(invoice, idempotency_key="payout-1")
    second = await backend.pay(invoice, idempotency_key="payout-1")
    assert first.status == second.status == "paid"
    assert second.preimage == first.preimage
    assert lnbits.sent == [invoice.payment_hash]
    assert lnbits.count("POST") == 1


async def test_paying_twice_at_once_pays_once(
    backend: LnbitsBackend, lnbits: FakeLnbits, invoice: Invoice
) -> None:
    results = await asyncio.gather(
        *(backend.pay(invoice, idempotency_key="payout-1") for _ in range(4))
    )
    assert [r.status for r in results] == ["paid"] * 4
    assert all(_proves(r.preimage, invoice) for r in results)
    assert lnbits.sent == [invoice.payment_hash]


async def test_lnbits_refuses_a_second_payment_itself(
    lnbits: FakeLnbits, invoice: Invoice, client: httpx.AsyncClient
) -> None:
    """The fake behaves like LNbits when asked straight out to pay a hash twice."""
    url, headers = f"{lnbits.url}/api/v1/payments", {"X-Api-Key": lnbits.admin_key}
    body = {"out": True, "bolt11": invoice.bolt11}
    assert (await client.post(url, headers=headers, json=body)).status_code == 201
    again = await client.post(url, headers=headers, json=body)
    assert again.status_code == 520
    assert again.json() == {"detail": "Payment already paid.", "status": "success"}
    assert lnbits.sent == [invoice.payment_hash]


@pytest.mark.parametrize(
    ("balance", "reason"),
    [(20_000, "Insufficient balance."), (21_500, "You must reserve at least")],
)
async def test_insufficient_balance(
    backend: LnbitsBackend, lnbits: FakeLnbits, invoice: Invoice, balance: int, reason: str
) -> None:
    lnbits.balance_msat = balance
    result = await backend.pay(invoice, idempotency_key="payout-1")
    assert result.status == "failed"
    assert reason in result.detail
    assert lnbits.sent == []
    assert lnbits.balance_msat == balance


async def test_a_failed_payment_is_not_retried(
    backend: LnbitsBackend, lnbits: FakeLnbits, invoice: Invoice
) -> None:
    lnbits.fail_next_payment("no route found")
    result = await backend.pay(invoice, idempotency_key="payout-1")
    assert result.status == "failed"
    assert "no route found" in result.detail
    assert (await backend.status(invoice.payment_hash)).status == "failed"
    again = await backend.pay(invoice, idempotency_key="payout-1")
    assert again.status == "failed"
    assert lnbits.count("POST") == 1
    assert lnbits.sent == []


async def test_an_invoice_nobody_issued_fails(backend: LnbitsBackend, lnbits: FakeLnbits) -> None:
    pr = make_invoice(5_000, payment_hash="ab" * 32, description_hash="cd" * 32)
    result = await backend.pay(Invoice.from_bolt11(pr), idempotency_key="payout-x")
    assert result.status == "failed"
    assert "no route" in result.detail
    assert lnbits.sent == []


async def test_pending_then_settled(
    backend: LnbitsBackend, lnbits: FakeLnbits, invoice: Invoice
) -> None:
    lnbits.hold_next_payment()
    result = await backend.pay(invoice, idempotency_key="payout-1")
    assert (result.status, result.preimage) == ("pending", None)
    assert (await backend.status(invoice.payment_hash)).status == "pending"
    assert (await backend.pay(invoice, idempotency_key="payout-1")).status == "pending"

    lnbits.settle(invoice.payment_hash)
    settled = await backend.status(invoice.payment_hash)
    assert settled.status == "paid"
    assert _proves(settled.preimage, invoice)
    assert lnbits.sent == [invoice.payment_hash]


async def test_pending_then_failed(
    backend: LnbitsBackend, lnbits: FakeLnbits, invoice: Invoice
) -> None:
    balance = lnbits.balance_msat
    lnbits.hold_next_payment()
    assert (await backend.pay(invoice, idempotency_key="payout-1")).status == "pending"
    lnbits.fail(invoice.payment_hash)
    assert (await backend.status(invoice.payment_hash)).status == "failed"
    assert lnbits.balance_msat == balance


@pytest.mark.parametrize("mode", ["drop", "500"])
async def test_crash_mid_payment_is_reconciled(
    backend: LnbitsBackend, lnbits: FakeLnbits, invoice: Invoice, mode: str
) -> None:
    """LNbits paid but never said so: pay() looks the payment up instead of paying again."""
    lnbits.crash_next_payment(mode)  # type: ignore[arg-type]
    result = await backend.pay(invoice, idempotency_key="payout-1")
    assert result.status == "paid"
    assert _proves(result.preimage, invoice)
    assert lnbits.sent == [invoice.payment_hash]
    assert lnbits.count("POST") == 1


async def test_crash_then_down_is_unknown_until_status_says_paid(
    backend: LnbitsBackend, lnbits: FakeLnbits, invoice: Invoice
) -> None:
    lnbits.crash_next_payment("drop", stay_down=True)
    result = await backend.pay(invoice, idempotency_key="payout-1")
    assert result.status == "unknown"
    assert (await backend.status(invoice.payment_hash)).status == "unknown"
    # The payout engine must not pay again while unknown; a retry of pay() is harmless anyway.
    assert (await backend.pay(invoice, idempotency_key="payout-1")).status == "unknown"

    lnbits.come_back()
    status = await backend.status(invoice.payment_hash)
    assert status.status == "paid"
    assert _proves(status.preimage, invoice)
    assert (await backend.pay(invoice, idempotency_key="payout-1")).status == "paid"
    assert lnbits.sent == [invoice.payment_hash]
    assert lnbits.count("POST") == 1


async def test_lnbits_down_before_paying_sends_nothing(
    backend: LnbitsBackend, lnbits: FakeLnbits, invoice: Invoice
) -> None:
    lnbits.go_down()
    result = await backend.pay(invoice, idempotency_key="payout-1")
    assert result.status == "unknown"
    assert lnbits.count("POST") == 0
    assert lnbits.sent == []


async def test_a_hash_lnbits_never_saw_is_failed(backend: LnbitsBackend) -> None:
    result = await backend.status("ef" * 32)
    assert result.status == "failed"
    assert "never sent" in result.detail


@pytest.mark.parametrize("key", ["wrong-key", "lnbits-invoice-key"])
async def test_a_key_that_cannot_pay(
    lnbits: FakeLnbits, client: httpx.AsyncClient, invoice: Invoice, key: str
) -> None:
    backend = LnbitsBackend(lnbits.url, key, client)
    result = await backend.pay(invoice, idempotency_key="payout-1")
    assert result.status == "failed"
    assert "key" in result.detail.lower()
    assert lnbits.sent == []


async def test_pre_1_0_lnbits(
    lnurl_server: FakeLnurlServer, alice: PayoutAddress, client: httpx.AsyncClient
) -> None:
    with FakeLnbits(network=lnurl_server, legacy_api=True) as lnbits:
        backend = LnbitsBackend(lnbits.url + "/", lnbits.admin_key, client)
        invoice = await fetch_invoice(alice, 3_000, client)
        result = await backend.pay(invoice, idempotency_key="payout-1")
        assert result.status == "paid"
        assert _proves(result.preimage, invoice)
        assert (await backend.pay(invoice, idempotency_key="payout-1")).status == "paid"
        assert lnbits.sent == [invoice.payment_hash]

        failing = await fetch_invoice(alice, 3_000, client)
        lnbits.fail_next_payment()
        assert (await backend.pay(failing, idempotency_key="payout-2")).status == "failed"
        assert (await backend.status(failing.payment_hash)).status == "failed"

        lnbits.balance_msat = 0
        poor = await fetch_invoice(alice, 3_000, client)
        result = await backend.pay(poor, idempotency_key="payout-3")
        assert (result.status, result.detail) == ("failed", "Insufficient balance.")


async def test_none_backend_moves_nothing(
    invoice: Invoice, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def no_network(*args: object, **kwargs: object) -> httpx.Response:
        raise AssertionError("NoneBackend must not make requests")

    monkeypatch.setattr(httpx.AsyncClient, "send", no_network)
    backend = NoneBackend()
    result = await backend.pay(invoice, idempotency_key="payout-1")
    assert (result.status, result.detail) == ("pending", "manual payout: settle by hand")
    assert result.payment_hash == invoice.payment_hash
    assert result.preimage is None
    status = await backend.status(invoice.payment_hash)
    assert status.status == "unknown"


def test_both_backends_are_lightning_backends(backend: LnbitsBackend) -> None:
    assert isinstance(backend, LightningBackend)
    assert isinstance(NoneBackend(), LightningBackend)


async def test_a_wrong_base_url_pays_nothing(
    lnbits: FakeLnbits, client: httpx.AsyncClient, invoice: Invoice
) -> None:
    """A URL that is not LNbits (FastAPI's bare 404) is not read as "never sent"."""
    backend = LnbitsBackend(f"{lnbits.url}/lnbits", lnbits.admin_key, client)
    assert (await backend.status(invoice.payment_hash)).status == "unknown"
    result = await backend.pay(invoice, idempotency_key="payout-1")
    assert result.status == "unknown"
    assert "404" in result.detail
    assert lnbits.count("POST") == 0
