"""Fuzzing the HTTP API with Schemathesis against the queen's own OpenAPI spec, over real HTTP.

Two queens: one requiring keys (billing on, a funded key, the admin API on) and one open (no
admin token, so the admin routes are off). The checks are in ``httpfuzz``: no 5xx, the documented
statuses, content types and bodies, and OpenAI's error shape for every error. Hypothesis runs in
a thread and sends blocking requests; the queen answers from the test's event loop.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given

from tests.queen_server.fuzz.httpfuzz import http_fuzz_harness
from tests.queen_server.fuzz.profiles import fuzz_settings, fuzz_timeout_s

pytestmark = pytest.mark.timeout(fuzz_timeout_s())


@pytest.mark.parametrize("billed", [True, False], ids=["keys", "open"])
async def test_the_http_api_keeps_its_own_spec(tmp_path, billed):
    async with http_fuzz_harness(tmp_path, billed=billed) as harness:

        @fuzz_settings(ci_examples=120)
        @given(drawn=harness.strategy())
        def example(drawn):
            case, credentials, served_model = drawn
            harness.run_case(case, credentials, served_model)

        await asyncio.to_thread(example)
        tally = harness.tally
        assert tally.requests >= 120
        assert not tally.failures
        # The fuzz got past the front door: real answers and real refusals both came back.
        assert tally.by_status[200] > 0
        assert tally.by_status[400] > 0
        assert tally.by_status[401 if billed else 404] > 0
