"""EngineCore and InprocClient end to end with the fake runner."""

from __future__ import annotations

import pytest
from fake_runner import Collected, FakeRunner, make_request, reference_generate

from scheduler import (
    EngineCore,
    EngineCoreOutputs,
    FinishReason,
    InprocClient,
    ModelRunnerProtocol,
    SchedulerConfig,
    SchedulerOutput,
)

VOCAB = 500


class CountingRunner(FakeRunner):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    def execute(self, so: SchedulerOutput):
        self.calls += 1
        return super().execute(so)


def make_client(num_blocks=32, **config):
    config.setdefault("block_size", 4)
    config.setdefault("max_model_len", 64)
    config.setdefault("max_num_batched_tokens", 32)
    runner = CountingRunner(num_blocks, config["block_size"], VOCAB)
    return InprocClient(EngineCore(SchedulerConfig(**config), runner, num_blocks)), runner


def drain(client, collected=None, max_steps=1000) -> Collected:
    collected = collected or Collected()
    for _ in range(max_steps):
        if not client.has_unfinished_requests():
            return collected
        outs = client.step()
        assert isinstance(outs, EngineCoreOutputs) and outs.scheduler_stats is not None and outs.timestamp > 0
        collected.add(outs.outputs)
    raise AssertionError("engine did not finish")


def test_runner_satisfies_the_protocol():
    assert isinstance(FakeRunner(4, 4), ModelRunnerProtocol)


def test_end_to_end_generation():
    client, runner = make_client()
    prompts = {f"r{i}": [i + 1] * (3 + 5 * i) for i in range(5)}
    for req_id, p in prompts.items():
        client.add_request(make_request(req_id, p, max_tokens=6))
    got = drain(client)
    for req_id, p in prompts.items():
        assert got.tokens[req_id] == reference_generate(p, 6, VOCAB)
        assert got.finish[req_id] == FinishReason.LENGTH
    stats = client.make_stats()
    assert stats.num_running_reqs == stats.num_waiting_reqs == 0 and stats.kv_cache_usage == 0.0
    assert stats.prefix_cache_queries_total == sum(map(len, prompts.values()))


def test_requests_added_between_steps_join_the_batch():
    client, runner = make_client()
    client.add_request(make_request("a", [1, 2, 3], max_tokens=8))
    got = Collected()
    got.add(client.step().outputs)
    client.add_request(make_request("b", [4, 5, 6], max_tokens=3))
    out = client.step()
    got.add(out.outputs)
    assert {o.req_id for o in out.outputs} == {"a", "b"}
    assert out.scheduler_stats.num_running_reqs == 2
    drain(client, got)
    assert got.tokens["b"] == reference_generate([4, 5, 6], 3, VOCAB)


def test_abort_mid_run_is_reported_and_frees_everything():
    client, runner = make_client()
    client.add_request(make_request("a", list(range(1, 20)), max_tokens=50))
    client.add_request(make_request("b", [7, 7, 7], max_tokens=5))
    got = Collected()
    got.add(client.step().outputs)
    got.add(client.step().outputs)
    client.abort_requests(["a", "unknown"])
    out = client.step()
    got.add(out.outputs)
    aborts = [o for o in out.outputs if o.req_id == "a"]
    assert len(aborts) == 1 and aborts[0].finish_reason == FinishReason.ABORT and aborts[0].new_token_ids == []
    drain(client, got)
    assert got.finish == {"a": FinishReason.ABORT, "b": FinishReason.LENGTH}
    assert client.make_stats().kv_cache_usage == 0.0


def test_step_with_nothing_scheduled_returns_aborts_without_running_the_model():
    client, runner = make_client()
    client.add_request(make_request("a", [1, 2, 3, 4, 5], max_tokens=10))
    client.step()
    calls = runner.calls
    client.abort_requests(["a"])
    assert client.has_unfinished_requests()  # the abort notice is pending
    out = client.step()
    assert runner.calls == calls  # nothing scheduled: the runner was not called
    assert [(o.req_id, o.finish_reason) for o in out.outputs] == [("a", FinishReason.ABORT)]
    assert not client.has_unfinished_requests()
    assert client.step().outputs == []
    # the runner still learns to drop "a", with the next step it runs
    client.add_request(make_request("b", [1, 2, 3], max_tokens=1))
    client.step()
    assert "a" in runner.history[-1].finished_req_ids and "a" not in runner.reqs


def test_rejected_request_raises_and_leaves_the_engine_usable():
    client, _ = make_client(max_model_len=8)
    with pytest.raises(ValueError, match="max_model_len"):
        client.add_request(make_request("long", list(range(9))))
    client.add_request(make_request("ok", [1, 2], max_tokens=2))
    got = drain(client)
    assert got.finish == {"ok": FinishReason.LENGTH}


def test_shared_prefix_across_requests_hits_the_cache():
    client, runner = make_client(block_size=4)
    shared = list(range(10, 22))  # 3 full blocks
    client.add_request(make_request("a", shared + [1], max_tokens=2))
    drain(client)
    client.add_request(make_request("b", shared + [2], max_tokens=2))
    got = drain(client)
    assert got.outputs["b"][0].num_cached_tokens == 12
    assert runner.computed["b"][0] == 12
    stats = client.make_stats()
    assert stats.prefix_cache_hits_total == 12
    client.engine_core.reset_prefix_cache()
    client.add_request(make_request("c", shared + [3], max_tokens=1))
    drain(client)
    assert runner.computed["c"][0] == 0
