"""The direct route's TLS (issue 19): a throwaway self-signed certificate on the gate, pinned by
the head to the fingerprint the queen handed over."""

from __future__ import annotations

import asyncio
import datetime
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from desktop_worker.errors import GroupCredentialsError, GroupLinkError, TlsPinMismatch
from desktop_worker.groups import tls
from desktop_worker.groups.dialer import HeadDialer
from desktop_worker.groups.gate import LinkStats, MemberGate
from desktop_worker.groups.tls import SelfSignedIdentity
from tests.desktop_worker.groups.gate_fakes import (
    REPLY_PREFIX,
    FakeRpcServer,
    exchange,
    frame,
    read_to_end,
)

TOKEN = b"k" * 48
GROUP = "grp-tls"
HEAD = "w_head"


@pytest.fixture(scope="module")
def identity() -> SelfSignedIdentity:
    return SelfSignedIdentity.generate()


@pytest.fixture
async def gate(rpc: FakeRpcServer, identity: SelfSignedIdentity) -> AsyncIterator[MemberGate]:
    member_gate = MemberGate(GROUP, HEAD, TOKEN, rpc.port, ssl=identity.server_context())
    await member_gate.start()
    yield member_gate
    await member_gate.stop()


def dialer_for(gate: MemberGate, fingerprint: str | None, **options: float) -> HeadDialer:
    host, port = gate.address
    return HeadDialer(GROUP, HEAD, TOKEN, host, port, tls_fingerprint=fingerprint, **options)


async def test_bytes_round_trip_over_pinned_tls(
    rpc: FakeRpcServer, gate: MemberGate, identity: SelfSignedIdentity
) -> None:
    dialer = dialer_for(gate, identity.fingerprint)
    await dialer.start()
    try:
        host, port = dialer.endpoint.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        payloads = [bytes([i]) * (1000 * i + 3) for i in range(10)]
        for payload in payloads:
            assert await exchange(reader, writer, payload) == REPLY_PREFIX + payload
        expected = LinkStats(
            connections=1,
            bytes_to_member=sum(4 + len(p) for p in payloads),
            bytes_to_head=sum(4 + len(REPLY_PREFIX) + len(p) for p in payloads),
            round_trips=10,
        )
        assert gate.stats() == expected
        assert dialer.stats() == expected
        writer.close()
        await writer.wait_closed()
        await rpc.wait_closed(1)
    finally:
        await dialer.stop()


async def test_a_fingerprint_written_with_colons_and_capitals_is_the_same_pin(
    gate: MemberGate, identity: SelfSignedIdentity
) -> None:
    spelled = ":".join(identity.fingerprint[i : i + 2] for i in range(0, 64, 2)).upper()
    await dialer_for(gate, spelled).check()


async def test_a_wrong_pin_is_refused_before_any_byte_reaches_the_rpc_side(
    rpc: FakeRpcServer, gate: MemberGate, identity: SelfSignedIdentity
) -> None:
    impostor = SelfSignedIdentity.generate()
    assert impostor.fingerprint != identity.fingerprint
    dialer = dialer_for(gate, impostor.fingerprint)
    await dialer.start()
    try:
        host, port = dialer.endpoint.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(frame(b"graph compute"))
        assert await read_to_end(reader) == b""
        assert dialer.last_error is not None
        assert "not the" in dialer.last_error
        assert rpc.accepts == 0
        assert rpc.received == b""
        writer.close()
        await writer.wait_closed()
        with pytest.raises(TlsPinMismatch, match="refusing to connect"):
            await dialer.check()
        assert rpc.accepts == 0
    finally:
        await dialer.stop()


async def test_a_plain_dialer_cannot_talk_to_a_tls_gate(
    rpc: FakeRpcServer, gate: MemberGate
) -> None:
    with pytest.raises(GroupLinkError, match="handshake"):
        await dialer_for(gate, None, connect_timeout_s=0.5).check()
    assert rpc.accepts == 0


async def test_a_pinned_dialer_refuses_a_plain_gate(rpc: FakeRpcServer) -> None:
    plain = MemberGate(GROUP, HEAD, TOKEN, rpc.port)
    await plain.start()
    try:
        with pytest.raises(GroupLinkError):
            await dialer_for(plain, "ab" * 32, connect_timeout_s=1.0).check()
        assert rpc.accepts == 0
    finally:
        await plain.stop()


def test_the_certificate_is_ec_p256_short_lived_and_fingerprinted(
    identity: SelfSignedIdentity,
) -> None:
    cert = x509.load_pem_x509_certificate(identity.cert_pem)
    key = cert.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey)
    assert key.curve.name == "secp256r1"
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert lifetime <= datetime.timedelta(days=3)
    from cryptography.hazmat.primitives.serialization import Encoding

    assert identity.fingerprint == tls.fingerprint_of(cert.public_bytes(Encoding.DER))


def test_loading_the_context_leaves_no_file_behind(identity: SelfSignedIdentity) -> None:
    def ours() -> set[Path]:
        return set(Path(tempfile.gettempdir()).glob("apiary-gate-tls-*"))

    before = ours()
    identity.server_context()
    assert ours() == before


@pytest.mark.parametrize("text", ["", "abc", "zz" * 32, "ab" * 31, None])
def test_bad_fingerprints_are_refused(text: object) -> None:
    with pytest.raises(GroupCredentialsError, match="fingerprint"):
        tls.normalize_fingerprint(text)  # type: ignore[arg-type]
    if text is not None:  # None is the plain route
        with pytest.raises(GroupCredentialsError):
            HeadDialer(GROUP, HEAD, TOKEN, "127.0.0.1", 1, tls_fingerprint=text)  # type: ignore[arg-type]


def test_no_certificate_is_a_pin_mismatch() -> None:
    with pytest.raises(TlsPinMismatch, match="no TLS certificate"):
        tls.check_pin(None, "ab" * 32)


async def test_a_client_that_never_starts_tls_is_dropped_at_the_handshake_deadline(
    rpc: FakeRpcServer, identity: SelfSignedIdentity
) -> None:
    gate = MemberGate(GROUP, HEAD, TOKEN, rpc.port, ssl=identity.server_context(),
                      handshake_timeout_s=0.3)
    await gate.start()
    try:
        reader, writer = await asyncio.open_connection(*gate.address)
        assert await read_to_end(reader, timeout_s=5.0) == b""
        assert rpc.accepts == 0
        writer.close()
        await writer.wait_closed()
    finally:
        await gate.stop()
