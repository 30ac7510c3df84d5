"""The relay's batch encoder (issue 40): ``encode_events`` writes the very bytes the
``ClusterEvents`` model would, for every kind of frame, without building the model."""

from __future__ import annotations

import pytest

from shared_schema import Chunk, JobError, Result, Usage
from shared_schema.cluster import (
    MAX_BATCH_EVENTS,
    Accepted,
    Assigned,
    ClusterEvents,
    KeepAlive,
    Lost,
    decode_cluster,
    encode_cluster,
    encode_events,
)

FRAMES = [
    Accepted(),
    Assigned(worker_key="aa" * 32, worker_id="w1", sha256="cd" * 32,
             shares=[("aa" * 32, 12), ("bb" * 32, 10)], group="0f" * 8),
    KeepAlive(),
    Chunk(id="r1.1", seq=0, tokens=3, data={
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
        "choices": [{"index": 0, "delta": {"content": "é \"quoted\" \u2028 \U0001f41d"},
                     "logprobs": {"content": [{"token": "x", "logprob": -0.25}]},
                     "finish_reason": None}]}),
    Result(id="r1.1", usage=Usage(prompt_tokens=5, completion_tokens=3, total_tokens=8)),
    JobError(id="r1.1", code="worker_error", message="out of memory", retryable=True),
    Lost(reason="the worker left"),
]


@pytest.mark.parametrize("job_id", ["r1.1", 'odd "id" \\ é'])
def test_the_batch_is_the_bytes_the_model_writes(job_id: str) -> None:
    for start in range(len(FRAMES)):
        frames = FRAMES[start:]
        fast = encode_events(job_id, 7 + start, frames)
        assert fast == encode_cluster(ClusterEvents(job_id=job_id, first_seq=7 + start,
                                                    frames=frames))
        decoded = decode_cluster(fast)
        assert isinstance(decoded, ClusterEvents)
        assert decoded.first_seq == 7 + start
        assert decoded.frames == frames


def test_a_batch_the_model_would_refuse_is_refused() -> None:
    with pytest.raises(ValueError, match="1 to"):
        encode_events("r1.1", 0, [])
    with pytest.raises(ValueError, match="1 to"):
        encode_events("r1.1", 0, [KeepAlive()] * (MAX_BATCH_EVENTS + 1))
    with pytest.raises(ValueError, match="seq"):
        encode_events("r1.1", -1, [KeepAlive()])
