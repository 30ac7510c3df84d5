"""Worker identity: Ed25519 challenge verification and the short public id shown on pages.

``HelloGate`` hands these checks, and the payout-address rules, to the swarm's link machine
(``swarm.link.Gate``), which imports neither cryptography nor the Lightning code itself.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
from collections.abc import Collection

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from queen_server.errors import HandshakeRefused
from queen_server.payouts.lightning import InvalidPayoutAddress, parse_payout_address
from shared_schema import Hello, hello_signing_payload
from shared_schema.protocol import is_small_order_key


def new_nonce() -> str:
    return secrets.token_hex(32)


def verify_hello(hello: Hello, nonce: str) -> None:
    """Check that the hello is signed by its own key over this session's nonce."""
    try:
        key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(hello.pubkey))
        key.verify(
            bytes.fromhex(hello.signature),
            hello_signing_payload(nonce, hello.pubkey, hello.ln_url),
        )
    except (InvalidSignature, ValueError) as exc:
        raise HandshakeRefused("bad_signature", "the hello's signature does not verify") from exc


def verify_signature(pubkey: str, signature: str, payload: bytes) -> bool:
    """Whether ``signature`` is the key's over ``payload``. Small-order keys never verify:
    OpenSSL accepts forged signatures under them."""
    try:
        if is_small_order_key(pubkey):
            return False
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(pubkey)).verify(
            bytes.fromhex(signature), payload)
    except (InvalidSignature, ValueError):
        return False
    return True


def public_id(pubkey: str) -> str:
    """A short, stable, non-secret id for a worker key (12 base32 characters)."""
    digest = hashlib.sha256(bytes.fromhex(pubkey)).digest()
    return base64.b32encode(digest).decode("ascii")[:12].lower()


class HelloGate:
    """The checks of a worker's hello that the link machine cannot make itself: its signature,
    its public id, and its payout address (``insecure_hosts`` as in ``QueenSettings``)."""

    def __init__(self, insecure_hosts: Collection[str] = ()) -> None:
        self.insecure_hosts = insecure_hosts

    def hello_signed(self, hello: Hello, nonce: str) -> bool:
        try:
            verify_hello(hello, nonce)
        except HandshakeRefused:
            return False
        return True

    def public_id(self, pubkey: str) -> str:
        return public_id(pubkey)

    def payout_problem(self, ln_url: str | None) -> str | None:
        try:
            parse_payout_address(ln_url, insecure_hosts=self.insecure_hosts)
        except InvalidPayoutAddress as exc:
            return exc.message
        return None
