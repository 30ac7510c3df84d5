"""The OpenAI API end to end: the official SDK, a real queen, scripted workers on websockets."""

from __future__ import annotations

import base64
import struct

import httpx
import openai
import pytest

from tests.support.queen import running_queen
from tests.support.workers import ECHO_MODEL, ScriptedWorker, fake_embedding

USER = [{"role": "user", "content": "Who won the world series in 2020?"}]


@pytest.fixture
async def worker(queen):
    worker = await ScriptedWorker(queen.ws_url, max_jobs=4).start()
    yield worker
    await worker.stop()


async def test_plain_chat_answer_has_usage_and_queen_ids(queen, worker):
    answer = await queen.client().chat.completions.create(
        model=ECHO_MODEL, messages=USER, max_tokens=20, temperature=0.0, seed=1, stop=["\n"]
    )
    assert answer.choices[0].message.content == "echo: Who won the world series in 2020?"
    assert answer.choices[0].finish_reason == "stop"
    assert answer.model == ECHO_MODEL
    assert answer.id.startswith("chatcmpl-")
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (7, 8)
    assert answer.usage.total_tokens == 15
    job = worker.jobs[-1]
    assert job.openai_url == "/v1/chat/completions"
    assert job.openai_req["max_tokens"] == 20
    assert job.openai_req["seed"] == 1
    assert job.openai_req["stop"] == ["\n"]
    assert job.openai_req["messages"] == USER


async def test_streamed_chat_relays_chunks_then_usage_then_done(queen, worker):
    stream = await queen.client().chat.completions.create(
        model=ECHO_MODEL, messages=[{"role": "user", "content": "one two three"}],
        stream=True, stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "echo: one two three"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({chunk.id for chunk in chunks}) == 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 4


async def test_raw_sse_stream_ends_with_done(queen, worker):
    body = {"model": ECHO_MODEL, "messages": USER, "stream": True}
    async with httpx.AsyncClient(base_url=queen.base_url) as http:
        response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [line for line in response.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert all(event.startswith("data: {") for event in events[:-1])


async def test_embeddings_float_and_base64(queen, worker):
    client = queen.client()
    floats = await client.embeddings.create(
        model=ECHO_MODEL, input=["hello world", "bye"], encoding_format="float"
    )
    assert [item.embedding for item in floats.data] == [
        fake_embedding("hello world"), fake_embedding("bye")]
    assert floats.usage.prompt_tokens == 3
    # The SDK asks for base64 by default and decodes it itself.
    decoded = await client.embeddings.create(model=ECHO_MODEL, input="hello world")
    assert decoded.data[0].embedding == pytest.approx(fake_embedding("hello world"))
    assert worker.jobs[-1].openai_req["encoding_format"] == "float"
    async with httpx.AsyncClient(base_url=queen.base_url) as http:
        raw = (await http.post("/v1/embeddings", json={
            "model": ECHO_MODEL, "input": "abc", "encoding_format": "base64"})).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    assert struct.unpack("<4f", packed) == tuple(fake_embedding("abc"))


async def test_an_unbilled_request_without_max_tokens_gets_the_queens_default(queen, worker):
    """The queen's budget for an answer is ``default_max_tokens`` when the client sets none;
    the worker is told the same limit, so it stops there instead of failing the job."""
    await queen.client().chat.completions.create(
        model=ECHO_MODEL, messages=[{"role": "user", "content": "hi"}])
    assert worker.jobs[-1].openai_req["max_tokens"] == queen.state.settings.default_max_tokens
    await queen.client().chat.completions.create(
        model=ECHO_MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=7)
    assert "max_tokens" not in worker.jobs[-1].openai_req  # the client's own limit stands
    assert worker.jobs[-1].openai_req["max_completion_tokens"] == 7


async def test_models_lists_what_connected_workers_hold(queen, worker):
    other = await ScriptedWorker(queen.ws_url, models=[ECHO_MODEL, "b/c:Q8_0"],
                                 loaded=False).start()
    try:
        models = await queen.client().models.list()
        by_id = {model.id: model for model in models.data}
        assert set(by_id) == {ECHO_MODEL, "b/c:Q8_0"}
        extra = by_id[ECHO_MODEL].model_extra["apiary"]
        assert extra["workers"] == 2
        assert extra["loaded_on"] == 1
        # the workers say 135M parameters; the queen shows only what it read itself, and
        # prices a model on no hub as unverified (the test queen's class for those: tiny)
        assert extra["parameter_count"] is None
        assert extra["verified"] is False
        assert extra["price"] == {
            "size_class": "tiny", "prompt_msat_per_1k": 100, "completion_msat_per_1k": 200,
            "basis": "unverified", "reason": "unverified: the queen could not read this "
            "model's file on the hub, so it is priced as the tiny class, this queen's class for "
            "unverified models"}
    finally:
        await other.stop()
    await queen.wait_until(lambda: len(queen.state.registry) == 1)
    models = await queen.client().models.list()
    assert [model.id for model in models.data] == [ECHO_MODEL]


async def test_unknown_model_is_404_model_not_found(queen, worker):
    with pytest.raises(openai.NotFoundError) as caught:
        await queen.client().chat.completions.create(model="no/such:model", messages=USER)
    assert caught.value.code == "model_not_found"
    assert caught.value.body["param"] == "model"


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"model": ECHO_MODEL}, "messages", "missing_required_parameter"),
        ({"model": ECHO_MODEL, "messages": USER, "temperature": "hot"}, "temperature",
         "invalid_value"),
        ({"model": ECHO_MODEL, "messages": USER, "n": 0}, "n", "invalid_value"),
        ({"model": ECHO_MODEL, "messages": [{"role": "robot", "content": "x"}]},
         "messages.0.role", "invalid_value"),
        ({"model": ECHO_MODEL, "messages": USER, "max_tokens": 0}, "max_tokens",
         "invalid_value"),
    ],
)
async def test_validation_errors_are_400_with_param(queen, body, param, code):
    async with httpx.AsyncClient(base_url=queen.base_url) as http:
        response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    assert error["message"]


async def test_malformed_json_and_wrong_shapes_are_400(queen):
    async with httpx.AsyncClient(base_url=queen.base_url) as http:
        for content in (b"{not json", b"", b"[1, 2]", b'"text"'):
            response = await http.post(
                "/v1/chat/completions", content=content,
                headers={"content-type": "application/json"},
            )
            assert response.status_code == 400, content
            assert response.json()["error"]["type"] == "invalid_request_error"
        response = await http.post("/v1/embeddings", json={"model": ECHO_MODEL, "input": []})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "input"


async def test_oversized_body_is_413(tmp_path):
    async with running_queen(tmp_path, max_body_bytes=2048) as queen, \
            httpx.AsyncClient(base_url=queen.base_url) as http:
        big = {"model": ECHO_MODEL, "messages": [{"role": "user", "content": "x" * 5000}]}
        response = await http.post("/v1/chat/completions", json=big)
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"

        async def chunks():  # no Content-Length: the limit applies while reading
            for _ in range(10):
                yield b"x" * 1024

        response = await http.post("/v1/chat/completions", content=chunks())
        assert response.status_code == 413


async def test_unknown_route_and_method_use_openai_error_shape(queen):
    async with httpx.AsyncClient(base_url=queen.base_url) as http:
        missing = await http.get("/v1/nothing-here")
        wrong_method = await http.get("/v1/chat/completions")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["type"] == "invalid_request_error"


async def test_api_keys_are_enforced_when_configured(tmp_path):
    async with running_queen(tmp_path, auth="keys", api_keys="k-one, k-two") as queen:
        worker = await ScriptedWorker(queen.ws_url).start()
        try:
            with pytest.raises(openai.AuthenticationError) as caught:
                await queen.client(api_key="wrong").chat.completions.create(
                    model=ECHO_MODEL, messages=USER)
            assert caught.value.code == "invalid_api_key"
            async with httpx.AsyncClient(base_url=queen.base_url) as http:
                bare = await http.get("/v1/models")
            assert bare.status_code == 401
            assert bare.json()["error"]["code"] == "missing_api_key"
            answer = await queen.client(api_key="k-two").chat.completions.create(
                model=ECHO_MODEL, messages=USER)
            assert answer.choices[0].message.content.startswith("echo:")
        finally:
            await worker.stop()


async def test_health_and_openapi_docs(queen, worker):
    async with httpx.AsyncClient(base_url=queen.base_url) as http:
        health = (await http.get("/health")).json()
        spec = (await http.get("/openapi.json")).json()
        docs = await http.get("/docs")
    assert health["status"] == "ok"
    assert health["workers"] == 1
    assert health["models"] == [ECHO_MODEL]
    assert docs.status_code == 200
    chat = spec["paths"]["/v1/chat/completions"]["post"]
    ref = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert ref == "#/components/schemas/ChatCompletionRequest"
    assert "ChatMessage" in spec["components"]["schemas"]
