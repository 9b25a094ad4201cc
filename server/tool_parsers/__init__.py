"""Tool-call parsers, by name (`serval serve --tool-call-parser NAME`).

    parser = get_tool_parser("hermes")
    parser.extract('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>').tool_calls[0].name == "f"

A new format is one ToolParser subclass (see base.py) registered in
TOOL_PARSERS.
"""

from __future__ import annotations

from server.tool_parsers.base import (
    ContentDelta,
    ExtractedToolCalls,
    StreamEvent,
    StreamingToolParser,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
    ToolParser,
    tool_call_id,
)
from server.tool_parsers.hermes import HermesToolParser
from server.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,  # Llama 3.1 / 3.2: {"name": ..., "parameters": ...}; ...
    "qwen": HermesToolParser,  # Qwen2.5 / Qwen3 use the Hermes format
}
DEFAULT_TOOL_PARSER = "hermes"


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {name!r}; choose from {', '.join(sorted(TOOL_PARSERS))}"
        ) from None


__all__ = [
    "ContentDelta",
    "DEFAULT_TOOL_PARSER",
    "ExtractedToolCalls",
    "StreamEvent",
    "StreamingToolParser",
    "TOOL_PARSERS",
    "ToolCall",
    "ToolCallArguments",
    "ToolCallStart",
    "ToolParser",
    "get_tool_parser",
    "tool_call_id",
]
