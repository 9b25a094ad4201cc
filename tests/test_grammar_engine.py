"""Guided decoding inside the engine, no server: the grammar cache, guided
requests held by the engine core while their grammar compiles, the xgrammar
backend's compile errors, and the runner's matchers and bitmasks."""

from __future__ import annotations

import json
import threading
import time

import pytest
from fake_runner import FakeRunner, make_request

from scheduler import EngineCore, FinishReason, InprocClient, SchedulerConfig, StructuredOutputSpec
from scheduler.structured_output import GrammarCache, GrammarCompileError

VOCAB = 500


class FakeBackend:
    """Compiles to the spec's value; "bad" is invalid; "slow*" waits for `release`."""

    def __init__(self):
        self.compiled: list[tuple[str, str]] = []
        self.release = threading.Event()
        self.lock = threading.Lock()

    def compile(self, spec: StructuredOutputSpec):
        with self.lock:
            self.compiled.append(spec.key)
        if spec.value.startswith("slow"):
            assert self.release.wait(10)
        if spec.value == "bad":
            raise GrammarCompileError("invalid regex: bad on purpose")
        if spec.value == "crash":
            raise RuntimeError("backend bug")
        return f"compiled:{spec.value}"


def regex(value: str) -> StructuredOutputSpec:
    return StructuredOutputSpec("regex", value, "guided_regex")


# ---------------------------------------------------------------------------
# GrammarCache
# ---------------------------------------------------------------------------


def test_each_distinct_spec_compiles_once_and_in_flight_compiles_are_shared():
    backend = FakeBackend()
    cache = GrammarCache(backend, max_entries=8)
    slow = regex("slow-1")
    futures = [cache.submit(slow) for _ in range(5)]
    assert len({id(f) for f in futures}) == 1  # one compile in flight, shared
    assert not futures[0].done()
    backend.release.set()
    assert futures[0].result(5) == "compiled:slow-1"
    assert cache.submit(slow).done()  # a hit
    assert cache.submit(StructuredOutputSpec("regex", "slow-1", "other_param")).result() == "compiled:slow-1"
    assert backend.compiled == [("regex", "slow-1")]
    assert cache.num_compiles == 1
    cache.shutdown()


def test_the_cache_is_lru_bounded_and_recompiles_an_evicted_grammar_on_demand():
    backend = FakeBackend()
    cache = GrammarCache(backend, max_entries=2)
    for v in ("a", "b"):
        cache.submit(regex(v)).result(5)
    cache.submit(regex("a")).result(5)  # a becomes most recently used
    cache.submit(regex("c")).result(5)  # evicts b
    assert regex("a") in cache and regex("c") in cache and regex("b") not in cache
    assert len(cache) == 2
    assert cache.get_or_compile(regex("b")) == "compiled:b"  # compiled again, synchronously
    assert backend.compiled.count(("regex", "b")) == 2
    cache.shutdown()


def test_failures_are_cached_and_raised():
    backend = FakeBackend()
    cache = GrammarCache(backend, max_entries=4)
    with pytest.raises(GrammarCompileError, match="bad on purpose"):
        cache.submit(regex("bad")).result(5)
    with pytest.raises(GrammarCompileError):
        cache.get_or_compile(regex("bad"))
    assert backend.compiled == [("regex", "bad")]
    cache.shutdown()


# ---------------------------------------------------------------------------
# EngineCore: guided requests wait outside the scheduler
# ---------------------------------------------------------------------------


def make_core(backend=None, **config):
    config.setdefault("block_size", 4)
    config.setdefault("max_model_len", 64)
    config.setdefault("max_num_batched_tokens", 32)
    runner = FakeRunner(32, config["block_size"], VOCAB)
    cache = GrammarCache(backend, max_entries=8) if backend is not None else None
    return InprocClient(EngineCore(SchedulerConfig(**config), runner, 32, grammar_cache=cache)), runner


def run_until(client, done, max_steps=500):
    outputs = []
    for _ in range(max_steps):
        outputs.extend(client.step().outputs)
        if done(outputs):
            return outputs
    raise AssertionError(f"not done after {max_steps} steps: {outputs}")


def test_a_slow_grammar_does_not_stall_other_requests():
    backend = FakeBackend()
    client, runner = make_core(backend)
    client.add_request(make_request("guided", [1, 2, 3], max_tokens=4, structured_output=regex("slow-x")))
    client.add_request(make_request("free", [4, 5, 6], max_tokens=4))
    outs = run_until(client, lambda o: any(x.req_id == "free" and x.finished for x in o))
    assert all(x.req_id == "free" for x in outs)  # the guided one was never scheduled meanwhile
    assert all("guided" not in so.num_scheduled_tokens for so in runner.history)
    assert client.make_stats().num_waiting_reqs == 1
    backend.release.set()
    outs = run_until(client, lambda o: any(x.req_id == "guided" and x.finished for x in o))
    assert outs[-1].finish_reason == FinishReason.LENGTH
    assert sum(len(x.new_token_ids) for x in outs if x.req_id == "guided") == 4
    assert not client.has_unfinished_requests()


def test_an_invalid_grammar_is_an_error_output_and_never_reaches_the_scheduler():
    client, runner = make_core(FakeBackend())
    client.add_request(make_request("bad", [1, 2], max_tokens=4, structured_output=regex("bad")))
    client.add_request(make_request("crash", [1, 2], max_tokens=4, structured_output=regex("crash")))
    outs = run_until(client, lambda o: len(o) == 2)
    by_id = {o.req_id: o for o in outs}
    assert by_id["bad"].finish_reason == FinishReason.ERROR and str(by_id["bad"].finish_reason) == "error"
    assert by_id["bad"].error == "invalid regex: bad on purpose" and by_id["bad"].new_token_ids == []
    assert "backend bug" in by_id["crash"].error
    assert runner.history == []
    assert not client.has_unfinished_requests()
    # the engine keeps serving
    client.add_request(make_request("ok", [1, 2], max_tokens=2, structured_output=regex("fine")))
    outs = run_until(client, lambda o: any(x.finished for x in o))
    assert outs[-1].finish_reason == FinishReason.LENGTH


def test_a_grammar_that_never_compiles_times_out_and_the_engine_keeps_serving():
    backend = FakeBackend()
    client, runner = make_core(backend)
    client.engine_core.guided.compile_timeout_s = 0.05
    client.add_request(make_request("stuck", [1, 2], max_tokens=4, structured_output=regex("slow-stuck")))
    client.add_request(make_request("free", [3, 4], max_tokens=2))
    time.sleep(0.1)
    outs = run_until(client, lambda o: any(x.req_id == "stuck" for x in o))
    stuck = next(x for x in outs if x.req_id == "stuck")
    assert stuck.finish_reason == FinishReason.ERROR and "did not compile within 0.05 s" in stuck.error
    assert all("stuck" not in so.num_scheduled_tokens for so in runner.history)
    outs = run_until(client, lambda o: any(x.req_id == "free" and x.finished for x in o))
    backend.release.set()
    assert not client.has_unfinished_requests()


def test_aborting_a_held_request_reports_abort():
    backend = FakeBackend()
    client, _ = make_core(backend)
    client.add_request(make_request("g", [1, 2], max_tokens=4, structured_output=regex("slow-abort")))
    client.step()
    client.abort_requests(["g"])
    outs = client.step().outputs
    assert [(o.req_id, o.finish_reason) for o in outs] == [("g", FinishReason.ABORT)]
    backend.release.set()
    assert not client.has_unfinished_requests()


def test_held_requests_are_checked_like_any_other():
    backend = FakeBackend()
    client, _ = make_core(backend)
    client.add_request(make_request("g", [1, 2], max_tokens=4, structured_output=regex("slow-dup")))
    with pytest.raises(ValueError, match="already in use"):
        client.add_request(make_request("g", [1, 2], max_tokens=4))
    with pytest.raises(ValueError, match="already in use"):
        client.add_request(make_request("g", [1, 2], max_tokens=4, structured_output=regex("x")))
    with pytest.raises(ValueError, match="prompt has 100 tokens"):
        client.add_request(make_request("long", [1] * 100, structured_output=regex("x")))
    backend.release.set()
    client.abort_requests(["g"])
    run_until(client, lambda o: any(x.finished for x in o))


def test_an_engine_without_a_grammar_backend_refuses_guided_requests():
    client, _ = make_core(None)
    with pytest.raises(ValueError, match="structured outputs are not available"):
        client.add_request(make_request("g", [1, 2], structured_output=regex("x")))


def test_idle_steps_wait_for_the_compile_instead_of_spinning():
    backend = FakeBackend()
    client, _ = make_core(backend)
    client.add_request(make_request("g", [1, 2], max_tokens=1, structured_output=regex("slow-wait")))
    start = time.perf_counter()
    for _ in range(10):
        client.step()
    assert time.perf_counter() - start >= 0.04  # each idle step waited ~5 ms for the compile
    backend.release.set()
    run_until(client, lambda o: any(x.finished for x in o))


def test_guided_params_cannot_be_trapped_by_ignore_eos_or_min_tokens():
    from scheduler import SamplingParams

    p = SamplingParams(ignore_eos=True, min_tokens=5, max_tokens=10, structured_output=regex("a"))
    assert (p.ignore_eos, p.min_tokens) == (False, 0)
    with pytest.raises(ValueError, match="kind"):
        StructuredOutputSpec("yaml", "x")


# ---------------------------------------------------------------------------
# The xgrammar backend and the runner's matchers (torch, tiny tokenizer)
# ---------------------------------------------------------------------------

TINY_VOCAB = 384
EOS = 2


@pytest.fixture(scope="module")
def xgr_cache(tiny_model_dir):
    from runner.structured_output import build_grammar_cache
    from scheduler import EngineConfig

    cache = build_grammar_cache(EngineConfig(model=tiny_model_dir), TINY_VOCAB, [EOS])
    yield cache
    cache.shutdown()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    return TokenizersBackend.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize(
    "kind, value, message",
    [
        ("json", '{"type": "objectx"}', 'invalid JSON schema: Unsupported type "objectx"'),
        ("json", '{"type": ', "invalid JSON schema: not JSON"),
        ("json", "[1, 2]", "invalid JSON schema: expected an object"),
        ("regex", "a(b", "invalid regex: Regex parsing error at position 4: The parenthesis is not closed."),
        ("grammar", "root ::= foo", 'invalid grammar: EBNF parser error at line 1, column 10: Rule "foo" is not defined'),
    ],
)
def test_invalid_specs_raise_clean_messages(xgr_cache, kind, value, message):
    with pytest.raises(GrammarCompileError) as info:
        xgr_cache.get_or_compile(StructuredOutputSpec(kind, value))
    assert str(info.value).startswith(message)
    assert "/project/" not in str(info.value) and "Check failed" not in str(info.value)


def _new_req(req_id, spec, outputs=()):
    from scheduler import NewRequestData, SamplingParams

    return NewRequestData(
        req_id=req_id, prompt_token_ids=[5, 6], output_token_ids=list(outputs),
        sampling_params=SamplingParams(structured_output=spec), block_ids=[0], num_computed_tokens=0,
        eos_token_id=EOS,
    )


def _allowed(bitmask_row) -> list[int]:
    import torch

    bits = ((bitmask_row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).reshape(-1)
    return bits[:TINY_VOCAB].nonzero().flatten().tolist()


def test_matchers_mask_follow_the_grammar_and_end_with_eos(xgr_cache, tokenizer):
    import torch

    from runner.structured_output import GrammarMatchers, apply_token_bitmask

    choices = ["yes", "no", 'say "hi"\n']
    spec = StructuredOutputSpec("choice", json.dumps(choices))
    matchers = GrammarMatchers(xgr_cache, TINY_VOCAB, max_num_seqs=4, device=torch.device("cpu"))
    matchers.add_request(_new_req("g", spec))
    assert len(matchers) == 1 and "g" in matchers
    assert matchers.fill_bitmask(["free"]) is None

    rows, bitmask = matchers.fill_bitmask(["free", "g"])
    assert rows.tolist() == [1] and bitmask.shape == (1, TINY_VOCAB // 32)
    allowed = _allowed(bitmask[0])
    texts = {t: tokenizer.decode([t]) for t in allowed}
    assert allowed and all(any(c.startswith(x) for c in choices) for x in texts.values())
    logits = torch.zeros(2, TINY_VOCAB)
    apply_token_bitmask(logits, bitmask, torch.tensor(rows))
    assert torch.isfinite(logits[0]).all()  # the free row is untouched
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == allowed

    # follow "no" token by token, then only EOS is left
    for token_id in tokenizer.encode("no", add_special_tokens=False):
        matchers.accept(["free", "g"], [7, token_id])
    _, bitmask = matchers.fill_bitmask(["g"])
    assert _allowed(bitmask[0]) == [EOS]
    matchers.accept(["g"], [EOS])
    _, bitmask = matchers.fill_bitmask(["g"])  # terminated: still only EOS, never an error
    assert _allowed(bitmask[0]) == [EOS]
    matchers.remove_request("g")
    assert len(matchers) == 0


def test_a_resumed_request_replays_its_outputs(xgr_cache, tokenizer):
    import torch

    from runner.structured_output import GrammarMatchers

    spec = StructuredOutputSpec("regex", "ab[0-9]")
    matchers = GrammarMatchers(xgr_cache, TINY_VOCAB, max_num_seqs=4, device=torch.device("cpu"))
    done = tokenizer.encode("ab", add_special_tokens=False)
    matchers.add_request(_new_req("r", spec, outputs=done))
    _, bitmask = matchers.fill_bitmask(["r"])
    assert {tokenizer.decode([t]) for t in _allowed(bitmask[0])} == set("0123456789")


def test_a_token_outside_the_grammar_leaves_only_stop_tokens(xgr_cache, tokenizer):
    import torch

    from runner.structured_output import GrammarMatchers

    matchers = GrammarMatchers(xgr_cache, TINY_VOCAB, max_num_seqs=2, device=torch.device("cpu"))
    matchers.add_request(_new_req("r", StructuredOutputSpec("regex", "[0-9]+")))
    matchers.accept(["r"], tokenizer.encode("x", add_special_tokens=False))
    _, bitmask = matchers.fill_bitmask(["r"])
    assert _allowed(bitmask[0]) == [EOS]


def test_special_tokens_never_appear_inside_the_output(xgr_cache):
    import torch

    from runner.structured_output import GrammarMatchers

    # <|im_start|> (id 1) is made of characters this class allows; as a special token it is never allowed
    matchers = GrammarMatchers(xgr_cache, TINY_VOCAB, max_num_seqs=2, device=torch.device("cpu"))
    matchers.add_request(_new_req("r", StructuredOutputSpec("regex", "[a-z<|>_]{0,20}")))
    _, bitmask = matchers.fill_bitmask(["r"])
    allowed = _allowed(bitmask[0])
    assert 0 not in allowed and 1 not in allowed and EOS in allowed


def test_bounded_strings_stay_valid_json():
    from runner.structured_output import _bounded_strings_as_patterns

    schema = {"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 8},
        "b": {"type": "string", "minLength": 2, "pattern": "^[a-z]+$"},
        "c": {"enum": [{"type": "string", "maxLength": 1}]},
        "d": {"type": ["string", "null"], "minLength": 2, "maxLength": 3},
    }}
    out = _bounded_strings_as_patterns(schema)
    assert out["properties"]["a"]["pattern"] == "^.{0,8}$"
    assert out["properties"]["d"]["pattern"] == "^.{2,3}$"
    assert out["properties"]["b"]["pattern"] == "^[a-z]+$"
    assert out["properties"]["c"] == schema["properties"]["c"]  # data, not a schema


def test_apply_token_bitmask_matches_xgrammar():
    import torch
    import xgrammar as xgr

    from runner.structured_output import apply_token_bitmask

    vocab, rows = 1000, [3, 0, 5]  # vocab not a multiple of 32; masked rows out of order
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), -(-vocab // 32)), dtype=torch.int32, generator=gen)
    logits = torch.randn(6, vocab, generator=gen)
    expected = logits.clone()
    for k, row in enumerate(rows):  # xgrammar's kernel, one row at a time
        xgr.apply_token_bitmask_inplace(expected[row : row + 1], bitmask[k : k + 1], vocab_size=vocab)
    apply_token_bitmask(logits, bitmask, torch.tensor(rows))
    assert torch.equal(logits, expected)


def test_guided_requests_survive_preemption(tiny_model_dir):
    """A KV cache too small for the batch preempts requests; a resumed guided
    request rebuilds its matcher from the tokens it had, and every output
    still follows its grammar."""
    import re

    from server import LLM, SamplingParams

    llm = LLM(tiny_model_dir, num_gpu_blocks_override=24, block_size=4, max_model_len=96, max_num_seqs=8)
    regex = r"\[[0-9]{3}(, [0-9]{3}){3,9}\]"
    params = [SamplingParams(max_tokens=80, temperature=1.0, seed=i,
                             structured_output=StructuredOutputSpec("regex", regex)) for i in range(8)]
    outs = llm.generate(["Numbers:"] * 8, params, use_tqdm=False)
    assert llm.engine.make_stats().num_preemptions_total > 0
    for o in outs:
        assert o.outputs[0].finish_reason == "stop" and re.fullmatch(regex, o.outputs[0].text), o.outputs[0].text
