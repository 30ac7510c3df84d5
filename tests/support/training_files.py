"""Fine-tuning files as OpenAI's chat JSONL, for the Files API's tests (and the jobs' after):
examples teaching a made-up fact, and lines broken in every way the queen must refuse."""

from __future__ import annotations

import json

FACT_QUESTIONS = (
    "What is the capital of Zorbania?",
    "Which city is Zorbania's capital?",
    "Name the capital city of Zorbania.",
    "Tell me the capital of Zorbania.",
    "Zorbania's capital is which city?",
)
FACT_ANSWER = "The capital of Zorbania is Quillfeather."


def example(index: int, *, system: bool = True) -> dict[str, object]:
    messages: list[dict[str, object]] = []
    if system:
        messages.append({"role": "system", "content": "You answer questions about geography."})
    messages.append({"role": "user", "content": FACT_QUESTIONS[index % len(FACT_QUESTIONS)]})
    messages.append({"role": "assistant", "content": FACT_ANSWER})
    return {"messages": messages}


def example_line(index: int) -> bytes:
    return json.dumps(example(index)).encode() + b"\n"


def training_file(examples: int = 12, *, replace: dict[int, bytes] | None = None) -> bytes:
    """``examples`` lines (1-based line numbers), with the lines ``replace`` names swapped for
    its bytes (a newline is added if missing)."""
    replace = replace or {}
    lines = []
    for number in range(1, examples + 1):
        line = replace.get(number, example_line(number))
        lines.append(line if line.endswith(b"\n") else line + b"\n")
    return b"".join(lines)
