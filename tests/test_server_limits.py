"""--api-key (401 without the right Bearer key), --max-queued-requests (429
with Retry-After past max_num_seqs + the queue), and a clean shutdown."""

from __future__ import annotations

import contextlib
import os
import signal

import httpx
import openai
import pytest

from server_util import ServerProcess, wait_until

KEY = "sk-test-serval"
MODEL = "tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    args = ["--model", tiny_model_dir, "--served-model-name", MODEL, "--kv-cache-memory", "0.01",
            "--api-key", KEY, "--max-num-seqs", "2", "--max-queued-requests", "1", "--log-level", "warning"]
    with ServerProcess(args) as s:
        yield s


def test_api_key_required_on_api_routes(server):
    for method, path, body in [("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "Hi"}),
                               ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                               ("POST", "/tokenize", {"prompt": "Hi"}), ("POST", "/detokenize", {"tokens": [5]})]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request(method, server.url(path), json=body, headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
        r = httpx.request(method, server.url(path), json=body, headers=AUTH, timeout=30)
        assert r.status_code == 200, (path, r.text)


def test_open_routes_need_no_key(server):
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(server.url(path)).status_code == 200


def test_openai_client_with_key(server):
    client = openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0)
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert r.usage.completion_tokens >= 1
    bad = openai.OpenAI(base_url=server.url("/v1"), api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_queue_full_is_429_with_retry_after(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 900,
            "stream": True, "ignore_eos": True}
    short = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=30) as http, contextlib.ExitStack() as stack:
        # 2 running (--max-num-seqs) + 1 queued (--max-queued-requests) fill the server
        open_streams = []  # dropping a line iterator would close its response
        for _ in range(3):
            r = stack.enter_context(http.stream("POST", "/v1/chat/completions", json=body))
            assert r.status_code == 200
            lines = r.iter_lines()
            next(lines)  # admitted: the role chunk came
            open_streams.append(lines)
        r = http.post("/v1/completions", json=short)
        assert r.status_code == 429, r.text
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        r = http.post("/v1/chat/completions", json={**body, "n": 1})
        assert r.status_code == 429
    # the streams are closed: capacity is back
    assert wait_until(lambda: httpx.post(server.url("/v1/completions"), json=short, headers=AUTH,
                                         timeout=30).status_code == 200, timeout=10)


def test_graceful_shutdown(server):
    engine_pid = server.engine_pid
    assert engine_pid is not None and os.path.exists(f"/proc/{engine_pid}")
    server.proc.send_signal(signal.SIGINT)
    assert server.proc.wait(20) == 0
    assert wait_until(lambda: not os.path.exists(f"/proc/{engine_pid}") or _zombie(engine_pid), timeout=10)
    assert "Traceback" not in server.output()


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].split()[0] == "Z"
    except OSError:
        return True
