"""Tool calling on /v1/chat/completions: `tools`, `tool_choice`,
`parallel_tool_calls`.

- tool_choice "none" (the default without tools): tools are not rendered and
  the output is plain content.
- "auto" (the default with tools): the chat template renders the tools (or,
  for a template that ignores them, a system message in the parser's style
  describes them), and the model's text is parsed by the tool-call parser
  (`--tool-call-parser`, default hermes).
- "required" and a named function {"type": "function", "function": {"name"}}:
  the output is grammar-constrained JSON built from the functions' parameter
  schemas, so the arguments always parse and validate:
      named:     the arguments object itself           {"city": "Paris"}
      required:  a list of calls   [{"name": "get_weather", "arguments": {"city": "Paris"}}]
             (one call at most when parallel_tool_calls is false)
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from scheduler.types import StructuredOutputSpec
from server.errors import invalid_field
from server.tool_parsers import (
    ContentDelta,
    StreamEvent,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
    ToolParser,
    tool_call_id,
)

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_EMPTY_OBJECT = {"type": "object", "properties": {}}


@dataclass
class ToolContext:
    """A chat request's tools, validated. mode: "auto" | "required" | "named"."""

    tools: list[dict[str, Any]]  # OpenAI tool dicts, {"type": "function", "function": {...}}
    mode: str
    parser: ToolParser
    named: str | None = None  # the function of mode "named"
    parallel: bool = True
    spec: StructuredOutputSpec | None = None  # the grammar of "required" / "named"

    @property
    def functions(self) -> dict[str, dict[str, Any]]:
        return {t["function"]["name"]: t["function"] for t in self.tools}


def _check_tools(tools: Any) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise invalid_field(f"{where}.type", f'{where} must be {{"type": "function", "function": {{...}}}}')
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise invalid_field(f"{where}.function", f"{where}.function must be an object with a name")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise invalid_field(f"{where}.function.name",
                                f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise invalid_field(f"{where}.function.parameters", f"{where}.function.parameters must be a JSON schema object")
        out.append({"type": "function", "function": fn})
    names = [t["function"]["name"] for t in out]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise invalid_field("tools", f"tools has two functions named {dup!r}")
    return out


def prepare_tools(req: Any, parser: ToolParser) -> ToolContext | None:
    """The request's tool context; None when no tool may be called."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise invalid_field("tool_choice", "tool_choice needs tools")
        return None
    tools = _check_tools(req.tools)
    parallel = req.parallel_tool_calls is not False
    if choice is None or choice == "auto":
        return ToolContext(tools, "auto", parser, parallel=parallel)
    if choice == "none":
        return None
    functions = {t["function"]["name"]: t["function"] for t in tools}
    if choice == "required":
        schema = required_schema(list(functions.values()), parallel)
        spec = StructuredOutputSpec("json", json.dumps(schema), "tools")
        return ToolContext(tools, "required", parser, parallel=parallel, spec=spec)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in functions:
            raise invalid_field("tool_choice", f"tool_choice names function {name!r}, which is not in tools")
        spec = StructuredOutputSpec("json", json.dumps(functions[name].get("parameters") or _EMPTY_OBJECT), "tools")
        return ToolContext(tools, "named", parser, named=name, parallel=parallel, spec=spec)
    raise invalid_field("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                                       '{"type": "function", "function": {"name": ...}}')


def required_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """[{"name": <one of the functions>, "arguments": <its parameters>}, ...], at least one.

    Each function's $defs move to the top level under a prefix, and its
    $refs follow ("#/$defs/Pet" of function 1 -> "#/$defs/f1.Pet"), so schemas
    that use $ref keep working once nested."""
    defs: dict[str, Any] = {}
    variants = []
    for i, fn in enumerate(functions):
        params = copy.deepcopy(fn.get("parameters") or _EMPTY_OBJECT)
        prefix = f"f{i}."
        for key in ("$defs", "definitions"):
            for name, sub in (params.pop(key, None) or {}).items():
                defs[prefix + name] = sub
        defs[prefix + "root"] = params
        variants.append({
            "type": "object",
            "properties": {"name": {"const": fn["name"]}, "arguments": {"$ref": f"#/$defs/{prefix}root"}},
            "required": ["name", "arguments"],
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    schema["$defs"] = _rewrite_refs(defs, functions)
    return schema


def _rewrite_refs(defs: dict[str, Any], functions: list[dict[str, Any]]) -> dict[str, Any]:
    def walk(node: Any, prefix: str) -> Any:
        if isinstance(node, list):
            return [walk(x, prefix) for x in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str):
                if v == "#":
                    v = f"#/$defs/{prefix}root"
                else:
                    for root in ("#/$defs/", "#/definitions/"):
                        if v.startswith(root):
                            v = f"#/$defs/{prefix}{v[len(root):]}"
                out[k] = v
            elif k in ("enum", "const", "default", "examples"):
                out[k] = v
            else:
                out[k] = walk(v, prefix)
        return out

    return {name: walk(sub, name.split(".", 1)[0] + ".") for name, sub in defs.items()}


# ---------------------------------------------------------------------------
# Rendering: tools into the prompt, earlier calls into the history
# ---------------------------------------------------------------------------


def _history_for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Earlier assistant tool calls with their arguments as objects, which is
    what chat templates (Qwen, Hermes, Llama 3) expect; OpenAI sends JSON text."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if not calls:
            out.append(m)
            continue
        fixed = []
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise invalid_field(f"messages[{i}].tool_calls[{j}].function",
                                    f"messages[{i}].tool_calls[{j}] must have a function with a name")
            args = fn.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    raise invalid_field(f"messages[{i}].tool_calls[{j}].function.arguments",
                                        f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON") from None
            fixed.append({**call, "type": call.get("type", "function"), "function": {**fn, "arguments": args}})
        out.append({**m, "tool_calls": fixed})
    return out


def _history_in_text(messages: list[dict[str, Any]], parser: ToolParser) -> list[dict[str, Any]]:
    """For a template that knows nothing of tools: calls and results written
    into the message contents, in the parser's format."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            text = "\n".join(parser.format_tool_call(c["function"]["name"], c["function"]["arguments"]) for c in calls)
            m["content"] = f"{m.get('content') or ''}\n{text}".lstrip("\n")
        if m.get("role") == "tool":
            m["content"] = parser.format_tool_result(m.get("content") or "")
            m.pop("tool_call_id", None)
        out.append(m)
    return out


def render_with_tools(
    render: Callable[..., tuple[str | None, list[int]]],
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    ctx: ToolContext | None,
) -> tuple[str | None, list[int]]:
    """render(tokenizer, messages, add_generation_prompt, tools=...) with the
    tools of ctx. If the template renders the same prompt with and without
    them, it ignores tools: a system message describes them instead."""
    messages = _history_for_template(messages)
    if ctx is None:
        return render(tokenizer, messages, add_generation_prompt, tools=None)
    with_tools = render(tokenizer, messages, add_generation_prompt, tools=ctx.tools)
    if with_tools != render(tokenizer, messages, add_generation_prompt, tools=None):
        return with_tools
    messages = _history_in_text(messages, ctx.parser)
    prompt = ctx.parser.tools_system_prompt(ctx.tools)
    if messages and messages[0].get("role") == "system":
        messages[0] = {**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{prompt}".lstrip()}
    else:
        messages.insert(0, {"role": "system", "content": prompt})
    return render(tokenizer, messages, add_generation_prompt, tools=None)


# ---------------------------------------------------------------------------
# Output -> tool calls
# ---------------------------------------------------------------------------


def extract_tool_calls(ctx: ToolContext, text: str) -> tuple[str | None, list[ToolCall]]:
    """A finished output -> (content, tool calls)."""
    if ctx.mode == "auto":
        got = ctx.parser.extract(text)
        calls = got.tool_calls if ctx.parallel else got.tool_calls[:1]
        return got.content, calls
    try:
        value = json.loads(text)
    except ValueError:  # cut short by max_tokens
        return text, []
    if ctx.mode == "named":
        return (None, [ToolCall(ctx.named, text)]) if isinstance(value, dict) else (text, [])
    if not isinstance(value, list) or not all(
        isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("arguments"), dict) for c in value
    ):
        return text, []
    return None, [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in value]


def finish_reason_with_tools(finish_reason: str | None, num_calls: int) -> str | None:
    return "tool_calls" if num_calls and finish_reason == "stop" else finish_reason


class ToolCallStream:
    """One sequence's streamed output -> content and tool-call events."""

    def __init__(self, ctx: ToolContext):
        self.ctx = ctx
        self.num_tool_calls = 0
        if ctx.mode == "auto":
            self._parser = ctx.parser.streaming()
        elif ctx.mode == "required":
            self._parser = _RequiredCallsStream()
        else:
            self._parser = None
            self._started = False

    def feed(self, text: str) -> list[StreamEvent]:
        if self._parser is None:  # named: the whole output is the arguments
            events: list[StreamEvent] = []
            if not self._started:
                self._started = True
                events.append(ToolCallStart(0, tool_call_id(), self.ctx.named or ""))
                self.num_tool_calls = 1
            if text:
                events.append(ToolCallArguments(0, text))
            return events
        return self._limit(self._parser.feed(text))

    def finish(self) -> list[StreamEvent]:
        if self._parser is None:
            return self.feed("") if not self._started else []
        return self._limit(self._parser.finish())

    def _limit(self, events: list[StreamEvent]) -> list[StreamEvent]:
        if not self.ctx.parallel:  # only the first call
            events = [e for e in events if isinstance(e, ContentDelta) or e.index == 0]
        n = self._parser.num_tool_calls
        self.num_tool_calls = n if self.ctx.parallel else min(n, 1)
        return events


# the rest of the previous call ("}, "), then the next call's head up to its arguments
_CALL_HEAD = re.compile(r'[\s}]*,?\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')


class _RequiredCallsStream:
    """Streams `[{"name": "f", "arguments": {...}}, ...]` (the grammar of
    tool_choice "required" fixes this shape and key order): a call starts
    once its name is complete, then its arguments stream as they come."""

    def __init__(self) -> None:
        self.buf = ""
        self.pos = 0  # next unread character of buf
        self.calls = 0
        self.in_args = False
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.started = False  # the opening "[" was read

    @property
    def num_tool_calls(self) -> int:
        return self.calls

    def feed(self, text: str) -> list[StreamEvent]:
        self.buf += text
        events: list[StreamEvent] = []
        while self.pos < len(self.buf):
            if not self.started:
                i = self.buf.find("[", self.pos)
                if i < 0:
                    return events
                self.started, self.pos = True, i + 1
            elif not self.in_args:
                m = _CALL_HEAD.match(self.buf, self.pos)
                if m is None:
                    return events  # the head is not complete yet (or the list ended)
                events.append(ToolCallStart(self.calls, tool_call_id(), json.loads(m.group(1))))
                self.calls += 1
                self.pos = m.end()
                self.in_args, self.depth, self.in_string, self.escape = True, 0, False, False
            else:
                start = self.pos
                done = self._scan_value()
                if self.pos > start:
                    events.append(ToolCallArguments(self.calls - 1, self.buf[start : self.pos]))
                if not done:
                    return events
                self.in_args = False  # the call's "}" is skipped by the next head
        return events

    def _scan_value(self) -> bool:
        """Advance pos through the arguments value; True once it is complete."""
        buf = self.buf
        while self.pos < len(buf):
            ch = buf[self.pos]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                if self.depth == 0:
                    return True  # the call object closes: the value ended before it
                self.depth -= 1
                if self.depth == 0:
                    self.pos += 1
                    return True
            elif ch == "," and self.depth == 0:
                return True
            self.pos += 1
        return False

    def finish(self) -> list[StreamEvent]:
        """Cut short (max_tokens) before any call's name was complete: what the
        model wrote goes out as content, as a non-streamed response gives it."""
        if self.calls == 0 and self.buf:
            return [ContentDelta(self.buf)]
        return []
