"""Fake Lightning services on 127.0.0.1 for the payout tests: an LNURL-pay server and LNbits.

``FakeLnurlServer`` is a worker's wallet provider. It answers LUD-16
``GET /.well-known/lnurlp/<name>`` (and the same at ``/lnurlp/<name>``, for LNURLs) with a
``payRequest`` whose callback already has a query (``?src=fake``), and the LUD-06 callback
``GET /lnurlp/<name>/callback?src=fake&amount=<msat>[&comment=...]`` with a REAL BOLT11
invoice: signed by ``TEST_NODE_KEY``, for the requested amount, ``description_hash =
sha256(metadata)``, a fresh random preimage per invoice, on mainnet (``bc``). Controls:
``min_sendable`` / ``max_sendable`` / ``comment_allowed``, ``next_invoice(...)`` (a wrong
amount, a wrong description hash, an expired invoice, another network) and
``error_next(reason, at=...)`` (``{"status": "ERROR"}``). To play a hostile service:
``answer_next(raw, at=...)`` sends any bytes as the next answer (``pay_request_text`` builds a
payRequest with fields swapped for raw JSON text such as ``1e999`` or ``NaN``) and
``hang_next(at=...)`` never answers (until the server stops). ``issued`` records the invoices.

``FakeLnbits`` is the queen's LNbits wallet, shaped like LNbits 1.x (``legacy_api=True``: the
pre-1.0 shapes). ``POST /api/v1/payments`` (admin key, ``{"out": true, "bolt11"}``) decodes the
invoice, refuses a hash it already has (``520 "Payment already paid."`` and friends) and a
payment over the balance (``520 "Insufficient balance."``), settles invoices that its
``network`` (a ``FakeLnurlServer``) issued, with their real preimage, and answers ``201`` with
the payment. ``GET /api/v1/payments/<hash>`` reports it. Controls: ``fail_next_payment``,
``hold_next_payment`` (then ``settle`` / ``fail``), ``crash_next_payment`` (the payment is
made, then the connection is dropped or a 500 sent, optionally staying down), ``go_down`` /
``come_back`` (every request is dropped unanswered). ``sent`` lists every debit, so a test can
see that nothing was paid twice. ``network`` may be several LNURL servers (a tuple).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any, Literal
from urllib.parse import parse_qs, urlsplit

import bolt11
from bolt11 import Bolt11, MilliSatoshi, Tags
from coincurve import PrivateKey
from lnurl import url_encode

from tests.support.http_server import RequestLog, ServedFake, TrackedHTTPServer

__all__ = [
    "TEST_NODE_KEY",
    "TEST_NODE_PUBKEY",
    "FakeLnbits",
    "FakeLnurlServer",
    "FakePayment",
    "IssuedInvoice",
    "RecordedRequest",
    "make_invoice",
]

logger = logging.getLogger(__name__)

TEST_NODE_KEY = hashlib.sha256(b"apiary fake lightning node").hexdigest()
TEST_NODE_PUBKEY = PrivateKey.from_hex(TEST_NODE_KEY).public_key.format(compressed=True).hex()


def make_invoice(
    amount_msat: int,
    *,
    payment_hash: str,
    description_hash: str,
    currency: str = "bc",
    date: int | None = None,
    expiry_s: int = 600,
    node_key: str = TEST_NODE_KEY,
) -> str:
    """A real signed BOLT11 invoice (with a random payment secret)."""
    invoice = Bolt11(
        currency=currency,
        amount_msat=MilliSatoshi(amount_msat),
        date=int(time.time()) if date is None else date,
        tags=Tags.from_dict(
            {
                "payment_hash": payment_hash,
                "payment_secret": os.urandom(32).hex(),
                "description_hash": description_hash,
                "expire_time": expiry_s,
                "min_final_cltv_expiry": 80,
            }
        ),
    )
    return bolt11.encode(invoice, node_key)


@dataclass(frozen=True)
class RecordedRequest:
    """A request a fake received."""

    method: str
    path: str
    query: dict[str, list[str]]
    api_key: str | None
    body: Any


@dataclass
class _Reply:
    status: int = 200
    body: Any = None
    drop: bool = False  # hang up without answering
    raw: bytes | None = None  # sent as is instead of ``body`` as JSON
    hang: bool = False  # never answer (until the server stops)


# --- the HTTP plumbing both fakes share ------------------------------------------------------


class _FakeServer(ServedFake):
    """A ThreadingHTTPServer on 127.0.0.1 whose requests go to ``_route``."""

    name = "fake"
    poll_interval_s = 0.01

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.RLock()
        self._log: RequestLog[RecordedRequest] = RequestLog()
        self._stopping = threading.Event()

    def _before_stop(self) -> None:
        self._stopping.set()  # releases every hanging answer

    def _make_server(self) -> _Server:
        return _Server(self)

    @property
    def host(self) -> str:
        """``127.0.0.1:<port>``."""
        if self._server is None:
            raise RuntimeError(f"the {self.name} is not running")
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    @property
    def requests(self) -> list[RecordedRequest]:
        return self._log.items

    def count(self, method: str | None = None, contains: str = "") -> int:
        return self._log.count(method, contains)

    def _handle(self, request: RecordedRequest) -> _Reply:
        self._log.record(request)
        return self._route(request)

    def _route(self, request: RecordedRequest) -> _Reply:
        raise NotImplementedError


class _Server(TrackedHTTPServer):
    def __init__(self, fake: _FakeServer) -> None:
        self.fake = fake
        super().__init__(_Handler, fake.name)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    timeout = 30

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in two writes; without this, Nagle and delayed ACKs cost
        # each keep-alive answer ~40 ms.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug(f"{self.server.fake.name}: {format}", *args)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        parts = urlsplit(self.path)
        request = RecordedRequest(
            method=method,
            path=parts.path,
            query=parse_qs(parts.query, keep_blank_values=True),
            api_key=self.headers.get("X-Api-Key"),
            body=body,
        )
        reply = self.server.fake._handle(request)
        if reply.hang:
            self.server.fake._stopping.wait(timeout=60)
            reply = _Reply(drop=True)
        if reply.drop:
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
            return
        data = reply.raw if reply.raw is not None else json.dumps(reply.body).encode()
        self.send_response(reply.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


# --- LNURL-pay --------------------------------------------------------------------------------


@dataclass
class IssuedInvoice:
    """An invoice the fake LNURL server issued (``preimage`` is the payee's secret; "" when
    the invoice came from ``invoices_from``, whose wallet keeps it)."""

    name: str
    bolt11: str
    payment_hash: str
    preimage: str
    amount_msat: int
    comment: str | None
    paid: bool = False


@dataclass
class _Tweak:
    amount_delta_msat: int = 0
    description_hash: str | None = None
    expired: bool = False
    currency: str = "bc"
    expiry_s: int | None = None


class FakeLnurlServer(_FakeServer):
    """The fake LNURL-pay service; ``names`` are the users it knows."""

    name = "fake-lnurl"

    def __init__(
        self,
        names: tuple[str, ...] = ("alice", "bob"),
        *,
        min_sendable: int = 1_000,
        max_sendable: int = 1_000_000_000,
        comment_allowed: int = 0,
        node_key: str = TEST_NODE_KEY,
        invoices_from: Callable[[str, int], tuple[str, str]] | None = None,
    ) -> None:
        """``invoices_from(name, amount_msat) -> (bolt11, payment_hash)``: a real wallet's
        invoices instead of the server's own (``next_invoice``'s tweaks then do not apply)."""
        super().__init__()
        self.names = set(names)
        self.invoices_from = invoices_from
        self.min_sendable = min_sendable
        self.max_sendable = max_sendable
        self.comment_allowed = comment_allowed
        self.node_key = node_key
        self._tweaks: list[_Tweak] = []
        self._overrides: list[tuple[str, _Reply]] = []
        self._invoices: dict[str, IssuedInvoice] = {}

    # --- what to give a test -----------------------------------------------------------------

    def address(self, name: str = "alice") -> str:
        """The Lightning address ``name@127.0.0.1:<port>`` (parse it with
        ``insecure_hosts={"127.0.0.1"}``)."""
        return f"{name}@{self.host}"

    def lnurl(self, name: str = "alice") -> str:
        """An LNURL (bech32, upper case, made with the ``lnurl`` package) for ``name``."""
        return url_encode(f"{self.url}/lnurlp/{name}")

    def metadata(self, name: str) -> str:
        return json.dumps(
            [["text/plain", f"Apiary payout to {name}"], ["text/identifier", self.address(name)]]
        )

    # --- controls ----------------------------------------------------------------------------

    def next_invoice(
        self,
        *,
        amount_delta_msat: int = 0,
        description_hash: str | None = None,
        expired: bool = False,
        currency: str = "bc",
        expiry_s: int | None = None,
    ) -> None:
        """Make the next invoice wrong: off by ``amount_delta_msat``, with another description
        hash, already expired, for another network, or expiring in ``expiry_s``."""
        with self._lock:
            self._tweaks.append(
                _Tweak(amount_delta_msat, description_hash, expired, currency, expiry_s)
            )

    def error_next(
        self, reason: str, *, at: Literal["pay_request", "callback"] = "pay_request"
    ) -> None:
        """Answer the next request of that kind ``{"status": "ERROR", "reason": reason}``."""
        with self._lock:
            self._overrides.append((at, _Reply(200, {"status": "ERROR", "reason": reason})))

    def answer_next(
        self, raw: bytes | str, *, at: Literal["pay_request", "callback"] = "pay_request"
    ) -> None:
        """Answer the next request of that kind with ``raw`` (HTTP 200, JSON content type),
        whatever it is: malformed JSON, ``1e999``, ``NaN``."""
        data = raw.encode() if isinstance(raw, str) else raw
        with self._lock:
            self._overrides.append((at, _Reply(200, raw=data)))

    def hang_next(self, *, at: Literal["pay_request", "callback"] = "pay_request") -> None:
        """Never answer the next request of that kind (the connection stays open until the
        server stops)."""
        with self._lock:
            self._overrides.append((at, _Reply(hang=True)))

    def pay_request_text(self, name: str = "alice", **raw_fields: str) -> str:
        """The payRequest this server would send for ``name``, as JSON text, with each of
        ``raw_fields`` set to its value as RAW JSON text (``minSendable="1e999"``)."""
        body = self._pay_request_body(name)
        marks = {key: f"@@{key}@@" for key in raw_fields}
        text = json.dumps({**body, **marks})
        for key, value in raw_fields.items():
            text = text.replace(json.dumps(marks[key]), value)
        return text

    def settle(self, payment_hash: str) -> str | None:
        """Mark an issued invoice paid and return its preimage (None: not one of ours)."""
        with self._lock:
            invoice = self._invoices.get(payment_hash)
            if invoice is None:
                return None
            invoice.paid = True
            return invoice.preimage

    # --- inspection --------------------------------------------------------------------------

    @property
    def issued(self) -> list[IssuedInvoice]:
        with self._lock:
            return list(self._invoices.values())

    def invoice(self, payment_hash: str) -> IssuedInvoice:
        with self._lock:
            return self._invoices[payment_hash]

    # --- serving -----------------------------------------------------------------------------

    def _route(self, request: RecordedRequest) -> _Reply:
        if request.method != "GET":
            return _Reply(405, {"status": "ERROR", "reason": "method not allowed"})
        segments = [s for s in request.path.split("/") if s]
        if segments[:2] == [".well-known", "lnurlp"] and len(segments) == 3:
            return self._pay_request(segments[2])
        if segments[:1] == ["lnurlp"] and len(segments) == 2:
            return self._pay_request(segments[1])
        if segments[:1] == ["lnurlp"] and len(segments) == 3 and segments[2] == "callback":
            return self._callback(segments[1], request.query)
        return _Reply(404, {"status": "ERROR", "reason": "not found"})

    def _take_override(self, at: str) -> _Reply | None:
        with self._lock:
            for i, (where, reply) in enumerate(self._overrides):
                if where == at:
                    del self._overrides[i]
                    return reply
        return None

    def _pay_request(self, name: str) -> _Reply:
        if name not in self.names:
            return _Reply(404, {"status": "ERROR", "reason": f"no user {name}"})
        override = self._take_override("pay_request")
        if override is not None:
            return override
        return _Reply(200, self._pay_request_body(name))

    def _pay_request_body(self, name: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "tag": "payRequest",
            "callback": f"{self.url}/lnurlp/{name}/callback?src=fake",
            "minSendable": self.min_sendable,
            "maxSendable": self.max_sendable,
            "metadata": self.metadata(name),
        }
        if self.comment_allowed:
            body["commentAllowed"] = self.comment_allowed
        return body

    def _callback(self, name: str, query: dict[str, list[str]]) -> _Reply:
        if name not in self.names:
            return _Reply(404, {"status": "ERROR", "reason": f"no user {name}"})
        if query.get("src") != ["fake"]:
            return _Reply(400, {"status": "ERROR", "reason": "the callback's own query was lost"})
        override = self._take_override("callback")
        if override is not None:
            return override
        try:
            (amount_text,) = query["amount"]
            amount = int(amount_text)
        except (KeyError, ValueError):
            return _Reply(400, {"status": "ERROR", "reason": "amount missing or not a number"})
        if not self.min_sendable <= amount <= self.max_sendable:
            return _Reply(200, {"status": "ERROR", "reason": "amount out of range"})
        comment = query.get("comment", [None])[0]
        if comment is not None and len(comment) > self.comment_allowed:
            return _Reply(200, {"status": "ERROR", "reason": "comment too long"})
        if self.invoices_from is not None:
            pr, payment_hash = self.invoices_from(name, amount)
            with self._lock:
                self._invoices[payment_hash] = IssuedInvoice(name, pr, payment_hash, "", amount,
                                                             comment)
            return _Reply(200, {"pr": pr, "routes": []})
        with self._lock:
            tweak = self._tweaks.pop(0) if self._tweaks else _Tweak()
        preimage = os.urandom(32).hex()
        payment_hash = hashlib.sha256(bytes.fromhex(preimage)).hexdigest()
        now = int(time.time())
        pr = make_invoice(
            amount + tweak.amount_delta_msat,
            payment_hash=payment_hash,
            description_hash=tweak.description_hash
            or hashlib.sha256(self.metadata(name).encode()).hexdigest(),
            currency=tweak.currency,
            date=now - 7200 if tweak.expired else now,
            expiry_s=60 if tweak.expired else (tweak.expiry_s or 600),
            node_key=self.node_key,
        )
        with self._lock:
            self._invoices[payment_hash] = IssuedInvoice(
                name, pr, payment_hash, preimage, amount + tweak.amount_delta_msat, comment
            )
        return _Reply(200, {"pr": pr, "routes": []})


# --- LNbits -----------------------------------------------------------------------------------


@dataclass
class FakePayment:
    """An outgoing payment in the fake LNbits wallet."""

    payment_hash: str
    bolt11: str
    amount_msat: int
    fee_msat: int
    status: Literal["success", "pending", "failed"]
    preimage: str | None
    extra: dict[str, Any] = field(default_factory=dict)
    created: float = field(default_factory=time.time)

    def as_lnbits(self, wallet_id: str, *, legacy: bool) -> dict[str, Any]:
        """The payment object as LNbits 1.x (or, ``legacy``, before 1.0) renders it."""
        body: dict[str, Any] = {
            "checking_id": self.payment_hash,
            "payment_hash": self.payment_hash,
            "wallet_id": wallet_id,
            "amount": -self.amount_msat,
            "fee": -self.fee_msat,
            "bolt11": self.bolt11,
            "memo": "",
            "preimage": self.preimage or "0" * 64,
            "extra": self.extra,
            "time": int(self.created) if legacy else self.created,
        }
        if legacy:
            body["pending"] = self.status == "pending"
        else:
            body["status"] = self.status
        return body


@dataclass
class _Plan:
    kind: Literal["fail", "hold", "crash"]
    reason: str = ""
    crash_mode: Literal["drop", "500"] = "drop"
    stay_down: bool = False


class FakeLnbits(_FakeServer):
    """The fake LNbits wallet; pay with ``admin_key``. ``network`` settles invoices it issued."""

    name = "fake-lnbits"
    wallet_id = "fakewallet0001"

    def __init__(
        self,
        *,
        admin_key: str = "lnbits-admin-key",
        invoice_key: str = "lnbits-invoice-key",
        balance_msat: int = 100_000_000,
        fee_msat: int = 1_000,
        network: FakeLnurlServer | tuple[FakeLnurlServer, ...] | None = None,
        legacy_api: bool = False,
    ) -> None:
        super().__init__()
        self.admin_key = admin_key
        self.invoice_key = invoice_key
        self.balance_msat = balance_msat
        self.fee_msat = fee_msat
        self.network = network
        self._networks: tuple[FakeLnurlServer, ...] = (
            () if network is None else network if isinstance(network, tuple) else (network,)
        )
        self.legacy_api = legacy_api
        self._payments: dict[str, FakePayment] = {}
        self._plans: list[_Plan] = []
        self._sent: list[str] = []
        self._down = False

    # --- controls ----------------------------------------------------------------------------

    def fail_next_payment(self, reason: str = "no route found") -> None:
        """The next payment fails at the node: ``520 "Payment failed: <reason>"``."""
        with self._lock:
            self._plans.append(_Plan("fail", reason))

    def hold_next_payment(self) -> None:
        """The next payment stays pending (the sats are held) until ``settle`` or ``fail``."""
        with self._lock:
            self._plans.append(_Plan("hold"))

    def crash_next_payment(
        self, mode: Literal["drop", "500"] = "drop", *, stay_down: bool = False
    ) -> None:
        """The next payment goes through, then LNbits hangs up (``drop``) or answers ``500``
        instead of the result; with ``stay_down`` it then drops everything until
        ``come_back``."""
        with self._lock:
            self._plans.append(_Plan("crash", crash_mode=mode, stay_down=stay_down))

    def go_down(self) -> None:
        with self._lock:
            self._down = True

    def come_back(self) -> None:
        with self._lock:
            self._down = False

    def settle(self, payment_hash: str) -> None:
        """A held payment succeeds."""
        with self._lock:
            payment = self._payments[payment_hash]
            payment.status = "success"
            payment.preimage = self._settle_on_network(payment_hash)

    def fail(self, payment_hash: str) -> None:
        """A held payment fails; its sats come back."""
        with self._lock:
            payment = self._payments[payment_hash]
            payment.status = "failed"
            self.balance_msat += payment.amount_msat + payment.fee_msat

    # --- inspection --------------------------------------------------------------------------

    @property
    def payments(self) -> dict[str, FakePayment]:
        with self._lock:
            return dict(self._payments)

    @property
    def sent(self) -> list[str]:
        """The payment hash of every debit, in order (a hash twice means paid twice)."""
        with self._lock:
            return list(self._sent)

    # --- serving -----------------------------------------------------------------------------

    def _route(self, request: RecordedRequest) -> _Reply:
        with self._lock:
            if self._down:
                return _Reply(drop=True)
        segments = [s for s in request.path.split("/") if s]
        if segments[:3] != ["api", "v1", "payments"]:
            return _Reply(404, {"detail": "Not Found"})
        if request.method == "POST" and len(segments) == 3:
            return self._pay(request)
        if request.method == "GET" and len(segments) == 4:
            return self._lookup(segments[3], request.api_key)
        return _Reply(405, {"detail": "Method Not Allowed"})

    def _payment_error(self, message: str, status: str) -> _Reply:
        if self.legacy_api:
            return _Reply(520, {"detail": message})
        return _Reply(520, {"detail": message, "status": status})

    def _pay(self, request: RecordedRequest) -> _Reply:
        if request.api_key not in (self.admin_key, self.invoice_key):
            return _Reply(401, {"detail": "Invalid key."})
        body = request.body if isinstance(request.body, dict) else {}
        if body.get("out") is not True:
            return _Reply(400, {"detail": "the fake only pays (out: true)"})
        if request.api_key != self.admin_key:
            return _Reply(403, {"detail": "Invoice (or Admin) key required."})
        pr = body.get("bolt11")
        if not isinstance(pr, str) or not pr:
            return _Reply(400, {"detail": "Missing BOLT11 invoice"})
        try:
            invoice = bolt11.decode(pr)
        except Exception:
            return self._payment_error("Bolt11 decoding failed.", "failed")
        if not invoice.amount_msat:
            return self._payment_error("Amountless invoices not supported.", "failed")
        amount = int(invoice.amount_msat)
        with self._lock:
            old = self._payments.get(invoice.payment_hash)
            if old is not None:
                return self._payment_error(*_AGAIN[old.status])
            if self.balance_msat < amount:
                return self._payment_error("Insufficient balance.", "failed")
            if self.balance_msat < amount + self.fee_msat:
                return self._payment_error(
                    f"You must reserve at least ({round(self.fee_msat / 1000)}  sat) to cover "
                    "potential routing fees.",
                    "failed",
                )
            plan = self._plans.pop(0) if self._plans else None
            payment = FakePayment(
                payment_hash=invoice.payment_hash,
                bolt11=pr.lower(),
                amount_msat=amount,
                fee_msat=self.fee_msat,
                status="pending",
                preimage=None,
                extra=body.get("extra") if isinstance(body.get("extra"), dict) else {},
            )
            self._payments[payment.payment_hash] = payment
            return self._send(payment, invoice, plan)

    def _send(self, payment: FakePayment, invoice: bolt11.Bolt11, plan: _Plan | None) -> _Reply:
        """The node's part (the lock is held)."""
        if plan is not None and plan.kind == "fail":
            payment.status = "failed"
            return self._payment_error(f"Payment failed: {plan.reason}", "failed")
        if invoice.has_expired():
            payment.status = "failed"
            return self._payment_error("Payment failed: invoice expired", "failed")
        known = any(
            invoice.payment_hash in {i.payment_hash for i in server.issued}
            for server in self._networks
        )
        if self._networks and not known:
            payment.status = "failed"
            return self._payment_error("Payment failed: no route found", "failed")
        self.balance_msat -= payment.amount_msat + payment.fee_msat
        self._sent.append(payment.payment_hash)
        if plan is not None and plan.kind == "hold":
            return _Reply(201, self._created(payment))
        payment.status = "success"
        payment.preimage = self._settle_on_network(payment.payment_hash)
        if plan is not None and plan.kind == "crash":
            logger.debug("fake LNbits: paid %s, then crashing", payment.payment_hash)
            self._down = plan.stay_down
            if plan.crash_mode == "500":
                return _Reply(500, {"detail": "Internal Server Error"})
            return _Reply(drop=True)
        return _Reply(201, self._created(payment))

    def _settle_on_network(self, payment_hash: str) -> str | None:
        for server in self._networks:
            preimage = server.settle(payment_hash)
            if preimage is not None:
                return preimage
        return None

    def _created(self, payment: FakePayment) -> dict[str, Any]:
        if self.legacy_api:
            return {"payment_hash": payment.payment_hash, "checking_id": payment.payment_hash}
        return payment.as_lnbits(self.wallet_id, legacy=False)

    def _lookup(self, payment_hash: str, api_key: str | None) -> _Reply:
        with self._lock:
            payment = self._payments.get(payment_hash)
            if payment is None:
                return _Reply(404, {"detail": "Payment does not exist."})
            mine = api_key in (self.admin_key, self.invoice_key)
            details = payment.as_lnbits(self.wallet_id, legacy=self.legacy_api)
            body: dict[str, Any]
            if payment.status == "success":
                body = {"paid": True, "preimage": payment.preimage}
            elif payment.status == "failed":
                body = {"paid": False} if self.legacy_api else {"paid": False, "status": "failed"}
            else:
                body = {"paid": False, "preimage": None}
                if not self.legacy_api:
                    body["status"] = "pending"
            if mine:
                body["details"] = details
            return _Reply(200, body)


_AGAIN: dict[str, tuple[str, str]] = {
    "success": ("Payment already paid.", "success"),
    "pending": ("Payment is still pending.", "pending"),
    "failed": ("Payment is failed node, retrying is not possible.", "failed"),
}
