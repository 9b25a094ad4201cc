"""Tool calling: the Hermes and llama3_json parsers over recorded model
outputs (whole and streamed in random pieces), the streaming of
grammar-constrained calls, the rendering of tools into prompts, and the
server end to end on the tiny random model (tool_choice required / named constrain the output; for auto, a
guided regex makes the model write the Hermes format)."""

from __future__ import annotations

import json
import random

import httpx
import jsonschema
import pytest
from openai import OpenAI

from server.tool_calls import ToolCallStream, ToolContext, _RequiredCallsStream, prepare_tools, render_with_tools
from server.tool_parsers import (
    ContentDelta,
    ExtractedToolCalls,
    ToolCallArguments,
    ToolCallStart,
    get_tool_parser,
)

MODEL = "tiny"
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["C", "F"]},
    },
    "required": ["city", "days"],
}
CLOCK = {  # uses $defs, which must survive being nested in the "required" schema
    "type": "object",
    "properties": {"zone": {"$ref": "#/$defs/zone"}},
    "required": ["zone"],
    "$defs": {"zone": {"type": "string", "pattern": "^UTC[+-][0-9]$"}},
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
HERMES = get_tool_parser("hermes")


# ---------------------------------------------------------------------------
# The Hermes parser on recorded outputs
# ---------------------------------------------------------------------------

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
RECORDED = [
    # (model output, expected content, expected [(name, arguments)])
    (CALL, None, [("get_weather", {"city": "Paris", "days": 2})]),
    ("Let me check.\n" + CALL, "Let me check.", [("get_weather", {"city": "Paris", "days": 2})]),
    (CALL + "\n" + CALL.replace("Paris", "Rome"), None,
     [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Rome", "days": 2})]),
    ('<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC+1\\"}"}\n</tool_call>', None,
     [("get_time", {"zone": "UTC+1"})]),  # arguments given as JSON text
    ('<tool_call>{"name": "get_time"}</tool_call>', None, [("get_time", {})]),
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC-2"}}', None, [("get_time", {"zone": "UTC-2"})]),
    ("It is sunny in Paris today.", "It is sunny in Paris today.", []),
    ("Use <tool_call> tags to call tools.", "Use <tool_call> tags to call tools.", []),
    ('<tool_call>\n{"name": get_weather, "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": get_weather, "arguments": {}}\n</tool_call>', []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', 
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', []),
    ('<tool_call>["get_weather"]</tool_call> and ' + CALL, '<tool_call>["get_weather"]</tool_call> and',
     [("get_weather", {"city": "Paris", "days": 2})]),
    ("<tool_call></tool_call>", "<tool_call></tool_call>", []),
    ("a < b <tool", "a < b <tool", []),
]


@pytest.mark.parametrize("text,content,calls", RECORDED)
def test_hermes_extracts_calls_and_leaves_the_rest_as_content(text, content, calls):
    got = HERMES.extract(text)
    assert got.content == content
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == calls
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in got.tool_calls)
    assert len({c.id for c in got.tool_calls}) == len(got.tool_calls)


def _stream(parser_stream, text: str, rng: random.Random) -> tuple[str, list[tuple[str, str]], list]:
    events = []
    i = 0
    while i < len(text):
        n = rng.randint(1, 9)
        events += parser_stream.feed(text[i : i + n])
        i += n
    events += parser_stream.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, ToolCallStart):
            assert e.index not in calls and e.id.startswith("call_")
            calls[e.index] = [e.name, ""]
        elif isinstance(e, ToolCallArguments):
            calls[e.index][1] += e.arguments  # a start always comes first
    return content, [tuple(v) for _, v in sorted(calls.items())], events


@pytest.mark.parametrize("text,content,calls", RECORDED)
def test_hermes_streaming_gives_what_extract_gives(text, content, calls):
    for seed in range(5):
        got, got_calls, _ = _stream(HERMES.streaming(), text, random.Random(seed))
        assert (got.strip() or None) == (content.strip() if content else None)
        assert [(n, json.loads(a)) for n, a in got_calls] == calls


def test_hermes_streaming_holds_back_only_what_may_start_a_call():
    s = HERMES.streaming()
    assert s.feed("Hello <tool") == [ContentDelta("Hello ")]
    assert s.feed("box> done") == [ContentDelta("<toolbox> done")]
    assert s.finish() == []


# ---------------------------------------------------------------------------
# The Llama 3.1 / 3.2 JSON parser (llama3_json) on recorded outputs
# ---------------------------------------------------------------------------

LLAMA3 = get_tool_parser("llama3_json")
L_CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'
L_PARIS = ("get_weather", {"city": "Paris", "days": 2})
LLAMA3_CALLS = [
    # (model output, expected [(name, arguments)]): the output is only calls, content None
    (L_CALL, [L_PARIS]),
    (L_CALL + "; " + L_CALL.replace("Paris", "Rome"), [L_PARIS, ("get_weather", {"city": "Rome", "days": 2})]),
    ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC+1"}}', [("get_time", {"zone": "UTC+1"})]),
    ('{"name": "get_time", "arguments": {"zone": "UTC-2"}}', [("get_time", {"zone": "UTC-2"})]),
    ('\n <|python_tag|>\n' + L_CALL + ' ;\n{"name": "get_time", "arguments": {}};\n',
     [L_PARIS, ("get_time", {})]),
    (L_CALL + "\n" + L_CALL, [L_PARIS, L_PARIS]),  # as the history is written back: one call a line
    ('{"name": "get_time", "parameters": "{\\"zone\\": \\"UTC+1\\"}"}', [("get_time", {"zone": "UTC+1"})]),
    ('{"type": "function", "name": "get_weather", "parameters": {"city": "Pa}ris\\"{", "days": [1, {"a": 2}]}}',
     [("get_weather", {"city": 'Pa}ris"{', "days": [1, {"a": 2}]})]),
]
LLAMA3_CONTENT = [  # outputs that are content, whole
    "It is sunny in Paris today.",
    "  Call it as {\"name\": \"get_time\", \"parameters\": {}}.",
    '<|python_tag|>brave_search.call(query="weather in Paris")',
    "<|python",
    "<b>bold</b>",
    '{"name": get_weather, "parameters": {}}',  # malformed JSON
    '{"name": "get_weather", "parameters": [1, 2]}',  # arguments not an object
    '{"name": "get_weather", "parameters": "Paris"}',
    '{"name": "get_weather", "arguments": "{oops"}',
    '{"name": "", "parameters": {}}',
    '{"city": "Paris", "days": 2}',  # a JSON answer, not a call
    '{"name": "Bob", "age": 3}',
    '["get_weather", {"city": "Paris"}]',
    '{"name": "get_weather", "parameters": {"city": "Par',  # cut short
    '{"name": 7, "parameters": {}}; ' + L_CALL,  # a bad first call: nothing is a call
    "",
]


@pytest.mark.parametrize("text,calls", LLAMA3_CALLS)
def test_llama3_json_extracts_calls(text, calls):
    got = LLAMA3.extract(text)
    assert got.content is None
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == calls
    assert all(isinstance(json.loads(c.arguments), dict) for c in got.tool_calls)
    assert all(c.id.startswith("call_") for c in got.tool_calls)
    assert len({c.id for c in got.tool_calls}) == len(got.tool_calls)


# text after a call: content in a stream (the call was sent), all content for extract
LLAMA3_TAILS = [" Done.", '; {"name": "get_ti', "; {oops}", "}", ", " + L_CALL, ";; " + L_CALL]


@pytest.mark.parametrize("text", LLAMA3_CONTENT + [L_CALL + tail for tail in LLAMA3_TAILS])
def test_llama3_json_leaves_what_is_not_only_calls_as_content(text):
    assert LLAMA3.extract(text) == ExtractedToolCalls(text, [])


@pytest.mark.parametrize("text,calls", LLAMA3_CALLS)
def test_llama3_json_streams_calls(text, calls):
    for seed in range(8):
        s = LLAMA3.streaming()
        content, got_calls, _ = _stream(s, text, random.Random(seed))
        assert content == ""
        assert [(n, json.loads(a)) for n, a in got_calls] == calls
        assert s.num_tool_calls == len(calls)


@pytest.mark.parametrize("text", LLAMA3_CONTENT)
def test_llama3_json_streams_content_whole(text):
    for seed in range(8):
        s = LLAMA3.streaming()
        content, calls, _ = _stream(s, text, random.Random(seed))
        assert content == text and calls == [] and s.num_tool_calls == 0


def test_llama3_json_streaming_holds_back_only_while_it_may_be_calls():
    s = LLAMA3.streaming()
    assert s.feed(" \n<|py") == []
    assert s.feed("thon_tag|> ") == []
    assert s.feed('{"name": "get_time", "para') == []
    ev = s.feed('meters": {"zone": "UTC+1"}}')  # a call goes out once its object is complete
    assert [type(e) for e in ev] == [ToolCallStart, ToolCallArguments]
    assert ev[0].index == 0 and ev[0].name == "get_time" and ev[0].id.startswith("call_")
    assert ev[1] == ToolCallArguments(0, '{"zone": "UTC+1"}')
    assert s.num_tool_calls == 1
    assert s.feed('; {"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}') == []
    ev = s.feed("}\n")
    assert ev[0].index == 1 and ev[0].name == "get_weather"
    assert ev[1] == ToolCallArguments(1, '{"city": "Oslo", "days": 1}')
    assert s.finish() == [] and s.num_tool_calls == 2

    # clearly not calls: everything held back goes out, then text passes straight through
    s = LLAMA3.streaming()
    assert s.feed("  <") == []
    assert s.feed("b>") == [ContentDelta("  <b>")]
    assert s.feed("hi") == [ContentDelta("hi")]
    assert s.feed('{"name": "f", "parameters": {}}') == [ContentDelta('{"name": "f", "parameters": {}}')]
    assert s.finish() == [] and s.num_tool_calls == 0
    s = LLAMA3.streaming()
    assert s.feed("<|python_tag|>") == []
    assert s.feed("print(1)") == [ContentDelta("<|python_tag|>print(1)")]
    # a complete object that is not a call is content at once, not only at the end
    s = LLAMA3.streaming()
    assert s.feed('{"name": get_weather, ') == []
    assert s.feed('"parameters": {}} and') == [ContentDelta('{"name": get_weather, "parameters": {}} and')]
    assert s.feed(" more") == [ContentDelta(" more")]
    assert s.finish() == []
    # held text that never became calls goes out at the end, as one delta
    s = LLAMA3.streaming()
    assert s.feed(' {"name": "get_time", "parameters": {"zone": "UT') == []
    assert s.finish() == [ContentDelta(' {"name": "get_time", "parameters": {"zone": "UT')]
    assert s.num_tool_calls == 0


@pytest.mark.parametrize("tail", LLAMA3_TAILS)
def test_llama3_json_streaming_keeps_text_after_a_sent_call_as_content(tail):
    # a call already sent cannot be taken back; what follows it is not lost
    for seed in range(5):
        s = LLAMA3.streaming()
        content, calls, _ = _stream(s, L_CALL + tail, random.Random(seed))
        assert [(n, json.loads(a)) for n, a in calls] == [L_PARIS] and s.num_tool_calls == 1
        assert content == tail.strip()


def test_llama3_json_is_registered_and_writes_its_own_format():
    from server.cli import build_parser
    from server.tool_parsers import DEFAULT_TOOL_PARSER, TOOL_PARSERS
    from server.tool_parsers.llama3_json import Llama3JsonToolParser

    assert isinstance(LLAMA3, Llama3JsonToolParser) and LLAMA3.name == "llama3_json"
    assert TOOL_PARSERS["llama3_json"] is Llama3JsonToolParser and DEFAULT_TOOL_PARSER == "hermes"
    assert build_parser().parse_args(["serve", "--tool-call-parser", "llama3_json"]).tool_call_parser == "llama3_json"
    written = LLAMA3.format_tool_call("get_weather", '{"city": "Paris"}')
    assert written == '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    written_obj = LLAMA3.format_tool_call("get_time", {"zone": "UTC+1"})
    assert written_obj == '{"name": "get_time", "parameters": {"zone": "UTC+1"}}'
    got = LLAMA3.extract(written)
    assert got.content is None
    assert [(c.name, c.arguments) for c in got.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    prompt = LLAMA3.tools_system_prompt(TOOLS)
    assert '{"name": function name, "parameters": dictionary of argument name and its value}' in prompt
    for tool in TOOLS:  # each tool's JSON, whole
        assert json.dumps(tool, indent=4) in prompt
    assert "<tool_call>" not in prompt and LLAMA3.format_tool_result("sunny") == "sunny"


def test_required_calls_stream_as_they_come():
    text = ('[{"name": "get_weather", "arguments": {"city": "Pa}ris\\"", "days": [1, {"a": 2}]}}, '
            '{"name": "get_time", "arguments": {}}]')
    for seed in range(8):
        content, calls, events = _stream(_RequiredCallsStream(), text, random.Random(seed))
        assert content == ""
        assert calls == [("get_weather", '{"city": "Pa}ris\\"", "days": [1, {"a": 2}]}'), ("get_time", "{}")]
    # the name is sent as soon as it is complete, before the arguments
    s = _RequiredCallsStream()
    assert s.feed('[{"name": "get_wea') == []
    ev = s.feed('ther", "arguments": {"ci')
    assert isinstance(ev[0], ToolCallStart) and ev[0].name == "get_weather"
    assert ev[1] == ToolCallArguments(0, '{"ci')
    assert s.finish() == []  # a call was started: its arguments went out as they came
    # cut short (max_tokens) before the first name: the text is content, not lost
    s = _RequiredCallsStream()
    assert s.feed('[{"name": "get_') == []
    assert s.finish() == [ContentDelta('[{"name": "get_')]


# ---------------------------------------------------------------------------
# Rendering tools into the prompt
# ---------------------------------------------------------------------------

TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}{% else %}{{ m.content }}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HISTORY = MSGS + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


class _Req:
    def __init__(self, **kw):
        self.tools = kw.get("tools")
        self.tool_choice = kw.get("tool_choice")
        self.parallel_tool_calls = kw.get("parallel_tool_calls")


def _render(tiny_model_dir, template, messages, ctx):
    from scheduler.config import resolve_model
    from server.protocol import ChatMessage
    from server.serving_chat import messages_for_template, render_chat
    from server.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(tiny_model_dir), None, template)
    msgs = messages_for_template([ChatMessage(**m) for m in messages])
    _, ids = render_with_tools(render_chat, tok, msgs, True, ctx)
    return tok.decode(ids)


def test_a_template_that_renders_tools_gets_them_and_the_history_as_objects(tiny_model_dir):
    ctx = prepare_tools(_Req(tools=TOOLS), HERMES)
    text = _render(tiny_model_dir, TOOL_TEMPLATE, HISTORY, ctx)
    assert "TOOLS:get_weather;get_time;" in text
    assert 'CALL get_weather {"city": "Paris"}' in text  # arguments as an object, not a JSON string
    assert "<tools>" not in text


def test_a_template_that_ignores_tools_gets_a_hermes_system_message(tiny_model_dir):
    ctx = prepare_tools(_Req(tools=TOOLS), HERMES)
    text = _render(tiny_model_dir, None, HISTORY, ctx)  # the tiny ChatML template knows no tools
    assert text.startswith("<|im_start|>system\n") and "<tools>" in text and '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    # without tools, nothing is injected
    plain = _render(tiny_model_dir, None, MSGS, None)
    assert "<tools>" not in plain and plain.startswith("<|im_start|>user")


def test_a_template_that_ignores_tools_gets_a_llama3_json_system_message(tiny_model_dir):
    text = _render(tiny_model_dir, None, HISTORY, prepare_tools(_Req(tools=TOOLS), LLAMA3))
    assert text.startswith("<|im_start|>system\n") and '"parameters": dictionary of argument name' in text
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in text and "<tool_call>" not in text


def test_tool_choice_none_renders_and_parses_nothing():
    assert prepare_tools(_Req(tools=TOOLS, tool_choice="none"), HERMES) is None
    ctx = prepare_tools(_Req(tools=TOOLS, tool_choice="auto", parallel_tool_calls=False), HERMES)
    assert isinstance(ctx, ToolContext) and ctx.spec is None and not ctx.parallel
    events = ToolCallStream(ctx).feed(CALL + CALL)
    assert [e.index for e in events if isinstance(e, ToolCallStart)] == [0]


# ---------------------------------------------------------------------------
# Through the server
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(tiny_server) -> OpenAI:
    return OpenAI(base_url=tiny_server.url("/v1"), api_key="unused", max_retries=0)


def _check_calls(calls, max_calls=None):
    assert calls and (max_calls is None or len(calls) <= max_calls)
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed_calls(chunks):
    """Rebuild tool calls from stream chunks, checking OpenAI's shape."""
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            finish = choice.finish_reason or finish
            for tc in delta.tool_calls or ():
                if tc.index not in calls:
                    assert tc.id.startswith("call_") and tc.type == "function" and tc.function.name
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments or ""}
                else:
                    assert tc.id is None and tc.function.name is None
                    calls[tc.index]["arguments"] += tc.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_gives_calls_whose_arguments_validate(client, seed):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="required",
                                       max_tokens=250, temperature=1.0, seed=seed, n=2)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        _check_calls(choice.message.tool_calls)


def test_required_streamed(client):
    chunks = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="required",
                                            max_tokens=250, temperature=1.0, seed=5, stream=True)
    content, calls, finish = _streamed_calls(chunks)
    assert content == "" and finish == "tool_calls" and calls
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_required_without_parallel_calls_gives_one(client):
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=250, temperature=1.0, seed=seed)
        _check_calls(r.choices[0].message.tool_calls, max_calls=1)


@pytest.mark.parametrize("stream", [False, True])
def test_named_function(client, stream):
    choice = {"type": "function", "function": {"name": "get_time"}}
    kwargs = dict(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice=choice, max_tokens=100, temperature=1.0, seed=3)
    if stream:
        content, calls, finish = _streamed_calls(client.chat.completions.create(stream=True, **kwargs))
        assert [c["name"] for c in calls] == ["get_time"] and finish == "tool_calls"
        jsonschema.validate(json.loads(calls[0]["arguments"]), CLOCK)
    else:
        r = client.chat.completions.create(**kwargs)
        assert r.choices[0].finish_reason == "tool_calls"
        assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_time"]
        _check_calls(r.choices[0].message.tool_calls)


# The random model writes Hermes tool calls when a regex makes it.
FORCED_CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}\n'
               r"</tool_call>")


@pytest.mark.parametrize("stream", [False, True])
def test_auto_turns_hermes_text_into_tool_calls(client, stream):
    kwargs = dict(model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=100, temperature=1.0, seed=1,
                  extra_body={"guided_regex": "Checking\\. " + FORCED_CALL})
    if stream:
        content, calls, finish = _streamed_calls(client.chat.completions.create(stream=True, **kwargs))
        assert content.strip() == "Checking." and finish == "tool_calls"
        assert [c["name"] for c in calls] == ["get_weather"]
        jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)
    else:
        r = client.chat.completions.create(**kwargs)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and message.content == "Checking."
        _check_calls(message.tool_calls)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("regex", [r"It is (sunny|rainy)\.", r'<tool_call>\{"name": get_weather\}</tool_call>'])
def test_auto_leaves_plain_and_broken_text_as_content(client, stream, regex):
    kwargs = dict(model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=60, temperature=1.0, seed=2,
                  extra_body={"guided_regex": regex})
    if stream:
        content, calls, finish = _streamed_calls(client.chat.completions.create(stream=True, **kwargs))
    else:
        r = client.chat.completions.create(**kwargs)
        content, calls, finish = r.choices[0].message.content, r.choices[0].message.tool_calls, r.choices[0].finish_reason
    assert not calls and finish == "stop"
    assert content.startswith(("It is", '<tool_call>{"name": get_weather}'))


def test_history_with_tool_calls_and_results_is_accepted(client):
    r = client.chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS, max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    r = client.chat.completions.create(model=MODEL, messages=HISTORY, max_tokens=5, temperature=0)
    assert r.choices[0].message.tool_calls is None


@pytest.mark.parametrize("fields,param", [
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}]},
     "tools[0].function.parameters"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
      "tool_choice": "required"}, "tools"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                         "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_tool_fields_are_400s(tiny_server, fields, param):
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 4, **fields}
    r = httpx.post(tiny_server.url("/v1/chat/completions"), json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
