"""``queen_origin``: every spelling of one queen's URL is one origin, and garbage is a clear
``InvalidQueenUrl`` (a ``ValueError``), since both sides sign and check exactly this string."""

from __future__ import annotations

import pytest

from shared_schema import InvalidQueenUrl, SchemaError, queen_origin


@pytest.mark.parametrize(
    ("url", "origin"),
    [
        # ws -> http, wss -> https; http and https kept.
        ("ws://127.0.0.1:8000/worker", "http://127.0.0.1:8000"),
        ("wss://queen.example/worker", "https://queen.example"),
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("https://queen.example/", "https://queen.example"),
        # Scheme and host are lower-cased.
        ("WSS://Queen.EXAMPLE/worker", "https://queen.example"),
        # Default ports go; any other port stays (443 is not http's default).
        ("wss://queen.example:443/worker", "https://queen.example"),
        ("ws://queen.example:80/worker", "http://queen.example"),
        ("ws://queen.example:443/worker", "http://queen.example:443"),
        ("wss://queen.example:80/worker", "https://queen.example:80"),
        ("wss://queen.example:8443", "https://queen.example:8443"),
        # Path, query, fragment and user info are not part of an origin.
        ("wss://queen.example/apiary/worker?x=1#top", "https://queen.example"),
        ("ws://alice:secret@queen.example:9000/worker", "http://queen.example:9000"),
        # IPv6 in brackets, in its one compressed form.
        ("ws://[::1]:8000/worker", "http://[::1]:8000"),
        ("wss://[0:0:0:0:0:0:0:1]/worker", "https://[::1]"),
        ("ws://[2001:DB8::1]:80/", "http://[2001:db8::1]"),
        # A non-ASCII host is IDNA-encoded; a root-zone dot is dropped.
        ("wss://bücher.example/worker", "https://xn--bcher-kva.example"),
        ("https://queen.example./", "https://queen.example"),
        # Spaces around a pasted URL are not part of it.
        ("  wss://queen.example/worker\n", "https://queen.example"),
        ("ws://queen_server:8000/worker", "http://queen_server:8000"),  # docker service names
    ],
)
def test_spellings_of_one_queen_are_one_origin(url, origin):
    assert queen_origin(url) == origin
    assert queen_origin(origin) == origin  # an origin is its own origin


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("queen.example", "must start with"),
        ("queen.example:8000/worker", "must start with"),
        ("//queen.example/worker", "must start with"),
        ("ftp://queen.example", "must start with"),
        ("javascript:alert(1)", "must start with"),
        ("ws://", "no host"),
        ("wss:///worker", "no host"),
        ("ws://:8000/worker", "no host"),
        ("ws://queen.example:99999/worker", "not a URL"),
        ("ws://queen.example:-1/worker", "not a URL"),
        ("ws://queen.example:http/worker", "not a URL"),
        ("ws://queen.example:0/worker", "port 0"),
        ("ws://[::1/worker", "not a URL"),
        ("ws://[::g]/worker", "IPv6"),
        ("ws://queen example/worker", "spaces or control"),
        ("ws://queen.example\r\nHost: evil/worker", "spaces or control"),
        ("ws://queen.example\x00/worker", "spaces or control"),
        ("ws://que<en>.example/", "characters no host name"),
        ("ws://queen..example/", "characters no host name"),
        ("ws://" + "a" * 300 + ".example/", "characters no host name"),
    ],
)
def test_garbage_is_a_clear_invalid_queen_url(url, says):
    with pytest.raises(InvalidQueenUrl) as info:
        queen_origin(url)
    assert says in str(info.value)
    # One error to catch for the package, and a ValueError for pydantic validators.
    assert isinstance(info.value, SchemaError)
    assert isinstance(info.value, ValueError)


def test_not_a_string_is_refused():
    with pytest.raises(InvalidQueenUrl):
        queen_origin(None)  # type: ignore[arg-type]
