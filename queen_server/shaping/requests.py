"""The job a worker gets for a chat request (the Responses API's too, once translated).

Workers read role-and-text messages and the sampling fields only (``WORKER_FIELDS``); the
identifiers and hints the queen accepts with no effect stay on the queen. A request with tools
goes out as the tools' instructions plus a ``json_schema`` response format (``shaping.tools``),
and a conversation that used tools has its calls and results turned into plain turns, so that any
worker with a grammar can serve it and any twin can continue it.
"""

from __future__ import annotations

from typing import Any

from queen_server.shaping.tools import ToolPlan, plan, worker_messages
from shared_schema.openai_requests import ChatCompletionRequest

# What a chat job carries to its worker, besides the model and the messages.
WORKER_FIELDS = (
    "stream", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed",
    "n", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs",
)
TOOL_CALL_FORMAT = "tool_call"


def chat_job(req: ChatCompletionRequest) -> tuple[dict[str, Any], ToolPlan | None]:
    """The worker's request for ``req``, and the plan its tool calls are read back with (None
    when the request had no tools to call)."""
    body = req.model_dump(mode="json", exclude_unset=True, by_alias=True)
    tool_plan = plan(body.get("tools") or [], body.get("tool_choice"),
                     body.get("parallel_tool_calls")) if req.tools else None
    job: dict[str, Any] = {"model": req.model}
    if tool_plan is not None or any(m.tool_calls or m.role == "tool" for m in req.messages):
        job["messages"] = worker_messages(body["messages"], tool_plan)
    else:
        job["messages"] = [
            {key: value for key, value in message.items()
             if key in ("role", "content", "name") and value is not None}
            for message in body["messages"]
        ]
    for name in WORKER_FIELDS:
        if name in body and body[name] is not None:
            job[name] = body[name]
    if tool_plan is not None:
        job["response_format"] = {"type": "json_schema", "json_schema": {
            "name": TOOL_CALL_FORMAT, "schema": tool_plan.schema, "strict": True}}
    elif req.response_format is not None and req.response_format.type != "text":
        job["response_format"] = body["response_format"]
    return job, tool_plan
