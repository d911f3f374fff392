"""Anthropic Messages request models.

Strict as ``server.protocol`` is (``"5"`` is no integer, ``1`` no boolean) and closed: a field
Anthropic's API does not have, or one kvserve cannot honour, is a 400 naming it, never dropped.
Which fields have an effect is said in ``server.messages.fields`` (and docs/api.md).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, field_validator

from server.cache_routes import CacheControl
from server.protocol import Integer


class AnthropicModel(BaseModel):
    """A part of a request: strict types, unknown fields refused."""

    model_config = ConfigDict(extra="forbid", strict=True)


class TextBlock(AnthropicModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None  # as the API returns them; not shown to the model


class ToolUseBlock(AnthropicModel):
    """A call an earlier assistant turn made."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    # as the SDK's response blocks carry them when a client sends a reply back
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


class ToolResultBlock(AnthropicModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[TextBlock], None] = None
    is_error: bool = False
    cache_control: CacheControl | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else join_text(self.content)


class ThinkingBlock(AnthropicModel):
    """An earlier assistant turn's reasoning, replayed by clients; not shown to the model
    (as Anthropic drops the thinking of earlier turns from the context)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(AnthropicModel):
    type: Literal["redacted_thinking"]
    data: str


class MediaBlock(BaseModel):
    """``image`` / ``document``: parsed only to refuse them with a clear 400."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image", "document"]


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock, MediaBlock],
                  Field(discriminator="type")]


def _as_blocks(content: Any) -> Any:
    """A string content is one text block (so that a bad block's error names the block's field)."""
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


class Message(AnthropicModel):
    """A turn. ``system`` is a mid-conversation system message (Claude Code sends one after the
    first user turn): text blocks only, rendered in its place."""

    role: Literal["user", "assistant", "system"]
    content: Annotated[list[Block], BeforeValidator(_as_blocks)]


class CustomTool(AnthropicModel):
    type: Literal["custom"] | None = None
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")]
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None
    strict: bool | None = None
    # Tool search's deferred loading: such a tool is outside the context until a tool search
    # (a server tool kvserve cannot run) loads it, so it is not offered to the model.
    defer_loading: bool | None = None


class ServerTool(BaseModel):
    """A tool Anthropic runs on its side (``web_search_20250305``, ``bash_20250124``, ...):
    kvserve cannot run it, so it is not offered to the model (see ``fields``)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Annotated[str, Field(pattern=r"^[a-z_]+_\d{8}$")]
    name: str


def _tool_kind(tool: Any) -> str:
    kind = tool.get("type") if isinstance(tool, dict) else getattr(tool, "type", None)
    return "custom" if kind in (None, "custom") else "server"


AnyTool = Annotated[Union[Annotated[CustomTool, Tag("custom")], Annotated[ServerTool, Tag("server")]],
                    Discriminator(_tool_kind)]


class ToolChoice(AnthropicModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(AnthropicModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[Integer, Field(ge=1)] | None = None
    display: Literal["summarized", "omitted"] | None = None


class Metadata(AnthropicModel):
    user_id: str | None = None


System = Union[str, list[TextBlock], None]


def join_text(blocks: list[TextBlock]) -> str:
    """Consecutive text blocks as one text (a blank line between them)."""
    return "\n\n".join(b.text for b in blocks)


class CountTokensRequest(AnthropicModel):
    """``POST /v1/messages/count_tokens``: what shapes the prompt."""

    model: str
    messages: list[Message]
    system: System = None
    tools: list[AnyTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    context_management: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    cache_control: CacheControl | None = None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: Annotated[Integer, Field(ge=1)]
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[Integer, Field(ge=1)] | None = None
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _non_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(not s for s in value):
            raise ValueError("stop sequences must be non-empty")
        return value
