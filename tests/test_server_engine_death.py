"""The engine-core process is killed mid-generation: /health turns 503 and
every waiting client, streaming or not, gets an error within seconds; later
requests get 503 at once while the API process stays up to say so."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from server_util import ServerProcess, metrics, wait_until

MODEL = "tiny"
KEY = "env-key"  # given through SERVAL_API_KEY, not --api-key
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    args = ["--model", tiny_model_dir, "--served-model-name", MODEL, "--kv-cache-memory", "0.01",
            "--log-level", "warning"]
    with ServerProcess(args, env={"SERVAL_API_KEY": KEY}) as s:
        yield s


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_key_from_environment(server):
    assert httpx.get(server.url("/v1/models")).status_code == 401
    assert httpx.get(server.url("/v1/models"), headers=AUTH).status_code == 200


def test_engine_killed_mid_generation(server):
    assert server.engine_pid is not None and _ppid(server.engine_pid) == server.proc.pid
    results: dict[str, object] = {}

    def non_streaming():
        r = httpx.post(server.url("/v1/completions"), headers=AUTH, timeout=60,
                       json={"model": MODEL, "prompt": "Tell me a story", "max_tokens": 1000, "ignore_eos": True})
        results["plain"] = (time.monotonic(), r.status_code, r.json())

    def streaming(name: str):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 1000,
                "stream": True, "ignore_eos": True}
        events = []
        with httpx.stream("POST", server.url("/v1/chat/completions"), headers=AUTH, json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
        results[name] = (time.monotonic(), events)

    threads = [threading.Thread(target=non_streaming)] + [
        threading.Thread(target=streaming, args=(f"stream{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    assert wait_until(lambda: metrics(server)["serval:num_requests_running"] == 3, timeout=10)

    os.kill(server.engine_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    for t in threads:
        t.join(15)
        assert not t.is_alive()

    done_at, status, body = results["plain"]
    assert status == 503 and body["error"]["code"] == "engine_dead"
    assert done_at - killed_at < 5
    for name in ("stream0", "stream1"):
        done_at, events = results[name]
        assert done_at - killed_at < 5
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_dead" and error["type"] == "server_error"

    r = httpx.get(server.url("/health"))
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    t0 = time.monotonic()
    r = httpx.post(server.url("/v1/chat/completions"), headers=AUTH,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 503 and time.monotonic() - t0 < 2
    assert server.proc.poll() is None  # the API process stays up to answer 503
