"""What a tool-call parser is: the model's text -> OpenAI tool calls.

A parser knows one model family's tool-call format. It turns a finished
output into content and tool calls (`extract`), and a streamed output into
events (`streaming()` gives a per-sequence state fed with text deltas):

    ContentDelta("Let me check. ")
    ToolCallStart(index=0, id="call_...", name="get_weather")
    ToolCallArguments(index=0, arguments='{"city": "Paris"}')

Anything that looks like a tool call but does not parse stays content: a
parser never fails a request. For a model whose chat template does not
render tools, the parser also says how to describe them in a system message
and how to write earlier calls back into the history, in its own format.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=tool_call_id)


@dataclass
class ExtractedToolCalls:
    content: str | None  # None when the output was only tool calls
    tool_calls: list[ToolCall]


@dataclass
class ContentDelta:
    text: str


@dataclass
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass
class ToolCallArguments:
    index: int
    arguments: str  # a fragment of the JSON text


StreamEvent = ContentDelta | ToolCallStart | ToolCallArguments


class StreamingToolParser(ABC):
    """The streaming state of one sequence."""

    @abstractmethod
    def feed(self, text: str) -> list[StreamEvent]:
        """Events for the next piece of output text (text may be held back
        until it is clear whether it starts a tool call)."""

    @abstractmethod
    def finish(self) -> list[StreamEvent]:
        """Events for whatever is still held back, at the end of the output."""

    @property
    @abstractmethod
    def num_tool_calls(self) -> int: ...


class ToolParser(ABC):
    name: str

    @abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls: ...

    @abstractmethod
    def streaming(self) -> StreamingToolParser: ...

    @abstractmethod
    def tools_system_prompt(self, tools: list[dict[str, Any]]) -> str:
        """A system message describing `tools` (OpenAI tool dicts) and how to call them."""

    @abstractmethod
    def format_tool_call(self, name: str, arguments: Any) -> str:
        """An earlier call written back as the model would have written it."""

    def format_tool_result(self, content: str) -> str:
        return content


def arguments_text(arguments: Any) -> str | None:
    """Tool-call arguments -> JSON text of an object; None if they are not one.
    {"a": 1} -> '{"a": 1}'; '{"a": 1}' (already text) -> '{"a": 1}'."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return json.dumps(arguments, ensure_ascii=False)
