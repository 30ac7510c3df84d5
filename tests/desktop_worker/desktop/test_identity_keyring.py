"""The worker key in the OS keyring, with the 0600 file as the fallback, and never a lost key.

A real keyring backend (in memory, a ``KeyringBackend`` subclass) is set with
``keyring.set_keyring``; keyring's own ``fail`` and ``null`` backends stand for machines with no
keyring. Each test restores the backend it found.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import keyring
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from keyring.backend import KeyringBackend
from keyring.backends import fail, null
from keyring.errors import PasswordDeleteError, PasswordSetError

from desktop_worker import identity as identity_module
from desktop_worker.identity import (
    KEYRING_SERVICE,
    KEYRING_USERNAME,
    IdentityError,
    KeyringUnavailable,
    WorkerIdentity,
)

ENTRY = (KEYRING_SERVICE, KEYRING_USERNAME)


class MemoryKeyring(KeyringBackend):
    """A working keyring that keeps its entries in a dict."""

    priority = 1  # type: ignore[assignment]

    def __init__(self) -> None:
        super().__init__()
        self.entries: dict[tuple[str, str], str] = {}

    def get_password(self, service: str, username: str) -> str | None:
        return self.entries.get((service, username))

    def set_password(self, service: str, username: str, password: str) -> None:
        self.entries[(service, username)] = password

    def delete_password(self, service: str, username: str) -> None:
        if self.entries.pop((service, username), None) is None:
            raise PasswordDeleteError("no such entry")


class ForgetfulKeyring(MemoryKeyring):
    """Accepts every write and keeps a mangled copy (a broken backend)."""

    def set_password(self, service: str, username: str, password: str) -> None:
        self.entries[(service, username)] = password[:20]


class LockedKeyring(MemoryKeyring):
    """A keyring that is there but refuses writes (a locked collection)."""

    def set_password(self, service: str, username: str, password: str) -> None:
        raise PasswordSetError("the collection is locked")


@pytest.fixture
def use_keyring() -> Iterator[object]:
    previous = keyring.get_keyring()

    def install(backend: KeyringBackend) -> KeyringBackend:
        keyring.set_keyring(backend)
        return backend

    yield install
    keyring.set_keyring(previous)


@pytest.fixture
def key_path(tmp_path: Path) -> Path:
    return tmp_path / "config" / "worker_key.pem"


def pubkey_of_pem(pem: bytes) -> str:
    return WorkerIdentity(load_pem_private_key(pem, password=None)).pubkey  # type: ignore[arg-type]


def assert_signs(identity: WorkerIdentity) -> None:
    public = Ed25519PublicKey.from_public_bytes(bytes.fromhex(identity.pubkey))
    public.verify(bytes.fromhex(identity.sign(b"payload")), b"payload")


def test_file_store_keeps_todays_behaviour(use_keyring, key_path: Path) -> None:
    backend = use_keyring(MemoryKeyring())
    first = WorkerIdentity.load_or_create(key_path)  # the default is "file"
    assert first.source == str(key_path)
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    assert WorkerIdentity.load_or_create(key_path, key_store="file").pubkey == first.pubkey
    assert backend.entries == {}  # the keyring is never touched
    assert_signs(first)


def test_keyring_store_creates_and_reloads(use_keyring, key_path: Path) -> None:
    backend = use_keyring(MemoryKeyring())
    first = WorkerIdentity.load_or_create(key_path, key_store="keyring")
    assert first.source == "keyring"
    assert set(backend.entries) == {ENTRY}
    assert pubkey_of_pem(backend.entries[ENTRY].encode()) == first.pubkey
    assert not key_path.exists()  # no file when the keyring holds it
    again = WorkerIdentity.load_or_create(key_path, key_store="auto")
    assert again.pubkey == first.pubkey
    assert_signs(again)


def test_auto_migrates_an_existing_file_and_keeps_it(use_keyring, key_path: Path) -> None:
    use_keyring(fail.Keyring())
    from_file = WorkerIdentity.load_or_create(key_path, key_store="file")
    pem = key_path.read_bytes()
    backend = use_keyring(MemoryKeyring())

    migrated = WorkerIdentity.load_or_create(key_path, key_store="auto")
    assert migrated.pubkey == from_file.pubkey
    assert migrated.source == "keyring"
    assert backend.entries[ENTRY] == pem.decode()
    assert key_path.read_bytes() == pem  # the user's key file is never deleted

    # From now on the keyring is the source: the same key even with the file gone.
    key_path.rename(key_path.with_suffix(".moved"))
    assert WorkerIdentity.load_or_create(key_path, key_store="auto").pubkey == from_file.pubkey
    assert not key_path.exists()


@pytest.mark.parametrize("backend", [fail.Keyring, null.Keyring, ForgetfulKeyring, LockedKeyring])
def test_auto_falls_back_to_the_file_with_a_warning(
    use_keyring, key_path: Path, backend: type[KeyringBackend], caplog: pytest.LogCaptureFixture
) -> None:
    installed = use_keyring(backend())
    with caplog.at_level(logging.WARNING, logger=identity_module.__name__):
        first = WorkerIdentity.load_or_create(key_path, key_store="auto")
    assert first.source == str(key_path)
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    assert pubkey_of_pem(key_path.read_bytes()) == first.pubkey
    assert "keyring cannot hold the worker key" in caplog.text
    assert str(key_path) in caplog.text
    # A half-kept key is not left behind to be read as ours next time.
    assert getattr(installed, "entries", {}) == {}
    assert WorkerIdentity.load_or_create(key_path, key_store="auto").pubkey == first.pubkey


@pytest.mark.parametrize(
    ("backend", "reason"),
    [
        (fail.Keyring, "no working keyring backend"),
        (null.Keyring, "no working keyring backend"),
        (ForgetfulKeyring, "did not keep the key"),
        (LockedKeyring, "the collection is locked"),
    ],
)
def test_keyring_store_refuses_a_keyring_that_does_not_work(
    use_keyring, key_path: Path, backend: type[KeyringBackend], reason: str
) -> None:
    use_keyring(backend())
    with pytest.raises(KeyringUnavailable, match=reason):
        WorkerIdentity.load_or_create(key_path, key_store="keyring")
    assert not key_path.exists()


def test_a_failed_migration_keeps_using_the_file(use_keyring, key_path: Path) -> None:
    use_keyring(fail.Keyring())
    from_file = WorkerIdentity.load_or_create(key_path, key_store="file")
    pem = key_path.read_bytes()
    use_keyring(LockedKeyring())
    assert WorkerIdentity.load_or_create(key_path, key_store="auto").pubkey == from_file.pubkey
    assert key_path.read_bytes() == pem
    with pytest.raises(KeyringUnavailable):
        WorkerIdentity.load_or_create(key_path, key_store="keyring")
    assert key_path.read_bytes() == pem


def test_the_keyring_key_wins_over_a_different_file(
    use_keyring, key_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = use_keyring(MemoryKeyring())
    in_keyring = WorkerIdentity.load_or_create(key_path, key_store="keyring")
    use_keyring(fail.Keyring())
    in_file = WorkerIdentity.load_or_create(key_path, key_store="file")
    assert in_file.pubkey != in_keyring.pubkey
    use_keyring(backend)
    with caplog.at_level(logging.WARNING, logger=identity_module.__name__):
        loaded = WorkerIdentity.load_or_create(key_path, key_store="auto")
    assert loaded.pubkey == in_keyring.pubkey
    assert in_file.pubkey[:12] in caplog.text
    assert pubkey_of_pem(key_path.read_bytes()) == in_file.pubkey  # left as it is


def test_a_corrupt_keyring_entry_is_an_error_not_a_new_key(use_keyring, key_path: Path) -> None:
    backend = use_keyring(MemoryKeyring())
    backend.entries[ENTRY] = "-----BEGIN PRIVATE KEY-----\nnot a key\n-----END PRIVATE KEY-----\n"
    with pytest.raises(IdentityError, match="the worker key in the OS keyring is unreadable"):
        WorkerIdentity.load_or_create(key_path, key_store="auto")
    assert not key_path.exists()
    assert backend.entries[ENTRY].startswith("-----BEGIN PRIVATE KEY-----\nnot a key")


def test_a_loose_key_file_is_fixed_to_0600(key_path: Path) -> None:
    first = WorkerIdentity.load_or_create(key_path)
    os.chmod(key_path, 0o644)
    assert WorkerIdentity.load_or_create(key_path).pubkey == first.pubkey
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600


def test_the_service_loads_the_key_from_the_configured_store(
    use_keyring, tmp_path: Path
) -> None:
    from desktop_worker.service import WorkerService
    from desktop_worker.settings import WorkerSettings

    backend = use_keyring(MemoryKeyring())
    settings = WorkerSettings(
        models_dir=tmp_path / "models", key_path=tmp_path / "key.pem", key_store="keyring"
    )
    service = WorkerService(settings)
    assert service.identity.source == "keyring"
    assert pubkey_of_pem(backend.entries[ENTRY].encode()) == service.identity.pubkey
    assert not settings.key_path.exists()
