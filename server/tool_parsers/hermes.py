"""The Hermes / Qwen tool-call format (NousResearch Hermes 2/3, Qwen2.5, Qwen3):

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Each <tool_call> block holds one JSON object with "name" and "arguments"
(an object; a JSON string of one is accepted too). Text outside the blocks is
content. A block that does not parse stays in the content, tags included.
A final block left open by the end of the output counts if its JSON is whole
(the model stopped right before </tool_call>).

Streaming holds back text that may start "<tool_call>" and the inside of a
block until its closing tag, so a call is sent only once it is known to be
valid: first a delta with id, type and name, then one with the arguments.
"""

from __future__ import annotations

import json
import re
from typing import Any

from server.tool_parsers.base import (
    ContentDelta,
    ExtractedToolCalls,
    StreamEvent,
    StreamingToolParser,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
    ToolParser,
    arguments_text,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


def parse_call(block: str) -> ToolCall | None:
    """'{"name": "f", "arguments": {"x": 1}}' -> ToolCall("f", '{"x": 1}'); None if malformed."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    text = arguments_text(args)
    return None if text is None else ToolCall(obj["name"], text)


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag:
    ("Hi <tool", "<tool_call>") -> 5."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HermesToolParser(ToolParser):
    name = "hermes"

    def extract(self, text: str) -> ExtractedToolCalls:
        calls: list[ToolCall] = []
        content_parts: list[str] = []
        pos = 0
        for m in _BLOCK.finditer(text):
            call = parse_call(m.group(1))
            if call is None:
                continue  # stays in the content
            content_parts.append(text[pos : m.start()])
            calls.append(call)
            pos = m.end()
        rest = text[pos:]
        i = rest.rfind(OPEN)
        if i >= 0 and CLOSE not in rest[i:]:
            call = parse_call(rest[i + len(OPEN) :])
            if call is not None:
                calls.append(call)
                rest = rest[:i]
        content_parts.append(rest)
        if not calls:
            return ExtractedToolCalls(text, [])
        content = "".join(content_parts).strip()
        return ExtractedToolCalls(content or None, calls)

    def streaming(self) -> StreamingToolParser:
        return _HermesStream()

    def tools_system_prompt(self, tools: list[dict[str, Any]]) -> str:
        signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            "You may call these functions:\n<tools>\n"
            f"{signatures}\n</tools>\n"
            "For each call, write its name and arguments as JSON in <tool_call></tool_call> tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call>\n'
            "Results come back in <tool_response></tool_response> tags."
        )

    def format_tool_call(self, name: str, arguments: Any) -> str:
        args = json.loads(arguments_text(arguments) or "{}")
        return f"{OPEN}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{CLOSE}"

    def format_tool_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


class _HermesStream(StreamingToolParser):
    def __init__(self) -> None:
        self.buf = ""
        self.in_call = False
        self.calls = 0
        # whitespace-only content waits for real text: after a call it is dropped
        self.pending_space = ""

    @property
    def num_tool_calls(self) -> int:
        return self.calls

    def _content(self, text: str, events: list[StreamEvent]) -> None:
        if not text:
            return
        if not text.strip():
            self.pending_space += text
            return
        events.append(ContentDelta(self.pending_space + text))
        self.pending_space = ""

    def _call(self, call: ToolCall, events: list[StreamEvent]) -> None:
        events.append(ToolCallStart(self.calls, call.id, call.name))
        events.append(ToolCallArguments(self.calls, call.arguments))
        self.calls += 1
        self.pending_space = ""

    def feed(self, text: str) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        self.buf += text
        while self.buf:
            if not self.in_call:
                i = self.buf.find(OPEN)
                if i < 0:
                    keep = _held_prefix(self.buf, OPEN)
                    self._content(self.buf[: len(self.buf) - keep], events)
                    self.buf = self.buf[len(self.buf) - keep :]
                    break
                self._content(self.buf[:i], events)
                self.buf = self.buf[i + len(OPEN) :]
                self.in_call = True
            else:
                j = self.buf.find(CLOSE)
                if j < 0:
                    break
                block, self.buf = self.buf[:j], self.buf[j + len(CLOSE) :]
                self.in_call = False
                call = parse_call(block)
                if call is None:
                    self._content(OPEN + block + CLOSE, events)
                else:
                    self._call(call, events)
        return events

    def finish(self) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if self.in_call:
            call = parse_call(self.buf)
            if call is not None:
                self._call(call, events)
            else:
                self._content(OPEN + self.buf, events)
        else:
            self._content(self.buf, events)
        self.buf = ""
        self.in_call = False
        if self.pending_space and not self.calls:
            events.append(ContentDelta(self.pending_space))
        self.pending_space = ""
        return events
