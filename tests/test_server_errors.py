"""Every invalid request gets a 400 (404 for an unknown model) in OpenAI's
error shape, naming the field; the server keeps answering afterwards."""

from __future__ import annotations

import httpx
import pytest

MODEL = "tiny"
MSGS = [{"role": "user", "content": "Hi"}]
CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"

# (route, body fields on top of a valid request, expected param)
CASES = [
    (CHAT, {"temperature": -1}, "temperature"),
    (CHAT, {"temperature": "hot"}, "temperature"),
    (CHAT, {"top_p": 0}, "top_p"),
    (CHAT, {"top_p": 1.5}, "top_p"),
    (CHAT, {"top_k": -2}, "top_k"),
    (CHAT, {"min_p": 2}, "min_p"),
    (CHAT, {"n": 0}, "n"),
    (CHAT, {"max_tokens": 0}, "max_tokens"),
    (CHAT, {"max_completion_tokens": -5}, "max_completion_tokens"),
    (CHAT, {"presence_penalty": 3}, "presence_penalty"),
    (CHAT, {"frequency_penalty": -2.5}, "frequency_penalty"),
    (CHAT, {"repetition_penalty": 0}, "repetition_penalty"),
    (CHAT, {"logit_bias": {"abc": 1}}, "logit_bias"),
    (CHAT, {"logit_bias": {"5": 101}}, "logit_bias"),
    (CHAT, {"logit_bias": {"999999": 1}}, "logit_bias"),
    (CHAT, {"stop_token_ids": [-1]}, "stop_token_ids"),
    (CHAT, {"stop": [""]}, "stop"),
    (CHAT, {"stop": 5}, "stop"),
    (CHAT, {"seed": "x"}, "seed"),
    (CHAT, {"min_tokens": -1}, "min_tokens"),
    (CHAT, {"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    (CHAT, {"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    (CHAT, {"top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"stream_options": {"include_usage": True}}, "stream_options"),
    (CHAT, {"stream": True, "stream_options": {"include_usage": True, "bogus": 1}}, "stream_options.bogus"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "Hi"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user"}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": "Hi", "colour": "red"}]}, "messages[0].colour"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    (CHAT, {"messages": "Hi"}, "messages"),
    (CHAT, {"response_format": {"type": "xml"}}, "response_format.type"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "no spaces", "parameters": {}}}]},
     "tools[0].function.name"),
    (CHAT, {"tool_choice": "auto"}, "tool_choice"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {
        "type": "function", "function": {"name": "g"}}}, "tool_choice"),
    (CHAT, {"functions": [{"name": "f"}]}, "functions"),
    (CHAT, {"guided_json": "{not json"}, "guided_json"),
    (CHAT, {"guided_regex": "a(b"}, "guided_regex"),
    (CHAT, {"guided_choice": []}, "guided_choice"),
    (CHAT, {"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs.regex"),
    (CHAT, {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    (CHAT, {"modalities": ["text", "audio"]}, "modalities"),
    (CHAT, {"max_tokens": 100000}, "max_tokens"),
    (CHAT, {"frobnicate": True}, "frobnicate"),
    (COMPL, {"prompt": []}, "prompt"),
    (COMPL, {"prompt": ""}, "prompt"),
    (COMPL, {"prompt": [1, 999999]}, "prompt"),
    (COMPL, {"prompt": [[1, 2], []]}, "prompt"),
    (COMPL, {"prompt": {"text": "x"}}, "prompt"),
    (COMPL, {"logprobs": 21}, "logprobs"),
    (COMPL, {"logprobs": 30, "echo": True}, "logprobs"),
    (COMPL, {"suffix": "end"}, "suffix"),
    (COMPL, {"best_of": 2}, "best_of"),
    (COMPL, {"max_tokens": 5000}, "max_tokens"),
    (COMPL, {"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
    (COMPL, {"echo": "maybe"}, "echo"),
    (COMPL, {"n": -1}, "n"),
    (COMPL, {"messages": MSGS}, "messages"),
]


def _base(route: str) -> dict:
    return {"model": MODEL, "messages": MSGS, "max_tokens": 4} if route == CHAT else {
        "model": MODEL, "prompt": "Hi", "max_tokens": 4}


@pytest.mark.parametrize("route,fields,param", CASES, ids=[f"{r.rsplit('/', 1)[-1]}-{p}-{i}" for i, (r, _, p)
                                                            in enumerate(CASES)])
def test_invalid_field_is_400_naming_it(tiny_server, route, fields, param):
    body = {**_base(route), **fields}
    r = httpx.post(tiny_server.url(route), json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert param.split("[")[0].split(".")[0] in err["message"] or param in err["message"], err


def test_context_length_message_names_both_numbers(tiny_server):
    max_len = httpx.get(tiny_server.url("/v1/models")).json()["data"][0]["max_model_len"]
    r = httpx.post(tiny_server.url(COMPL), json={"model": MODEL, "prompt": "Hi", "max_tokens": max_len + 7})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded"
    assert str(max_len) in err["message"] and str(max_len + 7) in err["message"]
    # a prompt longer than the context, with no max_tokens (chat fills the context by default)
    long_text = "Hello world! " * max_len
    r = httpx.post(tiny_server.url(CHAT), json={"model": MODEL, "messages": [{"role": "user", "content": long_text}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert str(max_len) in r.json()["error"]["message"]


def test_unknown_model_is_404(tiny_server):
    for route in (CHAT, COMPL):
        r = httpx.post(tiny_server.url(route), json={**_base(route), "model": "gpt-4"})
        assert r.status_code == 404
        assert r.json()["error"]["param"] == "model" and r.json()["error"]["code"] == "model_not_found"
    r = httpx.get(tiny_server.url("/v1/models/gpt-4"))
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_model_may_be_omitted(tiny_server):
    r = httpx.post(tiny_server.url(COMPL), json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == MODEL


def test_bad_bodies_are_400_not_422(tiny_server):
    url = tiny_server.url(CHAT)
    for content, ctype in [(b"{not json", "application/json"), (b"[1, 2]", "application/json"),
                           (b"", "application/json"), (b"messages=hi", "application/x-www-form-urlencoded")]:
        r = httpx.post(url, content=content, headers={"content-type": ctype})
        assert r.status_code == 400, (content, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url, json={"model": MODEL})  # messages missing
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_unknown_route_and_method_are_openai_shaped(tiny_server):
    r = httpx.get(tiny_server.url("/v1/nothing"))
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(tiny_server.url(CHAT))
    assert r.status_code == 405 and "error" in r.json()


def test_no_op_fields_are_accepted(tiny_server):
    body = {**_base(CHAT), "user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
            "response_format": {"type": "text"}, "tool_choice": "none", "modalities": ["text"]}
    assert httpx.post(tiny_server.url(CHAT), json=body, timeout=30).status_code == 200


def test_tokenize_errors(tiny_server):
    r = httpx.post(tiny_server.url("/tokenize"), json={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(tiny_server.url("/detokenize"), json={"tokens": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_server_still_answers_after_errors(tiny_server):
    r = httpx.post(tiny_server.url(CHAT), json=_base(CHAT), timeout=30)
    assert r.status_code == 200
    assert httpx.get(tiny_server.url("/health")).status_code == 200
