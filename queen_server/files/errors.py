"""Errors of the Files API, each with its OpenAI rendering (``queen_server.errors.ApiError``)."""

from __future__ import annotations

from queen_server.errors import ApiError, InvalidRequest, NotFound, PayloadTooLarge


class InvalidTrainingFile(InvalidRequest):
    """An upload that is not OpenAI's chat fine-tuning JSONL: the message names the line
    (``line 7: ...``) where there is one. Nothing was stored."""

    code = "invalid_file_format"

    def __init__(self, message: str, *, line: int | None = None) -> None:
        super().__init__(f"line {line}: {message}" if line is not None else message,
                         param="file")
        self.line = line


class FileTooLarge(PayloadTooLarge):
    """An upload over ``APIARY_FILES_MAX_BYTES``, refused while it was still coming in."""

    code = "file_too_large"

    def __init__(self, message: str) -> None:
        super().__init__(message, param="file")


class FileNotFound(NotFound):
    """No live file of this caller has the id: another key's file reads the same."""

    code = "file_not_found"

    def __init__(self, file_id: str, *, param: str = "file_id") -> None:
        super().__init__(f"No such File object: {shown_id(file_id)}", param=param)
        self.file_id = file_id


def shown_id(file_id: str) -> str:
    """An id as a message quotes it: a client's made-up one cut to a readable length."""
    return file_id if len(file_id) <= 64 else file_id[:61] + "..."


class FileStorageError(ApiError):
    """The queen's file storage (its folder, or the S3 bucket) failed or cannot be reached."""

    status_code = 503
    error_type = "server_error"
    code = "file_storage_unavailable"


class FilesUnavailable(ApiError):
    """The queen runs without a database, so it keeps no files."""

    status_code = 503
    error_type = "server_error"
    code = "files_unavailable"
