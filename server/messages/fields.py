"""Every request field of ``POST /v1/messages`` and what kvserve does with it.

The request model (``protocol.MessagesRequest``) refuses any field outside this table; a test
keeps the two equal, and docs/api.md's table for the endpoint is generated from this one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["supported", "accepted, no effect"]


@dataclass(frozen=True)
class MessagesField:
    name: str
    status: Status
    note: str


def _supported(name: str, note: str = "") -> MessagesField:
    return MessagesField(name, "supported", note)


def _no_effect(name: str, why: str) -> MessagesField:
    return MessagesField(name, "accepted, no effect", why)


MESSAGES_FIELDS: list[MessagesField] = [
    _supported("model", "must name the served model (404 `not_found_error` otherwise)"),
    _supported("max_tokens", "required; a value larger than the context's room (context length minus the prompt) "
                             "is clamped to it, so a client's 32000 works on a small context"),
    _supported("messages", "roles user, assistant and system (a mid-conversation system message, text blocks "
                           "only, rendered in its place); content a string or blocks `text`, `tool_use`, `tool_result` "
                           "(string or text blocks, `is_error`); `thinking` / `redacted_thinking` blocks of earlier "
                           "turns are not shown to the model; `image` and `document` are a 400 (kvserve serves "
                           "text models)"),
    _supported("system", "a string or text blocks"),
    _supported("tools", "custom tools (`name`, `description`, `input_schema`, which must compile); server tools "
                        "(a `type` such as `web_search_20250305` or `bash_20250124`) are accepted but not offered "
                        "to the model, since kvserve cannot run them, and the server log names them; so are tools with "
                        "`defer_loading: true`, which stay out of the context until a tool search (a server tool) "
                        "loads them"),
    _supported("tool_choice", "`auto`, `any`, `tool` (with `name`), `none`; `disable_parallel_tool_use`"),
    _supported("stop_sequences", "up to `max_stop` strings; a match ends with `stop_reason: stop_sequence`"),
    _supported("temperature", "0-1; the server's default when absent (the `anthropic` SDK 2.x sends none)"),
    _supported("top_p"), _supported("top_k"),
    _supported("stream", "Anthropic's SSE events, `ping` after `message_start`"),
    _supported("cache_control", "request level (automatic caching: a breakpoint after the last message) and on "
                                "system, tool and message blocks: the prefix up to the last breakpoint is pinned "
                                "(`ttl` 5m or 1h), as for chat completions"),
    _no_effect("metadata", "`user_id` tags a request for Anthropic's abuse monitoring; kvserve keeps no per-user "
                           "records"),
    _supported("thinking", "`enabled` / `adaptive`: a reasoning model's think block comes back as a `thinking` "
                           "block first (streamed as `thinking_delta`, `signature` empty); without it, or with "
                           "`disabled`, the thinking is left out of the output (the model still thinks as its "
                           "template says); with `enabled`, `budget_tokens` caps the think block: after that many tokens "
                           "the engine writes `</think>` and the answer follows (both count against `max_tokens`); "
                           "`display: omitted` returns the thinking block with empty `thinking` (no "
                           "`thinking_delta` when streamed), `summarized` (the default) the whole text, as kvserve "
                           "has no summariser"),
    _no_effect("context_management", "asks Anthropic to edit old tool results out of the context; kvserve runs the "
                                     "context as sent"),
    _no_effect("output_config", "`effort` tunes Anthropic's models; the served model has no such control"),
    _no_effect("service_tier", "one tier; the response does not claim another"),
]

COUNT_TOKENS_NOTE = ("`POST /v1/messages/count_tokens` takes the fields that shape the prompt (`model`, `messages`, "
                     "`system`, `tools`, `tool_choice`, `thinking`, `context_management`, `output_config`, "
                     "`cache_control`)")


def markdown_table() -> str:
    """The docs/api.md table for ``/v1/messages`` (kept equal to the docs by a test)."""
    lines = ["| field | status | notes |", "|---|---|---|"]
    for rule in sorted(MESSAGES_FIELDS, key=lambda r: r.name):
        lines.append(f"| `{rule.name}` | {rule.status} | {rule.note} |")
    return "\n".join(lines)
