"""What the queen offers the audits for a finished answer (``auditing.consider_audit``): the
text the client got, cut into the parts an auditor scores one by one (issue 39: each choice,
each prompt of a list, an echo's completion, each worker's span of a failover). A plain answer
whose worker sent checkpoints (as every real worker does when generation runs past a second) is
audited on its whole message, not on the text up to its last checkpoint: auditing the prefix
made an honest worker's usage look inflated, and a busy machine's honest worker was flagged
for it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from queen_server.http.auditing import consider_audit
from queen_server.swarm.metering import UNBOUNDED
from queen_server.swarm.relay import Delivered
from shared_schema import Result, Usage
from shared_schema.answers import checkpoint_chunk

WORDS = ["The ", "sky ", "is ", "blue ", "and ", "wide ", "today."]


def state_recording(cases: list[Any]) -> Any:
    audits = SimpleNamespace(wants=lambda _key, failed_over=False: True, consider=cases.append)
    catalog = SimpleNamespace(audit_file=lambda _model, _sha256: "a" * 64,  # a pinned file
                              served_files=lambda _model: None)
    return SimpleNamespace(audits=audits, catalog=catalog,
                           registry=SimpleNamespace(get=lambda _k: None))


def generation(stream: bool, prompt_bound: int = 10**9, **request: Any) -> Any:
    return SimpleNamespace(job_id="chatcmpl-1", model="org/m-GGUF:Q4_0",
                           worker_url=request.pop("url", "/v1/chat/completions"), stream=stream,
                           meter=SimpleNamespace(prompt_bound=prompt_bound),
                           worker_req={"model": "org/m-GGUF:Q4_0", "temperature": 0,
                                       "messages": [{"role": "user", "content": "Sky?"}],
                                       **request})


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


USAGE = Usage(prompt_tokens=5, completion_tokens=9, total_tokens=14)


@pytest.mark.parametrize("stream", [False, True])
def test_each_choice_of_n_is_a_part(stream: bool) -> None:
    cases: list[Any] = []
    answer = Delivered(UNBOUNDED)
    texts = {0: "Blue, mostly.", 1: "Grey today.", 2: "Dark at night."}
    if stream:  # the choices' pieces arrive interleaved
        for word in range(3):
            for index, text in texts.items():
                piece = text.split(" ")[word] if word < len(text.split(" ")) else ""
                if piece:
                    answer.take({"choices": [{"index": index, "delta": {
                        "content": piece if word == 0 else " " + piece}, "finish_reason": None}]})
        for index in texts:
            answer.take({"choices": [{"index": index, "delta": {}, "finish_reason": "stop"}]})
        result = Result(id="j.1", data={}, usage=USAGE)
    else:
        result = Result(id="j.1", usage=USAGE, data={"choices": [
            {"index": i, "finish_reason": "stop", "message": {"role": "assistant",
                                                              "content": text}}
            for i, text in texts.items()]})
    consider_audit(state_recording(cases), generation(stream, n=3), None, "worker-key", answer,
                   result)
    [case] = cases
    assert [part.answer for part in case.score_parts] == list(texts.values())
    assert all("n" not in job["request"] for job in case.jobs())
    assert {part.prompt_index for part in case.score_parts} == {0}  # one prompt, counted once
    assert case.claimed_completion_tokens == 9  # the one claim for all three


def test_each_prompt_of_a_list_and_an_echo_are_parts() -> None:
    cases: list[Any] = []
    prompts = ["Roses are", "The sky is"]
    result = Result(id="j.1", usage=USAGE, data={"choices": [
        {"index": i, "finish_reason": "length", "text": prompt + " red, they say"}
        for i, prompt in enumerate(prompts)]})
    gen = generation(False, url="/v1/completions", prompt=prompts, echo=True)
    consider_audit(state_recording(cases), gen, None, "worker-key", Delivered(UNBOUNDED),
                   result)
    [case] = cases
    assert [job["request"]["prompt"] for job in case.jobs()] == prompts
    assert [part.answer for part in case.score_parts] == [" red, they say"] * 2  # echo off
    assert [part.prompt_index for part in case.score_parts] == [0, 1]
    assert all("echo" not in job["request"] for job in case.jobs())


def test_each_workers_span_of_a_failover_is_a_case_given_the_text_before_it() -> None:
    """A worker lost mid-answer is credited its part: its span is audited (more often), and
    the worker that finished is audited on its own span after the first's text."""
    cases: list[Any] = []
    wanted: list[tuple[str, bool]] = []

    def wants(key: str, failed_over: bool = False) -> bool:
        wanted.append((key, failed_over))
        return True

    state = state_recording(cases)
    state.audits.wants = wants
    answer = Delivered(UNBOUNDED)
    for word in WORDS[:3]:
        answer.take({"choices": [{"index": 0, "delta": {"content": word},
                                  "finish_reason": None}]})
    answer.lost(SimpleNamespace(key="first-key", shares=()))
    for word in WORDS[3:]:
        answer.take({"choices": [{"index": 0, "delta": {"content": word},
                                  "finish_reason": None}]})
    answer.take({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    consider_audit(state, generation(True), None, "second-key", answer,
                   Result(id="j.1", data={}, usage=USAGE))
    first, second = cases
    assert wanted == [("first-key", True), ("second-key", False)]
    assert (first.worker_key, first.answer, first.score_parts[0].prefix) == (
        "first-key", "".join(WORDS[:3]), "")
    assert first.finish_reason == "failover"
    assert (second.worker_key, second.answer, second.score_parts[0].prefix) == (
        "second-key", "".join(WORDS[3:]), "".join(WORDS[:3]))
    assert second.jobs()[0]["prefix"] == "".join(WORDS[:3])
    assert first.claimed_prompt_tokens is None  # no prompt claim is judged on a part
