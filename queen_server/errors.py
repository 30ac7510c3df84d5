"""Errors the queen raises, each carrying its OpenAI-shaped HTTP rendering."""

from __future__ import annotations

from shared_schema import ErrorDetail, ErrorResponse


class QueenError(Exception):
    """Base class for the queen's errors."""


class ApiError(QueenError):
    """An error answered to an API client as ``{"error": {message, type, param, code}}``."""

    status_code = 500
    error_type = "server_error"
    code: str | None = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, object] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}
        # Fields added to the error object beside OpenAI's four (``estimated_time`` of a model
        # that is loading, the ``candidates`` of an ambiguous model name).
        self.extra = extra or {}

    def body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorDetail(
                message=self.message, type=self.error_type, param=self.param, code=self.code
            )
        )

    def payload(self) -> dict[str, object]:
        """The JSON body: ``{"error": {message, type, param, code, ...extra}}``."""
        body = self.body().model_dump()
        body["error"].update(self.extra)
        return body


class InvalidRequest(ApiError):
    status_code = 400
    error_type = "invalid_request_error"
    code = "invalid_value"


class Unauthorized(ApiError):
    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(ApiError):
    """Refused whoever asks: e.g. an admin cookie's POST from another site's page."""

    status_code = 403
    error_type = "permission_error"
    code = "forbidden"


class NotFound(ApiError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class PaymentRequired(ApiError):
    """The key's balance or spend budget cannot cover what the request may cost."""

    status_code = 402
    error_type = "insufficient_quota"
    code = "insufficient_balance"


class RateLimited(ApiError):
    status_code = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"


class LimitsUnavailable(ApiError):
    """A key's rate or concurrency limit could not be checked (the shared Redis is down): the
    request is refused rather than admitted past a limit the operator set."""

    status_code = 503
    error_type = "server_error"
    code = "limits_unavailable"


class KeyNotFound(ApiError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "key_not_found"


class PayloadTooLarge(ApiError):
    status_code = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class WorkerFailed(ApiError):
    """Every attempt on a worker failed, or a worker failed after the answer had started."""

    status_code = 502
    error_type = "server_error"
    code = "worker_error"


class NoCapacity(ApiError):
    """No worker could take the job in time; the client should retry later."""

    status_code = 503
    error_type = "server_error"
    code = "no_capacity"


class GatewayTimeout(ApiError):
    status_code = 504
    error_type = "timeout_error"
    code = "timeout"


class HandshakeRefused(QueenError):
    """A worker's handshake was refused; ``code`` goes into the ``refused`` message."""

    def __init__(self, code: str, reason: str, close_code: int = 1008) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.close_code = close_code


class ModelUnverified(QueenError):
    """The queen could not read a model's header from the hub (it is priced as unverified).

    ``lasting``: the hub answered and the name cannot be read (no such repo, no single GGUF
    file); otherwise the hub was out of reach or failed, and a later try may work. ``kind``
    says which, for the answer a developer gets when the model is asked for on demand
    (``catalog.resolution.refusal``): ``not_found``, ``gated``, ``no_match``, ``ambiguous``
    (with ``candidates``), ``unpinned``, ``invalid`` or ``unreachable``."""

    def __init__(self, message: str, *, lasting: bool, kind: str | None = None,
                 candidates: list[str] | None = None) -> None:
        super().__init__(message)
        self.lasting = lasting
        self.kind = kind or ("invalid" if lasting else "unreachable")
        self.candidates = candidates or []


class ModelLoading(NoCapacity):
    """The model is being fetched onto a worker: try again in ``estimated_time`` seconds."""

    code = "model_loading"


class ModelForbidden(ApiError):
    """A model the queen will not fetch: gated on the hub, or outside the operator's lists."""

    status_code = 403
    error_type = "permission_error"
    code = "model_not_allowed"
