"""The origins a queen answers to (``identity.QueenOrigins``), from its settings and a request,
and the hello gate that checks signatures against them. No sockets: the ASGI scope's parts."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from queen_server.identity import HelloGate, QueenOrigins, RequestOrigins
from queen_server.settings import QueenSettings
from tests.support.workers import new_key, signed_hello

NONCE = "cd" * 32


def origins(**settings) -> QueenOrigins:
    return QueenOrigins(QueenSettings(db="sqlite+aiosqlite://", **settings))


def test_public_url_is_exactly_the_origins_accepted():
    queen = origins(public_url="wss://Queen.Example/worker, https://queen.example:443/, "
                               "http://10.0.0.5:8000")
    seen = queen.for_request("ws", "127.0.0.1:8000", ("127.0.0.1", 8000))
    assert seen.accepted == ("https://queen.example", "http://10.0.0.5:8000")
    assert seen.host_origin == "http://127.0.0.1:8000"  # for the refusal's words only
    assert queen.startup_warning() is None


def test_public_url_from_the_environment(monkeypatch):
    monkeypatch.setenv("APIARY_PUBLIC_URL", "https://a.example, wss://b.example:8443/worker")
    queen = QueenOrigins(QueenSettings(db="sqlite+aiosqlite://"))
    assert queen.for_request("http", None, None).accepted == (
        "https://a.example", "https://b.example:8443")


@pytest.mark.parametrize("bad", ["ftp://queen.example", "queen.example", "https://", "ws://a b"])
def test_a_garbage_public_url_stops_the_queen_at_start(bad):
    with pytest.raises(ValidationError, match="queen URL"):
        QueenSettings(db="sqlite+aiosqlite://", public_url=bad)


@pytest.mark.parametrize(
    ("host", "accepted"),
    [
        ("127.0.0.1", ("http://127.0.0.1:41234", "http://localhost:41234")),
        ("localhost", ("http://localhost:41234", "http://127.0.0.1:41234",
                       "http://[::1]:41234")),
        ("::1", ("http://[::1]:41234", "http://localhost:41234")),
        ("Queen.LAN", ("http://queen.lan:41234",)),
        ("10.0.0.5", ("http://10.0.0.5:41234",)),
    ],
)
def test_a_specific_bind_host_is_its_own_origin_at_the_port_in_use(host, accepted):
    # The port comes from the socket the connection came in on (settings say 8000: port 0 and
    # test harnesses bind elsewhere), and the Host header plays no part.
    queen = origins(host=host)
    seen = queen.for_request("ws", "evil.example:1", ("127.0.0.1", 41234))
    assert seen.accepted == accepted
    assert queen.startup_warning() is None


def test_without_a_socket_address_the_settings_port_is_used_and_tls_is_https():
    assert origins(port=9000).for_request("wss", None, None).accepted == (
        "https://127.0.0.1:9000", "https://localhost:9000")


@pytest.mark.parametrize("host", ["0.0.0.0", "::", ""])
def test_a_wildcard_bind_takes_the_host_header_and_warns(host):
    queen = origins(host=host)
    assert queen.for_request("ws", "Queen.Example:8000", ("10.0.0.5", 8000)).accepted == (
        "http://queen.example:8000",)
    assert queen.for_request("wss", "queen.example", ("10.0.0.5", 8000)).accepted == (
        "https://queen.example",)
    warning = queen.startup_warning()
    assert warning is not None
    assert "APIARY_PUBLIC_URL" in warning


@pytest.mark.parametrize("header", [None, "", "evil.example/path", "a@evil.example",
                                    "evil.example?x", "bad host", "[::1", "h:99999"])
def test_a_host_header_that_names_no_host_gives_no_origin(header):
    seen = origins(host="0.0.0.0").for_request("ws", header, ("10.0.0.5", 8000))
    assert seen == RequestOrigins((), None)


def test_for_scope_reads_an_asgi_scope():
    scope = {"type": "websocket", "scheme": "wss", "server": ("127.0.0.1", 8443),
             "headers": [(b"user-agent", b"x"), (b"host", b"queen.example:8443")]}
    seen = origins().for_scope(scope)
    assert seen.accepted == ("https://127.0.0.1:8443", "https://localhost:8443")
    assert seen.host_origin == "https://queen.example:8443"


def test_misdirected_names_the_host_header_and_its_other_scheme_never_an_accepted_one():
    seen = RequestOrigins(("https://queen.example",), "http://127.0.0.1:8000")
    assert seen.misdirected() == ("http://127.0.0.1:8000", "https://127.0.0.1:8000")
    # A TLS proxy that does not say so: the Host header's origin with the other scheme.
    assert RequestOrigins(("http://127.0.0.1:8000",), "http://queen.example").misdirected() == (
        "http://queen.example", "https://queen.example")
    assert RequestOrigins(("http://queen.example",), "http://queen.example").misdirected() == (
        "https://queen.example",)
    assert RequestOrigins(("http://q.example",), None).misdirected() == ()


def test_the_gate_accepts_only_its_origins_and_names_a_misdirected_one():
    gate = HelloGate(origins=RequestOrigins(("https://queen.example",),
                                            "http://127.0.0.1:8000"))
    good = signed_hello(new_key(), NONCE, models=[], origin="https://queen.example")
    local = signed_hello(new_key(), NONCE, models=[], origin="http://127.0.0.1:8000")
    other = signed_hello(new_key(), NONCE, models=[], origin="https://evil.example")
    assert gate.hello_signed(good, NONCE)
    assert not gate.hello_signed(local, NONCE)
    assert gate.signed_for_elsewhere(local, NONCE) == "http://127.0.0.1:8000"
    assert not gate.hello_signed(other, NONCE)
    assert gate.signed_for_elsewhere(other, NONCE) is None
    assert gate.origins == ("https://queen.example",)


def test_a_gate_with_no_origins_accepts_nothing():
    hello = signed_hello(new_key(), NONCE, models=[], origin="http://127.0.0.1:8000")
    assert not HelloGate().hello_signed(hello, NONCE)
