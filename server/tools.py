"""Tool calls: rendering tools into the prompt, constraining calls, parsing calls out.

The default format (for chat templates without a tools section, such as SmolLM2's) is
Hermes-style: the tools are listed as JSON in a system message, and the model answers a call
as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (one block per call).

Modes (``tool_choice``):

- ``none``: tools are not shown to the model; output is plain content.
- ``auto``: tools shown; the model may answer in prose, but once it writes ``<tool_call>`` a
  lazily triggered grammar holds the block to a declared tool's name and arguments schema; the
  output is parsed: blocks become ``tool_calls`` (finish_reason ``tool_calls``), the rest
  stays content.
- ``required``: output constrained to ``<tool_call>`` blocks whose arguments match the named
  function's schema.
- named function: output constrained to that function's arguments object.

A turn holds at most :meth:`ToolPlan.max_calls` calls (one without ``parallel_tool_calls``),
after which the grammar ends the output, so a small model cannot repeat a call until
``max_tokens``. Only whole calls to declared tools are returned as calls; identical calls are
returned once; an unfinished last block (output cut by ``max_tokens``) is dropped.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Collection, Literal

from engine.sampling.json_bounds import bounded
from kvtypes.structured_spec import JSON_LAYOUT, StructuredOutputSpec
from server.errors import bad_request

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) + r"|$)", re.S)

SYSTEM_PROMPT = (
    "You are a function calling AI model. You may call one or more of the functions below to "
    "help with the user's request. The functions, as JSON signatures:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with one block per call, exactly like this:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <arguments-object>}}\n</tool_call>\n'
    "If no function fits, answer the user directly."
)

Mode = Literal["none", "auto", "required", "named"]

# The most calls one turn may hold with parallel_tool_calls (besides: one per tool, at least 2).
MAX_PARALLEL_CALLS = 8


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            call = {"index": index, **call}
        return call


@dataclass
class ToolPlan:
    """What a request's ``tools`` / ``tool_choice`` ask for."""

    mode: Mode
    tools: list[dict[str, Any]]  # OpenAI tool objects (type + function)
    named: str | None = None
    parallel: bool = True

    @property
    def shows_tools(self) -> bool:
        return self.mode != "none" and bool(self.tools)

    @property
    def max_calls(self) -> int:
        """How many calls one turn may hold: 1 without ``parallel_tool_calls``, else one per
        tool (at least 2, so that one tool can serve two questions), at most MAX_PARALLEL_CALLS."""
        return min(MAX_PARALLEL_CALLS, max(2, len(self.tools))) if self.parallel else 1

    def spec(self, constrain_auto: bool = True) -> StructuredOutputSpec | None:
        """The grammar of the output: a forced call (required / named), or for ``auto`` (unless
        ``constrain_auto`` is false, as when the request has a response_format) free text that
        a ``<tool_call>`` turns into constrained calls; None for none."""
        if self.mode == "named":
            return StructuredOutputSpec.json_schema(_parameters(self._function(self.named)))
        if self.mode not in ("required", "auto") or not self.tools or (self.mode == "auto" and not constrain_auto):
            return None
        # The Hermes blocks themselves, not a JSON array: after a closing tag the model may
        # stop (EOS) or open another call, which small models do far more sensibly than
        # choosing between "," and "]". After max_calls blocks the grammar is complete and the
        # engine ends the output.
        items = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                     "arguments": _parameters(t["function"])},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in self.tools]
        body = dict(items[0] if len(items) == 1 else {"anyOf": items}, **{"x-guidance": JSON_LAYOUT})
        more = (f'("\\n{TOOL_CALL_OPEN}" call){{0,{self.max_calls - 1}}} ' if self.max_calls > 1 else "") + '"\\n"?'
        if self.mode == "required":
            lark = f'start: "{TOOL_CALL_OPEN}" call {more}\n'
        else:
            # llguidance's lazy lexeme: the free text ends at the first "<tool_call>", and
            # from there on the call is held to the grammar (what llama.cpp calls a lazy grammar).
            lark = ("%llguidance {}\n"
                    "start: prose | opened call " + more + "\n"
                    "prose: TEXT\n"
                    f'opened[lazy]: TEXT "{TOOL_CALL_OPEN}"\n'
                    "TEXT: /(.|\\n)*/\n")
        lark += (f'call: "\\n" body "\\n{TOOL_CALL_CLOSE}"\n'
                 f"body: %json {json.dumps(body)}\n")
        return StructuredOutputSpec("grammar", lark)

    def parameter_specs(self) -> list[tuple[str, StructuredOutputSpec]]:
        """Each function's name and the grammar of its arguments (what a forced call compiles),
        so that a schema that cannot compile is refused whatever ``tool_choice`` says."""
        return [(t["function"]["name"], StructuredOutputSpec.json_schema(_parameters(t["function"])))
                for t in self.tools]

    def _function(self, name: str | None) -> dict[str, Any]:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"]
        raise bad_request(f"tool_choice names function {name!r}, which is not among the tools", "tool_choice")

    def calls_from_output(self, text: str) -> list[ToolCall] | None:
        """The whole calls in an output (None: no call could be read; the text stays content)."""
        if self.mode == "named":
            try:
                json.loads(text)
            except json.JSONDecodeError:
                return None
            return [ToolCall(self.named or "", text)]
        if self.mode in ("required", "auto"):
            _, calls = parse_tool_calls(text, self.names)
            return calls[:self.max_calls] or None
        return None

    @property
    def names(self) -> set[str]:
        """The declared function names (a call naming any other is not a call)."""
        return {t["function"]["name"] for t in self.tools}


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    """The function's argument schema for a forced call. Objects that do not say otherwise get
    ``additionalProperties: false`` (as OpenAI's strict mode requires): a forced call carries
    the declared arguments, and a small model cannot wander off into invented keys; integers
    are bounded as every JSON grammar's are (``engine.sampling.json_bounds``)."""
    return bounded(_closed(function.get("parameters") or {"type": "object", "properties": {}}))


def _closed(node: Any) -> Any:
    if isinstance(node, list):
        return [_closed(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: (_closed(v) if k not in ("const", "enum", "default", "examples") else v) for k, v in node.items()}
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel: bool) -> ToolPlan | None:
    """The ToolPlan of a chat request (``tools``: pydantic Tool models); None without tools."""
    if tool_choice is not None and not tools and tool_choice != "none":
        raise bad_request("tool_choice needs tools", "tool_choice")
    if not tools:
        return None
    dumped = [t.model_dump(exclude_none=True) for t in tools]
    names = [t["function"]["name"] for t in dumped]
    if len(set(names)) != len(names):
        raise bad_request("tool function names must be unique", "tools")
    if tool_choice is None or isinstance(tool_choice, str):
        plan = ToolPlan(tool_choice or "auto", dumped, parallel=parallel)
    else:
        plan = ToolPlan("named", dumped, tool_choice.function.name, parallel)
        plan._function(plan.named)  # 400 if unknown
    return plan


def render_messages(messages: list[Any], plan: ToolPlan | None, template_has_tools: bool) -> list[dict[str, Any]]:
    """Chat messages (pydantic) as template dicts, with tool turns in the default format.

    Assistant turns with ``tool_calls`` become ``<tool_call>`` blocks; ``tool`` turns keep their
    role with their content in ``<tool_response>``; when the template has no tools section and
    the plan shows tools, a system message listing them is put first (merged with the client's;
    an empty client system message leaves no trace). So the result has one message per request
    message, in order, after at most one message of its own (cache_routes relies on that).
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        content = m.text()
        if m.role == "assistant" and m.tool_calls:
            blocks = [f"{TOOL_CALL_OPEN}\n" + json.dumps({"name": c.function.name,
                                                          "arguments": _json_or_text(c.function.arguments)},
                                                         ensure_ascii=False) + f"\n{TOOL_CALL_CLOSE}"
                      for c in m.tool_calls]
            content = "\n".join(([content] if content else []) + blocks)
        elif m.role == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if plan is not None and plan.shows_tools and not template_has_tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in plan.tools)
        system = SYSTEM_PROMPT.format(tools=listing)
        if out and out[0]["role"] == "system":
            client = out[0]["content"]
            out[0] = {"role": "system", "content": (client + "\n\n" if client else "") + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def parse_tool_calls(text: str, declared: Collection[str] | None = None) -> tuple[str | None, list[ToolCall]]:
    """Split model output into content and ``<tool_call>`` calls (Hermes format).

    A closed block whose JSON does not parse, lacks a string ``name`` or (given ``declared``)
    names an undeclared function stays in the content. An unterminated last block (output cut,
    or EOS before the closing tag) is read if its JSON is whole and dropped otherwise: an
    unfinished call is neither a call nor content. A call repeating an earlier one (same name
    and arguments) is dropped. Returns (content or None when empty, calls).
    """
    content, calls, _ = _split_calls(text, declared)
    content = content.strip()
    return (content or None), calls


def _split_calls(text: str, declared: Collection[str] | None) -> tuple[str, list[ToolCall], bool]:
    """(content, calls, whether any block was taken out of the text)."""
    calls: list[ToolCall] = []
    seen: set[tuple[str, str]] = set()
    kept: list[str] = []
    pos = 0
    for match in _BLOCK.finditer(text):
        call = _read_call(match.group(1))
        if call is not None and declared is not None and call.name not in declared:
            call = None
        if call is None and match.group(0).endswith(TOOL_CALL_CLOSE):
            continue
        kept.append(text[pos:match.start()])
        pos = match.end()
        if call is not None and (call.name, call.arguments) not in seen:
            seen.add((call.name, call.arguments))
            calls.append(call)
    kept.append(text[pos:])
    return "".join(kept), calls, pos > 0


def _read_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _json_or_text(arguments)
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


class ToolStreamSplitter:
    """For ``auto`` streams: passes content through until a ``<tool_call>`` opens, holding back
    a possible partial tag; what follows the first tag is kept for ``finish``."""

    def __init__(self) -> None:
        self._pending = ""
        self._calls_text: str | None = None

    def feed(self, delta: str) -> str:
        """Content that is safe to stream now."""
        if self._calls_text is not None:
            self._calls_text += delta
            return ""
        text = self._pending + delta
        index = text.find(TOOL_CALL_OPEN)
        if index != -1:
            self._calls_text = text[index:]
            self._pending = ""
            return text[:index]
        keep = 0
        for k in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
            if TOOL_CALL_OPEN.startswith(text[-k:]):
                keep = k
                break
        self._pending = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep] if keep else text

    def finish(self, declared: Collection[str] | None = None) -> tuple[str, list[ToolCall]]:
        """(content still held back, calls) at the end of the output (``parse_tool_calls``)."""
        if self._calls_text is None:
            rest, self._pending = self._pending, ""
            return rest, []
        content, calls = parse_tool_calls(self._calls_text, declared)
        return (content or ""), calls


class ToolStreamer:
    """Turns one streamed choice's text deltas into chat ``delta`` fields under a ToolPlan.

    ``named`` streams the arguments as they come (the first delta carries id, type and name);
    ``required`` holds the constrained JSON until the end; ``auto`` streams content and holds
    back everything from the first ``<tool_call>`` on. ``final`` emits the calls with their
    ``index`` and says the finish_reason (``tool_calls`` when calls were made and it stopped).
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._splitter = ToolStreamSplitter()
        self._held = ""
        self._named_call: ToolCall | None = None

    def delta(self, text: str) -> dict[str, Any]:
        if not text:
            return {}
        mode = self.plan.mode
        if mode == "named":
            if self._named_call is None:
                self._named_call = ToolCall(self.plan.named or "", "")
                return {"tool_calls": [{**self._named_call.as_openai(0),
                                        "function": {"name": self._named_call.name, "arguments": text}}]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
        if mode == "required":
            self._held += text
            return {}
        if mode == "auto":
            content = self._splitter.feed(text)
            return {"content": content} if content else {}
        return {"content": text}

    def final(self, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        mode = self.plan.mode
        if mode == "named":
            return {}, ("tool_calls" if self._named_call is not None and finish_reason == "stop" else finish_reason)
        if mode == "required":
            calls = self.plan.calls_from_output(self._held)
            if not calls:  # a cut call is dropped, not shown as content
                return ({"content": self._held} if self._held and finish_reason != "length" else {}), finish_reason
            return {"tool_calls": [c.as_openai(i) for i, c in enumerate(calls)]}, _finish(finish_reason)
        if mode == "auto":
            content, calls = self._splitter.finish(self.plan.names)
            calls = calls[:self.plan.max_calls]
            delta: dict[str, Any] = {"content": content} if content else {}
            if calls:
                delta["tool_calls"] = [c.as_openai(i) for i, c in enumerate(calls)]
                finish_reason = _finish(finish_reason)
            return delta, finish_reason
        return {}, finish_reason


def _finish(finish_reason: str | None) -> str | None:
    """The finish_reason of a choice that made calls: ``tool_calls``, unless it was cut."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def finish_message(plan: ToolPlan | None, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """The non-streamed ``message`` (content / tool_calls) and finish_reason of one choice.

    Every whole call to a declared tool is returned, also when ``max_tokens`` cut the output
    (finish_reason then stays ``length``); an unfinished call is dropped, never left as content.
    """
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if plan is None or plan.mode == "none":
        return message, finish_reason
    if plan.mode == "named":
        calls = plan.calls_from_output(text) or []
        if not calls and finish_reason == "length":
            message["content"] = None  # the arguments of a cut call
    else:
        content, calls, changed = _split_calls(text, plan.names)
        calls = calls[:plan.max_calls]
        if changed:
            message["content"] = content.strip() or None
    if calls:
        if plan.mode == "named":
            message["content"] = None
        message["tool_calls"] = [c.as_openai() for c in calls]
        finish_reason = _finish(finish_reason)
    return message, finish_reason
