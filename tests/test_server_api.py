"""The real server on a tiny random model, through the official `openai`
client (sync and async) and raw httpx: chat and completions, streaming or
not, usage, n > 1, stop strings, logprobs, seeds, echo, token-id prompts,
and the small routes."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from server_util import SPECIAL_TOKENS

MODEL = "tiny"
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.url("/v1"), api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def aclient_factory(tiny_server):
    # one AsyncOpenAI per event loop (each async test runs its own loop)
    return lambda: openai.AsyncOpenAI(base_url=tiny_server.url("/v1"), api_key="unused", max_retries=0, timeout=60)


def tokenize(server, **body) -> list[int]:
    r = httpx.post(server.url("/tokenize"), json=body, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello world!"}]


# ---------------------------------------------------------------------------
# chat
# ---------------------------------------------------------------------------


def test_chat_completion_shape_and_exact_usage(client, tiny_server):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=7, seed=1, extra_body=NO_EOS)
    assert r.id.startswith("chatcmpl-")
    assert r.object == "chat.completion"
    assert r.model == MODEL and r.created > 0
    [choice] = r.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    prompt_ids = tokenize(tiny_server, messages=MESSAGES)
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == len(prompt_ids) + 7


def test_chat_content_parts_and_max_completion_tokens(client):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=3, extra_body=NO_EOS)
    assert r.usage.completion_tokens == 3
    assert r.choices[0].finish_reason == "length"


def test_chat_stream_role_first_then_content_then_usage(client, tiny_server):
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, seed=3, stream=True,
        stream_options={"include_usage": True}, extra_body=NO_EOS,
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in body)
    assert [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason] == ["length"]
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert last.usage.completion_tokens == 6
    assert last.usage.prompt_tokens == len(tokenize(tiny_server, messages=MESSAGES))
    assert last.usage.total_tokens == last.usage.prompt_tokens + 6
    # the same seed without streaming gives the same text
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, seed=3, extra_body=NO_EOS)
    assert r.choices[0].message.content == text


def test_chat_stream_raw_sse_format(tiny_server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", tiny_server.url("/v1/chat/completions"), json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert payloads[-1]["choices"][0]["delta"] == {} and payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in p for p in payloads)


def test_chat_n_choices_count_all_tokens(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, max_tokens=5, seed=7,
                                       temperature=1.0, extra_body=NO_EOS)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 15
    assert len({c.message.content for c in r.choices}) > 1  # child seeds differ


def test_chat_stream_n_choices(client):
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}, extra_body=NO_EOS)
    roles, finishes = {}, {}
    usage = None
    for c in stream:
        if not c.choices:
            usage = c.usage
            continue
        ch = c.choices[0]
        if ch.delta.role:
            roles[ch.index] = ch.delta.role
        if ch.finish_reason:
            finishes[ch.index] = ch.finish_reason
    assert roles == {0: "assistant", 1: "assistant"}
    assert finishes == {0: "length", 1: "length"}
    assert usage.completion_tokens == 8


def test_chat_seed_reproducible(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=1.0, seed=1234, extra_body=NO_EOS)
    a = client.chat.completions.create(**kwargs).choices[0].message.content
    b = client.chat.completions.create(**kwargs).choices[0].message.content
    c = client.chat.completions.create(**{**kwargs, "seed": 4321}).choices[0].message.content
    assert a == b
    assert a != c


def test_chat_logprobs_schema(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True,
                                       top_logprobs=3, seed=5, extra_body=NO_EOS)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert isinstance(entry.token, str) and entry.logprob <= 0.0
        assert isinstance(entry.bytes, list) and all(0 <= b < 256 for b in entry.bytes)
        assert len(entry.top_logprobs) == 3
        lps = [t.logprob for t in entry.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert entry.logprob <= lps[0] + 1e-6
    # logprobs without top_logprobs: only the sampled token
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, logprobs=True)
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert r.choices[0].logprobs is None


# ---------------------------------------------------------------------------
# stop strings across token boundaries
# ---------------------------------------------------------------------------


def _boundary_stop(tokens: list[tuple[str, bytes]], text: str) -> tuple[str, str] | None:
    """A stop string of 2-3 chars that straddles a token boundary and first
    occurs there; returns (stop, text before it)."""
    pieces = [b for t, b in tokens if t not in SPECIAL_TOKENS]
    if b"".join(pieces).decode("utf-8", errors="replace") != text:
        return None
    offset = 0
    for left, right in zip(pieces, pieces[1:]):
        offset += len(left)
        lt, rt = left.decode(errors="replace"), right.decode(errors="replace")
        if not (left.isascii() and right.isascii() and lt.strip() and rt.strip()):
            continue
        stop = lt[-2:] + rt[:1]
        start = offset - len(lt[-2:])
        if text.find(stop) == start and start > 0:
            return stop, text[:start]
    return None


def _find_boundary_case(client) -> tuple[dict, str, str]:
    for seed in range(20):
        kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=24, seed=seed, temperature=1.0, extra_body=NO_EOS)
        r = client.chat.completions.create(**kwargs, logprobs=True)
        tokens = [(e.token, bytes(e.bytes)) for e in r.choices[0].logprobs.content]
        found = _boundary_stop(tokens, r.choices[0].message.content)
        if found:
            return kwargs, found[0], found[1]
    pytest.fail("no sample with a stop string across a token boundary")


def test_stop_string_across_tokens_non_streaming_and_streaming(client):
    kwargs, stop, expected = _find_boundary_case(client)
    r = client.chat.completions.create(**kwargs, stop=[stop, "never-appears"])
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"

    chunks = list(client.chat.completions.create(**kwargs, stop=stop, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_stop_string_across_tokens_completions(client):
    for seed in range(20):
        base = dict(model=MODEL, prompt="Hello world! The quick brown", max_tokens=24, seed=seed, extra_body=NO_EOS)
        r = client.completions.create(**base, logprobs=0)
        tokens = [(t, t.encode()) for t in r.choices[0].logprobs.tokens]
        found = _boundary_stop(tokens, r.choices[0].text)
        if found:
            break
    else:
        pytest.fail("no sample with a stop string across a token boundary")
    stop, expected = found
    r = client.completions.create(**base, stop=[stop])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(**base, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


# ---------------------------------------------------------------------------
# completions
# ---------------------------------------------------------------------------


def test_completion_shape_and_usage(client, tiny_server):
    prompt = "Once upon a time"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, extra_body=NO_EOS)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].finish_reason == "length" and r.choices[0].index == 0
    n_prompt = len(tokenize(tiny_server, prompt=prompt))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 5, n_prompt + 5)


def test_completion_default_max_tokens_is_16(client):
    r = client.completions.create(model=MODEL, prompt="Hello", extra_body=NO_EOS)
    assert r.usage.completion_tokens == 16


def test_completion_prompt_forms(client, tiny_server):
    ids = tokenize(tiny_server, prompt="Hello world")
    ids2 = tokenize(tiny_server, prompt="The lazy dog")
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, extra_body=NO_EOS)
    assert r.usage.prompt_tokens == len(ids)
    r = client.completions.create(model=MODEL, prompt=[ids, ids2], max_tokens=2, n=2, extra_body=NO_EOS)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == len(ids) + len(ids2)
    assert r.usage.completion_tokens == 8
    r = client.completions.create(model=MODEL, prompt=["Hello world", "The lazy dog"], max_tokens=2, extra_body=NO_EOS)
    assert r.usage.prompt_tokens == len(ids) + len(ids2)
    # token ids and the same text sample the same thing
    a = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, seed=9, extra_body=NO_EOS).choices[0].text
    b = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=6, seed=9,
                                  extra_body=NO_EOS).choices[0].text
    assert a == b


def test_completion_logprobs_schema(client):
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=4, logprobs=2, extra_body=NO_EOS)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(v <= 0 for v in lp.token_logprobs)
    # top-2 plus the sampled token; fewer when a random model's byte tokens
    # share the text "\ufffd" (the dict keys are token texts, as in OpenAI's format)
    assert all(1 <= len(d) <= 3 for d in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, top in zip(lp.tokens, lp.top_logprobs):
        assert token in top


def test_completion_echo(client, tiny_server):
    prompt = "The quick brown fox"
    n_prompt = len(tokenize(tiny_server, prompt=prompt))
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, extra_body=NO_EOS)
    assert r.choices[0].text.startswith(prompt)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=1,
                                  extra_body=NO_EOS)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == n_prompt + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens[:n_prompt]) == prompt
    assert r.choices[0].text.startswith(prompt)
    # streamed echo: the prompt comes first
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, stream=True,
                                            extra_body=NO_EOS))
    assert "".join(c.choices[0].text for c in chunks).startswith(prompt)


def test_completion_stream_include_usage(client, tiny_server):
    prompt = "Hello world"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=9, stream=True,
                                            stream_options={"include_usage": True}, extra_body=NO_EOS))
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 9
    assert last.usage.prompt_tokens == len(tokenize(tiny_server, prompt=prompt))
    assert body[-1].choices[0].finish_reason == "length"


def test_async_client_chat_and_completion(aclient_factory):
    async def run():
        aclient = aclient_factory()
        r = await aclient.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, extra_body=NO_EOS)
        assert r.usage.completion_tokens == 3
        stream = await aclient.completions.create(model=MODEL, prompt="Hi", max_tokens=4, stream=True,
                                                  stream_options={"include_usage": True}, extra_body=NO_EOS)
        usage = [c.usage async for c in stream if c.usage]
        assert usage[0].completion_tokens == 4
        await aclient.close()

    asyncio.run(run())


def test_fifty_concurrent_streams(aclient_factory):
    async def one(aclient, i: int) -> tuple[int, int]:
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"count {i}"}], max_tokens=12 + i % 5,
            stream=True, stream_options={"include_usage": True}, extra_body=NO_EOS,
        )
        usage = None
        async for c in stream:
            if c.usage:
                usage = c.usage
        return 12 + i % 5, usage.completion_tokens

    async def run():
        aclient = aclient_factory()
        results = await asyncio.wait_for(asyncio.gather(*(one(aclient, i) for i in range(50))), timeout=120)
        await aclient.close()
        return results

    for want, got in asyncio.run(run()):
        assert got == want


# ---------------------------------------------------------------------------
# small routes
# ---------------------------------------------------------------------------


def test_models(client, tiny_server, tiny_model_dir):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    r = httpx.get(tiny_server.url("/v1/models")).json()
    assert r["data"][0]["root"] == tiny_model_dir and r["data"][0]["max_model_len"] > 0


def test_tokenize_detokenize_roundtrip(tiny_server):
    r = httpx.post(tiny_server.url("/tokenize"), json={"prompt": "Hello world!", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] > 0
    assert "".join(r["token_strs"]).replace("Ġ", " ") == "Hello world!"
    d = httpx.post(tiny_server.url("/detokenize"), json={"tokens": r["tokens"]}).json()
    assert d == {"prompt": "Hello world!"}
    chat = httpx.post(tiny_server.url("/tokenize"), json={"messages": MESSAGES}).json()
    text = httpx.post(tiny_server.url("/detokenize"), json={"tokens": chat["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>") and text.endswith("<|im_start|>assistant\n")


def test_health_and_version(tiny_server):
    assert httpx.get(tiny_server.url("/health")).status_code == 200
    v = httpx.get(tiny_server.url("/version")).json()
    assert v["version"]


def test_openapi_describes_the_routes(tiny_server):
    doc = httpx.get(tiny_server.url("/openapi.json")).json()
    paths = doc["paths"]
    for path, method in [("/v1/chat/completions", "post"), ("/v1/completions", "post"), ("/v1/models", "get"),
                         ("/tokenize", "post"), ("/detokenize", "post"), ("/health", "get"),
                         ("/metrics", "get"), ("/version", "get")]:
        assert method in paths[path], path
    chat = paths["/v1/chat/completions"]["post"]
    ok = chat["responses"]["200"]["content"]
    assert ok["application/json"]["schema"]["$ref"].endswith("/ChatCompletionResponse")
    assert ok["text/event-stream"]["schema"]["$ref"].endswith("/ChatCompletionChunk")
    assert chat["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert "422" not in chat["responses"]
    assert chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletionRequest")
    schemas = doc["components"]["schemas"]
    for name in ("ChatCompletionChunk", "CompletionStreamResponse", "CompletionResponse", "ModelList"):
        assert name in schemas


def test_startup_banner(tiny_server):
    out = tiny_server.output()
    assert "Serval serving tiny" in out
    assert "KV cache" in out and "concurrent requests at the full context of" in out
    assert tiny_server.engine_pid is not None
