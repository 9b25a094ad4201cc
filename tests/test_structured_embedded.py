"""Structured outputs and tool calls where the answer's quality matters: the
embedded SmolLM2-135M-Instruct, constrained, says sensible things."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel

from scheduler.config import ConfigError, resolve_model
from server_util import ServerProcess

try:
    resolve_model(None)
except ConfigError as e:  # pragma: no cover
    pytest.skip(str(e), allow_module_level=True)

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
PARIS = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class Capital(BaseModel):
    country: str
    capital: str


@pytest.fixture(scope="module")
def client():
    with ServerProcess(["--kv-cache-memory", "0.1", "--max-model-len", "2048", "--log-level", "warning"]) as s:
        yield openai.OpenAI(base_url=s.url("/v1"), api_key="unused", max_retries=0, timeout=120)


def test_parse_gives_the_right_capital(client):
    r = client.chat.completions.parse(model=MODEL, messages=PARIS, response_format=Capital, max_tokens=60,
                                      temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.parsed.capital == "Paris"


def test_required_tool_call_picks_the_city(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What's the weather in Paris?"}],
        tools=[WEATHER_TOOL], tool_choice="required", max_tokens=60, temperature=0,
    )
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert r.choices[0].finish_reason == "tool_calls"
