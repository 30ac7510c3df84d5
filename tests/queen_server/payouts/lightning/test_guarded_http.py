"""The SSRF guard: worker-supplied hosts resolving inside are refused before a byte is sent,
and every connection goes to the very address that was checked. Real sockets on 127.0.0.1 play
the services inside; an injected resolver plays DNS."""

from __future__ import annotations

import socket
from collections.abc import Sequence

import httpcore
import pytest
from lnurl import url_encode

from queen_server.payouts.lightning import (
    LnurlError,
    fetch_invoice,
    guarded_client,
    parse_payout_address,
)
from queen_server.payouts.lightning.guarded_http import (
    AddressRefused,
    GuardedNetworkBackend,
    address_problem,
)
from tests.queen_server.payouts.lightning.conftest import LOCAL
from tests.support.fake_lightning import FakeLnurlServer


class FakeDns:
    """A resolver with fixed answers; each answer list is used in turn, the last one stays."""

    def __init__(self, **answers: list[str] | list[list[str]]) -> None:
        self.answers = {host.replace("_", "."): value for host, value in answers.items()}
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> Sequence[str]:
        self.asked.append((host, port))
        answer = self.answers.get(host)
        if answer is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        if answer and isinstance(answer[0], list):
            return answer.pop(0) if len(answer) > 1 else answer[0]
        return answer  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("127.0.0.1", "loopback"),
        ("127.8.9.10", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),
        ("10.0.0.5", "private"),
        ("172.16.3.4", "private"),
        ("192.168.1.1", "private"),
        ("fd00::1", "private"),
        ("100.64.0.1", "private"),
        ("169.254.169.254", "link-local"),
        ("fe80::1%eth0", "link-local"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("240.0.0.1", "reserved"),
        ("not an address", "unparseable"),
    ],
)
def test_inside_addresses_are_refused(address: str, kind: str) -> None:
    assert address_problem(address) == kind


@pytest.mark.parametrize("address", ["93.184.215.14", "1.1.1.1", "2606:4700:4700::1111"])
def test_public_addresses_pass(address: str) -> None:
    assert address_problem(address) is None


async def test_a_name_resolving_to_loopback_is_refused_before_connecting(
    lnurl_server: FakeLnurlServer,
) -> None:
    """The LNURL names a public-looking host whose DNS answer is 127.0.0.1, where a service
    really listens: the queen never connects, and the reason shows neither address nor port."""
    port = lnurl_server.host.rsplit(":", 1)[1]
    address = parse_payout_address(url_encode(f"https://evil.example.com:{port}/lnurlp/alice"))
    assert address is not None
    dns = FakeDns(evil_example_com=["127.0.0.1"])
    async with guarded_client(resolver=dns) as client:
        with pytest.raises(LnurlError) as caught:
            await fetch_invoice(address, 10_000, client)
    assert caught.value.code == "private_address"
    assert "loopback address, so it was refused" in caught.value.message
    assert "127.0.0.1" not in caught.value.message
    assert port not in caught.value.message
    assert dns.asked == [("evil.example.com", int(port))]
    assert lnurl_server.requests == []


async def test_one_private_answer_among_public_ones_is_enough_to_refuse() -> None:
    dns = FakeDns(mixed_example_com=["93.184.215.14", "10.0.0.5"])
    address = parse_payout_address("alice@mixed.example.com")
    assert address is not None
    async with guarded_client(resolver=dns) as client:
        with pytest.raises(LnurlError) as caught:
            await fetch_invoice(address, 10_000, client)
    assert caught.value.code == "private_address"
    assert "10.0.0.5" not in caught.value.message


async def test_a_callback_pointing_inside_is_refused(lnurl_server: FakeLnurlServer) -> None:
    """An honest-looking service (allowed here on 127.0.0.1) sends a callback whose host
    resolves to the private network: the callback is never called."""
    lnurl_server.answer_next(lnurl_server.pay_request_text(
        "alice", callback='"https://billing.internal.example.com/cb"'))
    dns = FakeDns(**{"127.0.0.1": ["127.0.0.1"]}, billing_internal_example_com=["10.1.2.3"])
    address = parse_payout_address(lnurl_server.address("alice"), insecure_hosts=LOCAL)
    assert address is not None
    async with guarded_client(allowed_hosts=LOCAL, resolver=dns) as client:
        with pytest.raises(LnurlError) as caught:
            await fetch_invoice(address, 10_000, client)
    assert caught.value.code == "private_address"
    assert caught.value.message.startswith("the LNURL-pay callback ")
    assert [host for host, _ in dns.asked] == ["127.0.0.1", "billing.internal.example.com"]
    assert lnurl_server.count(contains="/callback") == 0


async def test_an_allowed_host_is_still_resolved_by_the_resolver_and_pinned(
    lnurl_server: FakeLnurlServer,
) -> None:
    """``pay.test`` exists only in the injected resolver: the request can only have reached the
    fake through the address the resolver gave."""
    port = int(lnurl_server.host.rsplit(":", 1)[1])
    dns = FakeDns(pay_test=["127.0.0.1"])
    async with guarded_client(allowed_hosts={"pay.test"}, resolver=dns) as client:
        response = await client.get(f"http://pay.test:{port}/.well-known/lnurlp/alice")
    assert response.status_code == 200
    assert response.json()["tag"] == "payRequest"
    assert dns.asked == [("pay.test", port)]
    assert lnurl_server.count(contains="/.well-known/lnurlp/alice") == 1


class RecordingBackend(httpcore.AsyncNetworkBackend):
    """Where the guard opens its sockets (it opens none)."""

    def __init__(self) -> None:
        self.connects: list[tuple[str, int]] = []

    async def connect_tcp(self, host, port, timeout=None, local_address=None,  # noqa: ASYNC109
                          socket_options=None):
        self.connects.append((host, port))
        raise httpcore.ConnectError("recorded")


async def test_dns_rebinding_changes_nothing() -> None:
    """The name answers a public address, then 127.0.0.1: the first connection goes to the
    public address it checked (never to the name again), the second is refused."""
    dns = FakeDns(rebind_example_com=[["93.184.215.14"], ["127.0.0.1"]])
    inner = RecordingBackend()
    guard = GuardedNetworkBackend(resolver=dns, inner=inner)
    with pytest.raises(httpcore.ConnectError, match="recorded"):
        await guard.connect_tcp("rebind.example.com", 443)
    assert inner.connects == [("93.184.215.14", 443)]
    with pytest.raises(AddressRefused) as caught:
        await guard.connect_tcp("rebind.example.com", 443)
    assert caught.value.kind == "loopback"
    assert inner.connects == [("93.184.215.14", 443)]
    assert len(dns.asked) == 2


async def test_a_name_that_does_not_resolve_is_unreachable() -> None:
    address = parse_payout_address("alice@nowhere.example.com")
    assert address is not None
    async with guarded_client(resolver=FakeDns()) as client:
        with pytest.raises(LnurlError) as caught:
            await fetch_invoice(address, 10_000, client)
    assert caught.value.code == "unreachable"


async def test_unreachable_says_nothing_of_the_socket_error() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    address = parse_payout_address(f"alice@127.0.0.1:{port}", insecure_hosts=LOCAL)
    assert address is not None
    async with guarded_client(allowed_hosts=LOCAL) as client:
        with pytest.raises(LnurlError) as caught:
            await fetch_invoice(address, 10_000, client)
    assert caught.value.code == "unreachable"
    assert "refused" not in caught.value.message.lower()
    assert "errno" not in caught.value.message.lower()
