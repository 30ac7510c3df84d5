"""The fast path is one middleware among others: the hot routes (chat completions, embeddings)
skip FastAPI's router, but no middleware, no route table and no error renderer of their own.

A real queen over real HTTP, with scripted workers: a middleware added after ``create_app``
wraps the hot routes' answers, errors included; each hot route is declared once; and an error on
a hot route is rendered and counted exactly as one on any other route.
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.routing import iter_route_contexts
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from queen_server.http.fastpath import FastPath
from tests.support.queen import running_queen
from tests.support.workers import ECHO_MODEL, ScriptedWorker

HOT = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")
USER = [{"role": "user", "content": "one two three"}]
DEV_KEY = "dev-key-for-fastpath-tests"
ERROR_FIELDS = ["message", "type", "param", "code"]


class Stamp:
    """A plain ASGI middleware: notes each HTTP answer's status and adds a header to it."""

    def __init__(self, app: ASGIApp, seen: list[tuple[str, str, int]]) -> None:
        self.app = app
        self.seen = seen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.seen.append((scope["method"], scope["path"], message["status"]))
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-stamp", b"asgi")]}
            await send(message)

        await self.app(scope, receive, stamped)


def add_stamp(app: FastAPI, seen: list[tuple[str, str, int]]) -> None:
    app.add_middleware(Stamp, seen=seen)


def add_http_middleware(app: FastAPI, seen: list[tuple[str, str, int]]) -> None:
    """The decorator form, ``@app.middleware("http")`` (a ``BaseHTTPMiddleware``)."""

    @app.middleware("http")
    async def stamp(request: Request, call_next: Callable[[Request], Any]) -> Response:
        response = await call_next(request)
        seen.append((request.method, request.url.path, response.status_code))
        response.headers["x-stamp"] = "http"
        return response


@contextlib.asynccontextmanager
async def serving(tmp_path: Path, prepare: Callable[[FastAPI], None] = lambda app: None,
                  **overrides: Any) -> AsyncIterator[tuple[FastAPI, str]]:
    """``create_app``, then ``prepare(app)`` (before it starts), served on a free port in this
    event loop (``tests.support.queen``). Yields the app and its base URL."""
    async with running_queen(tmp_path, prepare=prepare, **overrides) as queen:
        yield queen.app, queen.base_url


def error_counts(metrics: str) -> Counter[str]:
    """``apiary_errors_total`` by code, from the Prometheus text."""
    return Counter({code: int(float(value)) for code, value in re.findall(
        r'^apiary_errors_total\{code="([^"]+)"\} (\S+)$', metrics, re.MULTILINE)})


@pytest.mark.parametrize("add", [add_stamp, add_http_middleware], ids=["asgi", "decorator"])
async def test_middleware_added_after_create_app_wraps_the_hot_routes(tmp_path, add):
    seen: list[tuple[str, str, int]] = []
    async with serving(tmp_path, lambda app: add(app, seen)) as (app, base_url):
        stamp = "asgi" if add is add_stamp else "http"
        ws_url = base_url.replace("http", "ws", 1) + "/worker"
        worker = await ScriptedWorker(ws_url, max_jobs=2).start()
        try:
            async with httpx.AsyncClient(base_url=base_url, trust_env=False) as http:
                answers = {
                    "chat": await http.post("/v1/chat/completions",
                                            json={"model": ECHO_MODEL, "messages": USER}),
                    "stream": await http.post("/v1/chat/completions", json={
                        "model": ECHO_MODEL, "messages": USER, "stream": True}),
                    "embeddings": await http.post("/v1/embeddings",
                                                  json={"model": ECHO_MODEL, "input": "abc"}),
                    "unknown model": await http.post("/v1/chat/completions", json={
                        "model": "no/such:model", "messages": USER}),
                    "bad body": await http.post("/v1/embeddings", json={"model": ECHO_MODEL}),
                    "not json": await http.post("/v1/chat/completions", content=b"{"),
                    "models": await http.get("/v1/models"),
                }
        finally:
            await worker.stop()
    statuses = {name: answer.status_code for name, answer in answers.items()}
    assert statuses == {"chat": 200, "stream": 200, "embeddings": 200, "unknown model": 404,
                        "bad body": 400, "not json": 400, "models": 200}
    # Every answer went through the middleware, which could change it.
    assert {name: answer.headers.get("x-stamp") for name, answer in answers.items()} == {
        name: stamp for name in answers}
    assert answers["chat"].json()["choices"][0]["message"]["content"] == "echo: one two three"
    assert answers["stream"].text.rstrip().endswith("data: [DONE]")
    assert answers["unknown model"].json()["error"]["code"] == "model_not_found"
    assert answers["bad body"].json()["error"]["param"] == "input"
    assert [entry for entry in seen if entry[1] in HOT] == [
        ("POST", "/v1/chat/completions", 200), ("POST", "/v1/chat/completions", 200),
        ("POST", "/v1/embeddings", 200), ("POST", "/v1/chat/completions", 404),
        ("POST", "/v1/embeddings", 400), ("POST", "/v1/chat/completions", 400)]
    # The fast path is still the innermost middleware, and there once.
    assert [m.cls for m in app.user_middleware].count(FastPath) == 1
    assert app.user_middleware[-1].cls is FastPath


async def test_each_hot_route_is_declared_once(tmp_path):
    async with (serving(tmp_path) as (app, base_url),
                httpx.AsyncClient(base_url=base_url, trust_env=False) as http):
        spec = (await http.get("/openapi.json")).json()
        wrong_method = await http.get("/v1/chat/completions")
    fast = [m for m in app.user_middleware if m.cls is FastPath]
    assert len(fast) == 1
    handlers = fast[0].kwargs["handlers"]
    assert set(handlers) == {("POST", path) for path in HOT}
    for path in HOT:
        # app.routes holds the included routers; their routes are its route contexts.
        routes = [context.original_route for context in iter_route_contexts(app.routes)
                  if context.path == path]
        assert len(routes) == 1, path
        assert routes[0].methods == {"POST"}
        # The route the docs show is the very handler the fast path calls.
        assert routes[0].endpoint is handlers[("POST", path)]
        assert list(spec["paths"][path]) == ["post"]
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["$ref"].startswith("#/components/schemas/")
    operation_ids = Counter(operation["operationId"] for item in spec["paths"].values()
                            for operation in item.values())
    assert [op for op, count in operation_ids.items() if count > 1] == []
    # Other methods on a hot path get the router's 405, in OpenAI's shape.
    assert wrong_method.status_code == 405
    assert wrong_method.headers["allow"] == "POST"
    assert list(wrong_method.json()["error"]) == ERROR_FIELDS


async def test_hot_and_ordinary_routes_share_one_error_renderer(tmp_path):
    async with serving(tmp_path, auth="keys", api_keys=[DEV_KEY]) as (_app, base_url):
        key = {"Authorization": f"Bearer {DEV_KEY}"}
        async with httpx.AsyncClient(base_url=base_url, trust_env=False) as http:
            before = error_counts((await http.get("/metrics")).text)
            hot = {
                "no key": await http.post("/v1/chat/completions",
                                          json={"model": ECHO_MODEL, "messages": USER}),
                "no model": await http.post("/v1/embeddings", headers=key,
                                            json={"model": "no/such:model", "input": "x"}),
                "bad body": await http.post("/v1/chat/completions", headers=key,
                                            json={"model": ECHO_MODEL}),
            }
            ordinary = {
                "no key": await http.get("/v1/models"),
                "no route": await http.get("/v1/nothing-here", headers=key),
                "bad query": await http.get("/worker/stats", params={"key": "nope"}),
                "bad path": await http.post("/admin/keys/seven/credit", json={"sats": 1}),
            }
            after = error_counts((await http.get("/metrics")).text)
    answers = [*hot.values(), *ordinary.values()]
    assert [answer.status_code for answer in answers] == [401, 404, 400, 401, 404, 400, 400]
    for answer in answers:
        assert answer.headers["content-type"] == "application/json"
        body = answer.json()
        assert list(body) == ["error"]
        assert list(body["error"]) == ERROR_FIELDS
    # The same refusal reads the same on a hot route and on an ordinary one.
    assert hot["no key"].json() == ordinary["no key"].json()
    assert hot["no key"].json()["error"]["code"] == "missing_api_key"
    # Every error answered, hot or not, was counted by its code.
    assert after - before == Counter(answer.json()["error"]["code"] for answer in answers)
