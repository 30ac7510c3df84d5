"""The OpenAI request bodies Apiary serves: chat completions, text completions, embeddings.

Each model holds exactly the fields the queen honours (``WireModel``: anything else is refused).
``shared_schema.openai_fields`` lists every field of OpenAI's own request schemas with what
the queen does with it, and ``openai_fields.refusal`` turns a field a model does not hold into
the 400 that names it. Values are range-checked here, so a bad one is a 400 naming its
``param``. The Responses API's body is ``shared_schema.responses``'.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from shared_schema.base import WireModel
from shared_schema.json_schemas import check_json_schema
from shared_schema.openai_types import MAX_TOKENS, TokenId

# How many choices one request may ask for (OpenAI allows 128; a volunteer's GPU makes them one
# after another, so fewer).
MAX_CHOICES = 8
# OpenAI's own limits.
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_STOPS = 4
MAX_TOOLS = 128
MAX_LOGIT_BIAS = 300
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"

Penalty = Annotated[float, Field(ge=-2, le=2)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]


def _check_stops(value: str | list[str] | None) -> str | list[str] | None:
    if isinstance(value, list) and len(value) > MAX_STOPS:
        raise ValueError(f"at most {MAX_STOPS} stop sequences are allowed")
    if isinstance(value, list) and any(not item for item in value):
        raise ValueError("a stop sequence must not be empty")
    return value


def _check_logit_bias(value: dict[str, float] | None) -> dict[str, float] | None:
    if value is None:
        return value
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"at most {MAX_LOGIT_BIAS} tokens may be biased")
    for key, bias in value.items():
        if not key.isdigit() or int(key) > MAX_TOKENS:
            raise ValueError(f"{key!r} is not a token id (keys are token ids as strings)")
        if not -100 <= bias <= 100:
            raise ValueError(f"the bias of token {key} must be between -100 and 100")
    return value


class StreamOptions(WireModel):
    include_usage: bool = False
    # No effect on what is sent: the queen adds no obfuscation padding either way.
    include_obfuscation: bool | None = None


# --- chat messages ----------------------------------------------------------------------------


class TextPart(WireModel):
    type: Literal["text"]
    text: str


class FunctionCall(WireModel):
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str


class ToolCall(WireModel):
    """A call the assistant made, as a message of the conversation gives it back."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(WireModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(default=None, max_length=256)
    # An assistant turn that called tools, and a tool's answer to one of those calls.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(default=None, max_length=256)
    # What the SDK echoes back when an answer's message object is appended to the conversation
    # as it came: empty, so it changes nothing (a value would be something the queen drops).
    refusal: None = None
    function_call: None = None
    audio: None = None
    annotations: list[Any] | None = Field(default=None, max_length=0)

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            kinds = {part.get("type") for part in value if isinstance(part, dict)} - {"text"}
            if kinds:
                raise ValueError("only text content is supported; parts of type "
                                 f"{', '.join(sorted(map(str, kinds)))} are not")
        return value

    @model_validator(mode="after")
    def _roles_fit(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a 'tool' message needs the 'tool_call_id' of the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an 'assistant' message may carry 'tool_calls'")
        if self.content is None and not self.tool_calls and self.role != "assistant":
            raise ValueError(f"a '{self.role}' message needs 'content'")
        return self


# --- structured output and tools ----------------------------------------------------------------


class JsonSchemaSpec(WireModel):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = Field(default=None, max_length=4096)
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None

    _valid_schema = field_validator("schema_")(check_json_schema)


class TextFormat(WireModel):
    type: Literal["text"]


class JsonObjectFormat(WireModel):
    type: Literal["json_object"]


class JsonSchemaFormat(WireModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


def _format_type(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"type:{kind}" if isinstance(kind, str) else None


# Tagged ``type:...``, which a 400's ``param`` leaves out (``response_format.json_schema.schema``).
ResponseFormat = Annotated[
    Annotated[TextFormat, Tag("type:text")]
    | Annotated[JsonObjectFormat, Tag("type:json_object")]
    | Annotated[JsonSchemaFormat, Tag("type:json_schema")],
    Discriminator(_format_type, custom_error_type="invalid_format",
                  custom_error_message="'type' must be text, json_object or json_schema"),
]


class FunctionDefinition(WireModel):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = Field(default=None, max_length=16384)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    _valid_schema = field_validator("parameters")(check_json_schema)


class Tool(WireModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(WireModel):
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(WireModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def check_tool_names(names: list[str]) -> None:
    """Tools are called by name: no two may share one (chat's and the Responses API's)."""
    if len(set(names)) != len(names):
        raise ValueError("two tools have the same name")


def check_tool_choice(names: list[str], named: str | None, required: bool) -> None:
    """A ``tool_choice`` that names a function (``named``) must name one of the tools; one that
    requires a call needs a tool to call."""
    if named is not None and named not in names:
        raise ValueError(f"tool_choice names '{named}', which is not one of the tools")
    if required and not names:
        raise ValueError("tool_choice 'required' needs at least one tool")


# --- chat completions -------------------------------------------------------------------------


class ChatCompletionRequest(WireModel):
    model: str = Field(min_length=1, max_length=512)
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    stop: str | list[str] | None = None
    seed: Seed | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Accepted with no effect on the answer, as OpenAI defines them (identifiers and hints).
    user: str | None = Field(default=None, max_length=512)
    safety_identifier: str | None = Field(default=None, max_length=512)
    prompt_cache_key: str | None = Field(default=None, max_length=512)
    # Accepted only with the one value the queen can honour.
    store: Literal[False] | None = None
    service_tier: Literal["auto", "default"] | None = None
    modalities: list[Literal["text"]] | None = None

    _stops = field_validator("stop")(_check_stops)
    _bias = field_validator("logit_bias")(_check_logit_bias)

    # Checks across fields run on the later field (pydantic has checked the earlier ones), so
    # that a 400 names the field at fault.
    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("'top_logprobs' needs 'logprobs': true")
        return value

    @field_validator("tools")
    @classmethod
    def _tools_alone(cls, value: list[Tool] | None, info: ValidationInfo) -> list[Tool] | None:
        response_format = info.data.get("response_format")
        if value and response_format is not None and response_format.type != "text":
            raise ValueError("'tools' cannot be combined with a JSON 'response_format'; "
                             "describe the answer's shape as a tool's parameters instead")
        if value and info.data.get("logprobs"):
            raise ValueError("'tools' cannot be combined with 'logprobs'")
        check_tool_names([tool.function.name for tool in value or []])
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_names_a_tool(cls, value: ToolChoice | None, info: ValidationInfo
                             ) -> ToolChoice | None:
        tools = info.data.get("tools") or []
        check_tool_choice([tool.function.name for tool in tools],
                          None if value is None or isinstance(value, str) else value.function.name,
                          value == "required")
        return value

    @property
    def choices(self) -> int:
        return self.n or 1


# --- text completions -------------------------------------------------------------------------

Prompt = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(WireModel):
    model: str = Field(min_length=1, max_length=512)
    prompt: Prompt
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    stop: str | list[str] | None = None
    seed: Seed | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = None
    suffix: None = None
    user: str | None = Field(default=None, max_length=512)

    _stops = field_validator("stop")(_check_stops)
    _bias = field_validator("logit_bias")(_check_logit_bias)

    @field_validator("suffix", mode="before")
    @classmethod
    def _no_suffix(cls, value: Any) -> None:
        if value is not None:
            raise ValueError("inserting text before a suffix (fill-in-the-middle) is not "
                             "supported")
        return None

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value != (info.data.get("n") or 1):
            raise ValueError("'best_of' other than 'n' is not supported: each choice the "
                             "swarm makes is returned")
        return value

    @field_validator("echo")
    @classmethod
    def _echo_alone(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        if value and info.data.get("logprobs") is not None:
            raise ValueError("'echo' with 'logprobs' is not supported: workers score the "
                             "tokens they make, not the prompt's")
        return value

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and (not value or any(
                isinstance(item, list | str) and not item for item in value)):
            raise ValueError("prompt must not be empty")
        return value

    @property
    def choices(self) -> int:
        return self.n or 1

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(item, int) for item in prompt):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]


# --- embeddings -------------------------------------------------------------------------------


class EmbeddingRequest(WireModel):
    model: str = Field(min_length=1, max_length=512)
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = Field(default=None, max_length=512)

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and (not value or any(
                isinstance(item, list) and not item for item in value)):
            raise ValueError("input must not be empty")
        return value

    @property
    def token_ids(self) -> bool:
        """Whether the inputs are token ids (one list, or a list of lists)."""
        value = self.input
        return isinstance(value, list) and not any(isinstance(item, str) for item in value)
