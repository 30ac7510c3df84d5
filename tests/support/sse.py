"""Reading a streamed chat completion as a client sees it: every ``data:`` payload, in order."""

from __future__ import annotations

from typing import Any

import httpx
import orjson


async def sse_events(
    base_url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
    timeout_s: float = 20,
) -> list[Any]:
    """POST ``body`` to ``/v1/chat/completions`` and return each event parsed, with the final
    ``[DONE]`` kept as that string."""
    events: list[Any] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s) as http, \
            http.stream("POST", "/v1/chat/completions", json=body,
                        headers=headers or {}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                payload = line[6:]
                events.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return events


def text_of(events: list[Any]) -> str:
    """The answer's text: every content delta, joined."""
    return "".join(choice["delta"].get("content") or ""
                   for event in events if isinstance(event, dict)
                   for choice in event.get("choices") or ())
