"""Getting an invoice over LNURL-pay from the fake service, and refusing bad ones."""

from __future__ import annotations

import hashlib
import socket
from datetime import UTC, datetime

import bolt11
import httpx
import pytest

from queen_server.payouts.lightning import (
    Invoice,
    InvoiceMismatch,
    LnurlError,
    PayoutAddress,
    fetch_invoice,
    parse_payout_address,
)
from tests.queen_server.payouts.lightning.conftest import LOCAL
from tests.support.fake_lightning import TEST_NODE_PUBKEY, FakeLnurlServer


async def test_invoice_for_a_lightning_address(
    lnurl_server: FakeLnurlServer, alice: PayoutAddress, client: httpx.AsyncClient
) -> None:
    invoice = await fetch_invoice(alice, 21_000, client)

    decoded = bolt11.decode(invoice.bolt11)
    expected_hash = hashlib.sha256(lnurl_server.metadata("alice").encode()).hexdigest()
    assert int(decoded.amount_msat or 0) == invoice.amount_msat == 21_000
    assert decoded.description_hash == invoice.description_hash == expected_hash
    assert decoded.payment_hash == invoice.payment_hash
    assert decoded.payee == TEST_NODE_PUBKEY
    assert invoice.expires_at > datetime.now(UTC)
    issued = lnurl_server.invoice(invoice.payment_hash)
    assert issued.bolt11 == invoice.bolt11
    assert hashlib.sha256(bytes.fromhex(issued.preimage)).hexdigest() == invoice.payment_hash
    # The callback's own query survived, the amount was added to it, no comment was sent.
    (callback,) = [r for r in lnurl_server.requests if r.path.endswith("/callback")]
    assert callback.query == {"src": ["fake"], "amount": ["21000"]}
    assert Invoice.from_bolt11(invoice.bolt11) == invoice


async def test_invoice_for_an_lnurl(
    lnurl_server: FakeLnurlServer, client: httpx.AsyncClient
) -> None:
    address = parse_payout_address(lnurl_server.lnurl("bob"), insecure_hosts=LOCAL)
    assert address is not None
    assert address.kind == "lnurl"
    invoice = await fetch_invoice(address, 1_000, client)
    assert lnurl_server.invoice(invoice.payment_hash).name == "bob"
    assert invoice.amount_msat == 1_000


async def test_every_invoice_has_its_own_payment_hash(
    alice: PayoutAddress, client: httpx.AsyncClient
) -> None:
    first = await fetch_invoice(alice, 5_000, client)
    second = await fetch_invoice(alice, 5_000, client)
    assert first.payment_hash != second.payment_hash


async def test_comment_sent_only_when_allowed_and_cut_to_the_limit(
    lnurl_server: FakeLnurlServer, alice: PayoutAddress, client: httpx.AsyncClient
) -> None:
    await fetch_invoice(alice, 2_000, client, comment="not allowed")
    lnurl_server.comment_allowed = 10
    invoice = await fetch_invoice(alice, 2_000, client, comment="Apiary payout #42 for May")
    assert lnurl_server.invoice(invoice.payment_hash).comment == "Apiary pay"
    callbacks = [r for r in lnurl_server.requests if r.path.endswith("/callback")]
    assert "comment" not in callbacks[0].query
    assert callbacks[1].query["comment"] == ["Apiary pay"]


@pytest.mark.parametrize(
    ("tweak", "code"),
    [
        ({"amount_delta_msat": 1_000}, "amount"),
        ({"amount_delta_msat": -1}, "amount"),
        ({"description_hash": hashlib.sha256(b"something else").hexdigest()}, "description_hash"),
        ({"expired": True}, "expired"),
        ({"currency": "tb"}, "network"),
        ({"currency": "bcrt"}, "network"),
    ],
)
async def test_a_wrong_invoice_is_refused(
    lnurl_server: FakeLnurlServer,
    alice: PayoutAddress,
    client: httpx.AsyncClient,
    tweak: dict[str, object],
    code: str,
) -> None:
    lnurl_server.next_invoice(**tweak)  # type: ignore[arg-type]
    with pytest.raises(InvoiceMismatch) as caught:
        await fetch_invoice(alice, 10_000, client)
    assert caught.value.code == code
    assert len(lnurl_server.issued) == 1  # it really issued one, and we refused it


async def test_other_networks_can_be_accepted(
    lnurl_server: FakeLnurlServer, alice: PayoutAddress, client: httpx.AsyncClient
) -> None:
    lnurl_server.next_invoice(currency="tb")
    invoice = await fetch_invoice(alice, 10_000, client, currencies={"bc", "tb"})
    assert invoice.bolt11.startswith("lntb")


@pytest.mark.parametrize("at", ["pay_request", "callback"])
async def test_service_error(
    lnurl_server: FakeLnurlServer, alice: PayoutAddress, client: httpx.AsyncClient, at: str
) -> None:
    lnurl_server.error_next("wallet frozen", at=at)  # type: ignore[arg-type]
    with pytest.raises(LnurlError, match="wallet frozen") as caught:
        await fetch_invoice(alice, 10_000, client)
    assert caught.value.code == "service_error"
    assert not isinstance(caught.value, InvoiceMismatch)
    assert lnurl_server.issued == []


async def test_unknown_user_is_a_service_error(
    lnurl_server: FakeLnurlServer, client: httpx.AsyncClient
) -> None:
    address = parse_payout_address(lnurl_server.address("mallory"), insecure_hosts=LOCAL)
    assert address is not None
    with pytest.raises(LnurlError, match="no user mallory") as caught:
        await fetch_invoice(address, 10_000, client)
    assert caught.value.code == "service_error"


@pytest.mark.parametrize("amount", [999, 50_001])
async def test_amount_out_of_range(
    lnurl_server: FakeLnurlServer, alice: PayoutAddress, client: httpx.AsyncClient, amount: int
) -> None:
    lnurl_server.min_sendable, lnurl_server.max_sendable = 1_000, 50_000
    with pytest.raises(LnurlError) as caught:
        await fetch_invoice(alice, amount, client)
    assert caught.value.code == "amount_out_of_range"
    assert (caught.value.min_sendable, caught.value.max_sendable) == (1_000, 50_000)
    assert lnurl_server.count(contains="/callback") == 0  # never asked for the invoice
    # The edges are inside.
    for edge in (1_000, 50_000):
        assert (await fetch_invoice(alice, edge, client)).amount_msat == edge


async def test_unreachable_service(client: httpx.AsyncClient) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    address = parse_payout_address(f"alice@127.0.0.1:{port}", insecure_hosts=LOCAL)
    assert address is not None
    with pytest.raises(LnurlError) as caught:
        await fetch_invoice(address, 10_000, client)
    assert caught.value.code == "unreachable"


async def test_non_positive_amount_is_a_programming_error(
    alice: PayoutAddress, client: httpx.AsyncClient
) -> None:
    with pytest.raises(ValueError, match="positive"):
        await fetch_invoice(alice, 0, client)
