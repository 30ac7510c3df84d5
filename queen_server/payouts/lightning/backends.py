"""Backends that send the sats: ``LnbitsBackend`` (an LNbits wallet's admin key) and
``NoneBackend`` (the default: nothing moves; an operator settles by hand).

The LNbits REST API used (checked against LNbits 1.x ``core/views/payment_api.py``,
``core/services/payments.py`` and ``exceptions.py``):

* ``POST {base}/api/v1/payments`` with ``X-Api-Key: <admin key>`` and
  ``{"out": true, "bolt11": ..., "extra": {...}}``. 1.x answers ``201`` with the payment
  (``payment_hash``, ``checking_id``, ``status`` ``success|pending|failed``, ``preimage``,
  ``fee`` in msat, negative for outgoing); before 1.0 it answered ``201 {"payment_hash",
  "checking_id"}`` once the payment was done. A payment refused or failed is ``520
  {"detail": ..., "status": "failed|pending|success"}``: ``"Insufficient balance."``,
  ``"Payment failed: ..."``, ``"Payment already paid."`` (status ``success``),
  ``"Payment is still pending."`` (status ``pending``). Other errors are ``4xx/5xx
  {"detail": ...}``.
* ``GET {base}/api/v1/payments/{payment_hash}`` (same key): ``{"paid": bool, "preimage",
  "status"?, "details": {payment}}``; ``404 {"detail": "Payment does not exist."}`` if this
  wallet never sent it. Old versions put ``"pending": bool`` in ``details`` instead of
  ``status``.

LNbits itself never pays one payment hash twice; on top of that ``pay`` looks the hash up
first, and after an ambiguous answer (a dropped connection, a 5xx without a status) it looks
again instead of posting again.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Protocol, runtime_checkable

import httpx

from queen_server.payouts.lightning.models import Invoice, PaymentResult, PaymentStatus

__all__ = ["LightningBackend", "LnbitsBackend", "NoneBackend"]

logger = logging.getLogger(__name__)

_ZERO_PREIMAGE = "0" * 64
_REFUSALS = (
    "Insufficient balance",
    "You must reserve at least",
    "Amountless invoices not supported",
    "Bolt11 decoding failed",
    "Invoice amount",
)
_STATUSES: dict[str, PaymentStatus] = {"success": "paid", "pending": "pending", "failed": "failed"}


@runtime_checkable
class LightningBackend(Protocol):
    """Pays invoices and reports on payments; see ``PaymentResult`` for what each status
    allows the caller to do next."""

    async def pay(self, invoice: Invoice, *, idempotency_key: str) -> PaymentResult:
        """Pay ``invoice`` at most once; ``idempotency_key`` names the payout (for the logs
        and the backend's records)."""
        ...

    async def status(self, payment_hash: str) -> PaymentResult:
        """What the backend knows of the payment of ``payment_hash`` (reconciliation)."""
        ...


class NoneBackend:
    """No Lightning backend: every payout stays pending for a human to settle."""

    async def pay(self, invoice: Invoice, *, idempotency_key: str) -> PaymentResult:
        logger.info(
            "payout %s (%d msat, hash %s) left for manual settlement",
            idempotency_key,
            invoice.amount_msat,
            invoice.payment_hash,
        )
        return PaymentResult(
            status="pending",
            payment_hash=invoice.payment_hash,
            detail="manual payout: settle by hand",
        )

    async def status(self, payment_hash: str) -> PaymentResult:
        return PaymentResult(
            status="unknown",
            payment_hash=payment_hash,
            detail="manual payout: no Lightning backend to ask",
        )


class _Lookup:
    """One look-up: ``result``, and ``found`` (False: LNbits answered 404)."""

    __slots__ = ("found", "result")

    def __init__(self, result: PaymentResult, *, found: bool) -> None:
        self.result = result
        self.found = found


class LnbitsBackend:
    """Pays from one LNbits wallet; ``admin_key`` is that wallet's admin key."""

    def __init__(self, base_url: str, admin_key: str, client: httpx.AsyncClient) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"X-Api-Key": admin_key, "Accept": "application/json"}
        self._client = client

    async def pay(self, invoice: Invoice, *, idempotency_key: str) -> PaymentResult:
        payment_hash = invoice.payment_hash
        before = await self._lookup(payment_hash)
        if before.found:
            logger.info(
                "payout %s: LNbits already has payment %s (%s); not paying again",
                idempotency_key,
                payment_hash,
                before.result.status,
            )
            return before.result
        if before.result.status == "unknown":
            return before.result  # LNbits unreachable: nothing was sent.
        logger.info(
            "payout %s: paying %d msat, hash %s", idempotency_key, invoice.amount_msat, payment_hash
        )
        body = {"out": True, "bolt11": invoice.bolt11, "extra": {"apiary_payout": idempotency_key}}
        try:
            response = await self._client.post(
                f"{self.base_url}/api/v1/payments", headers=self._headers, json=body
            )
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            return PaymentResult(
                status="failed", payment_hash=payment_hash, detail=f"LNbits unreachable: {exc!r}"
            )
        except httpx.HTTPError as exc:
            logger.warning(
                "payout %s: no answer to the payment (%r); checking", idempotency_key, exc
            )
            return await self._reconcile(payment_hash, f"no answer from LNbits ({exc!r})")
        return await self._pay_answer(response, payment_hash, idempotency_key)

    async def status(self, payment_hash: str) -> PaymentResult:
        return (await self._lookup(payment_hash)).result

    # --- internals ---------------------------------------------------------------------------

    async def _pay_answer(
        self, response: httpx.Response, payment_hash: str, idempotency_key: str
    ) -> PaymentResult:
        data = _json_object(response)
        if response.is_success:
            if data.get("payment_hash") not in (None, payment_hash):
                logger.error(
                    "payout %s: LNbits answered for hash %s, not %s",
                    idempotency_key,
                    data.get("payment_hash"),
                    payment_hash,
                )
            state = _state(data)
            if state is None:  # LNbits < 1.0: only the hashes; ask for the outcome.
                return await self._reconcile(payment_hash, "LNbits did not say the outcome")
            return _result(payment_hash, state, data, detail=f"LNbits: {state}")
        detail = str(data.get("detail") or f"HTTP {response.status_code}")[:500]
        state = data.get("status")
        if state == "success":  # "Payment already paid."
            looked = await self._lookup(payment_hash)
            if looked.result.status == "paid":
                return looked.result
            return PaymentResult(status="paid", payment_hash=payment_hash, detail=detail)
        if state == "pending":
            return PaymentResult(status="pending", payment_hash=payment_hash, detail=detail)
        if state == "failed" or 400 <= response.status_code < 500 or _refusal(detail):
            logger.warning("payout %s: LNbits refused: %s", idempotency_key, detail)
            return PaymentResult(status="failed", payment_hash=payment_hash, detail=detail)
        logger.warning("payout %s: LNbits answered %s; checking", idempotency_key, detail)
        return await self._reconcile(payment_hash, f"LNbits answered {detail}")

    async def _reconcile(self, payment_hash: str, why: str) -> PaymentResult:
        """After an ambiguous answer: LNbits' record decides; no record means ``unknown`` (the
        payment may still be on its way in), never ``failed``."""
        looked = await self._lookup(payment_hash)
        if looked.found or looked.result.status == "paid":
            return looked.result
        return PaymentResult(
            status="unknown",
            payment_hash=payment_hash,
            detail=f"{why}; {looked.result.detail}",
        )

    async def _lookup(self, payment_hash: str) -> _Lookup:
        try:
            response = await self._client.get(
                f"{self.base_url}/api/v1/payments/{payment_hash}", headers=self._headers
            )
        except httpx.HTTPError as exc:
            return _Lookup(
                PaymentResult(
                    status="unknown",
                    payment_hash=payment_hash,
                    detail=f"could not ask LNbits: {exc!r}",
                ),
                found=False,
            )
        data = _json_object(response)
        if response.status_code == 404 and data.get("detail") != "Not Found":
            # LNbits: "Payment does not exist." (FastAPI's bare "Not Found" is a wrong URL.)
            return _Lookup(
                PaymentResult(
                    status="failed",
                    payment_hash=payment_hash,
                    detail="LNbits has no payment with this hash (it was never sent)",
                ),
                found=False,
            )
        if not response.is_success:
            detail = str(data.get("detail") or "")[:300]
            return _Lookup(
                PaymentResult(
                    status="unknown",
                    payment_hash=payment_hash,
                    detail=f"LNbits answered HTTP {response.status_code} {detail}".strip(),
                ),
                found=False,
            )
        details = data.get("details") if isinstance(data.get("details"), dict) else {}
        if data.get("paid") is True:
            state = "success"
        else:
            state = _state(details) or _state(data)
            if state is None and details.get("pending") is False:
                state = "failed"  # LNbits < 1.0: not paid and no longer pending.
        return _Lookup(
            _result(payment_hash, state or "pending", {**details, **_preimage_only(data)}),
            found=True,
        )


def _refusal(detail: str) -> bool:
    """LNbits' messages for a payment refused before anything was sent (old versions send no
    ``status`` with them)."""
    return detail.startswith(_REFUSALS)


def _json_object(response: httpx.Response) -> dict[str, Any]:
    try:
        data = response.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _state(data: dict[str, Any]) -> str | None:
    state = data.get("status")
    return state if state in ("success", "pending", "failed") else None


def _preimage_only(data: dict[str, Any]) -> dict[str, Any]:
    return {"preimage": data["preimage"]} if data.get("preimage") else {}


def _result(
    payment_hash: str, state: str, data: dict[str, Any], *, detail: str | None = None
) -> PaymentResult:
    """A ``PaymentResult`` from an LNbits payment state and payment object."""
    status = _STATUSES[state]
    preimage = _verified_preimage(data.get("preimage"), payment_hash) if status == "paid" else None
    fee = data.get("fee")
    fee_msat = abs(fee) if isinstance(fee, int) and not isinstance(fee, bool) else None
    return PaymentResult(
        status=status,
        payment_hash=payment_hash,
        preimage=preimage,
        fee_msat=fee_msat,
        detail=detail or f"LNbits: {state}",
    )


def _verified_preimage(preimage: Any, payment_hash: str) -> str | None:
    """The preimage if it is the proof of payment (it hashes to ``payment_hash``)."""
    if not isinstance(preimage, str) or preimage == _ZERO_PREIMAGE:
        return None
    try:
        digest = hashlib.sha256(bytes.fromhex(preimage)).hexdigest()
    except ValueError:
        digest = ""
    if digest != payment_hash.lower():
        logger.warning("LNbits gave a preimage that does not match payment %s", payment_hash)
        return None
    return preimage.lower()
