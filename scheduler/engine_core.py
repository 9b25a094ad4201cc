"""The engine-core step loop and its in-process client.

    out = scheduler.schedule()
    res = runner.execute(out)           # skipped when nothing is scheduled
    outputs = scheduler.update_from_output(out, res)

The ZMQ engine-core process wraps one `EngineCore` and calls
`add_request` / `abort_requests` between steps, `step()` while
`has_unfinished_requests()`. `InprocClient` gives the same surface inside one
process (offline `LLM` API, tests).
"""

from __future__ import annotations

import time
from typing import Iterable, Protocol, runtime_checkable

from scheduler.config import SchedulerConfig
from scheduler.scheduler import Scheduler
from scheduler.types import (
    EMPTY_RUNNER_OUTPUT,
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


class EngineCore:
    """A scheduler and a runner, stepped together. Token ids only."""

    def __init__(self, scheduler_config: SchedulerConfig, runner: ModelRunnerProtocol, num_blocks: int) -> None:
        self.scheduler = Scheduler(scheduler_config, num_blocks)
        self.runner = runner

    def add_request(self, request: EngineCoreRequest) -> None:
        """Raises ValueError if the scheduler rejects it (see Scheduler.add_request)."""
        self.scheduler.add_request(request)

    def abort_requests(self, req_ids: Iterable[str]) -> None:
        self.scheduler.abort_requests(req_ids)

    def step(self) -> EngineCoreOutputs:
        """Run one step. Returns the outputs of every request that produced
        tokens or finished (aborts included), with the scheduler's stats."""
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.total_num_scheduled_tokens > 0:
            runner_output = self.runner.execute(scheduler_output)
        else:
            runner_output = EMPTY_RUNNER_OUTPUT  # only abort notices come out
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        return EngineCoreOutputs(
            outputs=outputs,
            scheduler_stats=self.scheduler.make_stats(),
            timestamp=time.time(),
        )

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

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
