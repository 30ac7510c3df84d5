"""The original system's three messages must be accepted exactly as written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from shared_schema import (
    ChatCompletion,
    ChatCompletionRequest,
    Hello,
    LegacyRegistration,
    LegacyRequest,
    NvGpu,
    ProtocolError,
    decode,
    encode,
    looks_like_registration,
)
from tests.support.workers import LegacyWorker, new_key, signed_hello

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "original"


def _text(name: str) -> str:
    return (FIXTURES / f"{name}.json").read_text(encoding="utf-8")


def _json(name: str) -> dict[str, Any]:
    return orjson.loads(_text(name))


def test_fixtures_hold_exactly_the_original_messages():
    assert _json("registration") == {
        "ln_url": "http://example.com", "cpu_count": 8, "disk_space": 500, "vram": 2048,
        "nv_gpu_count": 1, "nv_driver_version": "465.19.01",
        "nv_gpus": [{"name": "NVIDIA Tesla K80", "memory": 11441}],
    }
    assert _json("request") == {
        "openai_url": "/v1/chat/completion",
        "openai_req": {
            "model": "TheBloke/CoolModelv2:Q4_K_M",
            "messages": [{"role": "user", "content": "Who won the world series in 2020?"}],
        },
    }
    assert _json("response") == {
        "choices": [{
            "message": {"role": "assistant",
                        "content": "The Los Angeles Dodgers won the World Series in 2020."},
            "finish_reason": "stop", "index": 0,
        }],
        "usage": {"prompt_tokens": 56, "completion_tokens": 31, "total_tokens": 87},
    }


def test_scripted_legacy_worker_speaks_the_original_messages():
    assert _json("registration") == LegacyWorker.REGISTRATION
    assert _json("response") == LegacyWorker.ANSWER


# --- registration ------------------------------------------------------------------------------


def test_registration_parses_with_values_intact():
    # Strict validation (no extra="ignore"): every original field is known.
    registration = LegacyRegistration.model_validate_json(_text("registration"))
    assert registration.ln_url == "http://example.com"
    assert registration.cpu_count == 8
    assert registration.disk_space == 500
    assert registration.vram == 2048
    assert registration.nv_gpu_count == 1
    assert registration.nv_driver_version == "465.19.01"
    assert registration.nv_gpus == [NvGpu(name="NVIDIA Tesla K80", memory=11441)]
    assert registration.cl_gpus == []
    assert registration.cl_driver_version is None


def test_registration_round_trips():
    original = _json("registration")
    registration = LegacyRegistration.model_validate(original)
    assert registration.model_dump(exclude_defaults=True) == original
    assert orjson.loads(registration.model_dump_json(exclude_defaults=True)) == original


def test_registration_is_recognised_and_typed_messages_are_not():
    assert looks_like_registration(_json("registration")) is True
    hello = signed_hello(new_key(), "ab" * 16, models=[])
    hello_body = orjson.loads(encode(hello))
    # A hello carries cpu_count, vram and ln_url too, but it is typed.
    assert {"cpu_count", "vram"} <= hello_body.keys()
    assert looks_like_registration(hello_body) is False
    assert looks_like_registration({"type": "ping", "ts": 0}) is False
    assert looks_like_registration(_json("request")) is False
    assert looks_like_registration(_json("response")) is False


def test_registration_is_not_a_protocol_message():
    registration = _text("registration")
    with pytest.raises(ProtocolError) as info:
        decode(registration)
    assert info.value.code == "unknown_type"
    # The same facts fit into a v1 hello's fields unchanged.
    fields = set(_json("registration"))
    assert fields <= set(Hello.model_fields)


# --- request -----------------------------------------------------------------------------------


def test_request_parses_and_its_body_is_a_chat_completion_request():
    original = _json("request")
    request = LegacyRequest.model_validate_json(_text("request"))
    assert request.openai_url == "/v1/chat/completion"
    body = ChatCompletionRequest.model_validate(request.openai_req)
    assert body.model == "TheBloke/CoolModelv2:Q4_K_M"
    assert len(body.messages) == 1
    assert body.messages[0].role == "user"
    assert body.messages[0].content == "Who won the world series in 2020?"
    assert body.stream is False
    assert body.choices == 1
    assert body.model_dump(exclude_unset=True) == original["openai_req"]


def test_request_round_trips():
    original = _json("request")
    request = LegacyRequest.model_validate(original)
    assert request.model_dump() == original
    assert orjson.loads(request.model_dump_json()) == original


# --- response ----------------------------------------------------------------------------------


def test_response_validates_as_chat_completion_with_usage_intact():
    answer = ChatCompletion.model_validate_json(_text("response"))
    assert answer.usage.model_dump() == {"prompt_tokens": 56, "completion_tokens": 31,
                                         "total_tokens": 87}
    assert len(answer.choices) == 1
    choice = answer.choices[0]
    assert choice.index == 0
    assert choice.finish_reason == "stop"
    assert choice.message.role == "assistant"
    assert choice.message.content == "The Los Angeles Dodgers won the World Series in 2020."
    # The original answer has no id/model/created; the defaults fill in.
    assert answer.object == "chat.completion"
    assert answer.id == ""


def test_response_round_trips():
    original = _json("response")
    answer = ChatCompletion.model_validate(original)
    assert answer.model_dump(exclude_unset=True) == original
    assert orjson.loads(answer.model_dump_json(exclude_unset=True)) == original
