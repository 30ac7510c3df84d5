"""The gate's handshake (issue 19), sans-I/O: the MAC's exact layout, replay, tokens, names,
and lines that are bounded and strictly read."""

from __future__ import annotations

import hashlib
import hmac
import json

import pytest

from desktop_worker.errors import GroupCredentialsError, GroupLinkError, GroupLinkRefused
from desktop_worker.groups import handshake
from desktop_worker.groups.handshake import (
    MAX_LINE,
    Challenge,
    LineBuffer,
    LineTooLong,
    answer,
    verify,
)

TOKEN = bytes(range(32))
GROUP = "grp-7f3a"
HEAD = "w_head01"


def test_mac_covers_exactly_the_documented_bytes() -> None:
    nonce = bytes([0xAB]) * 32
    assert handshake.mac_message(GROUP, HEAD, nonce) == b"apiary-rpc/1|grp-7f3a|w_head01|" + nonce
    expected = hmac.new(TOKEN, b"apiary-rpc/1|grp-7f3a|w_head01|" + nonce, hashlib.sha256)
    assert handshake.mac(TOKEN, GROUP, HEAD, nonce) == expected.digest()


def test_challenge_line_and_answer_line_on_the_wire() -> None:
    challenge = Challenge(bytes(32))
    assert challenge.line() == b"APIARY-RPC/1 " + b"00" * 32 + b"\n"
    line = answer(TOKEN, GROUP, HEAD, challenge.line())
    assert line.endswith(b"\n")
    assert line.count(b"\n") == 1
    body = json.loads(line)
    assert body == {
        "group": GROUP,
        "head": HEAD,
        "mac": handshake.mac(TOKEN, GROUP, HEAD, bytes(32)).hex(),
    }


def test_the_right_answer_is_let_in() -> None:
    challenge = Challenge.new()
    verdict = verify(TOKEN, GROUP, HEAD, challenge.nonce, answer(TOKEN, GROUP, HEAD,
                                                                 challenge.line()))
    assert verdict.ok
    assert verdict.line() == b"OK\n"


def test_fresh_nonces_differ() -> None:
    assert len({Challenge.new().nonce for _ in range(50)}) == 50


def test_an_answer_for_one_nonce_never_verifies_for_another() -> None:
    first, second = Challenge.new(), Challenge.new()
    replayed = answer(TOKEN, GROUP, HEAD, first.line())
    verdict = verify(TOKEN, GROUP, HEAD, second.nonce, replayed)
    assert verdict.reason == "bad_mac"
    assert verdict.line() == b"NO bad_mac\n"


def test_wrong_token_wrong_group_wrong_head() -> None:
    challenge = Challenge.new()
    other_token = bytes(reversed(TOKEN))
    assert verify(TOKEN, GROUP, HEAD, challenge.nonce,
                  answer(other_token, GROUP, HEAD, challenge.line())).reason == "bad_mac"
    assert verify(TOKEN, GROUP, HEAD, challenge.nonce,
                  answer(TOKEN, "grp-other", HEAD, challenge.line())).reason == "wrong_group"
    assert verify(TOKEN, GROUP, HEAD, challenge.nonce,
                  answer(TOKEN, GROUP, "w_other", challenge.line())).reason == "wrong_head"


def test_a_mac_made_for_another_group_under_the_same_token_does_not_verify() -> None:
    challenge = Challenge.new()
    foreign = json.loads(answer(TOKEN, "grp-other", HEAD, challenge.line()))
    forged = json.dumps({"group": GROUP, "head": HEAD, "mac": foreign["mac"]}).encode() + b"\n"
    assert verify(TOKEN, GROUP, HEAD, challenge.nonce, forged).reason == "bad_mac"


@pytest.mark.parametrize(
    "line",
    [
        b"hello\n",
        b"\n",
        b"[1, 2]\n",
        b'"just a string"\n',
        b'{"group": "grp-7f3a", "head": "w_head01"}\n',
        b'{"group": "grp-7f3a", "head": "w_head01", "mac": "' + b"0" * 64 + b'", "x": 1}\n',
        b'{"group": "grp-7f3a", "head": "w_head01", "mac": "zz"}\n',
        b'{"group": "grp-7f3a", "head": "w_head01", "mac": "' + b"0" * 62 + b'"}\n',
        b'{"group": "grp-7f3a", "head": "w_head01", "mac": "' + b"A" * 64 + b'"}\n',
        b'{"group": 1, "head": "w_head01", "mac": "' + b"0" * 64 + b'"}\n',
        b'{"group": "grp-7f3a", "head": "w_head01", "mac": "' + b"0" * 64 + b'"}',
        '{"group": "grüppe", "head": "w", "mac": "0"}\n'.encode(),
        b"\xff\xfe\n",
        b"{}\n{}\n",
        b"{" + b" " * MAX_LINE + b"}\n",
    ],
)
def test_malformed_answers_are_bad_lines(line: bytes) -> None:
    assert verify(TOKEN, GROUP, HEAD, bytes(32), line).reason == "bad_line"


@pytest.mark.parametrize("token", [b"", b"x" * 31, "a" * 64, None])
def test_short_or_non_bytes_tokens_are_refused(token: object) -> None:
    with pytest.raises(GroupCredentialsError, match="token"):
        handshake.check_token(token)  # type: ignore[arg-type]
    with pytest.raises(GroupCredentialsError):
        handshake.mac(token, GROUP, HEAD, bytes(32))  # type: ignore[arg-type]


def test_a_32_byte_token_is_enough() -> None:
    assert handshake.check_token(bytearray(32)) == bytes(32)


@pytest.mark.parametrize("name", ["", "a|b", "a b", "tab\t", "ü", "x" * 129, None])
def test_names_that_would_make_the_layout_ambiguous_are_refused(name: object) -> None:
    with pytest.raises(GroupCredentialsError, match="name"):
        handshake.check_name("group", name)  # type: ignore[arg-type]
    with pytest.raises(GroupCredentialsError):
        handshake.mac_message(GROUP, name, bytes(32))  # type: ignore[arg-type]


def test_a_nonce_of_the_wrong_size_is_refused() -> None:
    with pytest.raises(GroupCredentialsError, match="nonce"):
        handshake.mac_message(GROUP, HEAD, bytes(16))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b"APIARY-RPC/2 " + b"00" * 32 + b"\n", "speaks"),
        (b"APIARY-RPC/1 1234\n", "malformed nonce"),
        (b"APIARY-RPC/1 " + b"00" * 32, "no valid challenge"),
        (b"SSH-2.0-OpenSSH_9.2\n", "speaks"),
        (b"\x16\x03\x01\x00\n", "no valid challenge"),
    ],
)
def test_the_head_refuses_a_bad_challenge(line: bytes, message: str) -> None:
    with pytest.raises(GroupLinkError, match=message):
        Challenge.parse(line)
    with pytest.raises(GroupLinkError):
        answer(TOKEN, GROUP, HEAD, line)


def test_the_head_reads_the_gates_verdict() -> None:
    handshake.read_reply(b"OK\n")
    with pytest.raises(GroupLinkRefused) as refused:
        handshake.read_reply(b"NO bad_mac\n")
    assert refused.value.reason == "bad_mac"
    assert "bad_mac" in str(refused.value)
    for line in (b"OK", b"NO\n", b"NO Bad Mac!\n", b"YES\n", b"NO " + b"x" * 40 + b"\n"):
        with pytest.raises(GroupLinkError):
            handshake.read_reply(line)


def test_refusal_lines_name_only_known_reasons() -> None:
    assert handshake.refusal_line("timeout") == b"NO timeout\n"
    with pytest.raises(ValueError, match="unknown"):
        handshake.refusal_line("because")


def test_line_buffer_joins_pieces_and_keeps_what_follows() -> None:
    buffer = LineBuffer()
    assert buffer.feed(b"APIARY") is None
    assert buffer.feed(b"-RPC/1 ab\nRPC BYTES") == b"APIARY-RPC/1 ab\n"
    assert buffer.rest == b"RPC BYTES"


def test_line_buffer_refuses_an_over_long_line_and_never_asks_for_more() -> None:
    buffer = LineBuffer()
    assert buffer.read_size == MAX_LINE
    assert buffer.feed(b"a" * (MAX_LINE - 10)) is None
    assert buffer.read_size == 10
    with pytest.raises(LineTooLong):
        buffer.feed(b"a" * 10)


def test_a_line_of_exactly_the_limit_is_read() -> None:
    buffer = LineBuffer()
    assert buffer.feed(b"a" * (MAX_LINE - 1) + b"\n") == b"a" * (MAX_LINE - 1) + b"\n"


def test_a_newline_past_the_limit_does_not_save_a_long_line() -> None:
    with pytest.raises(LineTooLong):
        LineBuffer().feed(b"a" * MAX_LINE + b"\n")
