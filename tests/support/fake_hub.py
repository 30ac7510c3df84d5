"""A fake Hugging Face hub on 127.0.0.1, for tests that drive the real ``huggingface_hub`` client.

It answers the requests listed in /work/shared/TESTING.md:

* ``GET /api/models/{repo}`` (and ``/revision/{rev}``): ``id``, ``sha``, ``siblings`` with
  ``rfilename``, ``size`` and, for LFS files (``.gguf``, ``.safetensors``), ``lfs: {sha256, size,
  pointerSize}``.
* ``GET /api/models/{repo}/tree/{rev}[/{folder}]?recursive=...``: a list of
  ``{"type": "file", "path", "size", "oid", "lfs"?}`` and ``{"type": "directory", ...}``.
* ``HEAD`` / ``GET /{repo}/resolve/{rev}/{path}``: ``X-Repo-Commit`` (40 hex), a quoted ``ETag``
  (the sha256 for LFS files, the git blob sha1 otherwise), ``Content-Length``,
  ``Accept-Ranges: bytes``; ``Range`` requests get ``206`` with ``Content-Range``. No ``X-Xet-*``
  headers, so the client downloads over plain HTTP.
* Errors as the hub sends them: ``404`` with ``X-Error-Code: RepoNotFound``, ``EntryNotFound`` or
  ``RevisionNotFound``; for a gated repo ``401`` (no token) or ``403`` (a token without access)
  with ``X-Error-Code: GatedRepo``. As on the real hub, listing a gated repo works without a
  token; its files do not.

With ``serve_lfs_from_cdn()``, ``.gguf`` files answer ``302`` to a "CDN" on another host name,
with ``X-Linked-Etag`` and ``X-Linked-Size``, as huggingface.co does.

Test controls: ``requests`` / ``count`` (what was asked), ``cut_after`` (end one download early,
to test resuming), ``pause_at`` (hold a download at a byte offset until released, to test
cancelling), ``throttle`` and ``fail_next`` (answer an error status).

``make_gguf`` and ``make_split_gguf`` write small valid GGUF files for repos whose content
does not matter.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import socket
import struct
import threading
import time
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from tests.support.http_server import RequestLog, ServedFake, TrackedHTTPServer

__all__ = [
    "FakeHub",
    "FakeRepo",
    "PausePoint",
    "RecordedRequest",
    "make_gguf",
    "make_split_gguf",
]

logger = logging.getLogger(__name__)

FileSource = bytes | str | os.PathLike[str]

_CHUNK = 256 * 1024
_THROTTLED_CHUNK = 16 * 1024
_PAUSE_LIMIT_S = 30.0
_HASHES: dict[tuple[str, int, int], str] = {}
_HASHES_LOCK = threading.Lock()


@dataclass
class FakeRepo:
    """A repo the fake hub serves. ``files`` maps a path in the repo to bytes, text (``str``) or
    the path of a file on disk (``Path``). ``tokens`` are the tokens allowed into a gated repo."""

    repo_id: str
    files: Mapping[str, FileSource]
    gated: bool = False
    tokens: Collection[str] = ()
    commit: str = ""

    def __post_init__(self) -> None:
        if not self.commit:
            self.commit = hashlib.sha1(self.repo_id.encode()).hexdigest()


@dataclass(frozen=True)
class RecordedRequest:
    """A request the fake hub received."""

    method: str
    path: str
    query: str
    range: str | None
    authorization: str | None


@dataclass
class PausePoint:
    """A download held at ``offset``: ``reached`` is set when it gets there; set ``release``."""

    path: str
    offset: int
    reached: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)


class _Blob:
    """One file's content, size and hashes."""

    def __init__(self, path_in_repo: str, source: FileSource) -> None:
        self.path_in_repo = path_in_repo
        if isinstance(source, bytes | str):
            self.data: bytes | None = source.encode() if isinstance(source, str) else source
            self.file: Path | None = None
            self.size = len(self.data)
        else:
            self.data = None
            self.file = Path(source)
            self.size = self.file.stat().st_size
        # What the hub's default .gitattributes stores with LFS: model weights.
        self.lfs = path_in_repo.lower().endswith((".gguf", ".safetensors"))
        self.sha256 = _sha256(self.data, self.file)
        if self.lfs:
            pointer = (
                "version https://git-lfs.github.com/spec/v1\n"
                f"oid sha256:{self.sha256}\nsize {self.size}\n"
            ).encode()
            self.pointer_size = len(pointer)
            self.oid = _git_sha1(pointer)
            self.etag = self.sha256
        else:
            self.pointer_size = 0
            self.oid = _git_sha1(self.read(0, self.size))
            self.etag = self.oid

    def read(self, start: int, end: int) -> bytes:
        if self.data is not None:
            return self.data[start:end]
        assert self.file is not None
        with self.file.open("rb") as handle:
            handle.seek(start)
            return handle.read(end - start)

    @contextlib.contextmanager
    def reader(self, start: int) -> Iterator[Any]:
        if self.data is not None:
            yield _BytesReader(self.data, start)
            return
        assert self.file is not None
        with self.file.open("rb") as handle:
            handle.seek(start)
            yield handle


class _BytesReader:
    def __init__(self, data: bytes, pos: int) -> None:
        self.view = memoryview(data)
        self.pos = pos

    def read(self, n: int) -> bytes:
        chunk = bytes(self.view[self.pos : self.pos + n])
        self.pos += len(chunk)
        return chunk


def _sha256(data: bytes | None, file: Path | None) -> str:
    if data is not None:
        return hashlib.sha256(data).hexdigest()
    assert file is not None
    stat = file.stat()
    key = (str(file.resolve()), stat.st_size, stat.st_mtime_ns)
    with _HASHES_LOCK:
        if key in _HASHES:
            return _HASHES[key]
    with file.open("rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    with _HASHES_LOCK:
        _HASHES[key] = digest
    return digest


def _git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class _Failure:
    contains: str
    status: int
    times: int
    error_code: str | None
    method: str | None


class FakeHub(ServedFake):
    """The fake hub. Use as a context manager (``with`` or ``async with``) or call
    ``start``/``stop``; ``url`` is the endpoint to hand to the client."""

    name = "fake hub"

    def __init__(self, repos: Iterable[FakeRepo] = ()) -> None:
        super().__init__()
        self._repos: dict[str, tuple[FakeRepo, dict[str, _Blob]]] = {}
        self._lock = threading.Lock()
        self._log: RequestLog[RecordedRequest] = RequestLog()
        self._cuts: dict[str, int] = {}
        self._pauses: list[PausePoint] = []
        self._failures: list[_Failure] = []
        self._corrupt: set[str] = set()
        self._cdn = False
        self._throttle: float | None = None
        for repo in repos:
            self.add_repo(repo)

    # --- set-up ------------------------------------------------------------------------------

    def add_repo(self, repo: FakeRepo) -> None:
        blobs = {path: _Blob(path, source) for path, source in repo.files.items()}
        with self._lock:
            self._repos[repo.repo_id] = (repo, blobs)

    def _make_server(self) -> _Server:
        return _Server(self)

    def _before_stop(self) -> None:
        with self._lock:  # a held download must not keep the server from stopping
            for pause in self._pauses:
                pause.release.set()

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the fake hub is not running")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    # --- controls ----------------------------------------------------------------------------

    def cut_after(self, path_in_repo: str, nbytes: int) -> None:
        """The next GET of ``path_in_repo`` sends ``nbytes`` of its body, then hangs up."""
        with self._lock:
            self._cuts[path_in_repo] = nbytes

    def pause_at(self, path_in_repo: str, offset: int) -> PausePoint:
        """Downloads of ``path_in_repo`` stop at byte ``offset`` of the file until released."""
        pause = PausePoint(path_in_repo, offset)
        with self._lock:
            self._pauses.append(pause)
        return pause

    def throttle(self, bytes_per_s: float | None) -> None:
        """Limit how fast file bodies are sent (None: as fast as possible)."""
        self._throttle = bytes_per_s

    def fail_next(
        self,
        contains: str,
        status: int,
        *,
        times: int = 1,
        error_code: str | None = None,
        method: str | None = None,
    ) -> None:
        """Answer the next ``times`` requests (of ``method``) whose path contains ``contains``
        with ``status`` (and ``X-Error-Code: error_code``)."""
        with self._lock:
            self._failures.append(_Failure(contains, status, times, error_code, method))

    def serve_lfs_from_cdn(self, enabled: bool = True) -> None:
        """Answer HEAD/GET of LFS files as the real hub does: ``302`` to a "CDN" URL on another
        host name (``localhost`` instead of ``127.0.0.1``) with ``X-Linked-Etag`` and
        ``X-Linked-Size``. The CDN URL (``/cdn/<sha256>``) serves the bytes without a token."""
        self._cdn = enabled

    def corrupt_next(self, path_in_repo: str) -> None:
        """The next GET of ``path_in_repo`` sends its first byte flipped."""
        with self._lock:
            self._corrupt.add(path_in_repo)

    # --- inspection --------------------------------------------------------------------------

    @property
    def requests(self) -> list[RecordedRequest]:
        return self._log.items

    def count(self, method: str | None = None, contains: str = "") -> int:
        """How many requests (of ``method``, with ``contains`` in the path) arrived."""
        return self._log.count(method, contains)

    def file_sha256(self, repo_id: str, path_in_repo: str) -> str:
        with self._lock:
            return self._repos[repo_id][1][path_in_repo].sha256

    # --- used by the handler -----------------------------------------------------------------

    def _record(self, request: RecordedRequest) -> None:
        self._log.record(request)

    def _repo(self, repo_id: str) -> tuple[FakeRepo, dict[str, _Blob]] | None:
        with self._lock:
            return self._repos.get(repo_id)

    def _take_failure(self, method: str, path: str) -> _Failure | None:
        with self._lock:
            for failure in self._failures:
                if failure.method not in (None, method):
                    continue
                if failure.contains in path and failure.times > 0:
                    failure.times -= 1
                    return failure
        return None

    def _blob_by_sha256(self, sha256: str) -> _Blob | None:
        with self._lock:
            for _, blobs in self._repos.values():
                for blob in blobs.values():
                    if blob.lfs and blob.sha256 == sha256:
                        return blob
        return None

    def _take_corrupt(self, path_in_repo: str) -> bool:
        with self._lock:
            if path_in_repo in self._corrupt:
                self._corrupt.discard(path_in_repo)
                return True
            return False

    def _take_cut(self, path_in_repo: str) -> int | None:
        with self._lock:
            return self._cuts.pop(path_in_repo, None)

    def _pause_between(self, path_in_repo: str, start: int, end: int) -> PausePoint | None:
        with self._lock:
            for pause in self._pauses:
                if (
                    pause.path == path_in_repo
                    and start <= pause.offset < end
                    and not pause.release.is_set()
                ):
                    return pause
        return None


class _Server(TrackedHTTPServer):
    def __init__(self, hub: FakeHub) -> None:
        self.hub = hub
        super().__init__(_Handler, "fake hub")


_API_MODEL = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?/?$")
_API_TREE = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?:/(?P<path>.+))?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
_CDN = re.compile(r"^/cdn/(?P<sha>[0-9a-f]{64})$")
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    timeout = 30

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("fake hub: " + format, *args)

    def do_HEAD(self) -> None:
        self._dispatch(head=True)

    def do_GET(self) -> None:
        self._dispatch(head=False)

    def _dispatch(self, *, head: bool) -> None:
        hub = self.server.hub
        split = urlsplit(self.path)
        path = unquote(split.path)
        hub._record(
            RecordedRequest(
                method=self.command,
                path=path,
                query=split.query,
                range=self.headers.get("Range"),
                authorization=self.headers.get("Authorization"),
            )
        )
        try:
            failure = hub._take_failure(self.command, path)
            if failure is not None:
                self._error(failure.status, failure.error_code, "injected failure", head=head)
            elif match := _API_TREE.match(path):
                self._tree(match["repo"], match["rev"], match["path"] or "", head=head)
            elif match := _API_MODEL.match(path):
                self._model_info(match["repo"], match["rev"] or "main", head=head)
            elif match := _RESOLVE.match(path):
                self._resolve(match["repo"], match["rev"], match["path"], head=head)
            elif match := _CDN.match(path):
                self._cdn(match["sha"], head=head)
            else:
                self._error(404, None, f"no route for {path}", head=head)
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
            self.close_connection = True

    # --- routes ------------------------------------------------------------------------------

    def _model_info(self, repo_id: str, rev: str, *, head: bool) -> None:
        found = self._find_repo(repo_id, rev, head=head)
        if found is None:
            return
        repo, blobs = found
        siblings = []
        for path, blob in sorted(blobs.items()):
            sibling: dict[str, Any] = {"rfilename": path, "size": blob.size, "blobId": blob.oid}
            if blob.lfs:
                sibling["lfs"] = {
                    "sha256": blob.sha256,
                    "size": blob.size,
                    "pointerSize": blob.pointer_size,
                }
            siblings.append(sibling)
        self._json(
            {
                "_id": repo.commit[:24],
                "id": repo.repo_id,
                "modelId": repo.repo_id,
                "sha": repo.commit,
                "private": False,
                "gated": "manual" if repo.gated else False,
                "disabled": False,
                "tags": ["gguf"],
                "siblings": siblings,
            },
            head=head,
        )

    def _tree(self, repo_id: str, rev: str, folder: str, *, head: bool) -> None:
        found = self._find_repo(repo_id, rev, head=head)
        if found is None:
            return
        _, blobs = found
        recursive = "recursive=true" in self.path.lower() or "recursive=1" in self.path
        prefix = f"{folder.strip('/')}/" if folder.strip("/") else ""
        entries: list[dict[str, Any]] = []
        folders: set[str] = set()
        for path, blob in sorted(blobs.items()):
            if not path.startswith(prefix):
                continue
            rest = path[len(prefix) :]
            parts = rest.split("/")
            for depth in range(1, len(parts)):
                sub = prefix + "/".join(parts[:depth])
                if (recursive or depth == 1) and sub not in folders:
                    folders.add(sub)
                    oid = _git_sha1(sub.encode())
                    entries.append({"type": "directory", "path": sub, "oid": oid})
            if recursive or len(parts) == 1:
                entry: dict[str, Any] = {
                    "type": "file",
                    "path": path,
                    "size": blob.size,
                    "oid": blob.oid,
                }
                if blob.lfs:
                    entry["lfs"] = {
                        "oid": blob.sha256,
                        "size": blob.size,
                        "pointerSize": blob.pointer_size,
                    }
                entries.append(entry)
        self._json(entries, head=head)

    def _resolve(self, repo_id: str, rev: str, path_in_repo: str, *, head: bool) -> None:
        found = self._find_repo(repo_id, rev, head=head)
        if found is None:
            return
        repo, blobs = found
        blob = blobs.get(path_in_repo)
        if blob is None:
            self._error(
                404,
                "EntryNotFound",
                f"{path_in_repo} does not exist on main",
                head=head,
                commit=repo.commit,
            )
            return
        if repo.gated and not self._granted(repo, head=head):
            return
        if blob.lfs and self.server.hub._cdn:
            port = self.server.server_address[1]
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{port}/cdn/{blob.sha256}")
            self.send_header("X-Linked-Etag", f'"{blob.sha256}"')
            self.send_header("X-Linked-Size", str(blob.size))
            self.send_header("ETag", f'"{blob.oid}"')
            self.send_header("X-Repo-Commit", repo.commit)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self._serve_blob(blob, repo.commit, head=head)

    def _cdn(self, sha256: str, *, head: bool) -> None:
        blob = self.server.hub._blob_by_sha256(sha256)
        if blob is None:
            self._error(404, None, "no such object", head=head)
            return
        self._serve_blob(blob, None, head=head)

    def _serve_blob(self, blob: _Blob, commit: str | None, *, head: bool) -> None:
        start, end = 0, blob.size
        status = 200
        requested = self.headers.get("Range")
        if requested:
            parsed = _parse_range(requested, blob.size)
            if parsed is None:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{blob.size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            start, end = parsed
            status = 206
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{blob.etag}"')
        if commit:
            self.send_header("X-Repo-Commit", commit)
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{blob.size}")
        self.end_headers()
        if not head:
            self._send_body(blob, start, end)

    # --- helpers -----------------------------------------------------------------------------

    def _find_repo(
        self, repo_id: str, rev: str, *, head: bool
    ) -> tuple[FakeRepo, dict[str, _Blob]] | None:
        found = self.server.hub._repo(repo_id)
        if found is None:
            self._error(404, "RepoNotFound", "Repository not found", head=head)
            return None
        if rev not in ("main", found[0].commit):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", head=head)
            return None
        return found

    def _granted(self, repo: FakeRepo, *, head: bool) -> bool:
        auth = self.headers.get("Authorization") or ""
        token = auth[7:] if auth.lower().startswith("bearer ") else ""
        if token and token in repo.tokens:
            return True
        if not token:
            message = (
                f"Access to model {repo.repo_id} is restricted. You must have access to it and "
                "be authenticated to access it. Please log in."
            )
            self._error(401, "GatedRepo", message, head=head)
        else:
            message = (
                f"Access to model {repo.repo_id} is restricted and you are not in the "
                "authorized list."
            )
            self._error(403, "GatedRepo", message, head=head)
        return False

    def _send_body(self, blob: _Blob, start: int, end: int) -> None:
        hub = self.server.hub
        cut = hub._take_cut(blob.path_in_repo)
        corrupt = hub._take_corrupt(blob.path_in_repo)
        stop = min(end, start + cut) if cut is not None else end
        pos = start
        with blob.reader(start) as source:
            while pos < stop:
                throttle = hub._throttle
                size = min(_THROTTLED_CHUNK if throttle else _CHUNK, stop - pos)
                pause = hub._pause_between(blob.path_in_repo, pos, pos + size + 1)
                if pause is not None:
                    size = pause.offset - pos
                if size > 0:
                    data = source.read(size)
                    if corrupt:
                        data = bytes([data[0] ^ 0xFF]) + data[1:]
                        corrupt = False
                    self.wfile.write(data)
                    pos += size
                    if throttle:
                        time.sleep(size / throttle)
                if pause is not None and pos == pause.offset:
                    self.wfile.flush()
                    pause.reached.set()
                    pause.release.wait(_PAUSE_LIMIT_S)
        self.wfile.flush()
        if pos < end:
            logger.debug("fake hub: cut %s off at byte %d", blob.path_in_repo, pos)
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)

    def _json(self, payload: Any, *, head: bool, status: int = 200) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _error(
        self,
        status: int,
        code: str | None,
        message: str,
        *,
        head: bool,
        commit: str | None = None,
    ) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.end_headers()
        if not head:
            self.wfile.write(body)


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """``(start, end_exclusive)`` for a single ``bytes=`` range; None if unsatisfiable."""
    match = _RANGE.match(header.strip())
    if match is None or (not match[1] and not match[2]):
        return None
    if not match[1]:  # bytes=-N: the last N bytes
        length = int(match[2])
        return (max(size - length, 0), size) if length else None
    start = int(match[1])
    end = min(int(match[2]) + 1, size) if match[2] else size
    if start >= size or end <= start:
        return None
    return start, end


# --- small GGUF files ------------------------------------------------------------------------


def make_gguf(
    path: Path,
    *,
    arch: str = "llama",
    name: str = "tiny",
    blocks: int = 2,
    embedding: int = 16,
    vocab: int = 32,
    filler_bytes: int = 0,
    file_type: int | None = 3,
    context_length: int = 256,
    chat_template: str | None = "{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}",
) -> Path:
    """Write a small valid GGUF model (F32 tensors) and return its path.

    ``filler_bytes`` (a multiple of 4) adds a ``blk.0.filler`` tensor of that many bytes, for
    files big enough to watch a download progress.
    """
    from gguf import GGUFWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(path, arch)
    writer.add_name(name)
    writer.add_block_count(blocks)
    writer.add_context_length(context_length)
    writer.add_embedding_length(embedding)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    if file_type is not None:
        writer.add_file_type(file_type)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for tensor_name, array in _tiny_tensors(blocks, embedding, vocab, filler_bytes):
        writer.add_tensor(tensor_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def make_split_gguf(
    folder: Path, base: str, parts: int, *, blocks: int | None = None, arch: str = "llama"
) -> list[Path]:
    """Write a split GGUF model ``<base>-0000k-of-0000n.gguf``, one block per part or so."""
    from gguf import GGUFWriter

    blocks = blocks if blocks is not None else parts
    tensors = _tiny_tensors(blocks, 16, 32, 0)
    per_part = -(-len(tensors) // parts)
    paths = []
    for no in range(1, parts + 1):
        path = folder / f"{base}-{no:05d}-of-{parts:05d}.gguf"
        path.parent.mkdir(parents=True, exist_ok=True)
        writer = GGUFWriter(path, arch)
        if no == 1:
            writer.add_name(base)
            writer.add_block_count(blocks)
            writer.add_context_length(256)
            writer.add_embedding_length(16)
            writer.add_file_type(1)
        writer.add_uint16("split.no", no - 1)
        writer.add_uint16("split.count", parts)
        writer.add_int32("split.tensors.count", len(tensors))
        for tensor_name, array in tensors[(no - 1) * per_part : no * per_part]:
            writer.add_tensor(tensor_name, array)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        paths.append(path)
    return paths


def _tiny_tensors(
    blocks: int, embedding: int, vocab: int, filler_bytes: int
) -> list[tuple[str, Any]]:
    import numpy as np

    tensors: list[tuple[str, Any]] = [
        ("token_embd.weight", np.ones((vocab, embedding), dtype=np.float32))
    ]
    for block in range(blocks):
        tensors.append((f"blk.{block}.attn_norm.weight", np.ones(embedding, dtype=np.float32)))
        tensors.append(
            (f"blk.{block}.attn_q.weight", np.ones((embedding, embedding), dtype=np.float32))
        )
    if filler_bytes:
        tensors.append(("blk.0.filler", np.arange(filler_bytes // 4, dtype=np.float32)))
    tensors.append(("output_norm.weight", np.ones(embedding, dtype=np.float32)))
    return tensors


def gguf_header_only(parameter_count: int, *, arch: str = "llama", vocab: int = 0,
                     split: tuple[int, int] | None = None) -> bytes:
    """The header of a GGUF model of ``parameter_count`` parameters, and no tensor data: what
    the queen reads (with Range requests) to price a model. ``vocab`` adds a vocabulary of that
    many 8-byte tokens, to make the header long (300,000 tokens: about 4.8 MB); ``split`` is
    ``(part number from 1, part count)``. Written by hand so that a 70B model costs no bytes."""

    def text(value: str) -> bytes:
        data = value.encode()
        return struct.pack("<Q", len(data)) + data

    kvs = [text("general.architecture") + struct.pack("<I", 8) + text(arch),
           text(f"{arch}.context_length") + struct.pack("<II", 4, 4096)]
    if vocab:
        tokens = b"".join(text(f"tok{i:05d}") for i in range(vocab))
        kvs.append(text("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, vocab) + tokens)
    if split is not None:
        kvs.append(text("split.no") + struct.pack("<IH", 2, split[0] - 1))
        kvs.append(text("split.count") + struct.pack("<IH", 2, split[1]))
    # Two tensors whose element counts add up: one of shape (rest, 1), one of shape (1,).
    tensors = [("token_embd.weight", (parameter_count - 1, 1)), ("output_norm.weight", (1,))]
    table = b"".join(
        text(name) + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in shape)
        + struct.pack("<IQ", 0, 0)  # F32, offset 0 (no data follows: the queen never reads it)
        for name, shape in tensors)
    head = struct.pack("<IIQQ", 0x46554747, 3, len(tensors), len(kvs))
    return head + b"".join(kvs) + table


def pricing_repos(parameter_counts: Mapping[str, int], **kwargs: Any) -> list[FakeRepo]:
    """Repos that hold, for each ``hf-user/hf-repo:filter`` name, one header-only GGUF file the
    filter picks, of that many parameters (``kwargs`` go to ``gguf_header_only``)."""
    files: dict[str, dict[str, FileSource]] = {}
    for name, count in parameter_counts.items():
        repo_id, _, filter_ = name.partition(":")
        files.setdefault(repo_id, {})[f"model-{filter_}.gguf"] = gguf_header_only(count, **kwargs)
    return [FakeRepo(repo_id, repo_files) for repo_id, repo_files in files.items()]
