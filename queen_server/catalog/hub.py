"""The queen's edge to the Hugging Face hub: a repo's files with their sha256, and the first bytes
of one file (an HTTP Range request), through the real ``huggingface_hub`` client.

Everything here blocks; the catalog runs it in a thread. Every failure leaves as
``ModelUnverified``, ``lasting`` when the hub answered that the name cannot be read (no such repo,
a gated one), not when it was out of reach.
"""

from __future__ import annotations

import logging
import os

from huggingface_hub import HfApi, hf_hub_url
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
)
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

from queen_server.catalog.facts import RepoFiles
from queen_server.errors import ModelUnverified
from shared_schema.model_names import remote_files

__all__ = ["DEFAULT_ENDPOINT", "HubFiles"]

logger = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "https://huggingface.co"
_LASTING_STATUS = frozenset({401, 403, 404, 410})


class HubFiles:
    """Lists repos and reads file prefixes on one hub endpoint (``None``: ``HF_ENDPOINT`` when
    made, else huggingface.co)."""

    def __init__(self, endpoint: str | None = None, token: str | None = None,
                 timeout_s: float = 10.0) -> None:
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
        self.token = token or None
        self.timeout_s = timeout_s

    def listing(self, repo_id: str) -> RepoFiles:
        """The repo's files at its current commit, with sizes and sha256s."""
        api = HfApi(endpoint=self.endpoint, token=self.token)
        try:
            info = api.model_info(repo_id, files_metadata=True, timeout=self.timeout_s)
        except Exception as exc:
            raise self._unverified(exc, repo_id) from exc
        if not info.sha:
            raise ModelUnverified(f"{self.endpoint} gave no commit for {repo_id}", lasting=False)
        return RepoFiles(repo_id, info.sha, remote_files(info.siblings or ()))

    def read_prefix(self, repo_id: str, commit: str, path: str, nbytes: int) -> bytes:
        """The first ``nbytes`` of a file at ``commit`` (fewer if the file is shorter)."""
        url = hf_hub_url(repo_id, path, revision=commit, endpoint=self.endpoint)
        headers = build_hf_headers(token=self.token)
        headers["Range"] = f"bytes=0-{nbytes - 1}"
        headers["Accept-Encoding"] = "identity"
        try:
            with get_session().stream("GET", url, headers=headers,
                                      timeout=self.timeout_s) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    hf_raise_for_status(resp)
                data = bytearray()
                for piece in resp.iter_bytes():  # a server that ignores Range sends it all:
                    data += piece  # stop at what was asked
                    if len(data) >= nbytes:
                        break
                return bytes(data[:nbytes])
        except ModelUnverified:
            raise
        except Exception as exc:
            raise self._unverified(exc, f"{repo_id}/{path}") from exc

    def _unverified(self, exc: BaseException, what: str) -> ModelUnverified:
        where = self.endpoint
        if isinstance(exc, GatedRepoError):
            return ModelUnverified(f"{what} is gated on {where} (set APIARY_HUB_TOKEN)",
                                   lasting=True, kind="gated")
        if isinstance(exc, RepositoryNotFoundError | EntryNotFoundError):
            return ModelUnverified(f"{what} was not found on {where}", lasting=True,
                                   kind="not_found")
        if isinstance(exc, OfflineModeIsEnabled):
            return ModelUnverified(f"offline mode is on: cannot read {what}", lasting=False)
        if isinstance(exc, HfHubHTTPError):
            status = exc.response.status_code if exc.response is not None else None
            kind = {401: "gated", 403: "gated", 404: "not_found", 410: "not_found"}.get(
                status or 0, "unreachable")
            return ModelUnverified(f"{where} answered {status} for {what}",
                                   lasting=status in _LASTING_STATUS, kind=kind)
        logger.debug("reading %s from %s failed", what, where, exc_info=exc)
        return ModelUnverified(f"cannot reach {where} for {what}: {exc}", lasting=False)
