"""Keys and worker identities for end-to-end tests against a queen process: an API key made
and funded through the admin API (``/admin/keys``) with an openai client on it, a key's
available balance as the admin API reports it, and a worker key file made ahead (so that the
queen can be told to trust it before the worker starts)."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)


def funded_client(port: int, sats: int = 5000, *, admin_token: str, name: str = "dev",
                  timeout_s: float = 60) -> tuple[openai.OpenAI, int]:
    """A new API key credited ``sats``, and an openai client using it (no retries)."""
    admin = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10,
                         headers={"Authorization": f"Bearer {admin_token}"})
    made = admin.post("/admin/keys", json={"name": name, "credit_sats": sats})
    assert made.status_code == 201, made.text
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=made.json()["key"],
                           max_retries=0, timeout=timeout_s)
    return client, made.json()["id"]


def key_available_msat(port: int, key_id: int, *, admin_token: str) -> int:
    keys = httpx.get(f"http://127.0.0.1:{port}/admin/keys", timeout=10,
                     headers={"Authorization": f"Bearer {admin_token}"}).json()
    return next(k for k in keys if k["id"] == key_id)["available_msat"]


def worker_key(path: Path) -> str:
    """A worker key file made ahead, so the queen can be told to trust it; its public key."""
    key = Ed25519PrivateKey.generate()
    path.write_bytes(key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
    path.chmod(0o600)
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
