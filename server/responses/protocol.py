"""Request models of ``POST /v1/responses``, strict as ``server.protocol``'s (``"5"`` is no integer,
``1`` no boolean), so a mistyped field is a 400 naming it.

The top-level model takes the supported and ignored fields of ``server.responses.fields``;
anything else lands in ``model_extra`` and ``check_unsupported`` refuses it unless the table
says otherwise. Nested parts ignore fields they do not use (clients echo back ``id`` and
``status`` on items they received).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BeforeValidator, ConfigDict, Discriminator, Field, Tag

from server.protocol import Integer, OpenAIModel
from server.responses.fields import HOSTED_TOOLS, check_fields

FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class TextPart(OpenAIModel):
    type: Literal["input_text", "output_text"]
    text: str


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


class MessageItem(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[TextPart]]

    def text(self) -> str:
        return _text(self.content)


class FunctionCallItem(OpenAIModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(OpenAIModel):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[TextPart]]

    def text(self) -> str:
        return _text(self.output)


class ReasoningItem(OpenAIModel):
    """The model's earlier reasoning, sent back by reasoning clients; not put into the prompt."""

    type: Literal["reasoning"]


def _item_type(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("type", "message")  # an "easy" message has no type
    return getattr(value, "type", None)


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")],
                            Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]],
                      Discriminator(_item_type)]


def _items(value: Any) -> Any:
    """A string ``input`` is one user message."""
    return [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value


class FunctionTool(OpenAIModel):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class DroppedTool(OpenAIModel):
    """A hosted (or custom) tool kvserve cannot run: accepted, not offered to the model."""

    model_config = ConfigDict(extra="allow")
    type: Literal[HOSTED_TOOLS]  # type: ignore[valid-type]
    name: str | None = None


def _tool_type(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "hosted" if kind in HOSTED_TOOLS else kind


NestedTool = Annotated[Union[Annotated[FunctionTool, Tag("function")], Annotated[DroppedTool, Tag("hosted")]],
                       Discriminator(_tool_type)]


class NamespaceTool(OpenAIModel):
    """Codex CLI's group of tools: flattened into its function tools, under their own names."""

    type: Literal["namespace"]
    name: str
    description: str | None = None
    tools: list[NestedTool]


ToolEntry = Annotated[Union[Annotated[FunctionTool, Tag("function")], Annotated[NamespaceTool, Tag("namespace")],
                            Annotated[DroppedTool, Tag("hosted")]],
                      Discriminator(_tool_type)]


class FunctionChoice(OpenAIModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIModel):
    model_config = ConfigDict(populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # ignored


class ResponsesRequest(OpenAIModel):
    model_config = ConfigDict(extra="allow")
    model: str
    input: Annotated[list[InputItem], BeforeValidator(_items)]
    instructions: str | None = None
    max_output_tokens: Annotated[Integer, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    tools: list[ToolEntry] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], FunctionChoice, None] = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    truncation: Literal["disabled"] | None = None
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    priority: Integer | None = None  # vLLM's extra, as on chat completions
    # accepted, ignored (server.responses.fields says why)
    user: str | None = None
    safety_identifier: str | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    client_metadata: dict[str, Any] | None = None
    stream_options: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_options: dict[str, Any] | None = None

    def check_unsupported(self) -> None:
        check_fields(self.model_extra or {})

    def items(self) -> list[Any]:
        return list(self.input)
