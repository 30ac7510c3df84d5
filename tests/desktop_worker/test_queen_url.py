"""The queen address normaliser: every form people paste, and garbage refused with the form."""

from __future__ import annotations

import pytest

from desktop_worker.errors import QueenAddressError
from desktop_worker.queen_url import EXAMPLES, describe, normalise_queen_url


@pytest.mark.parametrize(("typed", "url"), [
    # The landing page's address of a hosted queen.
    ("https://queen.example", "wss://queen.example/worker"),
    ("https://queen.example/", "wss://queen.example/worker"),
    ("HTTPS://Queen.Example:443/", "wss://queen.example/worker"),
    # A queen on the LAN or this machine, as its operator says it.
    ("http://127.0.0.1:8000", "ws://127.0.0.1:8000/worker"),
    ("http://192.168.1.5:8000/", "ws://192.168.1.5:8000/worker"),
    ("127.0.0.1:8000", "ws://127.0.0.1:8000/worker"),
    ("localhost:8000", "ws://localhost:8000/worker"),
    ("localhost", "ws://localhost/worker"),
    ("[::1]:8000", "ws://[::1]:8000/worker"),
    # host:port and host alone.
    ("queen.example:8000", "ws://queen.example:8000/worker"),
    ("queen.example:443", "wss://queen.example/worker"),
    ("queen.example", "wss://queen.example/worker"),
    ("queen.example.", "wss://queen.example/worker"),
    # The full websocket URL, with the usual noise around it.
    ("wss://queen.example/worker", "wss://queen.example/worker"),
    ("  wss://queen.example/worker/  \n", "wss://queen.example/worker"),
    ("ws://127.0.0.1:8000/worker", "ws://127.0.0.1:8000/worker"),
    ("ws://queen.example:80/worker", "ws://queen.example/worker"),
    # Behind a reverse proxy under a prefix; the OpenAI base URL pasted from the API docs.
    ("https://example.org/apiary/", "wss://example.org/apiary/worker"),
    ("https://queen.example/v1", "wss://queen.example/worker"),
    ("https://queen.example//worker//", "wss://queen.example/worker"),
    ("https://queen.example/#top", "wss://queen.example/worker"),
    # An internationalised name is sent as its ASCII (IDNA) form.
    ("https://bücher.example", "wss://xn--bcher-kva.example/worker"),
])
def test_the_forms_people_paste(typed, url):
    assert normalise_queen_url(typed) == url
    assert normalise_queen_url(url) == url  # idempotent


@pytest.mark.parametrize(("typed", "problem"), [
    ("", "empty"),
    ("   ", "empty"),
    ("ftp://queen.example", "ftp:// is not a queen address"),
    ("mailto:alice@queen.example", "mailto: is not a queen address"),
    ("lightning:lnurl1dp68gurn8ghj7", "lightning: is not a queen address"),
    ("http://", "names no host"),
    ("http://queen example", "space"),
    ("queen.example:99999", "port"),
    ("queen.example:0", "Port 0"),
    ("http://queen.example:abc", "port"),
    ("https://alice:secret@queen.example", "no user name or password"),
    ("https://queen.example/?token=1", "query"),
    ("queen..example", "not a valid host name"),
    ("-queen.example", "not a valid host name"),
    ("queen_example.com", "not a valid host name"),
    ("999.1.1.1", "not a valid IP address"),
    ("<script>alert(1)</script>", ""),
])
def test_garbage_is_refused_with_the_expected_form(typed, problem):
    with pytest.raises(QueenAddressError) as caught:
        normalise_queen_url(typed)
    message = str(caught.value)
    assert problem in message
    assert EXAMPLES in message  # every refusal shows what is expected


def test_describe_names_host_and_port():
    assert describe("wss://queen.example/worker") == "queen.example:443"
    assert describe("ws://127.0.0.1:8000/worker") == "127.0.0.1:8000"
    assert describe("ws://[::1]:8000/worker") == "[::1]:8000"
