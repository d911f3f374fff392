"""Every request field of OpenAI's chat completions and completions, and what kvserve does with it.

One table serves three readers: the request check (a *rejected* field, when it asks for the
feature, gets a 400 naming it), docs/api.md (its field table is generated from this one and a
test keeps them equal), and the tests (each rejected row is sent with its ``example``).

Fields outside OpenAI's API (vLLM's extras such as ``top_k``, ``ignore_eos``, ``guided_json``,
which load generators send) are not in the table and stay accepted. The extras whose meaning a
client must know (``chat_template_kwargs``, the reasoning budgets) are in a
second table, ``EXTRAS``, checked and documented the same way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

from server.errors import bad_request

Status = Literal["supported", "ignored", "rejected"]


def _present(value: Any) -> bool:
    return value is not None


@dataclass(frozen=True)
class FieldRule:
    name: str
    status: Status
    note: str = ""  # what is supported, why it is ignored, or why it is rejected
    # For rejected fields: a value that asks for the feature (the test sends it) and the test
    # of whether a given value does (default: any non-null value).
    example: Any = None
    asks: Callable[[Any], bool] = _present


def _supported(name: str, note: str = "") -> FieldRule:
    return FieldRule(name, "supported", note)


def _ignored(name: str, why: str) -> FieldRule:
    return FieldRule(name, "ignored", why)


def _rejected(name: str, why: str, example: Any, asks: Callable[[Any], bool] = _present) -> FieldRule:
    return FieldRule(name, "rejected", why, example, asks)


_COMMON = [
    _supported("model", "must name the served model (404 otherwise)"),
    _supported("frequency_penalty"), _supported("presence_penalty"),
    _supported("logit_bias", "token ids in the vocabulary, values in [-100, 100]"),
    _supported("n"), _supported("seed"), _supported("stop", "up to `max_stop` strings"),
    _supported("stream"),
    _supported("stream_options",
               "with `stream` only (400 otherwise); `include_usage`; `include_obfuscation` is ignored"),
    _supported("temperature"), _supported("top_p"),
    _ignored("user", "an end-user id for OpenAI's abuse monitoring; kvserve keeps no per-user records"),
]

CHAT_FIELDS: list[FieldRule] = [
    _supported("messages", "roles system, developer (as system), user, assistant (with `tool_calls`), tool; "
                           "text content parts only"),
    *_COMMON,
    _supported("logprobs"), _supported("top_logprobs", "0-20"),
    _supported("max_tokens"), _supported("max_completion_tokens", "wins over `max_tokens`"),
    _supported("response_format", "`text`, `json_object`, `json_schema` (constrained decoding)"),
    _supported("tools", "function tools; each `parameters` schema must compile (400 otherwise)"),
    _supported("tool_choice", "`none`, `auto`, `required`, or a named function"),
    _supported("parallel_tool_calls"),
    _ignored("metadata", "tags for stored completions; kvserve stores none"),
    _ignored("store", "kvserve never stores completions for later retrieval"),
    _ignored("safety_identifier", "an end-user id for OpenAI's abuse monitoring"),
    _ignored("service_tier", "one tier; the response does not claim another"),
    _supported("prompt_cache_key", "accepted and recorded in the request's cache policy (for cache-aware routers)"),
    _supported("prompt_cache_retention", "`in_memory` (default) or `24h`: the prompt's prefix kept on the disk tier "
               "for 24 h (400 without `--kv-disk-dir`)"),
    _ignored("prompt_cache_options", "prefix caching is automatic; retention follows the cache's LRU"),
    _ignored("reasoning_effort", "no effort control: a reasoning model thinks as its chat template says "
                                 "(`chat_template_kwargs` can switch thinking off where the template allows)"),
    _ignored("verbosity", "a hint for OpenAI's models; the served model has no such control"),
    _rejected("audio", "audio output is not supported", {"voice": "alloy", "format": "wav"}),
    _rejected("modalities", "only text output is supported", ["text", "audio"],
              lambda v: v is not None and any(m != "text" for m in v)),
    _rejected("prediction", "predicted outputs are not supported",
              {"type": "content", "content": "x"}),
    _rejected("web_search_options", "web search is not supported", {}),
    _rejected("functions", "deprecated; use `tools`", [{"name": "f", "parameters": {"type": "object"}}]),
    _rejected("function_call", "deprecated; use `tool_choice`", "auto"),
    _rejected("moderation", "moderation is not supported", {"enabled": True}),
]

COMPLETION_FIELDS: list[FieldRule] = [
    _supported("prompt", "a string, a list of strings, token ids, or a list of token-id lists"),
    *_COMMON,
    _supported("max_tokens"),
    _supported("logprobs", "0-20"),
    _supported("echo", "prepends the prompt; with `logprobs`, its token logprobs (the first is null)"),
    _rejected("best_of", "server-side best-of-n ranking is not supported (best_of equal to n is accepted)", 3,
              lambda v: v is not None and v != 1),
    _rejected("suffix", "insertion (fill-in-the-middle) is not supported", "x", lambda v: bool(v)),
]

TABLES: dict[str, list[FieldRule]] = {"chat": CHAT_FIELDS, "completions": COMPLETION_FIELDS}

_BUDGET = ("at most this many tokens inside a reasoning model's think block: then the engine forces `</think>` "
           "and the answer follows (counted in `max_tokens` as the thinking is); a model that closes the block "
           "earlier thinks less; a model without think tags has no block to cap")
_PRIORITY = _supported("priority", "vLLM's extra, an integer: lower runs first, under `--scheduling-policy priority` "
                                   "only (a non-zero value is a 400 under `fcfs`); never below the tenant's `priority`")
_KV_EVICTION = ("`false`: this request keeps all of its KV (the context bounds it) on a server started with "
                "`--kv-eviction`; `true`: asks for eviction (400 on a server without a policy); unset: the server's "
                "policy. Tokens evicted are reported as `usage.evicted_tokens`")
CHAT_EXTRA_FIELDS: list[FieldRule] = [
    _supported("chat_template_kwargs", "variables for the model's chat template, e.g. `{\"enable_thinking\": false}` "
                                       "(Qwen3); an argument of the template call itself (`tools`, `tokenize`, ...) "
                                       "is a 400"),
    _supported("kv_eviction", _KV_EVICTION),
    _supported("max_reasoning_tokens", f"an integer >= 0; {_BUDGET}; the same as `thinking_token_budget`"),
    _supported("thinking_token_budget", f"vLLM's name; an integer >= 0; {_BUDGET}"),
    _PRIORITY,
]

EXTRAS: dict[str, list[FieldRule]] = {"chat": CHAT_EXTRA_FIELDS,
                                      "completions": [_supported("kv_eviction", _KV_EVICTION), _PRIORITY]}


def check_fields(kind: str, body: dict[str, Any], n: int = 1) -> None:
    """400 naming the first rejected field of ``body`` whose value asks for its feature."""
    for rule in (*TABLES[kind], *EXTRAS[kind]):
        if rule.status != "rejected" or rule.name not in body:
            continue
        value = body[rule.name]
        if rule.name == "best_of" and value == n:
            continue
        if rule.asks(value):
            raise bad_request(f"'{rule.name}' is not supported by kvserve: {rule.note}", rule.name,
                              "unsupported_parameter")


def markdown_table(kind: str, extras: bool = False) -> str:
    """The docs/api.md table for ``kind``, or for its extras (kept equal to the docs by a test)."""
    lines = ["| field | status | notes |", "|---|---|---|"]
    for rule in sorted((EXTRAS if extras else TABLES)[kind], key=lambda r: r.name):
        label = {"supported": "supported", "ignored": "accepted, ignored", "rejected": "rejected (400)"}[rule.status]
        lines.append(f"| `{rule.name}` | {label} | {rule.note} |")
    return "\n".join(lines)
