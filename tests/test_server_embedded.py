"""`serval serve` with no --model: the embedded SmolLM2-135M-Instruct answers
sensibly through the OpenAI client."""

from __future__ import annotations

import openai
import pytest

from scheduler.config import ConfigError, resolve_model
from server_util import ServerProcess

try:
    resolve_model(None)
except ConfigError as e:  # pragma: no cover
    pytest.skip(str(e), allow_module_level=True)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--kv-cache-memory", "0.1", "--max-model-len", "2048", "--log-level", "warning"]) as s:
        yield s


def test_embedded_chat_is_sensible(server):
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120)
    [model] = client.models.list().data
    assert model.id == "SmolLM2-135M-Instruct"
    r = client.chat.completions.create(
        model=model.id, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0,
    )
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"  # ends with <|im_end|>, not the length limit
    stream = client.chat.completions.create(
        model=model.id, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0, stream=True,
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == r.choices[0].message.content
