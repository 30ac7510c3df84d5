"""The score job and score result wire shapes (issue 16): round trips, lenient reading of a newer
auditor's additions, and each malformed result refused by ``ScoreData.read`` with its field."""

from __future__ import annotations

import copy
import math
from typing import Any

import orjson
import pytest

from shared_schema import (
    SCORE_OBJECT,
    SCORE_URL,
    InvalidScoreData,
    Job,
    SampledScores,
    ScoreData,
    ScoreJob,
    capabilities,
)
from shared_schema.audits import MAX_SCORED_TOKENS


def greedy() -> dict[str, Any]:
    return {"object": "apiary.score", "prompt_tokens": 12, "answer_tokens": 3,
            "logprobs": [-0.1, -2.5, 0.0], "argmax": [True, False, True],
            "best_logprobs": [-0.1, -0.3, 0.0], "end_logprob": -0.2,
            "end_best_logprob": -0.2, "temperature": 0.0, "sampled": None}


def sampled() -> dict[str, Any]:
    return {**greedy(), "temperature": 0.7, "sampled": {
        "logprobs": [-0.05, -3.1, -0.0], "expected": [-0.2, -0.4, -0.01],
        "variances": [0.3, 0.5, 0.0], "end": [-0.5, -0.6, 0.2]}}


def test_a_greedy_result_round_trips():
    data = greedy()
    read = ScoreData.read(data)
    assert read.sampled is None
    assert read.argmax == [True, False, True]
    # an auditor from before issue 39 sends neither: it replayed no grammar or penalties
    assert read.model_dump(mode="json") == {**data, "constraints_replayed": False,
                                             "format_broken_at": None}
    assert ScoreData.read(orjson.loads(orjson.dumps(read.model_dump(mode="json")))) == read


def test_a_sampled_result_round_trips():
    read = ScoreData.read(sampled())
    assert read.sampled == SampledScores(logprobs=[-0.05, -3.1, 0.0],
                                         expected=[-0.2, -0.4, -0.01],
                                         variances=[0.3, 0.5, 0.0], end=(-0.5, -0.6, 0.2))
    assert ScoreData.read(orjson.loads(orjson.dumps(read.model_dump(mode="json")))) == read


def test_no_end_token_and_a_tiny_positive_rounding_are_accepted():
    data = sampled()
    data.update(end_logprob=None, end_best_logprob=None)
    data["sampled"]["end"] = None
    data["logprobs"][0] = 5e-7  # a certain token, rounded a hair above 0
    assert ScoreData.read(data).end_logprob is None


def test_a_newer_auditors_extra_fields_are_ignored():
    data = sampled()
    data["entropy"] = [1.0, 2.0, 3.0]
    data["sampled"]["skew"] = 0.1
    assert ScoreData.read(data).temperature == 0.7


def bad(change) -> dict[str, Any]:
    data = copy.deepcopy(sampled())
    change(data)
    return data


@pytest.mark.parametrize(("data", "says"), [
    (bad(lambda d: d.update(object="chat.completion")), "object"),
    (bad(lambda d: d.update(answer_tokens=4)), "4 answer tokens"),
    (bad(lambda d: d.update(answer_tokens=0)), "answer_tokens"),
    (bad(lambda d: d.update(prompt_tokens=-1)), "prompt_tokens"),
    (bad(lambda d: d["argmax"].pop()), "'argmax' has 2 entries"),
    (bad(lambda d: d["best_logprobs"].append(-1.0)), "'best_logprobs' has 4 entries"),
    (bad(lambda d: d["sampled"]["logprobs"].pop()), "2 logprobs, 3 expected"),
    (bad(lambda d: [d["sampled"][key].pop() for key in ("logprobs", "expected", "variances")]),
     "'sampled.logprobs' has 2 entries for 3 answer tokens"),
    (bad(lambda d: d["sampled"]["expected"].pop()), "2 expected"),
    (bad(lambda d: d["sampled"]["variances"].append(0.1)), "4 variances"),
    (bad(lambda d: d["logprobs"].__setitem__(1, math.nan)), "logprobs.1"),
    (bad(lambda d: d["best_logprobs"].__setitem__(0, -math.inf)), "best_logprobs.0"),
    (bad(lambda d: d["sampled"]["expected"].__setitem__(0, math.nan)), "expected.0"),
    (bad(lambda d: d["sampled"]["variances"].__setitem__(0, math.inf)), "variances.0"),
    (bad(lambda d: d.update(end_logprob=math.nan)), "end_logprob"),
    (bad(lambda d: d.update(temperature=math.inf)), "temperature"),
    (bad(lambda d: d["logprobs"].__setitem__(0, 0.5)), "logprobs.0"),
    (bad(lambda d: d["sampled"]["logprobs"].__setitem__(2, 0.01)), "sampled.logprobs.2"),
    (bad(lambda d: d.update(end_best_logprob=0.1)), "end_best_logprob"),
    (bad(lambda d: d["sampled"]["variances"].__setitem__(1, -0.01)), "variances.1"),
    (bad(lambda d: d["sampled"].update(end=[-0.5, -0.6, -0.2])), "end.2"),
    (bad(lambda d: d["sampled"].update(end=[-0.5, -0.6])), "end"),
    (bad(lambda d: d.update(temperature=-0.5)), "temperature"),
    (bad(lambda d: d.update(sampled=None)), "needs 'sampled'"),
    (bad(lambda d: d.update(temperature=0.0)), "greedy request"),
    (bad(lambda d: d.pop("logprobs")), "logprobs"),
    (bad(lambda d: d.update(argmax=["maybe", False, True])), "argmax.0"),
])
def test_a_malformed_result_is_refused_by_name(data, says):
    with pytest.raises(InvalidScoreData, match="malformed score result") as caught:
        ScoreData.read(data)
    assert says in str(caught.value)
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("data", [None, [], "apiary.score", 3])
def test_a_result_that_is_not_an_object_is_refused(data):
    with pytest.raises(InvalidScoreData, match="must be an object"):
        ScoreData.read(data)


def test_an_overlong_result_is_refused():
    n = MAX_SCORED_TOKENS + 1
    data = {**greedy(), "answer_tokens": n, "logprobs": [0.0] * n, "argmax": [True] * n,
            "best_logprobs": [0.0] * n}
    with pytest.raises(InvalidScoreData, match="answer_tokens"):
        ScoreData.read(data)


def test_a_score_job_is_a_job_with_the_score_url():
    job = ScoreJob(model="smol", kind="chat",
                   request={"messages": [{"role": "user", "content": "hi"}]}, answer="Hello!")
    frame = Job(id="a1", openai_url=SCORE_URL, openai_req=job.model_dump())
    assert ScoreJob.model_validate(frame.openai_req) == job
    assert capabilities.needs(SCORE_URL, frame.openai_req) == {}
    assert SCORE_OBJECT == "apiary.score"
    with pytest.raises(ValueError, match="kind"):
        ScoreJob(model="smol", kind="embeddings", request={}, answer="x")  # type: ignore[arg-type]


def test_the_auditor_capability_is_named_and_never_needed():
    assert capabilities.CAPABILITY_AUDITOR == capabilities.AUDITOR == "auditor"
    assert capabilities.AUDITOR not in capabilities.needs("/v1/chat/completions",
                                                         {"logprobs": True, "n": 2})
