"""/metrics in Prometheus format, and clients that go away: a dropped stream
or a dropped non-streaming request is aborted in the engine, so the running
count and the KV cache usage go back to idle within seconds (the request
itself would have run for many more)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_util import metrics, wait_until

MODEL = "tiny"
LONG = 1000  # tokens: well over 10 s of decoding on the tiny model


def _idle(server) -> bool:
    m = metrics(server)
    return m["serval:num_requests_running"] == 0 and m["serval:kv_cache_usage_perc"] == 0


def _running(server) -> float:
    return metrics(server)["serval:num_requests_running"]


def test_metric_names_types_and_labels(tiny_server):
    r = httpx.post(tiny_server.url("/v1/completions"),
                   json={"model": MODEL, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}, timeout=30)
    assert r.status_code == 200
    text = httpx.get(tiny_server.url("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    expected = {
        "serval:num_requests_running": "gauge",
        "serval:num_requests_waiting": "gauge",
        "serval:kv_cache_usage_perc": "gauge",
        "serval:prompt_tokens": "counter",
        "serval:generation_tokens": "counter",
        "serval:request_success": "counter",
        "serval:num_preemptions": "counter",
        "serval:prefix_cache_queries": "counter",
        "serval:prefix_cache_hits": "counter",
        "serval:time_to_first_token_seconds": "histogram",
        "serval:inter_token_latency_seconds": "histogram",
        "serval:e2e_request_latency_seconds": "histogram",
        "serval:request_queue_time_seconds": "histogram",
    }
    for name, kind in expected.items():
        assert families[name].type == kind, name
        for sample in families[name].samples:
            assert sample.labels.get("model_name") == MODEL, sample
    assert "serval:prompt_tokens_total" in text and "serval:num_preemptions_total" in text
    m = metrics(tiny_server)
    assert m["serval:prompt_tokens_total"] >= 1
    assert m["serval:generation_tokens_total"] >= 4
    assert m["serval:request_success_total{finished_reason=length}"] >= 1
    assert m["serval:time_to_first_token_seconds_count"] >= 1
    assert m["serval:inter_token_latency_seconds_count"] >= 3
    assert m["serval:e2e_request_latency_seconds_count"] >= 1
    assert m["serval:request_queue_time_seconds_count"] >= 1
    assert m["serval:prefix_cache_queries_total"] >= 1


def test_counters_count_tokens_exactly(tiny_server):
    before = metrics(tiny_server)
    r = httpx.post(tiny_server.url("/v1/completions"),
                   json={"model": MODEL, "prompt": "Hello world", "max_tokens": 5, "n": 2, "ignore_eos": True},
                   timeout=30).json()
    after = metrics(tiny_server)
    assert after["serval:generation_tokens_total"] - before["serval:generation_tokens_total"] == 10
    assert after["serval:prompt_tokens_total"] - before["serval:prompt_tokens_total"] == r["usage"]["prompt_tokens"]
    key = "serval:request_success_total{finished_reason=length}"
    assert after[key] - before[key] == 2


def test_prefix_cache_hits_count(tiny_server):
    prompt = "Once upon a time there was a small model. " * 6  # several full blocks
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    httpx.post(tiny_server.url("/v1/completions"), json=body, timeout=30)
    before = metrics(tiny_server)["serval:prefix_cache_hits_total"]
    httpx.post(tiny_server.url("/v1/completions"), json=body, timeout=30)
    # stats arrive with the engine's next step or its idle tick (~1 s)
    assert wait_until(lambda: metrics(tiny_server)["serval:prefix_cache_hits_total"] >= before + 16, timeout=5)


def test_dropped_stream_is_aborted(tiny_server):
    assert wait_until(lambda: _idle(tiny_server), timeout=10)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": LONG,
            "stream": True, "ignore_eos": True}
    before = metrics(tiny_server)["serval:request_success_total{finished_reason=abort}"]
    # (leaving iter_lines() early closes the response: that is the disconnect)
    with httpx.stream("POST", tiny_server.url("/v1/chat/completions"), json=body, timeout=30) as r:
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events >= 4:
                assert _running(tiny_server) == 1
                assert metrics(tiny_server)["serval:kv_cache_usage_perc"] > 0
                break
    t0 = time.monotonic()
    assert wait_until(lambda: _idle(tiny_server), timeout=5), metrics(tiny_server)
    assert time.monotonic() - t0 < 5
    after = metrics(tiny_server)["serval:request_success_total{finished_reason=abort}"]
    assert after == before + 1


def test_dropped_non_streaming_request_is_aborted(tiny_server):
    assert wait_until(lambda: _idle(tiny_server), timeout=10)
    body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": LONG, "ignore_eos": True}
    done = threading.Event()

    def call():
        try:
            httpx.post(tiny_server.url("/v1/completions"), json=body, timeout=1.5)
        except httpx.TimeoutException:
            pass
        done.set()

    thread = threading.Thread(target=call)
    thread.start()
    assert wait_until(lambda: _running(tiny_server) == 1, timeout=5)
    assert done.wait(10)  # the client gave up and closed its connection
    t0 = time.monotonic()
    assert wait_until(lambda: _idle(tiny_server), timeout=5), metrics(tiny_server)
    assert time.monotonic() - t0 < 5
    thread.join()


@pytest.mark.parametrize("n", [1, 3])
def test_dropped_stream_with_n_aborts_every_choice(tiny_server, n):
    assert wait_until(lambda: _idle(tiny_server), timeout=10)
    body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": LONG, "n": n, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", tiny_server.url("/v1/completions"), json=body, timeout=30) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 6:
                assert wait_until(lambda: _running(tiny_server) == n, timeout=5)
                break
    assert wait_until(lambda: _idle(tiny_server), timeout=5), metrics(tiny_server)
