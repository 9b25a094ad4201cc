"""The Llama 3.1 / 3.2 JSON tool-call format (vLLM's `llama3_json`):

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

The whole output is the calls: after optional whitespace and the optional
<|python_tag|> marker, one JSON object per call, with "name" and "parameters"
("arguments" is accepted instead; an object, or a JSON string of one). Several
calls are separated by ";" (whitespace alone, as in the history this parser
writes back, is accepted too). An output that does not start with "{" (after
whitespace and the marker) is content, and so is, whole, an output that does
not parse as calls.

Streaming holds back the output while it may be calls (it starts with "{" or
a prefix of the marker) and sends each call, name then arguments, once its
JSON object is complete and valid. As soon as the output is clearly not calls,
everything held back goes out as content and the rest passes straight
through. Text that turns bad after a call was sent goes out as content from
the end of that call (the call itself cannot be taken back).
"""

from __future__ import annotations

import json
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

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def parse_call(obj: Any) -> ToolCall | None:
    """{"name": "f", "parameters": {"x": 1}} -> ToolCall("f", '{"x": 1}'); None if it is not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if "parameters" in obj:
        args = obj["parameters"]
    elif "arguments" in obj:
        args = obj["arguments"]
    else:
        return None
    text = arguments_text(args)
    return None if text is None else ToolCall(obj["name"], text)


def _body_start(text: str) -> int | None:
    """Where the first object starts (after whitespace and the marker); None if
    the text does not start with one."""
    pos = len(text) - len(text.lstrip())
    if text.startswith(PYTHON_TAG, pos):
        pos += len(PYTHON_TAG)
        pos += len(text[pos:]) - len(text[pos:].lstrip())
    return pos if text.startswith("{", pos) else None


def parse_calls(text: str) -> list[ToolCall] | None:
    """The calls of a whole output; None unless all of it is calls."""
    pos = _body_start(text)
    if pos is None:
        return None
    calls: list[ToolCall] = []
    while True:
        try:
            obj, pos = _DECODER.raw_decode(text, pos)
        except ValueError:
            return None
        call = parse_call(obj)
        if call is None:
            return None
        calls.append(call)
        rest = text[pos:].lstrip()
        pos = len(text) - len(rest)
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
            pos = len(text) - len(rest)
        if not rest:
            return calls
        if not rest.startswith("{"):
            return None


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def extract(self, text: str) -> ExtractedToolCalls:
        calls = parse_calls(text)
        if not calls:
            return ExtractedToolCalls(text, [])
        return ExtractedToolCalls(None, calls)

    def streaming(self) -> StreamingToolParser:
        return _Llama3JsonStream()

    def tools_system_prompt(self, tools: list[dict[str, Any]]) -> str:
        signatures = "\n\n".join(json.dumps(t, ensure_ascii=False, indent=4) for t in tools)
        return (
            "You have access to the following functions. To call a function, respond with only a JSON "
            "for the function call with its proper arguments, and no other text.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. '
            "Do not use variables. To call several functions, separate their JSON objects with \"; \".\n\n"
            f"{signatures}"
        )

    def format_tool_call(self, name: str, arguments: Any) -> str:
        args = json.loads(arguments_text(arguments) or "{}")
        return json.dumps({"name": name, "parameters": args}, ensure_ascii=False)


# states of the stream
_UNDECIDED, _CONTENT, _CALLS = "undecided", "content", "calls"
# states of the calls' scanner
_EXPECT_OBJECT, _IN_OBJECT, _AFTER_OBJECT = "expect object", "in object", "after object"


class _Llama3JsonStream(StreamingToolParser):
    def __init__(self) -> None:
        self.buf = ""  # the whole output so far, while it may be calls
        self.state = _UNDECIDED
        self.calls = 0
        # the scanner of _CALLS: buf[pos:] is unread
        self.pos = 0
        self.scan = _EXPECT_OBJECT
        self.obj_start = 0
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.after_calls = 0  # where the text after the last call sent starts

    @property
    def num_tool_calls(self) -> int:
        return self.calls

    def feed(self, text: str) -> list[StreamEvent]:
        if self.state == _CONTENT:
            return [ContentDelta(text)] if text else []
        self.buf += text
        events: list[StreamEvent] = []
        if self.state == _UNDECIDED:
            self._decide(events)
        if self.state == _CALLS:
            self._scan(events)
        return events

    def finish(self) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if self.state == _UNDECIDED:
            if self.buf:
                events.append(ContentDelta(self.buf))
        elif self.state == _CALLS and self.scan == _IN_OBJECT:
            self._bad(events)  # cut short inside an object
        self.buf = ""
        self.state = _CONTENT
        return events

    def _decide(self, events: list[StreamEvent]) -> None:
        head = self.buf.lstrip()
        if not head or (len(head) < len(PYTHON_TAG) and PYTHON_TAG.startswith(head)):
            return  # may still be calls
        if head.startswith(PYTHON_TAG):
            head = head[len(PYTHON_TAG) :].lstrip()
            if not head:
                return
        start = _body_start(self.buf)
        if start is None:
            self.state = _CONTENT
            events.append(ContentDelta(self.buf))
            self.buf = ""
            return
        self.state = _CALLS
        self.pos = start

    def _scan(self, events: list[StreamEvent]) -> None:
        buf = self.buf
        while self.pos < len(buf) and self.state == _CALLS:
            c = buf[self.pos]
            if self.scan == _IN_OBJECT:
                self.pos += 1
                if self.in_string:
                    if self.escape:
                        self.escape = False
                    elif c == "\\":
                        self.escape = True
                    elif c == '"':
                        self.in_string = False
                elif c == '"':
                    self.in_string = True
                elif c == "{":
                    self.depth += 1
                elif c == "}":
                    self.depth -= 1
                    if self.depth == 0:
                        self._object_done(events)
            elif c.isspace():
                self.pos += 1
            elif c == "{":
                self.scan = _IN_OBJECT
                self.obj_start = self.pos
                self.depth = 0
                self.in_string = self.escape = False
            elif c == ";" and self.scan == _AFTER_OBJECT:
                self.pos += 1
                self.scan = _EXPECT_OBJECT
            else:
                self._bad(events)

    def _object_done(self, events: list[StreamEvent]) -> None:
        try:
            call = parse_call(json.loads(self.buf[self.obj_start : self.pos]))
        except ValueError:
            call = None
        if call is None:
            self._bad(events)
            return
        events.append(ToolCallStart(self.calls, call.id, call.name))
        events.append(ToolCallArguments(self.calls, call.arguments))
        self.calls += 1
        self.after_calls = self.pos
        self.scan = _AFTER_OBJECT

    def _bad(self, events: list[StreamEvent]) -> None:
        """Not calls after all: the held text is content, and so is what follows."""
        text = self.buf[self.after_calls :].lstrip() if self.calls else self.buf
        if text:
            events.append(ContentDelta(text))
        self.buf = ""
        self.state = _CONTENT
