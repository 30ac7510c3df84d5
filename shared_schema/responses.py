"""The Responses API's request body (``POST /v1/responses``), as the queen serves it.

``ResponsesRequest`` holds exactly the fields ``openai_fields.RESPONSES`` does not refuse; the
queen translates it into a chat completion request (``queen_server.shaping.responses``), so
everything checked here is what that translation needs to be valid. ``input`` is a string or
the items the openai SDK sends: messages (text parts only), ``function_call`` items and their
``function_call_output``, and the assistant ``message`` and ``function_call`` items of an
earlier response passed back as they came.

Anything the queen cannot honour is refused with an error whose location names the field
(``tools.0.type``, ``input.2.content.1.type``, ``text.format.schema``): a wrong ``type`` goes
to a ``_Refused`` branch whose only check fails on ``type``; unions are told apart by callable
discriminators tagged ``type:...``, which the 400's ``param`` leaves out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from shared_schema.base import WireModel
from shared_schema.openai_requests import (
    FUNCTION_NAME,
    MAX_TOOLS,
    FunctionDefinition,
    JsonObjectFormat,
    JsonSchemaSpec,
    check_tool_choice,
    check_tool_names,
)
from shared_schema.openai_requests import TextFormat as ChatTextFormat
from shared_schema.openai_types import MAX_TOKENS

ItemStatus = Literal["in_progress", "completed", "incomplete"]
CALL_ID_MAX = 256


class _Refused(BaseModel):
    """A branch for a ``type`` the queen does not serve: keeps whatever else the object has
    (so the error is about ``type``, not its other fields) and fails on ``type`` saying why."""

    model_config = ConfigDict(extra="allow")
    why: ClassVar[str] = "is not supported"

    type: str

    @field_validator("type")
    @classmethod
    def _refuse(cls, value: str) -> str:
        raise ValueError(f"'{value}' {cls.why}")


def _by_type(known: tuple[str, ...], *, default: str | None = None) -> Callable[[Any], str]:
    """A discriminator: ``type:<t>`` for a known ``type`` (``default`` when it is missing),
    ``type:other`` for anything else (the refusing branch)."""

    def pick(value: Any) -> str:
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        if kind is None and default is not None:
            kind = default
        return f"type:{kind}" if isinstance(kind, str) and kind in known else "type:other"

    return pick


def _text_or_list(value: Any) -> str:
    return "type:text" if isinstance(value, str) else "type:list"


# --- content parts ------------------------------------------------------------------------------


class InputText(WireModel):
    type: Literal["input_text"]
    text: str


class OutputText(WireModel):
    """Text of an earlier answer passed back; its annotations and logprobs change nothing."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = Field(default=None, max_length=0)
    logprobs: list[Any] | None = None


class _RefusedPart(_Refused):
    why = "content is not supported: workers read text only ('input_text' or 'output_text')"


Part = Annotated[
    Annotated[InputText, Tag("type:input_text")]
    | Annotated[OutputText, Tag("type:output_text")]
    | Annotated[_RefusedPart, Tag("type:other")],
    Discriminator(_by_type(("input_text", "output_text"))),
]
Content = Annotated[
    Annotated[str, Tag("type:text")] | Annotated[list[Part], Tag("type:list")],
    Discriminator(_text_or_list),
]
OutputContent = Annotated[
    Annotated[str, Tag("type:text")] | Annotated[list[InputText], Tag("type:list")],
    Discriminator(_text_or_list),
]


def part_texts(content: str | list[Any]) -> list[str]:
    """The texts of a content value, one per part (one for a plain string)."""
    return [content] if isinstance(content, str) else [part.text for part in content]


# --- input items --------------------------------------------------------------------------------


class InputMessage(WireModel):
    """A message: the SDK's easy form (``role`` + ``content``, no ``type``), an input message,
    or an assistant ``message`` item of an earlier response passed back."""

    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: Content
    id: str | None = Field(default=None, max_length=256)
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class DirectCaller(WireModel):
    type: Literal["direct"]


class FunctionCallItem(WireModel):
    """A call an earlier response made, passed back (also as ``item.model_dump()`` gives it:
    the SDK's unset optional fields as nulls, ``async_`` under its Python name)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=CALL_ID_MAX)
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str
    id: str | None = Field(default=None, max_length=256)
    status: ItemStatus | None = None
    # Only the values that change nothing: a direct call, in no namespace, not asynchronous.
    caller: DirectCaller | None = None
    namespace: None = None
    async_: Literal[False] | None = Field(default=None,
                                          validation_alias=AliasChoices("async", "async_"))


class FunctionCallOutputItem(WireModel):
    """The client's result of a call, answering it by ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=CALL_ID_MAX)
    output: OutputContent
    id: str | None = Field(default=None, max_length=256)
    status: ItemStatus | None = None
    name: str | None = Field(default=None, pattern=FUNCTION_NAME)
    caller: DirectCaller | None = None
    namespace: None = None


class _RefusedItem(_Refused):
    why = ("items are not supported: input holds messages, 'function_call' and "
           "'function_call_output' items")


InputItem = Annotated[
    Annotated[InputMessage, Tag("type:message")]
    | Annotated[FunctionCallItem, Tag("type:function_call")]
    | Annotated[FunctionCallOutputItem, Tag("type:function_call_output")]
    | Annotated[_RefusedItem, Tag("type:other")],
    Discriminator(_by_type(("message", "function_call", "function_call_output"),
                           default="message")),
]
Input = Annotated[
    Annotated[str, Tag("type:text")]
    | Annotated[list[InputItem], Field(min_length=1), Tag("type:list")],
    Discriminator(_text_or_list),
]


# --- text format --------------------------------------------------------------------------------


class TextFormatJsonSchema(JsonSchemaSpec):
    """The Responses API's flat form of a JSON Schema format (chat nests the same fields in
    ``json_schema``); here the schema is required."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class _RefusedFormat(_Refused):
    why = "is not a text format: 'text', 'json_object' or 'json_schema'"


TextFormat = Annotated[
    Annotated[ChatTextFormat, Tag("type:text")]
    | Annotated[JsonObjectFormat, Tag("type:json_object")]
    | Annotated[TextFormatJsonSchema, Tag("type:json_schema")]
    | Annotated[_RefusedFormat, Tag("type:other")],
    Discriminator(_by_type(("text", "json_object", "json_schema"))),
]


class TextConfig(WireModel):
    format: TextFormat | None = None
    # The models served here have no verbosity setting (as chat's top-level 'verbosity').
    verbosity: None = None


# --- tools --------------------------------------------------------------------------------------


class FunctionTool(FunctionDefinition):
    """A function tool in the Responses API's flat shape (chat nests the same fields in
    ``function``)."""

    type: Literal["function"]


class _RefusedTool(_Refused):
    why = "tools are not supported: only 'function' tools (workers have no built-in tools)"


Tool = Annotated[
    Annotated[FunctionTool, Tag("type:function")] | Annotated[_RefusedTool, Tag("type:other")],
    Discriminator(_by_type(("function",))),
]


class FunctionChoice(WireModel):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)


class _RefusedChoice(_Refused):
    why = ("tool choice is not supported: 'none', 'auto', 'required' or "
           "{'type': 'function', 'name': ...}")


def _choice_kind(value: Any) -> str:
    return "type:mode" if isinstance(value, str) else _by_type(("function",))(value)


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("type:mode")]
    | Annotated[FunctionChoice, Tag("type:function")]
    | Annotated[_RefusedChoice, Tag("type:other")],
    Discriminator(_choice_kind),
]


class ResponsesStreamOptions(WireModel):
    # No effect on what is sent: the queen adds no obfuscation padding either way.
    include_obfuscation: bool | None = None


# --- the request --------------------------------------------------------------------------------


class ResponsesRequest(WireModel):
    model: str = Field(min_length=1, max_length=512)
    input: Input
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    # Accepted with no effect on the answer, as OpenAI defines them (identifiers and hints).
    user: str | None = Field(default=None, max_length=512)
    safety_identifier: str | None = Field(default=None, max_length=512)
    prompt_cache_key: str | None = Field(default=None, max_length=512)
    # Accepted only with the one value the queen can honour.
    store: Literal[False] | None = None
    service_tier: Literal["auto", "default"] | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = Field(default=None, max_length=0)

    @model_validator(mode="after")
    def _consistent(self) -> ResponsesRequest:
        names = [tool.name for tool in self.function_tools]
        check_tool_names(names)
        choice = self.tool_choice
        check_tool_choice(names, choice.name if isinstance(choice, FunctionChoice) else None,
                          choice == "required")
        fmt = self.text.format if self.text is not None else None
        if names and fmt is not None and fmt.type != "text":
            raise ValueError("'text.format' cannot be combined with 'tools'; describe the "
                             "answer's shape as a tool's parameters instead")
        return self

    @property
    def function_tools(self) -> list[FunctionTool]:
        # Every tool is a FunctionTool once validated (the others are refused).
        return [tool for tool in self.tools or [] if isinstance(tool, FunctionTool)]

    @property
    def items(self) -> list[InputMessage | FunctionCallItem | FunctionCallOutputItem]:
        """The input as items: a string is one user message."""
        if isinstance(self.input, str):
            return [InputMessage(role="user", content=self.input)]
        return [item for item in self.input if not isinstance(item, _Refused)]
