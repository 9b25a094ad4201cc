"""Async scheduling (EngineCore(async_scheduling=True), `--async-scheduling`)
gives exactly the tokens of the synchronous loop.

Each case runs the same requests through a sync and an async engine and
compares every request's tokens, finish reason and stop reason, then checks
that every KV block is free. First with the fake runner (tests/fake_runner.py:
the scheduler's bookkeeping, KV reads checked through the block tables),
then with the real runner on a tiny model on the CPU (the runner's
placeholders, and decode inputs gathered from the previous step's sampled ids).
"""

from __future__ import annotations

import json
from functools import lru_cache

import pytest
from fake_runner import Collected, FakeRunner, make_request, reference_generate

from scheduler import EngineCore, FinishReason, SchedulerConfig, StructuredOutputSpec
from scheduler.structured_output import GrammarCache
from scheduler.types import EngineCoreRequest, SamplingParams

VOCAB = 500


class _CompileToValue:
    """A grammar backend for the fake runner: guided requests only need to compile."""

    def compile(self, spec: StructuredOutputSpec):
        return spec.value


def fake_engine(async_scheduling: bool, num_blocks: int = 64, script=None, **config) -> EngineCore:
    config.setdefault("block_size", 4)
    config.setdefault("max_model_len", 64)
    config.setdefault("max_num_batched_tokens", 16)
    config.setdefault("max_num_seqs", 8)
    runner = FakeRunner(num_blocks, config["block_size"], VOCAB, script=script)
    cache = GrammarCache(_CompileToValue(), max_entries=8)
    return EngineCore(SchedulerConfig(**config), runner, num_blocks, grammar_cache=cache,
                      async_scheduling=async_scheduling)


def run(core: EngineCore, waves: dict[int, list[EngineCoreRequest]], abort_at: dict[str, int] | None = None,
        max_steps: int = 5000) -> Collected:
    """Step until done; waves[k] are added before step k. abort_at[req_id] = n
    aborts the request once n of its tokens have come out."""
    got = Collected()
    aborted: set[str] = set()
    for step in range(max_steps):
        for request in waves.get(step, []):
            core.add_request(request)
        if step > max(waves) and not core.has_unfinished_requests():
            assert core.scheduler.block_manager.num_free_blocks == core.scheduler.block_manager.num_blocks
            assert not any(core.scheduler.block_manager.ref_cnt)
            assert core._in_flight is None and not core.scheduler.requests
            return got
        got.add(core.step().outputs)
        for req_id, n in (abort_at or {}).items():
            if req_id not in aborted and req_id not in got.finish and len(got.tokens.get(req_id, [])) >= n:
                core.abort_requests([req_id])
                aborted.add(req_id)
    raise AssertionError("the engine did not finish")


def run_both(make_engine, waves, **kwargs) -> tuple[Collected, Collected, EngineCore]:
    """(sync outputs, async outputs, the async engine), checked equal."""
    sync = run(make_engine(False), waves, **kwargs)
    core = make_engine(True)
    got = run(core, waves, **kwargs)
    assert got.tokens == sync.tokens
    assert got.finish == sync.finish
    assert got.stop_reason == sync.stop_reason
    return sync, got, core


# ---------------------------------------------------------------------------
# Fake runner: the scheduler's and the engine core's bookkeeping
# ---------------------------------------------------------------------------

SHARED = list(range(100, 112))  # 3 full blocks of 4


def _mixed_waves() -> dict[int, list[EngineCoreRequest]]:
    return {
        0: [
            make_request("long", list(range(1, 41)), max_tokens=9),  # 40-token prompt: chunked at 16
            make_request("eos", [5, 6, 7], eos_token_id=7, max_tokens=20),
            make_request("stop", [8, 9], max_tokens=20, stop_token_ids=[99]),
            make_request("min", [3, 3, 3], eos_token_id=7, min_tokens=2, max_tokens=20),
            make_request("shared-a", SHARED + [1], max_tokens=6),
            make_request("ctx", list(range(200, 258)), max_tokens=None),  # ends at max_model_len
        ],
        3: [make_request("shared-b", SHARED + [2], max_tokens=5), make_request("one", [4], max_tokens=1)],
        9: [make_request("late", [11, 12, 13, 14, 15], max_tokens=7)],
    }


_SCRIPT = {"eos": [1, 2, 7, 4], "stop": [3, 99, 5], "min": [7, 7, 7, 5]}


def test_mixed_batch_with_every_stop_gives_the_sync_tokens():
    sync, got, core = run_both(lambda a: fake_engine(a, script=_SCRIPT), _mixed_waves())
    assert got.tokens["eos"] == [1, 2, 7] and got.finish["eos"] == FinishReason.STOP
    assert got.tokens["stop"] == [3, 99] and got.stop_reason["stop"] == 99
    assert got.tokens["min"] == [7, 7, 7]  # EOS counts from the 3rd token on
    assert len(got.tokens["ctx"]) == 64 - 58 and got.finish["ctx"] == FinishReason.LENGTH
    assert got.tokens["long"] == reference_generate(list(range(1, 41)), 9, VOCAB)
    assert got.outputs["shared-b"][0].num_cached_tokens == 12  # prefix cache hit
    runner = core.runner
    assert runner.max_in_flight == 2  # steps really overlapped
    # a request stopped by its in-flight token computed one position more; one
    # that reached max_tokens computed exactly what the sync engine did
    assert runner.computed["long"] == list(range(40 + 9 - 1))
    assert len(runner.computed["eos"]) == 3 + 3  # prompt, 2 decodes, and the dropped extra one
    for req_id, out in got.outputs.items():
        assert sum(o.first_scheduled_time is not None for o in out) == 1, req_id


def test_async_outputs_come_one_step_later():
    core = fake_engine(True)
    core.add_request(make_request("a", [1, 2, 3], max_tokens=3))
    assert core.step().outputs == []  # prefill launched, nothing applied yet
    first = core.step().outputs  # the prefill's token, while the first decode runs
    assert [o.new_token_ids for o in first] == [reference_generate([1, 2, 3], 1, VOCAB)]
    got = Collected()
    got.add(first)
    while core.has_unfinished_requests():
        got.add(core.step().outputs)
    assert got.tokens["a"] == reference_generate([1, 2, 3], 3, VOCAB)
    assert core.runner.computed["a"] == [0, 1, 2, 3, 4]  # no step past max_tokens


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_under_a_tiny_kv_cache(prefix_caching):
    waves = {0: [make_request(f"r{i}", [i + 1] * (5 + 3 * i) + SHARED[:4], max_tokens=14) for i in range(6)]}

    def make(a):
        return fake_engine(a, num_blocks=12, enable_prefix_caching=prefix_caching, max_model_len=48)

    sync, got, core = run_both(make, waves)
    assert core.scheduler.num_preemptions_total > 0
    for req in waves[0]:
        assert got.tokens[req.req_id] == reference_generate(req.prompt_token_ids, 14, VOCAB)


def test_aborts_while_a_step_is_in_flight():
    waves = {0: [make_request(f"r{i}", [i + 1] * (4 + i), max_tokens=12) for i in range(4)],
             2: [make_request("waiting", list(range(1, 30)), max_tokens=5)]}
    abort_at = {"r0": 1, "r2": 4, "waiting": 0, "r3": 12}  # r3: after it finished, a no-op
    sync, got, core = run_both(fake_engine, waves, abort_at=abort_at)
    assert got.finish["r0"] == got.finish["r2"] == FinishReason.ABORT
    assert got.tokens["r2"] == reference_generate([3] * 6, 4, VOCAB)
    assert got.finish["r3"] == FinishReason.LENGTH
    # what the runner still holds, it drops with the next step it runs
    assert set(core.runner.reqs) <= core.scheduler.finished_req_ids


def test_same_request_id_reused_right_after_an_abort():
    """The old request's token in flight must not reach the new one."""
    core = fake_engine(True)
    core.add_request(make_request("x", [1, 2, 3], max_tokens=20))
    got = Collected()
    for _ in range(4):
        got.add(core.step().outputs)
    core.abort_requests(["x"])
    got.add(core.step().outputs)
    assert got.finish["x"] == FinishReason.ABORT
    core.add_request(make_request("x", [7, 8], max_tokens=3))
    fresh = Collected()
    while core.has_unfinished_requests():
        fresh.add(core.step().outputs)
    assert fresh.tokens["x"] == reference_generate([7, 8], 3, VOCAB)


def test_guided_and_penalised_requests_fall_back_to_sync_steps():
    """The fake runner asserts that no step is launched ahead while such a
    request is in its batch; before and after them, steps overlap."""
    guided = SamplingParams(temperature=0.0, max_tokens=4, structured_output=StructuredOutputSpec("regex", "a+"))
    waves = {
        0: [make_request("plain", [1, 2, 3], max_tokens=40)],
        4: [EngineCoreRequest("guided", [4, 5, 6], guided)],
        12: [make_request("pen", [7, 8], max_tokens=5, repetition_penalty=1.2, frequency_penalty=0.5)],
        20: [make_request("pres", [9], max_tokens=3, presence_penalty=0.5)],
    }
    sync, got, core = run_both(fake_engine, waves)
    assert core.runner.max_in_flight == 2
    assert got.tokens["plain"] == reference_generate([1, 2, 3], 40, VOCAB)
    assert got.tokens["guided"] == reference_generate([4, 5, 6], 4, VOCAB)


# ---------------------------------------------------------------------------
# The real runner on a tiny model (CPU)
# ---------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _real_engine(model_dir: str, async_scheduling: bool, blocks: int, prefix_caching: bool) -> EngineCore:
    from runner.engine import build_engine_core
    from scheduler.config import EngineConfig

    config = EngineConfig(model=model_dir, device="cpu", block_size=4, max_num_batched_tokens=16, max_num_seqs=8,
                          num_gpu_blocks_override=blocks, enable_prefix_caching=prefix_caching,
                          async_scheduling=async_scheduling)
    return build_engine_core(config)[0]


@pytest.fixture
def real(tiny_model_dir):
    """make(async_scheduling) -> a real engine (cached per config), its prefix cache emptied,
    counting the decode inputs it gathered from a step in flight."""
    gathered = []

    def make(async_scheduling: bool, blocks: int = 128, prefix_caching: bool = True) -> EngineCore:
        core = _real_engine(tiny_model_dir, async_scheduling, blocks, prefix_caching)
        core.reset_prefix_cache()
        runner = core.runner
        gather = type(runner)._gather_in_flight
        runner._gather_in_flight = lambda ids, flat, src: (gathered.append(flat.size), gather(runner, ids, flat, src))
        return core

    make.gathered = gathered
    return make


def _req(req_id, prompt, **sampling):
    sampling.setdefault("temperature", 0.0)
    eos = sampling.pop("eos_token_id", None)
    return EngineCoreRequest(req_id, list(prompt), SamplingParams(**sampling), eos_token_id=eos)


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 131 + 17 * i) % 380 + 3 for i in range(n)]


def test_real_runner_mixed_batch(real):
    shared = _prompt(9, 13)
    seeded = dict(temperature=0.9, top_p=0.9, top_k=40, max_tokens=10)
    waves = {
        0: [
            _req("greedy", _prompt(1, 5), max_tokens=10, logprobs=3),
            _req("seeded", _prompt(2, 23), seed=7, **seeded),  # chunked prefill (budget 16)
            _req("seeded-min", _prompt(3, 11), seed=8, min_tokens=4, eos_token_id=2, **seeded),
            _req("shared-a", shared + [7, 8], max_tokens=6),
        ],
        2: [_req("one", _prompt(4, 3), max_tokens=1)],
        8: [_req("shared-b", shared + [40, 41], max_tokens=6)],
    }
    plain = run(real(False), waves)
    # stops that end requests mid-way: the plain run's 3rd tokens as EOS / stop token
    waves[3] = [
        _req("eos", _prompt(1, 5), max_tokens=10, eos_token_id=plain.tokens["greedy"][2]),
        _req("stop", _prompt(4, 3), max_tokens=10, stop_token_ids=[plain.tokens["one"][0]]),
    ]
    sync, got, core = run_both(real, waves)
    assert got.tokens["greedy"] == plain.tokens["greedy"]
    assert len(got.tokens["eos"]) <= 3 and got.finish["eos"] == FinishReason.STOP
    assert got.tokens["stop"][-1] == plain.tokens["one"][0] and got.stop_reason["stop"] is not None
    assert got.outputs["shared-b"][0].num_cached_tokens == 12
    lps = [lp for o in got.outputs["greedy"] for lp in o.new_logprobs]
    assert [lp.token_ids[0] for lp in lps] == got.tokens["greedy"]
    assert sum(real.gathered) > 0  # decode inputs came from the step in flight


def test_real_runner_preemption(real):
    waves = {0: [_req(f"r{i}", _prompt(i, n), max_tokens=12, **({"seed": i, "temperature": 0.8} if i % 2 else {}))
                 for i, n in enumerate((5, 23, 1, 11, 16))]}
    sync, got, core = run_both(lambda a: real(a, blocks=14, prefix_caching=False), waves)
    assert core.scheduler.num_preemptions_total > 0
    assert all(len(t) == 12 for t in got.tokens.values())


def test_real_runner_aborts_in_flight(real):
    waves = {0: [_req(f"r{i}", _prompt(i, 4 + 3 * i), max_tokens=12) for i in range(4)]}
    sync, got, core = run_both(real, waves, abort_at={"r1": 2, "r3": 5})
    assert got.finish["r1"] == got.finish["r3"] == FinishReason.ABORT
    assert len(got.tokens["r0"]) == 12


def test_real_runner_guided_and_penalties_mixed_in(real):
    choice = StructuredOutputSpec("choice", json.dumps(["yes", "no", "maybe so"]))
    waves = {
        0: [_req("plain", _prompt(1, 6), max_tokens=24), _req("seeded", _prompt(2, 9), seed=3, temperature=1.0,
                                                               max_tokens=24)],
        3: [_req("guided", _prompt(3, 4), max_tokens=10, structured_output=choice, eos_token_id=2)],
        10: [_req("pen", _prompt(4, 7), max_tokens=6, repetition_penalty=1.5, frequency_penalty=1.0,
                  presence_penalty=0.5)],
    }
    sync, got, core = run_both(real, waves)
    assert got.finish["guided"] == FinishReason.STOP
    assert sum(real.gathered) > 0


# ---------------------------------------------------------------------------
# GPU: FlashInfer, CUDA graphs replayed with decode inputs gathered on the device
# ---------------------------------------------------------------------------

# head_dim 64: FlashInfer has no kernels for the CPU tests' 16
_TINY_GPU = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
_TIE = 0.05


def _gpu_run(path, async_scheduling: bool, prompts, seeded: bool = True, **config):
    """Tokens and logprobs per request; the engine; decode inputs gathered on the device."""
    from models.layers import ops
    from runner.engine import build_engine_core
    from scheduler.config import EngineConfig

    core = build_engine_core(EngineConfig(model=str(path), device="cuda", dtype="float16", block_size=16,
                                          max_num_seqs=8, async_scheduling=async_scheduling, **config))[0]
    gathered = []
    runner = core.runner
    gather = type(runner)._gather_in_flight
    runner._gather_in_flight = lambda ids, flat, src: (gathered.append(flat.size), gather(runner, ids, flat, src))
    waves = {0: [_req(f"r{i}", p, max_tokens=24, ignore_eos=True, logprobs=5,
                      **({"seed": i, "temperature": 0.8, "top_k": 50} if seeded and i % 2 else {}))
                 for i, p in enumerate(prompts)]}
    got = run(core, waves)
    ops.reset_ops()  # the engine installed the Triton ops process-wide
    return got, core, sum(gathered)


def _gpu_prompts() -> list[list[int]]:
    return [_prompt(i, n) for i, n in enumerate((5, 23, 1, 11, 16, 197))]


@pytest.mark.gpu
def test_gpu_graphs_give_the_sync_tokens(tmp_path):
    """No preemption and max_tokens stops only: both modes run the same
    batches, so the tokens must be identical."""
    from models_util import make_tiny_checkpoint

    path = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "ckpt", seed=1, **_TINY_GPU)
    config = dict(max_num_batched_tokens=64, num_gpu_blocks_override=64)
    sync, sync_core, _ = _gpu_run(path, False, _gpu_prompts(), **config)
    got, core, gathered = _gpu_run(path, True, _gpu_prompts(), **config)
    assert core.runner.graph_runner is not None and core.runner.backend.name == "flashinfer"
    assert gathered > 0
    assert got.tokens == sync.tokens


@pytest.mark.gpu
def test_gpu_eager_with_preemption_matches_sync_up_to_near_ties(tmp_path):
    """Preemption makes the two modes batch differently, so fp16 logits may
    differ in the last bits: a request's greedy tokens match until a near-tie."""
    from models_util import make_tiny_checkpoint

    path = make_tiny_checkpoint("LlamaForCausalLM", tmp_path / "ckpt", seed=1, **_TINY_GPU)
    config = dict(max_num_batched_tokens=32, num_gpu_blocks_override=6, enable_prefix_caching=False,
                  enforce_eager=True)
    prompts = _gpu_prompts()[:5]
    sync, _, _ = _gpu_run(path, False, prompts, seeded=False, **config)
    got, core, gathered = _gpu_run(path, True, prompts, seeded=False, **config)
    assert core.scheduler.num_preemptions_total > 0 and gathered > 0
    matched = 0
    for req_id, want in sync.tokens.items():
        lps = [lp for o in sync.outputs[req_id] for lp in o.new_logprobs]
        for step, (a, b) in enumerate(zip(got.tokens[req_id], want)):
            if a != b:
                top = dict(zip(lps[step].token_ids[1:], lps[step].logprobs[1:]))
                assert a in top and lps[step].logprobs[0] - top[a] < _TIE, f"{req_id}: token {step}"
                break
            matched += 1
    assert matched >= 0.75 * sum(map(len, sync.tokens.values()))
