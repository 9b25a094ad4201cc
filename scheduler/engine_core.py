"""The engine-core step loop and its in-process client.

    out = scheduler.schedule()
    res = runner.execute(out)           # skipped when nothing is scheduled
    outputs = scheduler.update_from_output(out, res)

The ZMQ engine-core process wraps one `EngineCore` and calls
`add_request` / `abort_requests` between steps, `step()` while
`has_unfinished_requests()`. `InprocClient` gives the same surface inside one
process (offline `LLM` API, tests).

With async scheduling (`--async-scheduling`) the loop keeps one step in
flight, so the host work of step N overlaps the device work of step N-1:

    out_N = scheduler.schedule()        # N-1's tokens are placeholders here
    handle_N = runner.execute_async(out_N)
    outputs = scheduler.update_from_output(out_N-1, handle_N-1.result())

and each `step()` returns the outputs of the step before. While a live
request reads its tokens on the host (guided decoding, penalties:
Scheduler.can_schedule_ahead), steps run synchronously, the pipeline drained.

A guided request (structured output) waits outside the scheduler until its
grammar is compiled on a worker thread (scheduler.structured_output); an
invalid grammar becomes an ERROR output without ever being scheduled.
"""

from __future__ import annotations

import gc
import time
from typing import Iterable, Protocol, runtime_checkable

from scheduler.config import SchedulerConfig
from scheduler.scheduler import Scheduler
from scheduler.structured_output import GrammarCache, GuidedRequests, error_output
from scheduler.types import (
    EMPTY_RUNNER_OUTPUT,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    RunnerOutput,
    SchedulerOutput,
    SchedulerStats,
)


@runtime_checkable
class ModelRunnerProtocol(Protocol):
    """What the engine core needs from a runner: one forward + sample per
    SchedulerOutput. The runner drops `finished_req_ids` (ignoring unknown
    ids) before adding `scheduled_new_reqs`."""

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput: ...


class RunnerStep(Protocol):
    """A launched runner step; result() waits for its sampled tokens."""

    def result(self) -> RunnerOutput: ...


@runtime_checkable
class AsyncModelRunnerProtocol(ModelRunnerProtocol, Protocol):
    """A runner that can launch a step before the previous step's result is
    collected. execute_async(N) may be called before step N-1's result();
    the input of a decode whose previous token is still in flight comes from
    step N-1's sampled ids on the device. Each step's result() is called
    once, in launch order; execute(so) is execute_async(so).result()."""

    def execute_async(self, scheduler_output: SchedulerOutput) -> RunnerStep: ...


# Allocations between young-generation collections (Python's default: 700).
# A step at 1,024 running requests nets ~2,500 new container objects, so the
# default collects gen 0 several times a step and reaches a full collection
# every ~100 steps.
GC_GEN0_THRESHOLD = 10_000


def freeze_gc_after_startup() -> None:
    """Call once, when the engine is built (model, KV cache, CUDA graphs,
    scheduler): collect, move every object alive now into the collector's
    permanent generation, and collect the young generation less often.

    The full collections that steps trigger then no longer walk the model's
    modules and parameters, the KV block pool and the other start-up objects
    (none of them ever becomes garbage). bench/bench_host_overhead.py at
    1,024 decoding requests on the dev box: step p99 about 100 ms without
    this, 13 ms with the freeze alone, 3.9 ms with the threshold too."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(GC_GEN0_THRESHOLD, gc.get_threshold()[0]), gen1, gen2)


# With only grammar compiles in flight, a step waits this long for one to
# finish instead of spinning (new requests and aborts wait at most as long).
_GRAMMAR_WAIT_S = 0.005


class EngineCore:
    """A scheduler and a runner, stepped together. Token ids only.

    grammar_cache: compiles the grammars of guided requests (the runner side
    builds it around its grammar backend, and reads compiled grammars from
    it); None: guided requests are rejected.
    async_scheduling: keep one step in flight (see the module docstring);
    the runner must offer execute_async.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        runner: ModelRunnerProtocol,
        num_blocks: int,
        grammar_cache: GrammarCache | None = None,
        async_scheduling: bool = False,
    ) -> None:
        if async_scheduling and not isinstance(runner, AsyncModelRunnerProtocol):
            raise ValueError(f"--async-scheduling: the runner {type(runner).__name__} has no execute_async")
        self.scheduler = Scheduler(scheduler_config, num_blocks)
        self.runner = runner
        self.async_scheduling = async_scheduling
        # async scheduling: the step launched last, its result not applied yet
        self._in_flight: tuple[SchedulerOutput, RunnerStep | None] | None = None
        self.guided = GuidedRequests(grammar_cache) if grammar_cache is not None else None
        self._early_outputs: list[EngineCoreOutput] = []  # aborts of held guided requests

    def add_request(self, request: EngineCoreRequest) -> None:
        """Raises ValueError if the scheduler rejects it (see Scheduler.add_request).
        A guided request is checked the same way, then held until its grammar
        is compiled (see step)."""
        if request.sampling_params.structured_output is None:
            if self.guided is not None and request.req_id in self.guided:
                raise ValueError(f"request id {request.req_id!r} is already in use")
            self.scheduler.add_request(request)
            return
        if self.guided is None:
            raise ValueError("structured outputs are not available: this engine has no grammar backend")
        self.scheduler.check_request(request)
        self.guided.add(request)

    def abort_requests(self, req_ids: Iterable[str]) -> None:
        if isinstance(req_ids, str):
            req_ids = (req_ids,)
        if self.guided is not None and len(self.guided):
            req_ids = list(req_ids)
            self._early_outputs.extend(self.guided.abort(req_ids))
        self.scheduler.abort_requests(req_ids)

    def _admit_guided(self) -> list[EngineCoreOutput]:
        """Hand compiled guided requests to the scheduler; ERROR outputs for
        the ones whose grammar failed (or that the scheduler refuses now)."""
        assert self.guided is not None
        if not self.scheduler.has_unfinished_requests():
            self.guided.wait(_GRAMMAR_WAIT_S)  # nothing else to do meanwhile
        ready, outputs = self.guided.pop_ready()
        for request in ready:
            try:
                self.scheduler.add_request(request)
            except ValueError as e:
                outputs.append(error_output(request.req_id, str(e)))
        return outputs

    def step(self) -> EngineCoreOutputs:
        """Run one step. Returns the outputs of every request that produced
        tokens or finished (aborts and grammar errors included), with the
        scheduler's stats."""
        early = self._early_outputs
        self._early_outputs = []
        if self.guided is not None and len(self.guided):
            early.extend(self._admit_guided())
        if self.async_scheduling:
            outputs = self._step_pipelined()
        else:
            scheduler_output = self.scheduler.schedule()
            if scheduler_output.total_num_scheduled_tokens > 0:
                runner_output = self.runner.execute(scheduler_output)
            else:
                runner_output = EMPTY_RUNNER_OUTPUT  # only abort notices come out
            outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if early:
            outputs = early + outputs
        return EngineCoreOutputs(
            outputs=outputs,
            scheduler_stats=self.make_stats(),
            timestamp=time.time(),
        )

    def _step_pipelined(self) -> list[EngineCoreOutput]:
        """Schedule and launch step N, then apply step N-1 (launched by the
        previous call) while N runs. Synchronous (N applied before returning,
        nothing left in flight) when the scheduler cannot schedule ahead or
        nothing was scheduled."""
        scheduler = self.scheduler
        sync = not scheduler.can_schedule_ahead()
        outputs: list[EngineCoreOutput] = []
        if sync and self._in_flight is not None:
            outputs += self._apply_in_flight()  # drain: step N needs N-1's tokens on the host
        scheduler_output = scheduler.schedule()
        handle = None
        if scheduler_output.total_num_scheduled_tokens > 0:
            handle = self.runner.execute_async(scheduler_output)  # type: ignore[attr-defined]
        if self._in_flight is not None:
            outputs += self._apply_in_flight()  # step N-1, while step N runs
        self._in_flight = (scheduler_output, handle)
        if sync or handle is None:
            outputs += self._apply_in_flight()
        return outputs

    def _apply_in_flight(self) -> list[EngineCoreOutput]:
        assert self._in_flight is not None
        scheduler_output, handle = self._in_flight
        self._in_flight = None
        runner_output = handle.result() if handle is not None else EMPTY_RUNNER_OUTPUT
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def has_unfinished_requests(self) -> bool:
        return (
            self._in_flight is not None
            or self.scheduler.has_unfinished_requests()
            or bool(self._early_outputs)
            or (self.guided is not None and len(self.guided) > 0)
        )

    def make_stats(self) -> SchedulerStats:
        stats = self.scheduler.make_stats()
        if self.guided is not None:
            stats.num_waiting_reqs += len(self.guided)  # held for their grammar
        return stats

    def reset_prefix_cache(self) -> None:
        self.scheduler.reset_prefix_cache()


class InprocClient:
    """The engine-core client surface without a process boundary: each call
    goes straight to the wrapped EngineCore. `step()` runs one engine step
    and returns its outputs; callers loop while `has_unfinished_requests()`."""

    def __init__(self, engine_core: EngineCore) -> None:
        self.engine_core = engine_core

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, req_ids: Iterable[str]) -> None:
        self.engine_core.abort_requests(req_ids)

    def step(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def make_stats(self) -> SchedulerStats:
        return self.engine_core.make_stats()

    def reset_prefix_cache(self) -> None:
        self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        """Nothing to stop in process; here for parity with the ZMQ client."""
