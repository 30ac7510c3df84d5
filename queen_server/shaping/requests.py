"""The job a worker gets for a chat request (the Responses API's too, once translated).

Workers get the messages and the sampling fields; what only the queen acts on (``QUEEN_ONLY``:
the tools, and the identifiers and hints it accepts with no effect) stays on the queen. A
request with tools goes out as the tools' instructions plus a ``json_schema`` response format
(``shaping.tools``), and a conversation that used tools has its calls and results turned into
plain turns, so that any worker with a grammar can serve it and any twin can continue it.
"""

from __future__ import annotations

from typing import Any

from queen_server.shaping.tools import ToolPlan, plan, worker_messages
from shared_schema.openai_requests import ChatCompletionRequest

# What stays on the queen: tools become a grammar, the rest changes nothing a worker does.
QUEEN_ONLY = frozenset({
    "tools", "tool_choice", "parallel_tool_calls", "stream_options", "user",
    "safety_identifier", "prompt_cache_key", "store", "service_tier", "modalities",
})


def chat_job(req: ChatCompletionRequest) -> tuple[dict[str, Any], ToolPlan | None]:
    """The worker's request for ``req``, and the plan its tool calls are read back with (None
    when the request had no tools to call). Runs for every chat request: one dump, and the
    messages rewritten only when tools were used."""
    job = req.model_dump(mode="json", exclude_unset=True, by_alias=True, exclude=QUEEN_ONLY)
    tool_plan = None
    if req.tools:
        body = req.model_dump(mode="json", include={"tools", "tool_choice",
                                                    "parallel_tool_calls"})
        tool_plan = plan(body["tools"], body["tool_choice"], body["parallel_tool_calls"])
    if tool_plan is not None or any(m.tool_calls or m.role == "tool" for m in req.messages):
        job["messages"] = worker_messages(job["messages"], tool_plan)
    if tool_plan is not None:
        job["response_format"] = tool_plan.response_format
    elif req.response_format is not None and req.response_format.type == "text":
        del job["response_format"]
    return job, tool_plan
