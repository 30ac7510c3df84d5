"""The parts of an answer an audit re-scores one by one (issue 39: every shape). Pure.

A score job scores one answer to one prompt. An answer of several shapes is cut into such
parts: each choice of ``n``; each prompt of a text completion's list (choice ``i`` answers
prompt ``i // n``, as OpenAI orders them); a completion with ``echo`` (the echoed prompt taken
off the front: only a text prompt's echo can be); and after a failover, one worker's part of
the answer, scored given the text the workers before it delivered (``prefix``). Each part
carries the request its score job replays (one prompt, ``n`` 1, no ``echo``) and which prompt
it answers, so that the auditor's prompt counts add up with each prompt counted once, as the
worker counts it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# The most parts one case holds: a request of more choices or prompts is not audited whole
# (its score jobs would cost more than it is worth; the queen caps n and prompt lists anyway).
MAX_PARTS = 16


@dataclass(frozen=True, slots=True)
class Delivered:
    """What one worker delivered for one choice: its text, why it ended ("failover" when its
    worker was lost mid-answer), and the text earlier workers delivered before it."""

    index: int
    text: str
    finish_reason: str = "stop"
    prefix: str = ""


@dataclass(frozen=True, slots=True)
class AuditPart:
    """One answer to one prompt, as one score job re-scores it."""

    request: dict[str, Any]  # the request the score job replays
    answer: str
    finish_reason: str = "stop"
    prefix: str = ""
    prompt_index: int = 0  # which prompt it answers (each counted once)

    @property
    def ended_by_model(self) -> bool:
        """The model chose to end here: "stop" without a stop string that could have cut it."""
        return self.finish_reason == "stop" and not self.request.get("stop")


def prompts_of(prompt: Any) -> list[Any] | None:
    """A text completion's prompts: one text, one list of token ids, or a list of either;
    None for anything else."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(item, int) and not isinstance(item, bool) for item in prompt):
            return [prompt]
        if all(isinstance(item, str) for item in prompt) \
                or all(isinstance(item, list) for item in prompt):
            return list(prompt)
    return None


def audit_parts(kind: str, request: Mapping[str, Any],
                delivered: Sequence[Delivered]) -> tuple[AuditPart, ...] | None:
    """The parts of an answer of ``kind`` ("chat" or "completions") to ``request``, from what
    was delivered per choice; None when it cannot be audited (no text, more than
    ``MAX_PARTS``, a prompt it cannot tell, an echo of token ids)."""
    if not delivered or len(delivered) > MAX_PARTS:
        return None
    n = request.get("n") if isinstance(request.get("n"), int) else 1
    n = max(1, n)
    base = {key: value for key, value in request.items() if key not in ("n", "echo")}
    prompts: list[Any] = [None]
    if kind == "completions":
        found = prompts_of(request.get("prompt"))
        if found is None:
            return None
        prompts = found
    parts = []
    for item in delivered:
        index = item.index // n
        if not 0 <= index < len(prompts):
            return None
        text = item.text
        part_request = dict(base)
        if kind == "completions":
            part_request["prompt"] = prompts[index]
            if request.get("echo") and not item.prefix:
                if not isinstance(prompts[index], str) or not text.startswith(prompts[index]):
                    return None  # an echo of token ids: its text cannot be told apart here
                text = text[len(prompts[index]):]
        if text:
            parts.append(AuditPart(part_request, text, item.finish_reason, item.prefix, index))
    return tuple(parts) or None
