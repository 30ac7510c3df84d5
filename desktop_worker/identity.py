"""The worker's Ed25519 identity: created on first run, kept in the OS keyring or in a 0600 file.

The public key is who the worker is to the queen, and its earnings belong to it, so the key is
never thrown away:

* ``key_store="file"``: the PEM file at ``key_path`` (mode 0600), as headless workers always had.
* ``key_store="keyring"``: the PEM in the OS keyring (service ``apiary-worker``, username
  ``worker-key``). A keyring that does not work is an ``IdentityError``.
* ``key_store="auto"`` (the app's default): the keyring when one works, else the file, with a
  warning that says why. A keyring "works" when it is not keyring's ``fail`` or ``null`` backend
  and what we wrote reads back the same.

An existing key file is migrated into a working keyring (written, then read back) and then kept
as it is: deleting a user's key is never ours to do.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Literal

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

KEYRING_SERVICE = "apiary-worker"
KEYRING_USERNAME = "worker-key"

KeyStore = Literal["auto", "keyring", "file"]


class IdentityError(WorkerError):
    pass


class KeyringUnavailable(IdentityError):
    """The OS keyring cannot hold the key (no backend, locked, refused, or it lost the write)."""


class WorkerIdentity:
    def __init__(self, key: Ed25519PrivateKey, *, source: str = "memory") -> None:
        self._key = key
        self.pubkey = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
        #: Where the key lives, for the owner: "keyring" or the file's path.
        self.source = source

    @classmethod
    def load_or_create(cls, path: Path, *, key_store: KeyStore = "file") -> WorkerIdentity:
        """The worker's key from ``key_store`` (see the module docstring), made on first run."""
        if key_store == "file":
            return cls._from_file(path)
        if key_store not in ("auto", "keyring"):
            raise IdentityError(f"unknown key store {key_store!r}: use auto, keyring or file")
        try:
            return cls._from_keyring(path)
        except KeyringUnavailable as exc:
            if key_store == "keyring":
                raise
            log.warning("the OS keyring cannot hold the worker key (%s); keeping it in the "
                        "file %s (mode 0600) instead", exc, path)
            return cls._from_file(path)

    @classmethod
    def _from_file(cls, path: Path) -> WorkerIdentity:
        if path.exists():
            key = _parse_pem(path.read_bytes(), f"the worker key at {path}")
            if os.name == "posix" and path.stat().st_mode & 0o077:
                log.warning("the worker key %s is readable by others; fixing its mode to 0600",
                            path)
                path.chmod(0o600)
            return cls(key, source=str(path))
        key = Ed25519PrivateKey.generate()
        _write_key_file(path, _pem(key))
        log.info("created a new worker identity at %s", path)
        return cls(key, source=str(path))

    @classmethod
    def _from_keyring(cls, path: Path) -> WorkerIdentity:
        store = _Keyring()
        stored = store.get()
        if stored is not None:
            key = _parse_pem(stored.encode(), "the worker key in the OS keyring")
            identity = cls(key, source="keyring")
            _warn_if_file_differs(path, identity.pubkey)
            return identity
        if path.exists():
            pem = path.read_bytes()
            key = _parse_pem(pem, f"the worker key at {path}")
            store.put(pem.decode())
            log.info("moved the worker key into the OS keyring; the file %s is kept as a "
                     "backup", path)
            return cls(key, source="keyring")
        key = Ed25519PrivateKey.generate()
        store.put(_pem(key).decode())
        log.info("created a new worker identity in the OS keyring")
        return cls(key, source="keyring")

    def sign(self, payload: bytes) -> str:
        return self._key.sign(payload).hex()

    def sign_hello(self, nonce: str, ln_url: str | None, *, origin: str) -> str:
        """The hello's signature over the queen's ``nonce``, the payout address and ``origin``:
        ``queen_origin`` of the URL this worker dialled, never an origin a queen names (that
        would let a hostile queen relay another queen's challenge to impersonate us there)."""
        return self.sign(hello_signing_payload(nonce, self.pubkey, ln_url, origin))


class _Keyring:
    """The OS keyring's one entry for the worker key; every failure is ``KeyringUnavailable``."""

    def __init__(self) -> None:
        import keyring
        from keyring.backends import fail, null

        try:
            self._backend = keyring.get_keyring()
        except Exception as exc:  # a backend that fails to initialise
            raise KeyringUnavailable(f"no keyring backend: {exc}") from exc
        if isinstance(self._backend, fail.Keyring | null.Keyring):
            raise KeyringUnavailable(f"no working keyring backend ({_name(self._backend)})")

    def get(self) -> str | None:
        try:
            return self._backend.get_password(KEYRING_SERVICE, KEYRING_USERNAME)
        except Exception as exc:  # KeyringError, or a backend's own (D-Bus, locked, ...)
            raise KeyringUnavailable(
                f"{_name(self._backend)} could not be read: {exc or type(exc).__name__}"
            ) from exc

    def put(self, pem: str) -> None:
        """Store ``pem`` and read it back: a keyring that loses it does not work."""
        try:
            self._backend.set_password(KEYRING_SERVICE, KEYRING_USERNAME, pem)
        except Exception as exc:
            raise KeyringUnavailable(
                f"{_name(self._backend)} refused the key: {exc or type(exc).__name__}"
            ) from exc
        try:
            kept = self.get() == pem
        except KeyringUnavailable:
            kept = False
        if not kept:
            self._forget()
            raise KeyringUnavailable(f"{_name(self._backend)} did not keep the key")

    def _forget(self) -> None:
        """Best effort: leave no half-kept key that a later start would read as ours."""
        try:
            self._backend.delete_password(KEYRING_SERVICE, KEYRING_USERNAME)
        except Exception as exc:
            log.debug("could not clear the keyring entry: %s", exc)


def _name(backend: object) -> str:
    cls = type(backend)
    return f"{cls.__module__}.{cls.__qualname__}"


def _pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())


def _parse_pem(pem: bytes, what: str) -> Ed25519PrivateKey:
    try:
        key = load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as exc:
        raise IdentityError(f"{what} is unreadable: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise IdentityError(f"{what} is not an Ed25519 key")
    return key


def _write_key_file(path: Path, pem: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(pem)


def _warn_if_file_differs(path: Path, pubkey: str) -> None:
    """A key file that is not the keyring's key is someone's identity too: say so, keep it."""
    if not path.exists():
        return
    try:
        other = WorkerIdentity(_parse_pem(path.read_bytes(), str(path)))
    except (OSError, IdentityError) as exc:
        log.warning("the worker key file %s is unreadable (%s); the key in the OS keyring "
                    "is used", path, exc)
        return
    if other.pubkey != pubkey:
        log.warning("the worker key file %s (%s...) is not the key in the OS keyring "
                    "(%s...), which is the one used; the file is left as it is",
                    path, other.pubkey[:12], pubkey[:12])
