"""Parsing payout addresses: Lightning addresses, LNURLs, "don't pay me", and the rest."""

from __future__ import annotations

import pytest
from lnurl import url_encode

from queen_server.errors import QueenError
from queen_server.payouts.lightning import (
    InvalidPayoutAddress,
    LightningError,
    PayoutAddress,
    parse_payout_address,
)


@pytest.mark.parametrize("text", [None, "", "   ", "\n\t"])
def test_nothing_means_dont_pay_me(text: str | None) -> None:
    assert parse_payout_address(text) is None


@pytest.mark.parametrize(
    ("text", "url"),
    [
        ("alice@example.com", "https://example.com/.well-known/lnurlp/alice"),
        ("  Alice@Example.COM ", "https://example.com/.well-known/lnurlp/alice"),
        (
            "a.b-c_d+tips@pay.sub.example.co.uk",
            "https://pay.sub.example.co.uk/.well-known/lnurlp/a.b-c_d+tips",
        ),
        ("lightning:bob@getalby.com", "https://getalby.com/.well-known/lnurlp/bob"),
        ("LIGHTNING:bob@getalby.com", "https://getalby.com/.well-known/lnurlp/bob"),
        ("carol@xn--bcher-kva.example", "https://xn--bcher-kva.example/.well-known/lnurlp/carol"),
        (
            "dave@" + "a" * 56 + ".onion",
            "http://" + "a" * 56 + ".onion/.well-known/lnurlp/dave",
        ),
    ],
)
def test_lightning_address(text: str, url: str) -> None:
    assert parse_payout_address(text) == PayoutAddress(
        kind="lightning_address", original=text.strip(), url=url
    )


@pytest.mark.parametrize(
    "text",
    [
        "alice",
        "alice@",
        "@example.com",
        "al ice@example.com",
        "alice!@example.com",
        "alice@example",
        "alice@localhost",
        "alice@127.0.0.1",
        "alice@example.com:8080",
        "alice@-bad.example.com",
        "alice@exa_mple.com",
        "alice@example.c0m",
        "https://example.com/.well-known/lnurlp/alice",
        "lnbc210n1p4sxvzfpp5r67dlg6s9n6yvz5n2qxw780vtj0zye9n4tyvp3cdv3esxaysjxyq",
        "lnurl1dp68gurn8ghj7etcv9khqmr99e3k7mf0d3h82unvwqhhs0mp85css2sayy",  # bad checksum
        "lnurl1",
        "alice@" + "a" * 2000 + ".com",
    ],
)
def test_not_an_address(text: str) -> None:
    with pytest.raises(InvalidPayoutAddress) as caught:
        parse_payout_address(text)
    assert "not a Lightning address (name@domain) or an LNURL (lnurl1...)" in str(caught.value)
    assert isinstance(caught.value, LightningError)
    assert isinstance(caught.value, QueenError)
    assert caught.value.code == "invalid_address"


@pytest.mark.parametrize(
    "url",
    [
        "https://service.example.com/lnurlp/abc",
        "https://service.example.com/api/v1/lnurl/cb/XYZ?tag=pay&k1=" + "f" * 64,
        "http://" + "b" * 56 + ".onion/lnurlp/abc",
    ],
)
def test_lnurl_round_trip(url: str) -> None:
    encoded = url_encode(url)  # the lnurl package's encoder, upper case
    for text in (encoded, encoded.lower(), f"lightning:{encoded}", f"lightning:{encoded.lower()}"):
        assert parse_payout_address(text) == PayoutAddress(kind="lnurl", original=text, url=url)


@pytest.mark.parametrize(
    "url",
    [
        "http://service.example.com/lnurlp/abc",  # plain http off onion
        "https://127.0.0.1/lnurlp/abc",  # an IP address
        "https://localhost/lnurlp/abc",
        "ftp://service.example.com/x",
        "https://user:pw@service.example.com/x",
        "not a url at all",
    ],
)
def test_lnurl_to_a_bad_url(url: str) -> None:
    """A real LNURL, but to a URL the queen must not call: the reason names the LNURL."""
    with pytest.raises(InvalidPayoutAddress, match=r"^the LNURL "):
        parse_payout_address(url_encode(url))


def test_mixed_case_lnurl_is_not_bech32() -> None:
    encoded = url_encode("https://service.example.com/lnurlp/abc")
    mixed = encoded[:10] + encoded[10:].lower()
    with pytest.raises(InvalidPayoutAddress, match="bech32"):
        parse_payout_address(mixed)


def test_insecure_hosts_allow_plain_http_with_a_port() -> None:
    local = {"127.0.0.1", "localhost"}
    assert parse_payout_address("Alice@127.0.0.1:8080", insecure_hosts=local) == PayoutAddress(
        kind="lightning_address",
        original="Alice@127.0.0.1:8080",
        url="http://127.0.0.1:8080/.well-known/lnurlp/alice",
    )
    assert parse_payout_address("bob@localhost", insecure_hosts=local) == PayoutAddress(
        kind="lightning_address",
        original="bob@localhost",
        url="http://localhost/.well-known/lnurlp/bob",
    )
    lnurl = url_encode("http://127.0.0.1:9/lnurlp/alice")
    assert parse_payout_address(lnurl, insecure_hosts=local) == PayoutAddress(
        kind="lnurl", original=lnurl, url="http://127.0.0.1:9/lnurlp/alice"
    )
    with pytest.raises(InvalidPayoutAddress):
        parse_payout_address("alice@127.0.0.1:99999", insecure_hosts=local)
    # Without the test switch, the same addresses are refused.
    for text in ("alice@127.0.0.1:8080", "bob@localhost", lnurl):
        with pytest.raises(InvalidPayoutAddress):
            parse_payout_address(text)
