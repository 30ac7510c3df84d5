"""A job's prompt-cache scope (issue 36): 32 lowercase hex digits or nothing, and a frame that
carries it stays readable by a worker that does not know the field."""

from __future__ import annotations

from typing import Any, Literal

import orjson
import pytest
from pydantic import ValidationError

from shared_schema import Job, ProtocolError, decode, encode
from shared_schema.base import WireModel
from shared_schema.cluster import ClusterJob

SCOPE = "0123456789abcdef" * 2


def test_a_job_carries_its_scope_through_a_frame():
    job = Job(id="j1", openai_url="/v1/chat/completions", openai_req={"messages": []},
              cache_scope=SCOPE)
    assert decode(encode(job)) == job
    assert orjson.loads(encode(job))["cache_scope"] == SCOPE


def test_a_job_without_a_scope_reads_as_none():
    frame = orjson.dumps({"type": "job", "id": "j1", "openai_url": "/v1/chat/completions",
                          "openai_req": {}})
    decoded = decode(frame)
    assert isinstance(decoded, Job)
    assert decoded.cache_scope is None


@pytest.mark.parametrize("scope", [
    "0123456789ABCDEF" * 2,  # upper case
    SCOPE[:-1],  # 31 digits
    SCOPE + "0",  # 33
    "g" * 32,  # not hex
    "key:7",  # a caller in clear
    "",
])
def test_anything_but_32_lowercase_hex_digits_is_refused(scope: str):
    with pytest.raises(ValidationError):
        Job(id="j1", openai_url="/v1/chat/completions", openai_req={}, cache_scope=scope)
    frame = orjson.dumps({"type": "job", "id": "j1", "openai_url": "/v1/chat/completions",
                          "openai_req": {}, "cache_scope": scope})
    with pytest.raises(ProtocolError) as caught:
        decode(frame)
    assert caught.value.code == "invalid_message"
    with pytest.raises(ValidationError):
        ClusterJob(job_id="j1", origin="a", reply_to="b", model="m", openai_url="/v1/x",
                   openai_req={}, timeout_s=1.0, cache_scope=scope)


class OlderJob(WireModel):
    """A job as a worker from before issue 36 knows it."""

    type: Literal["job"] = "job"
    id: str
    openai_url: str
    openai_req: dict[str, Any]
    continuation: str | None = None


def test_a_worker_that_does_not_know_the_field_still_reads_the_job():
    frame = encode(Job(id="j1", openai_url="/v1/chat/completions",
                       openai_req={"messages": [{"role": "user", "content": "Hi"}]},
                       cache_scope=SCOPE))
    older = OlderJob.model_validate_json(frame, extra="ignore")  # as ``decode`` reads frames
    assert older.openai_req == {"messages": [{"role": "user", "content": "Hi"}]}
    # And this worker, too, reads a frame of a later queen with fields it does not know.
    body = orjson.loads(frame)
    body["cache_policy_v9"] = {"anything": 1}
    decoded = decode(orjson.dumps(body))
    assert isinstance(decoded, Job)
    assert decoded.cache_scope == SCOPE
