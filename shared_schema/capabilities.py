"""What a worker says it can do (``Hello.capabilities``), and what a job needs of it.

Every capability is additive: a worker without one is never sent a job that needs it, and a
request that needs one no connected worker of its model has is refused with a 400 naming the
field, never answered by a worker that would drop it. ``needs`` is the queen's reading of a job,
the same for every attempt and failover of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Continue an answer another worker began (``Job.continuation``).
CONTINUE = "continue"
# ``response_format`` json_object / json_schema, enforced by a grammar; with ``continuation``
# the grammar first accepts the text delivered so far. (Tools are sent as a json_schema.)
GRAMMAR = "grammar"
# ``logprobs`` and ``top_logprobs`` on every content chunk and whole answer.
LOGPROBS = "logprobs"
# ``logit_bias`` (token ids of the model's vocabulary).
LOGIT_BIAS = "logit_bias"
# ``n`` > 1: the choices one after another, each chunk's ``index`` set.
CHOICES = "choices"
# ``/v1/completions`` jobs: a raw prompt (text or token ids), no chat template.
COMPLETIONS = "completions"
# ``/v1/embeddings`` jobs whose inputs are token ids.
EMBED_TOKENS = "embed_tokens"
# ``/apiary/score`` jobs (issue 16's re-scoring audits): per-token log-probabilities of a
# delivered answer in one teacher-forced pass. The queen sends them only to workers with this.
SCORE = "score"
# Trains LoRA adapters for fine-tuning jobs (issue 37): its owner opted in. The queen takes a
# fine-tuning job only for a base model such a worker holds.
TRAIN = "train"
# Serves fine-tuned models (issue 37): a job whose ``Job.adapter`` names a base model it holds
# and a LoRA adapter, fetched from the queen (``shared_schema.training.AdapterRef``).
LORA = "lora"
# Renders images (issue 38): its owner opted in ("Images"), and it runs stable-diffusion.cpp.
# The queen sends ``/v1/images/generations`` jobs (``shared_schema.images.ImageOrder``) only to
# workers with this, for diffusion models they hold (``ModelDescriptor.kind`` "image").
IMAGE = "image"
# A worker its operator offers as an audit-only re-scorer for the queen's operator (issue 16:
# trusted auditors, which the queen prefers). It says who runs the worker; ``needs`` never asks it.
AUDITOR = "auditor"
CAPABILITY_AUDITOR = AUDITOR
# Takes ``fetch`` commands (issue 17): the queen may place a model on this worker, within its
# owner's disk quota. (Not the legacy ``fetch_models``, a worker that downloads whatever a job
# names before answering it.)
FETCH = "fetch"  # the name shared_schema exports, beside CAPABILITY_CONTINUE
# Joins model groups (issue 19): its llama.cpp has the RPC backend (the hello's
# ``llama_build``: which build), its owner lets it, and it speaks every group frame, relayed too.
RPC = "rpc"

# What a field of a job's request needs, with the field a refusal names.
_FIELD_NEEDS = (
    ("response_format", GRAMMAR),
    ("logprobs", LOGPROBS),
    ("logit_bias", LOGIT_BIAS),
    ("n", CHOICES),
)
_FIELDS = frozenset(field for field, _ in _FIELD_NEEDS)


def needs(openai_url: str, request: Mapping[str, Any]) -> dict[str, str]:
    """The capabilities a job needs, each with the request field that needs it (for the 400
    that names it). ``request`` is the job's request as the worker gets it."""
    out: dict[str, str] = {}
    if openai_url.endswith("/embeddings"):
        value = request.get("input")
        if isinstance(value, list) and value and not any(isinstance(v, str) for v in value):
            out[EMBED_TOKENS] = "input"
        return out
    if openai_url.endswith("/completions") and not openai_url.endswith("/chat/completions"):
        out[COMPLETIONS] = "prompt"
    elif _FIELDS.isdisjoint(request.keys()):  # a plain chat request: runs for every one
        return out
    for field, capability in _FIELD_NEEDS:
        value = request.get(field)
        if field == "response_format":
            if isinstance(value, Mapping) and value.get("type") not in (None, "text"):
                out[capability] = field
        elif field == "n":
            if isinstance(value, int) and value > 1:
                out[capability] = field
        elif value:
            out[capability] = field
    return out
