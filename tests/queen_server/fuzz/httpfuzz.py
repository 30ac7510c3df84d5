"""Fuzzing the queen's HTTP API with Schemathesis, from the queen's own ``/openapi.json``.

``HttpFuzzHarness`` runs a real queen (``running_queen``) on 127.0.0.1 with an honest
``ScriptedWorker`` connected, loads the spec the queen serves, and sends Schemathesis's cases to
it over real HTTP (``requests``). Each case is checked for: no 5xx, a documented status code,
the documented content type and headers, a body that matches its schema, a proper ``Allow`` on
405s, and, for every error, OpenAI's ``{"error": {message, type, param, code}}`` shape.

Cases are steered a little so that they get past the front door: half of the generated chat
and embedding requests name the model the honest worker serves (so 200 answers, plain and
streamed, are validated too), and each request carries a valid credential, a wrong one, or none.

Shared by ``test_http_fuzz.py`` (bounded, for CI) and ``bench/fuzz.py`` (bigger runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import requests
import schemathesis
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

from shared_schema import ErrorResponse, earnings_auth_payload, queen_origin
from tests.queen_server.fuzz.wsfuzz import ErrorLog
from tests.support.queen import QueenHarness, running_queen
from tests.support.workers import ECHO_MODEL, ScriptedWorker

ADMIN_TOKEN = "fuzz-admin-token"
REQUEST_TIMEOUT_S = 15.0
# What the queen promises. Left out: Schemathesis's ``positive_data_acceptance`` and
# ``negative_data_rejection``, since the queen validates with pydantic's lax conversions ("3" for
# an int, false for a float) and checks a few rules JSON Schema cannot say (only n=1).
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance, unsupported_method]


def error_shape(response: requests.Response) -> str | None:
    """Why an error response is not OpenAI's error shape, or None if it is (or not an error)."""
    if response.status_code < 400:
        return None
    try:
        body = ErrorResponse.model_validate_json(response.content)
    except ValueError as exc:
        return f"{response.status_code} body is not an ErrorResponse: {exc}"
    if not body.error.message or not body.error.type:
        return f"{response.status_code} error has no message or type: {response.text}"
    return None


@dataclass
class HttpTally:
    requests: int = 0
    by_status: Counter[int] = field(default_factory=Counter)
    by_operation: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)


class HttpFuzzHarness:
    """A real queen with one honest worker, its spec, and the credentials to reach every route."""

    def __init__(self, queen: QueenHarness, *, billed: bool) -> None:
        self.queen = queen
        self.billed = billed
        self.tally = HttpTally()
        self.errors = ErrorLog()
        self.worker = ScriptedWorker(queen.ws_url)
        self.api_key = "sk-none"
        self.session = requests.Session()
        self.session.trust_env = False
        self.schema: Any = None

    async def start(self) -> None:
        self.errors.attach()
        await self.worker.start()
        await self.queen.wait_until(lambda: len(self.queen.state.registry) == 1)
        async with httpx.AsyncClient(base_url=self.queen.base_url, trust_env=False) as http:
            if self.billed:  # a funded key, made through the admin API itself
                made = await http.post("/admin/keys", json={"name": "fuzz", "credit_sats": 10**6},
                                       headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
                assert made.status_code == 201, made.text
                self.api_key = made.json()["key"]
        url = f"{self.queen.base_url}/openapi.json"
        self.schema = await asyncio.to_thread(schemathesis.openapi.from_url, url)

    async def stop(self) -> None:
        self.errors.detach()
        self.session.close()
        await self.worker.stop()

    def strategy(self) -> st.SearchStrategy[tuple[Any, str, bool]]:
        """Schemathesis's cases for every operation, valid (positive) and not (negative), with a
        credential choice and a model switch."""
        cases = st.one_of(self.schema.as_strategy(GenerationMode.POSITIVE),
                          self.schema.as_strategy(GenerationMode.NEGATIVE))
        return st.tuples(cases, st.sampled_from(["valid", "valid", "wrong", "none"]),
                         st.booleans())

    def credentials(self, path: str, choice: str) -> dict[str, str]:
        if choice == "none":
            return {}
        if path.startswith("/admin"):
            token = ADMIN_TOKEN if choice == "valid" else "not-the-token"
            return {"Authorization": f"Bearer {token}"}
        if path == "/worker/earnings":
            return {"Authorization": self.worker_signature(valid=choice == "valid")}
        return {"Authorization": f"Bearer {self.api_key if choice == 'valid' else 'sk-wrong'}"}

    def worker_signature(self, *, valid: bool) -> str:
        stamp = int(time.time())
        signed = earnings_auth_payload(self.worker.pubkey, stamp if valid else stamp + 1,
                                       queen_origin(self.queen.base_url))
        return f"Apiary-Worker {self.worker.pubkey}.{stamp}.{self.worker.key.sign(signed).hex()}"

    def run_case(self, case: Any, choice: str, served_model: bool) -> None:
        """Send one case to the queen and check the answer; raises on a failed check."""
        path = case.operation.path
        if served_model and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = ECHO_MODEL
        self.tally.requests += 1
        self.tally.by_operation[f"{case.method} {path}"] += 1
        response = case.call(base_url=self.queen.base_url, session=self.session,
                             headers=self.credentials(path, choice), timeout=REQUEST_TIMEOUT_S)
        self.tally.by_status[response.status_code] += 1
        try:
            case.validate_response(response, checks=CHECKS)
            problem = error_shape(response)
            assert problem is None, problem
            logged = self.errors.new()
            assert not logged, f"the queen logged errors: {logged}"
        except BaseException as exc:
            self.tally.failures.append(f"{case.method} {path} -> {response.status_code}: "
                                       f"{str(exc)[:300]}")
            raise


@contextlib.asynccontextmanager
async def http_fuzz_harness(tmp_path: Path, *, billed: bool) -> AsyncIterator[HttpFuzzHarness]:
    settings: dict[str, Any] = {"auth": "keys", "admin_token": ADMIN_TOKEN} if billed else {
        "auth": "open"}
    async with running_queen(tmp_path, **settings) as queen:
        harness = HttpFuzzHarness(queen, billed=billed)
        await harness.start()
        try:
            yield harness
        finally:
            await harness.stop()
