"""The shared payout address rules: what the queen accepts in a hello is what the app's
settings field accepts as the owner types."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lnurl import url_encode

from shared_schema import SchemaError
from shared_schema.payout_address import (
    INVOICE,
    MAX_ADDRESS_CHARS,
    ON_CHAIN,
    InvalidPayoutAddress,
    PayoutAddress,
    check_payout_address,
    check_service_url,
    parse_payout_address,
)

NOT_AN_ADDRESS = "not a Lightning address (name@domain) or an LNURL (lnurl1...)"

GOOD = [
    ("alice@example.com", "https://example.com/.well-known/lnurlp/alice"),
    ("  Alice@Example.COM ", "https://example.com/.well-known/lnurlp/alice"),
    (
        "a.b-c_d+tips@pay.sub.example.co.uk",
        "https://pay.sub.example.co.uk/.well-known/lnurlp/a.b-c_d+tips",
    ),
    ("lightning:bob@getalby.com", "https://getalby.com/.well-known/lnurlp/bob"),
    ("LIGHTNING:bob@getalby.com", "https://getalby.com/.well-known/lnurlp/bob"),
    ("carol@xn--bcher-kva.example", "https://xn--bcher-kva.example/.well-known/lnurlp/carol"),
    ("dave@" + "a" * 56 + ".onion", "http://" + "a" * 56 + ".onion/.well-known/lnurlp/dave"),
]

# (text, a piece of the reason the owner is shown)
BAD = [
    ("alice", NOT_AN_ADDRESS),
    ("alice@", NOT_AN_ADDRESS),
    ("@example.com", NOT_AN_ADDRESS),
    ("al ice@example.com", "may only use a-z, 0-9"),
    ("alice!@example.com", "may only use a-z, 0-9"),
    ("alice@example", "is not a domain name like example.com"),
    ("alice@localhost", "is not a domain name"),
    ("alice@127.0.0.1", "is not a domain name"),
    ("alice@example.com:8080", "is not a domain name"),
    ("alice@-bad.example.com", "is not a domain name"),
    ("alice@exa_mple.com", "is not a domain name"),
    ("alice@example.c0m", "is not a domain name"),
    ("alice@exämple.com", "is not a domain name"),
    ("https://example.com/.well-known/lnurlp/alice", NOT_AN_ADDRESS),
    ("lnurl1dp68gurn8ghj7etcv9khqmr99e3k7mf0d3h82unvwqhhs0mp85css2sayy", "not valid bech32"),
    ("lnurl1", "not valid bech32"),
    ("alice@" + "a" * MAX_ADDRESS_CHARS + ".com", f"over {MAX_ADDRESS_CHARS} characters"),
]


@pytest.mark.parametrize("text", [None, "", "   ", "\n\t"])
def test_nothing_means_dont_pay_me(text: str | None) -> None:
    assert parse_payout_address(text) is None
    assert check_payout_address(text) is None


@pytest.mark.parametrize(("text", "url"), GOOD)
def test_lightning_address(text: str, url: str) -> None:
    assert parse_payout_address(text) == PayoutAddress(
        kind="lightning_address", original=text.strip(), url=url
    )
    assert check_payout_address(text) is None


@pytest.mark.parametrize(("text", "reason"), BAD)
def test_not_an_address(text: str, reason: str) -> None:
    with pytest.raises(InvalidPayoutAddress) as caught:
        parse_payout_address(text)
    assert reason in str(caught.value)
    assert str(caught.value).startswith(NOT_AN_ADDRESS)
    # A ValueError for plain callers, a SchemaError like every shared_schema error.
    assert isinstance(caught.value, ValueError)
    assert isinstance(caught.value, SchemaError)
    assert caught.value.message == str(caught.value)
    assert check_payout_address(text) == str(caught.value)


# What a wallet shows besides a Lightning address, pasted by an owner who does not know the
# difference (issue 35): each refused with what it is and what to paste instead.
WALLET_MISTAKES = [
    ("bc1qar0srrr7xfkvy5l643lydnw9re59gtzzwf5mdq", ON_CHAIN),  # segwit v0
    ("BC1QAR0SRRR7XFKVY5L643LYDNW9RE59GTZZWF5MDQ", ON_CHAIN),  # as a QR code writes it
    ("bc1p5d7rjq7g6rdk2yhzks9smlaqtedr4dekq08ge8ztwac72sfr9rusxg3297", ON_CHAIN),  # taproot
    ("1A1zP1eP5QGefi2DMPTfTL5SLmv7DivfNa", ON_CHAIN),  # legacy P2PKH
    ("3J98t1WpEZ73CNmQviecrnyiWrnqRhWNLy", ON_CHAIN),  # P2SH
    ("tb1qw508d6qejxtdg4y5r3zarvary0c5xw7kxpjzsx", ON_CHAIN),  # testnet
    ("bitcoin:bc1qar0srrr7xfkvy5l643lydnw9re59gtzzwf5mdq?amount=0.001", ON_CHAIN),  # BIP 21
    ("lnbc210n1p4sxvzfpp5r67dlg6s9n6yvz5n2qxw780vtj0zye9n4tyvp3cdv3esxaysjxyq", INVOICE),
    ("lightning:LNBC1P4SXVZFPP5R67DLG6S9N6YVZ5N2QXW780VTJ0ZYE9N4TYVP3CDV3ESXAYSJXYQ", INVOICE),
]


@pytest.mark.parametrize(("text", "reason"), WALLET_MISTAKES)
def test_an_on_chain_address_or_an_invoice_says_what_it_is(text: str, reason: str) -> None:
    with pytest.raises(InvalidPayoutAddress) as caught:
        parse_payout_address(text)
    assert str(caught.value) == reason
    assert check_payout_address(text) == reason
    assert "Apiary pays over Lightning" in ON_CHAIN
    assert "you@wallet.com" in ON_CHAIN  # what to paste instead
    assert INVOICE.startswith(NOT_AN_ADDRESS)
    assert "paid only once" in INVOICE


@pytest.mark.parametrize("text", ["1abc", "bc1", "3" * 30, "tb1 qw508d6qejxtdg4y5r3zarvary0c5",
                                  "lnbcx", "my bitcoin: wallet",
                                  "1A1zP1eP5QGefi2DMPTfTL5SLmv7DivfNb"])  # a bad checksum
def test_near_misses_get_the_plain_reason(text: str) -> None:
    """Only what really looks like an on-chain address or an invoice gets that hint."""
    assert check_payout_address(text) == NOT_AN_ADDRESS


@pytest.mark.parametrize(
    "url",
    [
        "https://service.example.com/lnurlp/abc",
        # over the 90 characters BIP-173 allows: LNURLs are exempt
        "https://service.example.com/api/v1/lnurl/cb/XYZ?tag=pay&k1=" + "f" * 64,
        "http://" + "b" * 56 + ".onion/lnurlp/abc",
    ],
)
def test_lnurl_round_trip(url: str) -> None:
    encoded = url_encode(url)  # the lnurl package's encoder, upper case
    for text in (encoded, encoded.lower(), f"lightning:{encoded}", f"lightning:{encoded.lower()}"):
        assert parse_payout_address(text) == PayoutAddress(kind="lnurl", original=text, url=url)
        assert check_payout_address(text) is None


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://service.example.com/lnurlp/abc", "must use https://"),
        ("https://127.0.0.1/lnurlp/abc", "must be on a public domain name"),
        ("https://localhost/lnurlp/abc", "must be on a public domain name"),
        ("ftp://service.example.com/x", "must be an https:// URL"),
        ("https://user:pw@service.example.com/x", "must be an https:// URL"),
        ("https://service.example.com:99999/x", "is not a valid URL"),
        ("not a url at all", "is not a valid URL"),
    ],
)
def test_lnurl_to_a_bad_url(url: str, reason: str) -> None:
    """A real LNURL, but to a URL nobody should be sent to: the reason names the LNURL."""
    text = url_encode(url)
    with pytest.raises(InvalidPayoutAddress, match=r"^the LNURL ") as caught:
        parse_payout_address(text)
    assert reason in str(caught.value)
    assert check_payout_address(text) == str(caught.value)


def test_mixed_case_lnurl_is_not_bech32() -> None:
    encoded = url_encode("https://service.example.com/lnurlp/abc")
    mixed = encoded[:10] + encoded[10:].lower()
    assert "bech32" in (check_payout_address(mixed) or "")


def test_insecure_hosts_only_when_asked() -> None:
    local = {"127.0.0.1", "LOCALHOST"}
    assert parse_payout_address("Alice@127.0.0.1:8080", insecure_hosts=local) == PayoutAddress(
        kind="lightning_address",
        original="Alice@127.0.0.1:8080",
        url="http://127.0.0.1:8080/.well-known/lnurlp/alice",
    )
    lnurl = url_encode("http://localhost:9/lnurlp/alice")
    assert parse_payout_address(lnurl, insecure_hosts=local) == PayoutAddress(
        kind="lnurl", original=lnurl, url="http://localhost:9/lnurlp/alice"
    )
    with pytest.raises(InvalidPayoutAddress, match="bad port"):
        parse_payout_address("alice@127.0.0.1:99999", insecure_hosts=local)
    # The app's check never allows them: an owner's address must work from the queen.
    for text in ("alice@127.0.0.1:8080", lnurl):
        assert check_payout_address(text) is not None


def test_check_service_url() -> None:
    check_service_url("https://pay.example.com/cb?x=1", what="the callback")
    check_service_url("http://127.0.0.1:5/cb", insecure_hosts=["127.0.0.1"], what="the callback")
    with pytest.raises(InvalidPayoutAddress, match=r"^the callback must use https://"):
        check_service_url("http://pay.example.com/cb", what="the callback")
    with pytest.raises(InvalidPayoutAddress, match=r"^the callback is not a valid URL"):
        check_service_url("https://pay.example.com/a b", what="the callback")


@given(st.text(max_size=300))
def test_any_typed_text_gets_none_or_a_reason(text: str) -> None:
    """The settings field calls this on every keystroke: it must never raise."""
    result = check_payout_address(text)
    assert result is None or (isinstance(result, str) and result)
    if result is None and text.strip():
        assert parse_payout_address(text) is not None


@given(st.from_regex(r"[a-z0-9._+-]{1,20}@[a-z][a-z0-9]{0,10}\.(com|org|io)", fullmatch=True))
def test_generated_lightning_addresses_are_accepted(text: str) -> None:
    name, _, domain = text.partition("@")
    assert parse_payout_address(text.upper()) == PayoutAddress(
        kind="lightning_address",
        original=text.upper(),
        url=f"https://{domain}/.well-known/lnurlp/{name}",
    )


@pytest.mark.parametrize("text", [t for t, _ in GOOD + BAD + WALLET_MISTAKES])
def test_the_queen_uses_the_same_rules(text: str) -> None:
    """The queen's boundary gives the same answer, as its own error chained to the shared one."""
    from queen_server.payouts.lightning import InvalidPayoutAddress as QueenInvalid
    from queen_server.payouts.lightning import parse_payout_address as queen_parse

    reason = check_payout_address(text)
    if reason is None:
        assert queen_parse(text) == parse_payout_address(text)
        return
    with pytest.raises(QueenInvalid) as caught:
        queen_parse(text)
    assert str(caught.value) == reason
    assert caught.value.code == "invalid_address"
    assert isinstance(caught.value.__cause__, InvalidPayoutAddress)
