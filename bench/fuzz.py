"""A bigger fuzz of the queen than CI runs: the worker websocket and the HTTP API, counted, timed.

It drives the same harnesses as the fuzz tests (``tests/queen_server/fuzz``), each against a real
queen on 127.0.0.1 in this process's event loop, with Hypothesis drawing at random in a thread:

* ``ws-session``: a welcomed worker sends 1-10 bad frames per example (random text and bytes,
  truncated and mistyped messages, queen-only messages, frames for another worker's job in flight,
  non-finite numbers, frames over the size limit) while two honest workers stay connected;
* ``ws-handshake``: one bad first frame per connection, with and without the v1 subprotocol;
* ``ws-own-job``: a worker answers a real request for its own model (chat, plain or streamed,
  or embeddings) with chunks and an end in good and bad shapes, then leaves; the client must
  get a 200 in the right shape or a 502 in OpenAI's error shape;
* ``http-keys`` / ``http-open``: Schemathesis cases (valid and invalid) from the queen's own
  ``/openapi.json``, with keys required (a funded key, the admin API on) and in open mode.

Unlike the tests, a failing example does not stop the run: it is counted, its first line kept,
and the run goes on. A "failure" is any check that did not hold: a missing or wrong answer, a
5xx, a response off the spec, an error not in OpenAI's shape, a changed honest worker, an error
logged by the queen.

    .venv/bin/python bench/fuzz.py                                  # ~2 min on 2 cores
    .venv/bin/python bench/fuzz.py --ws-session 3000 --ws-handshake 1000 --ws-own-job 1000 \
        --http 1500
    .venv/bin/python bench/fuzz.py --seed 1                         # a repeatable draw

See bench/RESULTS.md ("Fuzzing").
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")

from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.errors import HypothesisDeprecationWarning  # noqa: E402

from tests.queen_server.fuzz.frames import (  # noqa: E402
    MAX_BAD_FRAMES,
    answer_frames,
    handshake_frames,
    session_frames,
)
from tests.queen_server.fuzz.httpfuzz import http_fuzz_harness  # noqa: E402
from tests.queen_server.fuzz.wsfuzz import ws_fuzz_harness  # noqa: E402

EXAMPLE_TIMEOUT_S = 60.0


@dataclass
class Row:
    part: str
    examples: int = 0
    frames: int = 0
    requests: int = 0
    failures: int = 0
    server_errors: int = 0
    wall_s: float = 0.0
    first_failures: list[str] = field(default_factory=list)
    detail: str = ""


def hypothesis_settings(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))


def run_examples(row: Row, strategy: st.SearchStrategy[Any], body: Callable[[Any], None],
                 examples: int, seed_value: int | None) -> None:
    """Hypothesis over ``strategy``; a failing example is counted, and the run goes on."""

    @hypothesis_settings(examples)
    @given(drawn=strategy)
    def example(drawn: Any) -> None:
        row.examples += 1
        try:
            body(drawn)
        except Exception as exc:  # counted, not raised: the run is a census, not a test
            row.failures += 1
            if len(row.first_failures) < 5:
                row.first_failures.append(f"{type(exc).__name__}: {str(exc)[:300]}")

    if seed_value is not None:
        example = seed(seed_value)(example)
    example()


def in_loop(loop: asyncio.AbstractEventLoop, coroutine: Any) -> None:
    asyncio.run_coroutine_threadsafe(coroutine, loop).result(EXAMPLE_TIMEOUT_S)


async def fuzz_ws(tmp: Path, session_examples: int, handshake_examples: int,
                  own_job_examples: int, seed_value: int | None) -> list[Row]:
    rows = []
    loop = asyncio.get_running_loop()
    for part, examples in (("ws-session", session_examples),
                           ("ws-handshake", handshake_examples),
                           ("ws-own-job", own_job_examples)):
        if not examples:
            continue
        row = Row(part)
        started = time.perf_counter()
        async with ws_fuzz_harness(tmp / part) as harness:
            if part == "ws-session":
                strategy: st.SearchStrategy[Any] = st.lists(
                    session_frames(harness.other_jobs), min_size=1, max_size=MAX_BAD_FRAMES + 2)

                def body(frames: Any, harness: Any = harness) -> None:
                    in_loop(loop, harness.session_example(frames))
            elif part == "ws-handshake":
                strategy = st.tuples(handshake_frames(), st.booleans())

                def body(drawn: Any, harness: Any = harness) -> None:
                    in_loop(loop, harness.handshake_example(drawn[0], v1=drawn[1]))
            else:
                strategy = st.tuples(answer_frames(), st.booleans(), st.booleans())

                def body(drawn: Any, harness: Any = harness) -> None:
                    frames, stream, embeddings = drawn
                    in_loop(loop, harness.own_job_example(frames, stream=stream,
                                                          embeddings=embeddings))

            await asyncio.to_thread(run_examples, row, strategy, body, examples, seed_value)
            try:
                await harness.finish()
            except Exception as exc:
                row.failures += 1
                row.first_failures.append(f"after the run: {exc}")
        row.wall_s = time.perf_counter() - started
        row.frames = harness.tally.frames
        statuses = {int(key.split()[1]): n for key, n in harness.tally.answers.items()
                    if key.startswith("http ")}
        row.requests = sum(statuses.values())
        # A 502 is the typed answer to a worker's malformed answer; any other 5xx is not.
        row.server_errors = sum(n for status, n in statuses.items() if status >= 500
                                and status != 502)
        answers = sorted(harness.tally.answers.items(), key=lambda item: -item[1])
        row.detail = ", ".join(f"{answer}: {count}" for answer, count in answers)
        rows.append(row)
    return rows


async def fuzz_http(tmp: Path, examples: int, seed_value: int | None) -> list[Row]:
    rows = []
    for billed in (True, False):
        row = Row("http-keys" if billed else "http-open")
        started = time.perf_counter()
        async with http_fuzz_harness(tmp / row.part, billed=billed) as harness:

            def body(drawn: Any, harness: Any = harness) -> None:
                case, credentials, served_model = drawn
                harness.run_case(case, credentials, served_model)

            await asyncio.to_thread(run_examples, row, harness.strategy(), body, examples,
                                    seed_value)
        row.wall_s = time.perf_counter() - started
        row.requests = harness.tally.requests
        row.server_errors = sum(n for status, n in harness.tally.by_status.items()
                                if status >= 500)
        statuses = sorted(harness.tally.by_status.items())
        row.detail = ", ".join(f"{status}: {count}" for status, count in statuses)
        rows.append(row)
    return rows


def print_table(rows: list[Row], total_s: float) -> None:
    print(f"# {os.cpu_count()} CPUs, Python {platform.python_version()}, {sys.platform}")
    print("| part | examples | frames | requests | failures | 5xx | wall s |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row.part} | {row.examples} | {row.frames or '-'} | {row.requests or '-'} | "
              f"{row.failures} | {row.server_errors if row.requests else '-'} | "
              f"{row.wall_s:.1f} |")
    frames = sum(row.frames for row in rows)
    requests = sum(row.requests for row in rows)
    failures = sum(row.failures for row in rows)
    errors = sum(row.server_errors for row in rows)
    print(f"| **all** | {sum(row.examples for row in rows)} | {frames} | {requests} | "
          f"{failures} | {errors} | {total_s:.1f} |")
    print()
    for row in rows:
        print(f"{row.part} answers: {row.detail}")
        for failure in row.first_failures:
            print(f"  failure: {failure}")


async def main_async(args: argparse.Namespace) -> int:
    # The queen logs a warning for every bad frame it refuses; errors still reach the harnesses.
    logging.getLogger().setLevel(logging.ERROR)
    # Schemathesis's strategies use `random`, which Hypothesis warns about once per strategy.
    warnings.filterwarnings("ignore", category=HypothesisDeprecationWarning)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="apiary-fuzz-") as tmp:
        rows = await fuzz_ws(Path(tmp), args.ws_session, args.ws_handshake, args.ws_own_job,
                             args.seed)
        if args.http:
            rows += await fuzz_http(Path(tmp), args.http, args.seed)
    print_table(rows, time.perf_counter() - started)
    return 1 if any(row.failures for row in rows) else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ws-session", type=int, default=1000,
                        help="websocket examples after the welcome (1-10 frames each)")
    parser.add_argument("--ws-handshake", type=int, default=500,
                        help="websocket examples with one bad first frame")
    parser.add_argument("--ws-own-job", type=int, default=500,
                        help="websocket examples where a worker answers its own job badly")
    parser.add_argument("--http", type=int, default=600,
                        help="Schemathesis requests per queen (keys, then open)")
    parser.add_argument("--seed", type=int, default=None, help="a repeatable Hypothesis draw")
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
