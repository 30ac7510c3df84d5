"""Fuzzing the /worker websocket with Hypothesis, against a real queen with honest workers.

Every example connects a fresh worker over a real websocket and sends it bad frames: random text
and bytes, truncated and mistyped messages, queen-only messages, job frames for another worker's
job in flight or for no job, non-finite numbers, frames over the size limit. The checks are in
``wsfuzz``: a typed answer to every frame, the honest workers untouched, the queen healthy.
Hypothesis runs in a thread; each example runs on the test's event loop, where the queen lives.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.queen_server.fuzz.frames import (
    MAX_BAD_FRAMES,
    answer_frames,
    handshake_frames,
    session_frames,
)
from tests.queen_server.fuzz.profiles import fuzz_settings, fuzz_timeout_s, run_in_loop
from tests.queen_server.fuzz.wsfuzz import ws_fuzz_harness

EXAMPLE_TIMEOUT_S = 60.0


pytestmark = pytest.mark.timeout(fuzz_timeout_s())


async def test_bad_frames_after_the_welcome_get_typed_answers(tmp_path):
    async with ws_fuzz_harness(tmp_path) as harness:
        loop = asyncio.get_running_loop()
        frames = st.lists(session_frames(harness.other_jobs), min_size=1,
                          max_size=MAX_BAD_FRAMES + 2)

        @fuzz_settings(ci_examples=120)
        @given(frames=frames)
        def example(frames):
            run_in_loop(loop, harness.session_example(frames), EXAMPLE_TIMEOUT_S)

        await asyncio.to_thread(example)
        await harness.finish()
        tally = harness.tally
        assert tally.examples >= 100
        # Every kind of bad frame was tried, and every kind of answer was seen.
        assert set(tally.by_kind) >= {"text", "binary", "json", "truncated", "wrong_types",
                                      "message", "job_frame", "oversized", "big"}
        assert {"error unknown_job", "error invalid_json", "error bad_relay_frame",
                "error unexpected_message", "close 1009"} <= set(tally.answers)


async def test_bad_first_frames_are_refused_with_a_code(tmp_path):
    async with ws_fuzz_harness(tmp_path) as harness:
        loop = asyncio.get_running_loop()

        @fuzz_settings(ci_examples=100)
        @given(frame=handshake_frames(), v1=st.booleans())
        def example(frame, v1):
            run_in_loop(loop, harness.handshake_example(frame, v1=v1), EXAMPLE_TIMEOUT_S)

        await asyncio.to_thread(example)
        await harness.finish()
        assert harness.tally.examples >= 100
        assert {"error invalid_json", "error binary_frame", "error unexpected_message",
                "error frame_too_large"} <= set(harness.tally.answers)


async def test_malformed_answers_to_a_workers_own_job_are_a_typed_failure(tmp_path):
    async with ws_fuzz_harness(tmp_path) as harness:
        loop = asyncio.get_running_loop()

        @fuzz_settings(ci_examples=80)
        @given(frames=answer_frames(), stream=st.booleans(), embeddings=st.booleans())
        def example(frames, stream, embeddings):
            run_in_loop(loop, harness.own_job_example(frames, stream=stream,
                                                      embeddings=embeddings), EXAMPLE_TIMEOUT_S)

        await asyncio.to_thread(example)
        await harness.finish()
        answers = harness.tally.answers
        assert answers.get("http 200", 0) > 0
        assert answers.get("http 502", 0) > 0
