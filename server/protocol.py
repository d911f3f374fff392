"""OpenAI request models.

Fields outside OpenAI's API are accepted (vLLM's extras from load generators); OpenAI fields
kvserve does not implement are classified in ``server.openai_fields`` and, when they ask for
the feature, answered with a 400 naming them (``check_fields``), never silently dropped.

Types are checked as OpenAI checks them: ``"5"`` or ``true`` is no integer, ``"0.5"`` no number,
``1`` no boolean (pydantic's lax mode would coerce all three), so every model here is strict;
an integral float such as ``5.0`` still counts as an integer, as in OpenAI's JSON schema.
Range checks live here (so a bad value is a 400 that names its parameter); cross-field
rules live in ``to_sampling_params``.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator

from engine.tokenizer import RESERVED_TEMPLATE_KWARGS
from kvtypes.sampling_params import SamplingParams
from kvtypes.structured_spec import StructuredOutputSpec
from server.cache_routes import CacheControl
from server.errors import bad_request
from server.openai_fields import check_fields


def _whole_number(value: Any) -> Any:
    """5.0 -> 5 (JSON has one number type); anything else is left for the strict int check."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Integer = Annotated[int, BeforeValidator(_whole_number)]


class OpenAIModel(BaseModel):
    """A part of a request: strict types (see the module doc), unknown fields ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None  # a prompt-cache breakpoint (server/cache_routes.py)


class FunctionCallIn(OpenAIModel):
    name: str
    arguments: str


class ToolCallIn(OpenAIModel):
    """A call an earlier assistant turn made (input)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


Content = Union[str, list[TextPart], None]


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = Field(default=None, validate_default=True)
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    cache_control: CacheControl | None = None  # a prompt-cache breakpoint (server/cache_routes.py)

    @field_validator("content")
    @classmethod
    def _content_required(cls, value: Content, info: ValidationInfo) -> Content:
        # as OpenAI's schema has it: only an assistant turn (which may carry tool_calls) may omit content
        if value is None and info.data.get("role", "assistant") != "assistant":
            raise ValueError(f"a {info.data['role']} message needs content")
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class FunctionDefinition(OpenAIModel):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: ToolChoiceFunction


class JsonSchemaFormat(OpenAIModel):
    model_config = ConfigDict(populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def spec(self) -> StructuredOutputSpec | None:
        """The grammar this format asks for (None for free text); 400 if it is incomplete."""
        if self.type == "json_object":
            return StructuredOutputSpec("json_object")
        if self.type == "json_schema":
            if self.json_schema is None:
                raise bad_request("response_format of type json_schema needs a 'json_schema' object",
                                  "response_format.json_schema")
            return StructuredOutputSpec.json_schema(self.json_schema.json_schema or {})
        return None


class SamplingFields(OpenAIModel):
    """Fields shared by chat and text completions.

    ``extra="allow"``: unknown fields are kept (in ``model_extra``) so that ``check_fields``
    can refuse the OpenAI ones kvserve does not implement; other extras are ignored.
    """

    model_config = ConfigDict(extra="allow")
    _kind = "chat"
    model: str
    max_tokens: Annotated[Integer, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[Integer, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    n: Annotated[Integer, Field(ge=1, le=128)] = 1
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[Integer] | None = None
    seed: Integer | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = None
    min_tokens: Annotated[Integer, Field(ge=0)] = 0
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None
    priority: Integer = 0  # vLLM's extra: lower runs first (scheduler policy 'priority' only)
    kv_eviction: bool | None = None  # kvserve's extra: opt out of (false) or into (true) --kv-eviction
    logit_bias: dict[str, float] | None = None
    # vLLM's structured-output extras (accepted because clients of vLLM send them)
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def check_unsupported(self) -> None:
        """400 for an OpenAI field kvserve does not implement (see server.openai_fields)."""
        check_fields(self._kind, {**self.model_dump(exclude_unset=True), **(self.model_extra or {})}, self.n)

    def guided_spec(self) -> StructuredOutputSpec | None:
        """vLLM's guided_* extras as a grammar spec (at most one may be given)."""
        given = [k for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
                 if getattr(self, k) is not None]
        if len(given) > 1:
            raise bad_request(f"only one of {', '.join(given)} may be given", given[1])
        if not given:
            return None
        if self.guided_json is not None:
            schema = self.guided_json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError:
                    raise bad_request("guided_json is not valid JSON", "guided_json") from None
            return StructuredOutputSpec.json_schema(schema)
        if self.guided_regex is not None:
            return StructuredOutputSpec("regex", self.guided_regex)
        if self.guided_choice is not None:
            return StructuredOutputSpec("choice", json.dumps(self.guided_choice))
        return StructuredOutputSpec("grammar", self.guided_grammar or "")
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_key: str | None = None  # recorded in the cache policy (for cache-aware routers)

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, max_stop: int,
                        structured_output: StructuredOutputSpec | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            # as OpenAI answers it: the options of a stream that was not asked for are a mistake
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        stops = self.stop or []
        if len(stops) > max_stop:
            raise bad_request(f"at most {max_stop} stop sequences are allowed, got {len(stops)}", "stop")
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0,
                min_p=self.min_p or 0.0,
                seed=self.seed,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=self.repetition_penalty or 1.0,
                stop=list(stops),
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                min_tokens=self.min_tokens,
                logit_bias=dict(self.logit_bias) if self.logit_bias else None,
                structured_output=structured_output,
                prompt_logprobs=prompt_logprobs,
                kv_eviction=self.kv_eviction,
            )
        except ValueError as exc:
            message = str(exc)
            raise bad_request(message, message.split(" ", 1)[0] if message.startswith("logit_bias") else None) \
                from None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Annotated[Integer, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[Integer, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: variables for the chat template
    # vLLM's cap on the tokens inside a reasoning model's think block, and the other name for it
    thinking_token_budget: Annotated[Integer, Field(ge=0)] | None = None
    max_reasoning_tokens: Annotated[Integer, Field(ge=0)] | None = None

    def reasoning_budget(self) -> int | None:
        """The think block's token cap (``thinking_token_budget`` or ``max_reasoning_tokens``), or None."""
        a, b = self.thinking_token_budget, self.max_reasoning_tokens
        if a is not None and b is not None and a != b:
            raise bad_request("give thinking_token_budget or max_reasoning_tokens, not two different values",
                              "max_reasoning_tokens")
        return a if a is not None else b

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(RESERVED_TEMPLATE_KWARGS & set(value or {}))
        if taken:
            raise ValueError(f"'{taken[0]}' is an argument of the template call, not a template variable")
        return value

    def to_sampling_params(self, max_stop: int,
                           structured_output: StructuredOutputSpec | None = None) -> SamplingParams:
        """``structured_output``: the tool-call grammar, when tool_choice forces a call."""
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        # max_completion_tokens is the newer name and wins when both are given.
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        spec = self.response_format.spec() if self.response_format is not None else None
        guided = self.guided_spec()
        if spec is not None and guided is not None:
            raise bad_request("give either response_format or a guided_* field, not both", "response_format")
        spec = spec or guided
        if structured_output is not None:
            if spec is not None:
                raise bad_request("a forced tool call (tool_choice required or named) cannot be combined with "
                                  "response_format", "tool_choice")
            spec = structured_output
        return self.sampling_params(max_tokens, logprobs, max_stop, spec)


class CompletionRequest(SamplingFields):
    _kind = "completions"
    prompt: Union[str, list[str], list[Integer], list[list[Integer]]]
    max_tokens: Annotated[Integer, Field(ge=1)] | None = 16
    logprobs: Annotated[Integer, Field(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[Integer, Field(ge=1)] | None = None
    response_format: ResponseFormat | None = None  # a vLLM extra on completions

    def to_sampling_params(self, max_stop: int) -> SamplingParams:
        spec = self.response_format.spec() if self.response_format is not None else None
        guided = self.guided_spec()
        if spec is not None and guided is not None:
            raise bad_request("give either response_format or a guided_* field, not both", "response_format")
        # echo with logprobs: the prompt's token logprobs too (lm-eval's loglikelihood).
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        return self.sampling_params(self.max_tokens, self.logprobs, max_stop, spec or guided, prompt_logprobs)

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (each text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt must not be empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]
