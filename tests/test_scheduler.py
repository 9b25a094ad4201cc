"""Scheduler policy through schedule -> fake runner -> update_from_output."""

from __future__ import annotations

import pytest
from fake_runner import Collected, FakeRunner, make_request, reference_generate, run_until_done, step_scheduler

from scheduler.config import SchedulerConfig
from scheduler.request import RequestStatus
from scheduler.scheduler import Scheduler
from scheduler.types import FinishReason

VOCAB = 1000


def setup(num_blocks=64, script=None, **config):
    config.setdefault("block_size", 4)
    config.setdefault("max_model_len", 256)
    cfg = SchedulerConfig(**config)
    return Scheduler(cfg, num_blocks), FakeRunner(num_blocks, cfg.block_size, VOCAB, script=script)


def prompt(n, seed=0):
    return [(seed * 131 + 7 * i) % 997 + 1 for i in range(n)]


# ------------------------------------------------------------------ budget


def test_chunked_prefill_splits_a_long_prompt_within_the_budget():
    sched, runner = setup(max_num_batched_tokens=8)
    sched.add_request(make_request("a", prompt(20), max_tokens=3))
    so, outs = step_scheduler(sched, runner)
    assert so.num_scheduled_tokens == {"a": 8} and outs == []  # partial chunk: no token
    assert [n.req_id for n in so.scheduled_new_reqs] == ["a"]
    so, outs = step_scheduler(sched, runner)
    assert so.num_scheduled_tokens == {"a": 8} and outs == []
    assert so.scheduled_cached_reqs.req_ids == ["a"] and so.scheduled_cached_reqs.num_computed_tokens == [8]
    assert so.scheduled_cached_reqs.new_block_ids == [[2, 3]]  # only the blocks new this step
    so, outs = step_scheduler(sched, runner)
    assert so.num_scheduled_tokens == {"a": 4}
    assert len(outs) == 1 and outs[0].new_token_ids == reference_generate(prompt(20), 1, VOCAB)
    assert runner.computed["a"] == list(range(20))  # every prompt token once
    got = run_until_done(sched, runner)
    assert got.finish["a"] == FinishReason.LENGTH


def test_prefill_without_chunking_waits_for_a_whole_budget():
    sched, runner = setup(max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False)
    sched.add_request(make_request("a", prompt(10), max_tokens=4))
    sched.add_request(make_request("b", prompt(10, 1), max_tokens=4))
    so, _ = step_scheduler(sched, runner)
    assert so.num_scheduled_tokens == {"a": 10}  # b's 10 tokens do not fit in the 6 left
    so, _ = step_scheduler(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 10}
    # with chunking, b would have started with a 6-token chunk
    sched, runner = setup(max_num_batched_tokens=16, max_model_len=16)
    sched.add_request(make_request("a", prompt(10), max_tokens=4))
    sched.add_request(make_request("b", prompt(10, 1), max_tokens=4))
    so, _ = step_scheduler(sched, runner)
    assert so.num_scheduled_tokens == {"a": 10, "b": 6}


def test_decodes_are_not_starved_by_a_flood_of_prefills():
    sched, runner = setup(num_blocks=256, max_num_batched_tokens=16, max_num_seqs=64)
    for i in range(4):
        sched.add_request(make_request(f"d{i}", prompt(3, i), max_tokens=30))
    step_scheduler(sched, runner)  # the four short prompts prefill together
    for i in range(20):
        sched.add_request(make_request(f"p{i}", prompt(40, 100 + i), max_tokens=2))
    for _ in range(25):
        so, _ = step_scheduler(sched, runner)
        assert so.total_num_scheduled_tokens <= 16
        decoding = [f"d{i}" for i in range(4) if f"d{i}" in sched.requests]
        assert decoding and all(so.num_scheduled_tokens.get(d) == 1 for d in decoding)
        assert so.total_num_scheduled_tokens == 16  # prefills take the rest of the budget


def test_max_num_seqs_is_respected():
    sched, runner = setup(max_num_seqs=3, max_num_batched_tokens=64)
    for i in range(8):
        sched.add_request(make_request(f"r{i}", prompt(5, i), max_tokens=4))
    seen_running = 0
    while sched.has_unfinished_requests():
        so, _ = step_scheduler(sched, runner)
        assert len(so.num_scheduled_tokens) <= 3 and len(sched.running) <= 3
        seen_running = max(seen_running, len(sched.running))
    assert seen_running == 3


def test_fifo_admission():
    sched, runner = setup(max_num_seqs=1, max_num_batched_tokens=64)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", prompt(5, i), max_tokens=2))
    order = []
    while sched.has_unfinished_requests():
        so, _ = step_scheduler(sched, runner)
        order += [n.req_id for n in so.scheduled_new_reqs]
    assert order == ["r0", "r1", "r2"]


# ------------------------------------------------------------------ prefix cache


def test_shared_prefix_is_served_from_the_cache():
    sched, runner = setup(block_size=16, num_blocks=32, max_num_batched_tokens=256)
    shared = prompt(32, 5)
    sched.add_request(make_request("a", shared + [1, 2, 3], max_tokens=4))
    run_until_done(sched, runner)
    stats = sched.make_stats()
    assert stats.prefix_cache_hits_total == 0 and stats.prefix_cache_queries_total == 35

    sched.add_request(make_request("b", shared + [9, 9], max_tokens=4))
    got = run_until_done(sched, runner)
    assert runner.computed["b"][0] == 32  # positions 0..31 never computed again
    assert got.outputs["b"][0].num_cached_tokens == 32
    assert got.tokens["b"] == reference_generate(shared + [9, 9], 4, VOCAB)
    stats = sched.make_stats()
    assert stats.prefix_cache_hits_total == 32 and stats.prefix_cache_queries_total == 35 + 34


def test_prompt_logprobs_requests_skip_the_prefix_cache():
    # prompt logprobs need logits at every prompt position, so a cached prefix
    # must be computed again for such a request
    sched, runner = setup(block_size=16, num_blocks=32, max_num_batched_tokens=256)
    shared = prompt(32, 5)
    sched.add_request(make_request("a", shared + [1, 2, 3], max_tokens=2))
    run_until_done(sched, runner)
    sched.add_request(make_request("b", shared + [9, 9], max_tokens=2, prompt_logprobs=1))
    so, _ = step_scheduler(sched, runner)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    assert runner.computed["b"][0] == 0


def test_new_request_data_carries_the_eos_token_id():
    sched, runner = setup()
    sched.add_request(make_request("a", prompt(5), eos_token_id=3, max_tokens=2))
    so, _ = step_scheduler(sched, runner)
    assert so.scheduled_new_reqs[0].eos_token_id == 3


def test_prefix_of_a_running_request_is_shared_while_it_runs():
    sched, runner = setup(block_size=4, num_blocks=32, max_num_batched_tokens=64)
    shared = prompt(12, 3)
    sched.add_request(make_request("a", shared + [1], max_tokens=10))
    got = Collected()
    got.add(step_scheduler(sched, runner)[1])  # a's prompt computed, its 3 full blocks cached
    sched.add_request(make_request("b", shared + [2], max_tokens=10))
    so, outs = step_scheduler(sched, runner)
    got.add(outs)
    assert so.num_scheduled_tokens["b"] == 1
    a, b = sched.requests["a"], sched.requests["b"]
    assert a.block_ids[:3] == b.block_ids[:3]
    assert all(sched.block_manager.ref_cnt[x] == 2 for x in a.block_ids[:3])
    run_until_done(sched, runner, collected=got)
    assert got.tokens["b"] == reference_generate(shared + [2], 10, VOCAB)
    assert sched.block_manager.usage == 0.0


def test_decoded_blocks_are_cached_too():
    sched, runner = setup(block_size=4, num_blocks=32)
    p = prompt(6, 8)
    sched.add_request(make_request("a", p, max_tokens=8))
    got = run_until_done(sched, runner)
    full = p + got.tokens["a"]  # 14 tokens, 13 computed: 3 full blocks cached
    sched.add_request(make_request("b", full[:13], max_tokens=1))
    run_until_done(sched, runner)
    assert runner.computed["b"] == [12]


# ------------------------------------------------------------------ preemption


def test_preemption_under_a_tiny_kv_cache_gives_the_same_tokens():
    prompts = {f"r{i}": prompt(6 + i, i) for i in range(6)}

    def run(num_blocks):
        sched, runner = setup(num_blocks=num_blocks, max_num_seqs=6, max_num_batched_tokens=32, max_model_len=40)
        for req_id, p in prompts.items():
            sched.add_request(make_request(req_id, p, max_tokens=20))
        return sched, runner, run_until_done(sched, runner)

    big_sched, _, big = run(num_blocks=64)
    assert big_sched.make_stats().num_preemptions_total == 0
    sched, runner, small = run(num_blocks=10)  # 40 token slots for ~6 * 30 tokens
    assert sched.make_stats().num_preemptions_total > 0
    assert small.tokens == big.tokens
    for req_id, p in prompts.items():
        assert small.tokens[req_id] == reference_generate(p, 20, VOCAB)
    recomputed = [r for r, pos in runner.computed.items() if len(pos) != len(set(pos))]
    assert recomputed  # a preempted request computed some positions again
    resumed = [n for so in runner.history for n in so.scheduled_new_reqs if n.output_token_ids]
    assert any(n.num_computed_tokens > 0 for n in resumed)  # some resumed from the prefix cache
    assert sched.block_manager.num_free_blocks == 10


def test_preempted_request_resumes_with_its_outputs():
    # block_size 4, 4 blocks: two 7-token prompts fit, their decodes do not
    sched, runner = setup(num_blocks=4, max_num_batched_tokens=32, max_model_len=16, enable_prefix_caching=False)
    sched.add_request(make_request("old", prompt(7, 1), max_tokens=8))
    sched.add_request(make_request("new", prompt(7, 2), max_tokens=8))
    got = Collected()
    got.add(step_scheduler(sched, runner)[1])  # prefill: 2 blocks each
    got.add(step_scheduler(sched, runner)[1])  # decode position 7, still in block 2
    so, outs = step_scheduler(sched, runner)  # position 8 needs a third block for "old"
    got.add(outs)
    new = sched.requests["new"]
    assert new.status == RequestStatus.PREEMPTED and new.num_preemptions == 1
    assert sched.waiting[0] is new and new.block_ids == [] and new.num_computed_tokens == 0
    assert so.num_scheduled_tokens == {"old": 1} and "new" in so.finished_req_ids
    assert sched.make_stats().num_preemptions_total == 1
    outputs_so_far = list(new.output_token_ids)
    assert len(outputs_so_far) == 2
    while True:  # "new" resumes once "old" finishes and frees its blocks
        so, outs = step_scheduler(sched, runner)
        got.add(outs)
        resumed = [n for n in so.scheduled_new_reqs if n.req_id == "new"]
        if resumed:
            break
    assert got.finish["old"] == FinishReason.LENGTH
    assert resumed[0].output_token_ids == outputs_so_far
    assert resumed[0].num_computed_tokens == 0  # no prefix caching: full recompute
    assert so.num_scheduled_tokens["new"] == 9  # prompt + 2 outputs, minus nothing cached
    run_until_done(sched, runner, collected=got)
    assert got.tokens["new"] == reference_generate(prompt(7, 2), 8, VOCAB)


def test_request_preempts_itself_when_it_is_the_newest():
    sched, runner = setup(num_blocks=3, max_num_batched_tokens=32, max_model_len=12, enable_prefix_caching=False)
    sched.add_request(make_request("a", prompt(4, 1), max_tokens=8))
    sched.add_request(make_request("b", prompt(4, 2), max_tokens=8))
    got = Collected()
    got.add(step_scheduler(sched, runner)[1])  # a: 1 block + b: 1 block, 1 block left
    so, outs = step_scheduler(sched, runner)  # a takes the last block; b cannot: b is newest -> itself
    got.add(outs)
    assert so.num_scheduled_tokens == {"a": 1}
    assert sched.requests["b"].status == RequestStatus.PREEMPTED
    run_until_done(sched, runner, collected=got)
    assert got.tokens["b"] == reference_generate(prompt(4, 2), 8, VOCAB)


# ------------------------------------------------------------------ abort


def test_abort_mid_prefill_frees_its_blocks():
    sched, runner = setup(max_num_batched_tokens=8)
    sched.add_request(make_request("a", prompt(40), max_tokens=5))
    step_scheduler(sched, runner)
    assert sched.block_manager.usage > 0
    sched.abort_requests(["a"])
    assert sched.block_manager.usage == 0.0 and not sched.running and "a" not in sched.requests
    sched.abort_requests(["a", "never-existed"])  # idempotent
    assert sched.has_unfinished_requests()  # the abort notice is still to be sent
    so, outs = step_scheduler(sched, runner)
    assert so.total_num_scheduled_tokens == 0 and "a" in so.finished_req_ids
    assert [(o.req_id, o.new_token_ids, o.finish_reason) for o in outs] == [("a", [], FinishReason.ABORT)]
    assert not sched.has_unfinished_requests()


def test_abort_a_waiting_request():
    sched, runner = setup(num_blocks=4, max_num_seqs=1, max_model_len=16)
    sched.add_request(make_request("run", prompt(4), max_tokens=4))
    sched.add_request(make_request("wait", prompt(4, 1), max_tokens=4))
    step_scheduler(sched, runner)
    sched.abort_requests(["wait"])
    assert list(sched.waiting) == [] and sched.make_stats().num_waiting_reqs == 0
    so, outs = step_scheduler(sched, runner)
    assert "wait" not in so.finished_req_ids  # the runner never saw it
    wait_outs = [o for o in outs if o.req_id == "wait"]
    assert [(o.finish_reason, o.first_scheduled_time) for o in wait_outs] == [(FinishReason.ABORT, None)]
    got = run_until_done(sched, runner)
    assert got.finish == {"run": FinishReason.LENGTH}


def test_abort_a_preempted_request():
    sched, runner = setup(num_blocks=4, max_num_batched_tokens=32, max_model_len=16, enable_prefix_caching=False)
    sched.add_request(make_request("x", prompt(7, 2), max_tokens=8))
    sched.add_request(make_request("y", prompt(7, 3), max_tokens=8))
    got = Collected()
    while sched.requests["y"].status != RequestStatus.PREEMPTED:
        got.add(step_scheduler(sched, runner)[1])
    sched.abort_requests(["y"])
    assert not sched.waiting and sched.requests.keys() == {"x"}
    run_until_done(sched, runner, collected=got)
    assert got.finish == {"y": FinishReason.ABORT, "x": FinishReason.LENGTH}
    assert got.outputs["y"][-1].new_token_ids == []
    assert sched.block_manager.num_free_blocks == 4


# ------------------------------------------------------------------ stops


def test_min_tokens_suppresses_eos():
    eos = 2
    sched, runner = setup(script={"a": [eos] * 10, "b": [eos] * 10})
    sched.add_request(make_request("a", prompt(5), eos_token_id=eos, max_tokens=10, min_tokens=3))
    sched.add_request(make_request("b", prompt(5), eos_token_id=eos, max_tokens=10))
    got = run_until_done(sched, runner)
    assert got.tokens["a"] == [eos] * 4 and got.finish["a"] == FinishReason.STOP  # 3 ignored, 4th stops
    assert got.tokens["b"] == [eos] and got.finish["b"] == FinishReason.STOP
    assert got.stop_reason["a"] is None


def test_ignore_eos():
    sched, runner = setup(script={"a": [2] * 10})
    sched.add_request(make_request("a", prompt(5), eos_token_id=2, max_tokens=6, ignore_eos=True))
    got = run_until_done(sched, runner)
    assert got.tokens["a"] == [2] * 6 and got.finish["a"] == FinishReason.LENGTH


def test_stop_token_ids():
    sched, runner = setup(script={"a": [5, 6, 42, 7], "b": [42, 42, 8, 42], "c": [9, 42]})
    sched.add_request(make_request("a", prompt(5), max_tokens=10, stop_token_ids=[42, 43]))
    sched.add_request(make_request("b", prompt(5), max_tokens=10, stop_token_ids=[42], min_tokens=2))
    sched.add_request(make_request("c", prompt(5), eos_token_id=42, max_tokens=10, stop_token_ids=[42]))
    got = run_until_done(sched, runner)
    assert got.tokens["a"] == [5, 6, 42] and got.finish["a"] == FinishReason.STOP
    assert got.stop_reason["a"] == 42
    assert got.tokens["b"] == [42, 42, 8, 42] and got.stop_reason["b"] == 42  # min_tokens applies
    assert got.stop_reason["c"] == 42  # stop_token_ids checked before EOS


def test_max_tokens():
    sched, runner = setup()
    sched.add_request(make_request("a", prompt(5), max_tokens=7))
    got = run_until_done(sched, runner)
    assert got.tokens["a"] == reference_generate(prompt(5), 7, VOCAB)
    assert got.finish["a"] == FinishReason.LENGTH and got.stop_reason["a"] is None
    assert [len(o.new_token_ids) for o in got.outputs["a"]] == [1] * 7


def test_max_model_len():
    sched, runner = setup(max_model_len=16)
    sched.add_request(make_request("none", prompt(10), max_tokens=None))
    sched.add_request(make_request("big", prompt(10, 1), max_tokens=100))
    sched.add_request(make_request("full", prompt(16, 2), max_tokens=5))
    got = run_until_done(sched, runner)
    assert len(got.tokens["none"]) == 6 and got.finish["none"] == FinishReason.LENGTH
    assert len(got.tokens["big"]) == 6 and got.finish["big"] == FinishReason.LENGTH
    assert len(got.tokens["full"]) == 1 and got.finish["full"] == FinishReason.LENGTH


def test_prompt_too_long_is_rejected():
    sched, _ = setup(max_model_len=16)
    with pytest.raises(ValueError, match=r"17 tokens.*max_model_len \(16\)"):
        sched.add_request(make_request("a", prompt(17)))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_request("b", []))
    sched, _ = setup(num_blocks=2, max_model_len=16)  # 8 token slots
    with pytest.raises(ValueError, match=r"9 tokens.*KV cache capacity \(8 tokens\)"):
        sched.add_request(make_request("c", prompt(9)))
    sched.add_request(make_request("d", prompt(8)))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("d", prompt(8)))
    assert not sched.requests.keys() - {"d"}


# ------------------------------------------------------------------ outputs


def test_outputs_carry_logprobs_timing_and_cache_info_once():
    sched, runner = setup(max_num_batched_tokens=4)
    sched.add_request(make_request("a", prompt(6), max_tokens=3, logprobs=2, prompt_logprobs=1))
    got = run_until_done(sched, runner)
    outs = got.outputs["a"]
    assert len(outs) == 3
    assert outs[0].first_scheduled_time is not None
    assert all(o.first_scheduled_time is None for o in outs[1:])
    assert len(outs[0].prompt_logprobs) == 5 and all(o.prompt_logprobs is None for o in outs[1:])
    for o in outs:
        assert len(o.new_logprobs) == 1 and o.new_logprobs[0].token_ids[0] == o.new_token_ids[0]


def test_finished_requests_are_reported_to_the_runner_once():
    sched, runner = setup()
    sched.add_request(make_request("a", prompt(5), max_tokens=1))
    sched.add_request(make_request("b", prompt(5, 1), max_tokens=3))
    step_scheduler(sched, runner)  # a finishes
    so, _ = step_scheduler(sched, runner)
    assert so.finished_req_ids == {"a"} and "a" not in runner.reqs
    so, _ = step_scheduler(sched, runner)
    assert so.finished_req_ids == set()


def test_stats():
    sched, runner = setup(num_blocks=8, max_num_seqs=1)
    sched.add_request(make_request("a", prompt(6), max_tokens=3))
    sched.add_request(make_request("b", prompt(6, 1), max_tokens=3))
    step_scheduler(sched, runner)
    s = sched.make_stats()
    assert (s.num_running_reqs, s.num_waiting_reqs, s.num_blocks_total) == (1, 1, 8)
    assert s.kv_cache_usage == 2 / 8
