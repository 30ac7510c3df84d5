"""Worker identity: Ed25519 challenge verification and the short public id shown on pages."""

from __future__ import annotations

import base64
import hashlib
import secrets

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from queen_server.errors import HandshakeRefused
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
