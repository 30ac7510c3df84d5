"""Errors raised by the wire-protocol helpers."""

from __future__ import annotations


class SchemaError(Exception):
    """Base class for errors in ``shared_schema``."""


class ProtocolError(SchemaError):
    """A frame could not be decoded into a protocol message.

    ``code`` is a short machine-readable reason (``invalid_json``, ``invalid_message``,
    ``unknown_type``); the message text says what was wrong, for logs and refusals.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
