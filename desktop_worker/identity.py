"""The worker's Ed25519 identity: created on first run, kept in the config dir with mode 0600.

The public key is who the worker is to the queen, and its earnings belong to it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
    load_pem_private_key,
)

from desktop_worker.errors import WorkerError
from shared_schema import hello_signing_payload

log = logging.getLogger(__name__)


class IdentityError(WorkerError):
    pass


class WorkerIdentity:
    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self.pubkey = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()

    @classmethod
    def load_or_create(cls, path: Path) -> WorkerIdentity:
        if path.exists():
            try:
                key = load_pem_private_key(path.read_bytes(), password=None)
            except (ValueError, TypeError) as exc:
                raise IdentityError(f"the worker key at {path} is unreadable: {exc}") from exc
            if not isinstance(key, Ed25519PrivateKey):
                raise IdentityError(f"the worker key at {path} is not an Ed25519 key")
            if os.name == "posix" and path.stat().st_mode & 0o077:
                log.warning("the worker key %s is readable by others; fixing its mode to 0600",
                            path)
                path.chmod(0o600)
            return cls(key)
        key = Ed25519PrivateKey.generate()
        path.parent.mkdir(parents=True, exist_ok=True)
        pem = key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(pem)
        log.info("created a new worker identity at %s", path)
        return cls(key)

    def sign(self, payload: bytes) -> str:
        return self._key.sign(payload).hex()

    def sign_hello(self, nonce: str, ln_url: str | None) -> str:
        return self.sign(hello_signing_payload(nonce, self.pubkey, ln_url))
