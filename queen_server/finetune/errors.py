"""Errors of training on workers (issue 37), each with its OpenAI rendering
(``queen_server.errors.ApiError``): what a worker's transfers are refused with."""

from __future__ import annotations

from queen_server.errors import InvalidRequest, NotFound, PayloadTooLarge, Unauthorized


class TransferRefused(Unauthorized):
    """No token, a wrong one, another attempt's, or one whose attempt is no longer its job's
    current running one: the same answer for each, so a guesser learns nothing."""

    code = "invalid_transfer_token"

    def __init__(self) -> None:
        super().__init__("This transfer needs the running training attempt's own token "
                         "(Authorization: Bearer <TrainOrder.token>); this one is not valid "
                         "for it, or the attempt has ended.", param="authorization")


class BadUploadName(InvalidRequest):
    code = "invalid_upload_name"

    def __init__(self, name: str) -> None:
        shown = name if len(name) <= 80 else name[:77] + "..."
        super().__init__(f"{shown!r} is not an upload a training job makes: "
                         "'checkpoint-NNNNNNNN.gguf' or 'adapter.gguf'.", param="name")


class UploadTooLarge(PayloadTooLarge):
    """An upload past the attempt's bound, refused while it came in: nothing was kept."""

    code = "upload_too_large"


class NoCheckpoint(NotFound):
    code = "no_checkpoint"


class AdapterRefused(Unauthorized):
    """An adapter's transfer without the token the queen gave this worker for it in a job, or
    for a model that is no longer served (deleted): the same answer for each."""

    code = "invalid_adapter_token"

    def __init__(self) -> None:
        super().__init__("This adapter is sent only with the token a job for its fine-tuned "
                         "model gave this worker (Authorization: Bearer <AdapterRef.token>), "
                         "and only while the model exists.", param="authorization")
