"""Structured outputs through the real server and the official client, on the
tiny random model: with a grammar only the constraint matters, so every
output sampled at temperature 1.0 must follow it."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import pytest
from openai import AsyncOpenAI, OpenAI
from pydantic import BaseModel, Field

MODEL = "tiny"
MSGS = [{"role": "user", "content": "Answer in JSON."}]
SCHEMAS = json.loads((Path(__file__).parent / "data" / "json_schemas.json").read_text())
# Formats are annotations in JSON Schema; these two are also asserted. (xgrammar
# generates dates and IPv4 addresses by shape: 02-31 and leading zeros pass.)
FORMATS = jsonschema.FormatChecker(formats=["email", "uuid"])


@pytest.fixture(scope="module")
def client(tiny_server) -> OpenAI:
    return OpenAI(base_url=tiny_server.url("/v1"), api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def aclient_factory(tiny_server):
    return lambda: AsyncOpenAI(base_url=tiny_server.url("/v1"), api_key="unused", max_retries=0)


def _validate(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=FORMATS)


class Weather(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    temperature: int = Field(ge=-30, le=50)
    sunny: bool


def test_parse_returns_the_pydantic_object(client):
    completion = client.chat.completions.parse(
        model=MODEL, messages=MSGS, response_format=Weather, max_tokens=100, temperature=1.0, seed=3, n=2
    )
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Weather)
        assert Weather.model_validate_json(choice.message.content) == choice.message.parsed


def _request_forms(i: int, schema: dict) -> tuple[str, dict]:
    """Each schema goes through one of the request fields that carry a schema."""
    form = i % 4
    if form == 0:
        return "chat", {"response_format": {"type": "json_schema",
                                            "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}}
    if form == 1:
        return "chat", {"extra_body": {"guided_json": schema}}
    if form == 2:
        return "completions", {"extra_body": {"guided_json": json.dumps(schema)}}
    return "completions", {"extra_body": {"structured_outputs": {"json": schema}}}


def test_every_output_of_the_schema_corpus_validates(aclient_factory):
    assert len(SCHEMAS) >= 30

    async def one(aclient: AsyncOpenAI, i: int, schema: dict) -> tuple[str, str]:
        route, extra = _request_forms(i, schema)
        common = dict(model=MODEL, max_tokens=400, temperature=1.0, seed=i, **extra)
        stream = i % 3 == 0
        if route == "chat":
            if stream:
                text, finish = "", None
                async for chunk in await aclient.chat.completions.create(messages=MSGS, stream=True, **common):
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
                return text, finish
            r = await aclient.chat.completions.create(messages=MSGS, **common)
            return r.choices[0].message.content, r.choices[0].finish_reason
        if stream:
            text, finish = "", None
            async for chunk in await aclient.completions.create(prompt="JSON:", stream=True, **common):
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            return text, finish
        r = await aclient.completions.create(prompt="JSON:", **common)
        return r.choices[0].text, r.choices[0].finish_reason

    async def run_all():
        async with aclient_factory() as aclient:
            return await asyncio.gather(*(one(aclient, i, s["schema"]) for i, s in enumerate(SCHEMAS)))

    results = asyncio.run(run_all())
    for entry, (text, finish) in zip(SCHEMAS, results):
        assert finish == "stop", (entry["name"], finish, text)
        try:
            _validate(text, entry["schema"])
        except (ValueError, jsonschema.ValidationError) as e:
            raise AssertionError(f"{entry['name']}: {text!r} does not validate: {e}") from None


def test_json_object(client):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=300, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason in ("stop", "length")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # a random model may nest forever; what it wrote is still a JSON object's beginning
        assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("stream", [False, True])
def test_regex_choice_and_grammar_match(client, stream):
    cases = [
        ({"guided_regex": r"[a-c]{2}-[0-9]{3}"}, lambda t: re.fullmatch(r"[a-c]{2}-[0-9]{3}", t)),
        ({"structured_outputs": {"regex": r"(yes|no), [0-9]+"}}, lambda t: re.fullmatch(r"(yes|no), [0-9]+", t)),
        ({"guided_choice": ["cat", "dog", 'say "hi"\n']}, lambda t: t in ("cat", "dog", 'say "hi"\n')),
        ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
        ({"guided_grammar": 'root ::= "(" digits ("+" digits)* ")"\ndigits ::= [0-9] | [0-9] [0-9]'},
         lambda t: re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})*\)", t)),
    ]
    for extra, ok in cases:
        for route in ("chat", "completions"):
            kwargs = dict(model=MODEL, max_tokens=200, temperature=1.0, seed=7, n=2, extra_body=extra)
            texts = {}
            if route == "chat":
                if stream:
                    texts = {0: "", 1: ""}
                    for chunk in client.chat.completions.create(messages=MSGS, stream=True, **kwargs):
                        for c in chunk.choices:
                            texts[c.index] += c.delta.content or ""
                else:
                    r = client.chat.completions.create(messages=MSGS, **kwargs)
                    texts = {c.index: c.message.content for c in r.choices}
                    assert all(c.finish_reason == "stop" for c in r.choices)
            else:
                if stream:
                    texts = {0: "", 1: ""}
                    for chunk in client.completions.create(prompt="x", stream=True, **kwargs):
                        for c in chunk.choices:
                            texts[c.index] += c.text
                else:
                    r = client.completions.create(prompt="x", **kwargs)
                    texts = {c.index: c.text for c in r.choices}
                    assert all(c.finish_reason == "stop" for c in r.choices)
            assert len(texts) == 2
            for text in texts.values():
                assert ok(text), (extra, route, text)


def test_guided_requests_end_with_eos_despite_ignore_eos_and_min_tokens(client):
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=50, temperature=1.0, seed=1,
                                  extra_body={"guided_choice": ["a", "b"], "ignore_eos": True, "min_tokens": 10})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text in ("a", "b")
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=1.0, seed=1,
                                  extra_body={"guided_regex": "[0-9]{10}"})
    assert r.choices[0].finish_reason == "length" and re.fullmatch("[0-9]+", r.choices[0].text)


INVALID = [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"guided_json": {"type": "integer", "minimum": 5, "maximum": 1}}, "guided_json"),
    ("/v1/chat/completions", {"guided_regex": "[z-a]"}, "guided_regex"),
    ("/v1/completions", {"guided_grammar": "root ::= item\nitem := 'x'"}, "guided_grammar"),
    ("/v1/completions", {"structured_outputs": {"grammar": 'root ::= "a" undefined_rule'}}, "structured_outputs.grammar"),
    ("/v1/completions", {"structured_outputs": {"json": {"type": "objectx"}}}, "structured_outputs.json"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route,fields,param", INVALID, ids=[p for _, _, p in INVALID])
def test_invalid_constraint_is_a_400_naming_the_field(tiny_server, route, fields, param, stream):
    body = {"model": MODEL, "max_tokens": 8, "stream": stream, "n": 2, **fields}
    body.update({"messages": MSGS} if "chat" in route else {"prompt": "x"})
    r = httpx.post(tiny_server.url(route), json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(f"{param}: invalid "), err
    # the server keeps serving, guided or not
    ok = httpx.post(tiny_server.url("/v1/completions"),
                    json={"model": MODEL, "prompt": "x", "max_tokens": 4, "guided_regex": "[0-9]+"}, timeout=30)
    assert ok.status_code == 200 and re.fullmatch("[0-9]+", ok.json()["choices"][0]["text"])


@pytest.mark.parametrize("fields,param", [
    ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, "guided_json"),
    ({"guided_choice": ["a", 1]}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"structured_outputs": {"yaml": "x"}}, "structured_outputs.yaml"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
])
def test_malformed_constraint_fields_are_400s(tiny_server, fields, param):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, **fields}
    r = httpx.post(tiny_server.url("/v1/completions"), json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_free_requests_in_a_mixed_batch_give_their_tokens_alone(client, aclient_factory):
    prompts = ["The quick brown fox", "Serval is a wild cat", "Once upon a time", "Numbers: 0 1 2"]
    alone = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0).choices[0].text
        for p in prompts
    ]

    async def mixed():
        async with aclient_factory() as aclient:
            free = [aclient.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0) for p in prompts]
            guided = [
                aclient.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=1.0, seed=i,
                                           extra_body={"guided_json": SCHEMAS[i]["schema"]})
                for i, p in enumerate(prompts * 2)
            ]
            results = await asyncio.gather(*guided[:4], *free, *guided[4:])
            return [r.choices[0].text for r in results[4:8]]

    assert asyncio.run(mixed()) == alone
