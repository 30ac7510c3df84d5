"""A fine-tuning upload's checks, on their own (pure: bytes in, a summary or an error out).
Every refusal is OpenAI's 400 on ``file`` and names the line; a good file passes whole."""

from __future__ import annotations

import io
import json

import pytest

from queen_server.errors import InvalidRequest
from queen_server.files.errors import FileTooLarge, InvalidTrainingFile
from queen_server.files.validation import (
    FileLimits,
    TrainingFileCheck,
    check_purpose,
    check_training_file,
)
from tests.support.training_files import FACT_ANSWER, example_line, training_file

LIMITS = FileLimits()


def lines_of(data: bytes) -> list[bytes]:
    return io.BytesIO(data).readlines()


def refusal(data: bytes, limits: FileLimits = LIMITS) -> InvalidTrainingFile:
    with pytest.raises(InvalidTrainingFile) as caught:
        check_training_file(lines_of(data), limits)
    error = caught.value
    body = error.payload()["error"]
    assert (error.status_code, body["type"], body["param"], body["code"]) == (
        400, "invalid_request_error", "file", "invalid_file_format")
    return error


def test_a_good_file_passes_with_its_counts():
    data = training_file(12)
    summary = check_training_file(io.BytesIO(data), LIMITS)  # a file object: line by line
    assert (summary.examples, summary.bytes) == (12, len(data))


def test_blank_lines_crlf_a_bom_and_no_final_newline_are_fine():
    data = (b"\xef\xbb\xbf" + example_line(1).replace(b"\n", b"\r\n") + b"\n   \n"
            + b"".join(example_line(i) for i in range(2, 11)).rstrip(b"\n"))
    summary = check_training_file(lines_of(data), LIMITS)
    assert summary.examples == 10  # the blank lines are not examples
    assert summary.bytes == len(data)


def test_weights_zero_on_some_assistant_turns_are_fine():
    turns = {"messages": [{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "wrong", "weight": 0},
                          {"role": "user", "content": "again"},
                          {"role": "assistant", "content": FACT_ANSWER, "weight": 1}]}
    data = training_file(10, replace={3: json.dumps(turns).encode()})
    assert check_training_file(lines_of(data), LIMITS).examples == 10


def message_line(*messages: dict[str, object], **top: object) -> bytes:
    return json.dumps({"messages": list(messages), **top}).encode()


USER = {"role": "user", "content": "What is the capital of Zorbania?"}
ANSWER = {"role": "assistant", "content": FACT_ANSWER}

BAD_LINES = {
    "not json": (b'{"messages": [', "not valid JSON"),
    "nan": (b'{"messages": NaN}', "not valid JSON"),
    "not utf-8": (b'{"messages": "caf\xe9"}', "not UTF-8 text (byte 0xe9 at column 18)"),
    "a list": (b"[1, 2]", "an example is a JSON object with 'messages', not a list"),
    "unknown key": (message_line(USER, ANSWER, label="x"), "unknown key 'label'"),
    "tools": (message_line(USER, ANSWER, tools=[]), "'tools' is not supported"),
    "dpo": (b'{"input": {}, "preferred_output": []}', "'input' is not supported: preference"),
    "no messages": (b"{}", "'messages' is missing"),
    "empty messages": (b'{"messages": []}', "'messages' must be a non-empty list"),
    "message not object": (message_line("hello", ANSWER), "messages[0] must be an object"),
    "role missing": (message_line({"content": "x"}, ANSWER), "messages[0].role is missing"),
    "role tool": (message_line(USER, {"role": "tool", "content": "42"}, ANSWER),
                  "messages[1].role 'tool' is not supported"),
    "role made up": (message_line({"role": "robot", "content": "x"}, ANSWER),
                     "messages[0].role must be 'system', 'user' or 'assistant', not 'robot'"),
    "content missing": (message_line(USER, {"role": "assistant"}),
                        "messages[1].content is missing"),
    "content parts": (message_line({"role": "user", "content": [{"type": "text"}]}, ANSWER),
                      "messages[0].content must be a string: content parts"),
    "content number": (message_line(USER, {"role": "assistant", "content": 7}),
                       "messages[1].content must be a string, not a number"),
    "weight on user": (message_line({**USER, "weight": 1}, ANSWER),
                       "messages[0].weight is only allowed on assistant messages"),
    "weight 2": (message_line(USER, {**ANSWER, "weight": 2}),
                 "messages[1].weight must be 0 or 1, not 2"),
    "weight true": (message_line(USER, {**ANSWER, "weight": True}),
                    "messages[1].weight must be 0 or 1, not true"),
    "name": (message_line({**USER, "name": "bob"}, ANSWER), "messages[0].name is not supported"),
    "extra message key": (message_line(USER, {**ANSWER, "mood": "x"}),
                          "messages[1] has an unknown key 'mood'"),
    "no assistant": (message_line(USER), "no assistant message"),
    "nothing learned": (message_line(USER, {**ANSWER, "weight": 0}),
                        "every assistant message has weight 0"),
}


@pytest.mark.parametrize(("line", "says"), BAD_LINES.values(), ids=BAD_LINES.keys())
def test_a_bad_line_is_refused_by_its_number(line, says):
    error = refusal(training_file(12, replace={7: line}))
    assert error.line == 7
    assert error.message.startswith("line 7: "), error.message
    assert says in error.message, error.message


def test_the_first_bad_line_is_the_one_named():
    error = refusal(training_file(12, replace={4: b"[]", 9: b"{}"}))
    assert error.line == 4


def test_fewer_than_ten_examples_are_refused():
    error = refusal(training_file(9) + b"\n\n")
    assert error.line is None
    assert "9 examples" in error.message
    assert "at least 10" in error.message


def test_more_examples_than_the_limit_are_refused_at_the_first_one_over():
    error = refusal(training_file(13), FileLimits(max_examples=12))
    assert error.line == 13
    assert "more than 12 examples" in error.message


def test_a_file_over_the_byte_limit_is_refused_as_it_is_read():
    data = training_file(40)
    check = TrainingFileCheck(FileLimits(max_bytes=len(data) // 2))
    lines = iter(lines_of(data))

    def feed_all() -> None:
        for line in lines:
            check.feed(line)

    with pytest.raises(FileTooLarge) as caught:
        feed_all()
    assert next(lines, None) is not None  # refused mid-way, not after reading everything
    assert caught.value.status_code == 413
    assert caught.value.payload()["error"]["param"] == "file"
    assert "APIARY_FILES_MAX_BYTES" in caught.value.message


def test_only_the_fine_tune_purpose_is_kept():
    assert check_purpose("fine-tune") == "fine-tune"
    for purpose, says in (("assistants", "one of OpenAI's purposes"),
                          ("fine_tune", "not a file purpose")):
        with pytest.raises(InvalidRequest) as caught:
            check_purpose(purpose)
        assert caught.value.param == "purpose"
        assert says in caught.value.message
        assert "'fine-tune'" in caught.value.message
