"""AsyncEngineClient against a real engine-core process over ZMQ.

Most tests spawn the engine core around the scheduler's FakeRunner (no torch,
fast start; tokens are a hash of the context) with the embedded tokenizer;
one runs the real embedded model end to end.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from scheduler.config import ConfigError, EngineConfig, SchedulerConfig, resolve_model
from scheduler.engine_core import EngineCore
from scheduler.types import EngineInfo, SamplingParams
from server.engine_client import AsyncEngineClient, EngineDeadError, EngineStartupError, RequestRejectedError

try:
    EMBEDDED = resolve_model(None)
except ConfigError as e:  # pragma: no cover
    pytest.skip(str(e), allow_module_level=True)

VOCAB = 49152
FAKE_BUILDER = f"{__name__}:build_fake_engine"
FAILING_BUILDER = f"{__name__}:build_failing_engine"


# -- engine builders run inside the spawned engine process ------------------


def build_fake_engine(config: EngineConfig) -> tuple[EngineCore, EngineInfo]:
    from fake_runner import FakeRunner

    class SlowFakeRunner(FakeRunner):
        def execute(self, so):
            time.sleep(0.005)  # a step takes time, as a model would
            return super().execute(so)

    num_blocks, block_size = 256, config.block_size
    max_model_len = config.max_model_len or 512
    sched = SchedulerConfig(
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=512, max_model_len=max_model_len, block_size=block_size
    )
    class FakeCore(EngineCore):
        def add_request(self, request):
            if request.req_id.startswith("error-"):  # as a grammar that fails to compile
                from scheduler.structured_output import error_output

                self._early_outputs.append(error_output(request.req_id, "the grammar is bad"))
                return
            super().add_request(request)

    core = FakeCore(sched, SlowFakeRunner(num_blocks, block_size, vocab_size=VOCAB), num_blocks)
    info = EngineInfo(
        model="fake", device="cpu", dtype="none", max_model_len=max_model_len, block_size=block_size,
        num_blocks=num_blocks, max_num_seqs=config.max_num_seqs, vocab_size=VOCAB,
    )
    return core, info


def build_failing_engine(config: EngineConfig):
    raise RuntimeError("no accelerator named Bob")


def reference_tokens(prompt: list[int], n: int) -> list[int]:
    from fake_runner import reference_generate

    return reference_generate(prompt, n, VOCAB)


# -- helpers -----------------------------------------------------------------


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def make_client(**kwargs) -> AsyncEngineClient:
    return await AsyncEngineClient.create(
        EngineConfig(max_model_len=256, max_num_seqs=8), engine_builder=FAKE_BUILDER, **kwargs
    )


async def collect(agen):
    return [d async for d in agen]


# -- tests -------------------------------------------------------------------


def test_generate_streams_tokens_and_text():
    async def main():
        client = await make_client()
        try:
            assert client.is_healthy() and client.engine_pid > 0
            assert client.info.model == "fake"
            stats_seen = []
            client.add_stats_callback(stats_seen.append)
            prompt = client.tokenizer.encode("Hello there")
            deltas = await collect(client.generate("a", prompt, SamplingParams(max_tokens=12, temperature=0)))
            tokens = [t for d in deltas for t in d.token_ids]
            assert tokens == reference_tokens(prompt, 12)
            assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
            last = deltas[-1]
            assert (last.finish_reason, last.num_output_tokens, last.num_prompt_tokens) == ("length", 12, len(prompt))
            assert "".join(d.text for d in deltas) == client.tokenizer.decode(tokens, skip_special_tokens=True)
            assert deltas[0].first_scheduled_time is not None
            assert stats_seen and client.latest_stats is stats_seen[-1]

            # concurrent requests, one with a stop string cut out of its text
            p2 = client.tokenizer.encode("Another prompt")
            full = client.tokenizer.decode(reference_tokens(p2, 40), skip_special_tokens=True)
            stop = full[10:13]
            r1, r2 = await asyncio.gather(
                collect(client.generate("b", prompt, SamplingParams(max_tokens=5))),
                collect(client.generate("c", p2, SamplingParams(max_tokens=40, stop=[stop]))),
            )
            assert sum(len(d.token_ids) for d in r1) == 5
            assert (r2[-1].finish_reason, r2[-1].stop_reason) == ("stop", stop)
            assert "".join(d.text for d in r2) == full[: full.index(stop)]
            assert client.num_unfinished_requests == 0
        finally:
            await client.shutdown()
        assert not client.is_healthy()

    run(main())


def test_break_out_of_stream_aborts_in_engine():
    async def main():
        client = await make_client()
        try:
            agen = client.generate("long", [1, 2, 3], SamplingParams(max_tokens=200))
            async for delta in agen:
                break
            await agen.aclose()
            # the engine drops it: the running count goes back to 0
            for _ in range(50):
                await asyncio.sleep(0.1)
                if client.latest_stats.num_running_reqs == 0 and client.latest_stats.kv_cache_usage == 0:
                    break
            assert client.latest_stats.num_running_reqs == 0
            assert client.latest_stats.kv_cache_usage == 0
            # a cancelled consumer (client disconnect) aborts too
            task = asyncio.create_task(collect(client.generate("cancelled", [4, 5, 6], SamplingParams(max_tokens=200))))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert client.num_unfinished_requests == 0
            assert not client.output_processor.has_unfinished_requests()
            # explicit abort: the consumer sees a final "abort" delta
            consumer = asyncio.create_task(collect(client.generate("x", [7, 8], SamplingParams(max_tokens=200))))
            await asyncio.sleep(0.2)
            await client.abort("x")
            deltas = await consumer
            assert deltas[-1].finish_reason == "abort"
            # the engine still serves
            out = await collect(client.generate("after", [9], SamplingParams(max_tokens=3)))
            assert out[-1].num_output_tokens == 3
        finally:
            await client.shutdown()

    run(main())


def test_rejected_request_raises():
    async def main():
        client = await make_client()
        try:
            with pytest.raises(RequestRejectedError):
                await collect(client.generate("big", list(range(300)), SamplingParams()))
            with pytest.raises(ValueError):
                await collect(client.generate("n2", [1], SamplingParams(n=2)))
            with pytest.raises(RequestRejectedError, match="the grammar is bad"):
                await collect(client.generate("error-1", [1, 2], SamplingParams()))
            assert not client.output_processor.has_unfinished_requests()
        finally:
            await client.shutdown()

    run(main())


def test_killed_engine_fails_pending_requests_fast():
    async def main():
        client = await make_client()
        try:
            task = asyncio.create_task(collect(client.generate("a", [1, 2], SamplingParams(max_tokens=250))))
            await asyncio.sleep(0.3)
            os.kill(client.engine_pid, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(EngineDeadError):
                await task
            assert time.monotonic() - t0 < 1.5
            assert not client.is_healthy()
            with pytest.raises(EngineDeadError):
                await collect(client.generate("b", [1], SamplingParams()))
        finally:
            await client.shutdown()

    run(main())


def test_startup_failure_reports_the_engine_traceback():
    async def main():
        with pytest.raises(EngineStartupError) as err:
            await AsyncEngineClient.create(EngineConfig(), engine_builder=FAILING_BUILDER)
        assert "no accelerator named Bob" in str(err.value)
        assert "build_failing_engine" in err.value.traceback

    run(main())


def test_api_side_never_imports_torch():
    code = (
        "import sys, asyncio\n"
        "import server, server.engine_client, server.tokenizer, server.detokenizer\n"
        "from scheduler.config import resolve_model\n"
        "from server.tokenizer import load_tokenizer\n"
        "tok = load_tokenizer(resolve_model(None))\n"
        "assert tok.encode('hi')\n"
        "bad = [m for m in ('torch', 'runner', 'models') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == 0, proc.stderr


def test_real_engine_on_tiny_model_matches_in_process_engine(tiny_model_dir):
    """The spawned real engine (loader, runner, torch) streams the same greedy
    tokens as the same engine stepped in this process."""
    config = EngineConfig(model=tiny_model_dir, kv_cache_memory_gb=0.01, max_num_seqs=4)
    prompts = [[1, 5, 9, 14], [1, 30, 31, 32, 33, 34, 35]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)

    async def main():
        client = await AsyncEngineClient.create(config)
        try:
            assert client.info.vocab_size == len(client.tokenizer)
            streams = await asyncio.gather(
                *(collect(client.generate(f"r{i}", p, params)) for i, p in enumerate(prompts))
            )
            # abort frees the sequence's KV blocks in the engine
            agen = client.generate("long", prompts[0], SamplingParams(max_tokens=500, ignore_eos=True))
            await agen.__anext__()
            await agen.aclose()
            for _ in range(50):
                await asyncio.sleep(0.1)
                if client.latest_stats.num_running_reqs == 0:
                    break
            assert client.latest_stats.num_running_reqs == 0
            return streams, client.tokenizer
        finally:
            await client.shutdown()

    streams, tokenizer = run(main())

    from runner.engine import build_engine_core
    from server.llm import LLM

    llm = LLM(tiny_model_dir, kv_cache_memory_gb=0.01, max_num_seqs=4, engine_builder=build_engine_core)
    expected = llm.generate(prompts, params, use_tqdm=False)
    for deltas, exp in zip(streams, expected):
        c = exp.outputs[0]
        assert [t for d in deltas for t in d.token_ids] == c.token_ids
        assert "".join(d.text for d in deltas) == c.text
        assert deltas[-1].finish_reason == "length" and len(c.token_ids) == 10
        # batch composition may differ (requests arrive apart): logprobs to float tolerance
        got = [lp for d in deltas for lp in d.logprobs]
        assert [{t: (lp.rank, lp.decoded_token) for t, lp in pos.items()} for pos in got] == [
            {t: (lp.rank, lp.decoded_token) for t, lp in pos.items()} for pos in c.logprobs
        ]
        flat = lambda positions: [lp.logprob for pos in positions for lp in pos.values()]  # noqa: E731
        assert flat(got) == pytest.approx(flat(c.logprobs), abs=1e-4)


def test_engine_exits_when_the_api_process_dies():
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    code = (
        "import sys, asyncio, os\n"
        f"sys.path.insert(0, {tests_dir!r})\n"
        "from scheduler.config import EngineConfig\n"
        "from server.engine_client import AsyncEngineClient\n"
        "async def main():\n"
        "    c = await AsyncEngineClient.create(EngineConfig(max_model_len=256), engine_builder='test_engine_client:build_fake_engine')\n"
        "    print(c.engine_pid, flush=True)\n"
        "    os.kill(os.getpid(), 9)\n"
        "asyncio.run(main())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    engine_pid = int(proc.stdout.split()[0])

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 5
    while alive(engine_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(engine_pid), "orphaned engine core still running"
