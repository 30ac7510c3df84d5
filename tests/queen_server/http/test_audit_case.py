"""What the queen offers the audits for a finished answer (``generation.consider_audit``): the
text the client got. A plain answer whose worker sent checkpoints (as every real worker does
when generation runs past a second) is audited on its whole message, not on the text up to its
last checkpoint: auditing the prefix made an honest worker's usage look inflated, and a busy
machine's honest worker was flagged for it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from queen_server.http.generation import consider_audit
from queen_server.swarm.metering import UNBOUNDED
from queen_server.swarm.relay import Delivered
from shared_schema import Result, Usage
from shared_schema.answers import checkpoint_chunk

WORDS = ["The ", "sky ", "is ", "blue ", "and ", "wide ", "today."]


def state_recording(cases: list[Any]) -> Any:
    audits = SimpleNamespace(wants=lambda _key: True, consider=cases.append)
    return SimpleNamespace(audits=audits, catalog=SimpleNamespace(facts=lambda _m: None),
                           registry=SimpleNamespace(get=lambda _k: None))


def generation(stream: bool, prompt_bound: int = 10**9) -> Any:
    return SimpleNamespace(job_id="chatcmpl-1", model="org/m-GGUF:Q4_0",
                           worker_url="/v1/chat/completions", stream=stream,
                           meter=SimpleNamespace(prompt_bound=prompt_bound),
                           worker_req={"model": "org/m-GGUF:Q4_0", "temperature": 0,
                                       "messages": [{"role": "user", "content": "Sky?"}]})


@pytest.mark.parametrize("stream", [False, True])
def test_the_audit_sees_the_text_the_client_got(stream: bool) -> None:
    cases: list[Any] = []
    answer = Delivered(UNBOUNDED)
    usage = Usage(prompt_tokens=5, completion_tokens=len(WORDS), total_tokens=5 + len(WORDS))
    if stream:
        for word in WORDS:
            answer.take({"choices": [{"index": 0, "delta": {"content": word},
                                      "finish_reason": None}]})
        result = Result(id="j.1", data={}, usage=usage)
    else:  # a checkpoint of the first three words, then the whole answer
        answer.take(checkpoint_chunk(WORDS[:3]))
        result = Result(id="j.1", usage=usage, data={"choices": [{
            "index": 0, "finish_reason": "stop",
            "message": {"role": "assistant", "content": "".join(WORDS)}}]})
    consider_audit(state_recording(cases), generation(stream), None, "worker-key", answer,
                   result)
    [case] = cases
    assert case.answer == "".join(WORDS)
    assert case.claimed_prompt_tokens == 5  # what the worker claimed and the client paid for


def test_the_audit_sees_the_prompt_claim_as_billed() -> None:
    """A prompt claim past the queen's byte bound was billed at the bound: the audit judges
    what the client paid for (issue 39)."""
    cases: list[Any] = []
    usage = Usage(prompt_tokens=500, completion_tokens=1, total_tokens=501)
    result = Result(id="j.1", usage=usage, data={"choices": [{
        "index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Hi"}}]})
    consider_audit(state_recording(cases), generation(False, prompt_bound=40), None,
                   "worker-key", Delivered(UNBOUNDED), result)
    [case] = cases
    assert case.claimed_prompt_tokens == 40
