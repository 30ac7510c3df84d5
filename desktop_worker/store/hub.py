"""The edge to the Hugging Face hub: list a repo's files; download a file, resumably.

Everything blocks; callers run it in a thread. Every failure leaves as one of the store errors in
``desktop_worker.errors`` (see ``translate_error``).

Why not ``hf_hub_download``: in huggingface_hub 2.4 (checked in its source) it downloads into a
temporary file with a random name and deletes that file in a ``finally`` when the download fails
or is interrupted, so a cancelled or broken download always starts again from zero (it resumes
with Range only inside one call, after a network error), and a cancel raised from its progress
bar is noticed only every 10 MB chunk. This module does the download itself with
huggingface_hub's own pieces (``model_info`` for the listing, ``get_hf_file_metadata`` for the
HEAD request, its shared HTTP session, auth headers, offline switch and error mapping), and keeps
the partial file as ``<file>.<etag-hash>.incomplete`` beside the destination. The next attempt
sends ``Range: bytes=<size of the partial file>-``. Downloads go over plain HTTP, even for repos
stored on Xet (the hub serves those over HTTP too, without Xet's speed-ups).
"""

from __future__ import annotations

import errno
import hashlib
import importlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from huggingface_hub import HfApi, constants, get_hf_file_metadata, hf_hub_url
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

from desktop_worker.errors import (
    ChecksumMismatch,
    DownloadCancelled,
    GatedRepo,
    HubError,
    HubOffline,
    InsufficientDisk,
    ModelStoreError,
    RemoteFileNotFound,
    RepoNotFound,
)
from desktop_worker.store.disk import LocalDisk
from shared_schema.model_names import RemoteFile, remote_files

__all__ = [
    "DEFAULT_ENDPOINT",
    "DownloadedFile",
    "HubClient",
    "RemoteFile",
    "RepoListing",
    "discard_partials",
    "free_bytes",
    "local_bytes",
    "resolve_endpoint",
    "sha256_file",
    "translate_error",
]

logger = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "https://huggingface.co"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_HASH_CHUNK = 1 << 20


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP library's network errors (huggingface_hub 2.x uses httpx2, 1.x httpx)."""
    found: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module in ("httpx2", "httpx"):
        try:
            found.append(importlib.import_module(module).TransportError)
        except (ImportError, AttributeError):
            continue
    return tuple(found)


_TRANSPORT_ERRORS = _transport_errors()


@dataclass(frozen=True)
class RepoListing:
    """A repo's files at one commit."""

    repo_id: str
    commit: str | None
    files: tuple[RemoteFile, ...]

    def paths(self) -> list[str]:
        return [f.path for f in self.files]

    def file(self, path: str) -> RemoteFile:
        for remote in self.files:
            if remote.path == path:
                return remote
        raise RemoteFileNotFound(f"{path} is not in {self.repo_id}")


@dataclass(frozen=True)
class DownloadedFile:
    """A finished download: where it is, its size and sha256, and how much was resumed."""

    path: Path
    size: int
    sha256: str
    resumed_from: int


def resolve_endpoint(endpoint: str | None = None) -> str:
    """The hub's base URL: ``endpoint``, else ``HF_ENDPOINT`` (read now), else huggingface.co."""
    chosen = endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT
    return chosen.rstrip("/")


def free_bytes(path: Path) -> int:
    """Free disk space where ``path`` is (or would be created)."""
    return LocalDisk().usage(path).free_bytes


def sha256_file(path: Path) -> str:
    """The sha256 of a file, read in chunks."""
    with Path(path).open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def local_bytes(dest: Path) -> int:
    """Bytes already on disk for ``dest``: the finished file, or its largest partial download."""
    if dest.is_file():
        return dest.stat().st_size
    return max((p.stat().st_size for p in _partials(dest)), default=0)


def discard_partials(dest: Path) -> int:
    """Delete the partial downloads of ``dest``; the bytes freed."""
    freed = 0
    for partial in _partials(dest):
        try:
            size = partial.stat().st_size
            partial.unlink()
        except FileNotFoundError:
            continue
        freed += size
    return freed


def _partials(dest: Path) -> list[Path]:
    if not dest.parent.is_dir():
        return []
    prefix = dest.name + "."
    return [
        p
        for p in dest.parent.iterdir()
        if p.name.startswith(prefix) and p.name.endswith(".incomplete") and p.is_file()
    ]


def _partial_path(dest: Path, etag: str) -> Path:
    tag = hashlib.sha256(etag.encode()).hexdigest()[:16]
    return dest.with_name(f"{dest.name}.{tag}.incomplete")


def _check_cancel(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise DownloadCancelled("the download was cancelled; the next pull resumes it")


class _ShortRead(Exception):
    """The server closed the body early without an error (treated as a network error)."""


def _is_offline_mode() -> bool:
    check = getattr(constants, "is_offline_mode", None)
    return bool(check()) if callable(check) else bool(constants.HF_HUB_OFFLINE)


def translate_error(
    exc: BaseException, *, repo_id: str, filename: str | None = None, endpoint: str = ""
) -> ModelStoreError:
    """Map an exception from the hub client (or from writing the file) to a store error."""
    what = f"{repo_id}/{filename}" if filename else repo_id
    where = endpoint or "the hub"
    if isinstance(exc, ModelStoreError):
        return exc
    if isinstance(exc, GatedRepoError):
        return GatedRepo(
            f"{repo_id} is a gated repo: accept its terms at {where}/{repo_id} with your "
            "Hugging Face account, then set HF_TOKEN to an access token of that account"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return RepoNotFound(
            f"repo {repo_id} was not found on {where} (if it is private, set HF_TOKEN)"
        )
    if isinstance(exc, RevisionNotFoundError):
        return HubError(f"{repo_id} changed while downloading; pull again ({exc})")
    if isinstance(exc, OfflineModeIsEnabled):
        return HubOffline(f"offline mode is on (HF_HUB_OFFLINE=1) and {what} is not cached")
    if isinstance(exc, LocalEntryNotFoundError):
        return HubOffline(f"cannot reach {where} and {what} is not cached")
    if isinstance(exc, EntryNotFoundError):
        return RemoteFileNotFound(f"{filename or 'the file'} was not found in {repo_id} on {where}")
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else None
        if status == 401:
            return HubError(f"{where} refused the access token (check HF_TOKEN): {exc}")
        return HubError(f"{where} answered {status} for {what}: {exc}")
    if isinstance(exc, (_TRANSPORT_ERRORS, _ShortRead)):
        return HubOffline(f"cannot reach {where} for {what}: {exc}")
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return InsufficientDisk(f"the disk filled up while downloading {what}")
    if isinstance(exc, OSError):
        return ModelStoreError(f"cannot write {what} to disk: {exc}")
    return HubError(f"unexpected error from {where} for {what}: {exc!r}")


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, OfflineModeIsEnabled | ModelStoreError):
        return False
    if isinstance(exc, HfHubHTTPError):
        return exc.response is not None and exc.response.status_code in _RETRY_STATUS
    return isinstance(exc, (_TRANSPORT_ERRORS, _ShortRead))


class HubClient:
    """Lists repos and downloads files from one hub endpoint.

    ``endpoint`` defaults to ``HF_ENDPOINT`` (read when the client is made) and then to
    huggingface.co. ``token`` defaults to what huggingface_hub finds itself: ``HF_TOKEN``, then
    the token saved by ``hf auth login``. A download that breaks is retried with a Range request:
    at once if the broken attempt brought data, else after ``retry_wait_s``, doubling, at most
    ``max_retries`` times in a row.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        token: str | None = None,
        *,
        timeout_s: float = 10.0,
        max_retries: int = 5,
        retry_wait_s: float = 0.5,
    ) -> None:
        self.endpoint = resolve_endpoint(endpoint)
        self.token = token or None
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.retry_wait_s = retry_wait_s

    def list_files(self, repo_id: str, revision: str | None = None) -> RepoListing:
        """The repo's files with sizes (and sha256 for LFS files), at its current commit (or at
        ``revision``)."""
        if _is_offline_mode():
            raise HubOffline(f"offline mode is on (HF_HUB_OFFLINE=1): cannot list {repo_id}")
        api = HfApi(endpoint=self.endpoint, token=self.token)
        try:
            info = api.model_info(repo_id, revision=revision, files_metadata=True,
                                  timeout=self.timeout_s)
        except Exception as exc:
            raise self._translate(exc, repo_id) from exc
        files = remote_files(info.siblings or ())
        logger.debug("%s at %s has %d files", repo_id, info.sha, len(files))
        return RepoListing(repo_id=repo_id, commit=info.sha, files=files)

    def download(
        self,
        repo_id: str,
        remote: RemoteFile,
        dest: Path,
        *,
        revision: str | None = None,
        on_bytes: Callable[[int], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> DownloadedFile:
        """Download ``remote`` to ``dest``, resuming a partial download left beside it.

        ``on_bytes(n)`` is called with the file's bytes on disk as they grow; ``cancel`` is
        checked after every piece that arrives. A cancel raises ``DownloadCancelled`` and keeps the
        partial file. The finished file is checked against the size and, when the hub knows it,
        the sha256.
        """
        report = on_bytes or (lambda _n: None)
        _check_cancel(cancel)
        url = hf_hub_url(repo_id, remote.path, revision=revision, endpoint=self.endpoint)
        try:
            meta = get_hf_file_metadata(
                url, token=self.token, timeout=self.timeout_s, endpoint=self.endpoint
            )
        except Exception as exc:
            raise self._translate(exc, repo_id, remote.path) from exc
        if meta.etag is None:
            raise HubError(f"{self.endpoint} sent no ETag for {repo_id}/{remote.path}")
        size = meta.size if meta.size is not None else remote.size
        expected_sha = remote.sha256 or (meta.etag if _SHA256.match(meta.etag) else None)

        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            done = self._reuse_finished(dest, size, expected_sha)
            if done is not None:
                report(done.size)
                return done
            partial = _partial_path(dest, meta.etag)
            for stale in _partials(dest):
                if stale != partial:
                    logger.info("dropping %s: the file changed on the hub", stale.name)
                    stale.unlink(missing_ok=True)
            start = partial.stat().st_size if partial.exists() else 0
            if size is not None and start > size:
                partial.unlink()
                start = 0
            if start:
                logger.info("resuming %s/%s at byte %d", repo_id, remote.path, start)
            if size is None or start < size:
                # like hf_hub_download: no token for a redirect to another host (a signed CDN URL)
                token: str | bool | None = self.token if _same_host(url, meta.location) else False
                self._fetch(
                    meta.location, token, partial, start, size, report, cancel, repo_id, remote
                )
            else:
                report(start)
            got = partial.stat().st_size
            if size is not None and got != size:
                raise HubError(f"{remote.path}: got {got} bytes, expected {size}; pull again")
            sha = sha256_file(partial)
            if expected_sha is not None and sha != expected_sha:
                partial.unlink()
                raise ChecksumMismatch(
                    f"{remote.path}: the download is corrupt (sha256 {sha}, expected "
                    f"{expected_sha}); it was deleted, pull again"
                )
            os.replace(partial, dest)
        except ModelStoreError:
            raise
        except Exception as exc:
            raise self._translate(exc, repo_id, remote.path) from exc
        logger.info("downloaded %s/%s (%d bytes)", repo_id, remote.path, got)
        return DownloadedFile(path=dest, size=got, sha256=sha, resumed_from=start)

    def _reuse_finished(
        self, dest: Path, size: int | None, expected_sha: str | None
    ) -> DownloadedFile | None:
        """A complete file already at ``dest`` (e.g. the index was lost) is kept if it checks."""
        if not dest.is_file():
            return None
        have = dest.stat().st_size
        if size is None or have == size:
            sha = sha256_file(dest)
            if expected_sha is None or sha == expected_sha:
                logger.info("%s is already complete on disk", dest)
                return DownloadedFile(path=dest, size=have, sha256=sha, resumed_from=have)
        logger.info("replacing %s: it does not match the hub's file", dest)
        dest.unlink()
        return None

    def _fetch(
        self,
        url: str,
        token: str | bool | None,
        partial: Path,
        start: int,
        size: int | None,
        report: Callable[[int], None],
        cancel: threading.Event | None,
        repo_id: str,
        remote: RemoteFile,
    ) -> None:
        """GET ``url`` into ``partial`` from byte ``start``, retrying network errors with Range."""
        session = get_session()
        pos = start
        failures = 0
        with partial.open("ab") as out:
            while True:
                _check_cancel(cancel)
                headers = build_hf_headers(token=token)
                headers["Accept-Encoding"] = "identity"
                if pos:
                    headers["Range"] = f"bytes={pos}-"
                progressed = False
                try:
                    stream = session.stream("GET", url, headers=headers, timeout=self.timeout_s)
                    with stream as resp:
                        if resp.status_code >= 400:
                            resp.read()
                            hf_raise_for_status(resp)
                        if pos and not _range_honoured(resp.status_code, resp.headers, pos):
                            logger.info("%s ignored the Range request; starting over", url)
                            out.truncate(0)
                            pos = 0
                            report(0)
                            if resp.status_code == 206:
                                continue
                        for piece in resp.iter_bytes():
                            out.write(piece)
                            pos += len(piece)
                            progressed = True
                            report(pos)
                            _check_cancel(cancel)
                    out.flush()
                    if size is None or pos >= size:
                        return
                    raise _ShortRead(f"the connection closed at byte {pos} of {size}")
                except DownloadCancelled:
                    out.flush()
                    logger.info("download of %s cancelled at byte %d", remote.path, pos)
                    raise
                except Exception as exc:
                    if not _is_transient(exc):
                        raise
                    failures = 1 if progressed else failures + 1
                    if failures > self.max_retries:
                        raise
                    delay = 0.0 if progressed else min(8.0, self.retry_wait_s * 2 ** (failures - 1))
                    logger.warning(
                        "download of %s/%s broke at byte %d (%s); retrying in %.1f s",
                        repo_id,
                        remote.path,
                        pos,
                        exc,
                        delay,
                    )
                    out.flush()
                    if delay and cancel is not None and cancel.wait(delay):
                        raise DownloadCancelled("the download was cancelled") from exc
                    if delay and cancel is None:
                        time.sleep(delay)

    def _translate(
        self, exc: BaseException, repo_id: str, filename: str | None = None
    ) -> ModelStoreError:
        return translate_error(exc, repo_id=repo_id, filename=filename, endpoint=self.endpoint)


def _same_host(url: str, other: str) -> bool:
    return urlsplit(url).netloc.lower() == urlsplit(other).netloc.lower()


def _range_honoured(status: int, headers: Mapping[str, str], pos: int) -> bool:
    """True if a response to ``Range: bytes=pos-`` starts at ``pos``."""
    if status != 206:
        return False
    content_range = headers.get("Content-Range") or ""
    match = re.match(r"^bytes (\d+)-", content_range.strip())
    return match is not None and int(match[1]) == pos
