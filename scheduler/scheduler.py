"""The phase-free scheduler: a token budget per step, no prefill/decode phases.

Each `schedule()`:
  1. running requests, oldest first, get their next tokens: 1 for a decode,
     the rest of the prompt (capped by the remaining budget) for a prefill.
     A request that cannot get a KV block preempts the NEWEST running request
     (itself if it is the newest) until it can.
  2. unless something was preempted this step, waiting requests (preempted
     ones sit at the front) are admitted FIFO while max_num_seqs and the
     token budget allow, their prompt looked up in the prefix cache first and
     the rest chunked to the budget.
  3. `num_computed_tokens` is advanced right away, so a token is never
     scheduled twice.

Example, max_num_batched_tokens=8, running=[A decoding], waiting=[B 20-token prompt]:
    step 1: A 1 token, B tokens 0..6 (7)      -> A samples, B does not
    step 2: A 1 token, B tokens 7..13 (7)
    step 3: A 1 token, B tokens 14..19 (6)    -> both sample

`update_from_output()` appends the sampled tokens, checks stops, registers
newly computed full blocks in the prefix cache, frees finished requests and
returns one `EngineCoreOutput` per request that produced something (plus one
per abort since the last update).

Async scheduling (EngineCore with async_scheduling=True) calls schedule() for
step N before update_from_output() of step N-1: each schedule() is paired
with one update_from_output(), in order. A request sampling in step N-1 holds
a placeholder for its unknown token (`Request.num_output_placeholders`), so
step N schedules its next decode anyway:
    schedule(N-1): A computes position 9, samples   -> placeholders=1
    schedule(N):   A computes position 10 (the unknown token's), samples -> 2
    update(N-1):   A's token #10 appended           -> placeholders=1
If update(N-1) finishes A (EOS, stop token), the token step N samples for it
is dropped by update(N); a request whose in-flight token is its max_tokens-th
is not scheduled again. Blocks are registered in the prefix cache only up to
what each step computed, when that step's update runs.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Iterable, NamedTuple

from scheduler.block_manager import BlockManager
from scheduler.config import SchedulerConfig
from scheduler.request import Request, RequestStatus
from scheduler.types import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    NewRequestData,
    RunnerOutput,
    SchedulerOutput,
    SchedulerStats,
)

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED
_FINISHED = RequestStatus.FINISHED_STOPPED  # this status and the ones above


class _ScheduledStep(NamedTuple):
    """What update_from_output needs from its schedule().

    sampling: the requests that sample in the step, by id; a sampled token is
    applied to this very Request (never to a later request reusing the id).
    to_cache: (request, num_computed_tokens after the step) for requests
    whose step fills a block, registered once the step has run.
    """

    output: SchedulerOutput
    sampling: dict[str, Request]
    to_cache: list[tuple[Request, int]]


class Scheduler:
    """Owns every live request and the block manager. Not thread-safe: the
    engine-core loop calls add/abort between steps.

    The effective max_model_len is min(config.max_model_len, KV capacity),
    so that any single admitted request can always run to its end alone.
    The effective max_num_seqs is capped at max_num_batched_tokens, so that
    every running decode fits in each step's budget.
    """

    def __init__(self, config: SchedulerConfig, num_blocks: int) -> None:
        self.config = config
        self.block_size = config.block_size
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.kv_capacity_tokens = num_blocks * config.block_size
        self.max_model_len = min(config.max_model_len, self.kv_capacity_tokens)
        self.max_num_seqs = min(config.max_num_seqs, config.max_num_batched_tokens)
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.chunked_prefill = config.enable_chunked_prefill

        self.requests: dict[str, Request] = {}  # every live (unfinished) request
        self.waiting: deque[Request] = deque()  # WAITING and PREEMPTED, FIFO
        self.running: list[Request] = []  # admission order: newest last
        # ids the runner holds and must drop before the next step
        self.finished_req_ids: set[str] = set()
        self._pending_outputs: list[EngineCoreOutput] = []  # abort notices
        # scheduled steps not yet updated, oldest first (2 at most, with async scheduling)
        self._steps: deque[_ScheduledStep] = deque()
        self.num_preemptions_total = 0
        # live requests for which reads_tokens_on_host() holds
        self.num_host_token_reqs = 0

    # ------------------------------------------------------------------ requests

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request. Raises ValueError for a duplicate id, an empty
        prompt, or a prompt longer than max_model_len / the KV cache."""
        self.check_request(request)
        req = Request.from_engine_core_request(request, self.max_model_len)
        self.requests[req.req_id] = req
        self.waiting.append(req)
        self.num_host_token_reqs += req.reads_tokens_on_host

    def check_request(self, request: EngineCoreRequest) -> None:
        """Raise the ValueError add_request would raise, without queueing it."""
        if request.req_id in self.requests:
            raise ValueError(f"request id {request.req_id!r} is already in use")
        num_prompt = len(request.prompt_token_ids)
        if num_prompt == 0:
            raise ValueError(f"request {request.req_id!r}: the prompt is empty")
        if num_prompt > self.max_model_len:
            if num_prompt > self.config.max_model_len:
                why = f"max_model_len ({self.config.max_model_len})"
            else:
                why = f"the KV cache capacity ({self.kv_capacity_tokens} tokens)"
            raise ValueError(
                f"request {request.req_id!r}: the prompt has {num_prompt} tokens, "
                f"more than {why}"
            )

    def abort_requests(self, req_ids: Iterable[str]) -> None:
        """Finish the given requests now, wherever they are, freeing their
        blocks. Unknown or already finished ids are ignored. Each aborted
        request yields one ABORT output from the next update_from_output."""
        if isinstance(req_ids, str):
            req_ids = (req_ids,)
        left_running = left_waiting = False
        for req_id in req_ids:
            req = self.requests.pop(req_id, None)
            if req is None:
                continue
            self.num_host_token_reqs -= req.reads_tokens_on_host
            if req.status == _RUNNING:
                left_running = True
                self.finished_req_ids.add(req_id)
            else:
                left_waiting = True
            self.block_manager.free(req)
            req.status = RequestStatus.FINISHED_ABORTED
            self._pending_outputs.append(
                EngineCoreOutput(
                    req_id=req_id,
                    new_token_ids=[],
                    finish_reason=FinishReason.ABORT,
                    num_cached_tokens=req.num_cached_tokens,
                    first_scheduled_time=req.first_scheduled_time if not req.output_token_ids else None,
                )
            )
        if left_running:
            self.running = [r for r in self.running if r.status == _RUNNING]
        if left_waiting:
            self.waiting = deque(r for r in self.waiting if not r.is_finished)

    def has_unfinished_requests(self) -> bool:
        """True while requests are live or abort notices wait to be sent."""
        return bool(self.requests) or bool(self._pending_outputs)

    def can_schedule_ahead(self) -> bool:
        """Whether the next step may be scheduled while the previous one's
        sampled tokens are unknown: not while any live request reads its
        tokens on the host (see request.reads_tokens_on_host)."""
        return self.num_host_token_reqs == 0

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()

    # ------------------------------------------------------------------ schedule

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.finished_req_ids.add(req.req_id)
        self.waiting.appendleft(req)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens; see the module docstring.

        If nothing is scheduled, `finished_req_ids` is reported but also kept
        for the next step (the engine core does not call the runner for an
        empty step), so runners must ignore ids they do not hold.
        """
        budget = self.max_num_batched_tokens
        block_manager = self.block_manager
        num_scheduled: dict[str, int] = {}
        to_cache: list[tuple[Request, int]] = []
        sampling: dict[str, Request] = {}
        caching = self.block_manager.enable_caching
        cached_ids: list[str] = []
        cached_new_blocks: list[list[int]] = []
        cached_computed: list[int] = []
        new_reqs: list[NewRequestData] = []
        preempted = False

        # 1. running requests, oldest first
        bs = self.block_size
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            i += 1
            num_computed = req.num_computed_tokens
            placeholders = req.num_output_placeholders
            if placeholders and len(req.output_token_ids) + placeholders >= req.max_output_tokens:
                continue  # its token in flight is its last (max_tokens / max_model_len)
            num_tokens = len(req.all_token_ids) + placeholders
            num_new = num_tokens - num_computed
            if num_new > budget:
                if not self.chunked_prefill:
                    continue
                num_new = budget
            elif num_new <= 0:  # the runner returned no token for its last step
                continue
            if num_computed + num_new <= len(req.block_ids) * bs:
                new_blocks = []  # fits in the blocks it holds: most decodes
            else:
                while (new_blocks := block_manager.allocate_slots(req, num_new)) is None:
                    victim = running.pop()  # the newest; never one scheduled above
                    self._preempt(victim)
                    preempted = True
                    if victim is req:
                        break
                if new_blocks is None:
                    break  # req preempted itself: it was the newest running request
            req_id = req.req_id
            cached_ids.append(req_id)
            cached_new_blocks.append(new_blocks)
            cached_computed.append(num_computed)
            num_scheduled[req_id] = num_new
            num_computed += num_new
            req.num_computed_tokens = num_computed
            if num_computed == num_tokens:
                req.num_output_placeholders = placeholders + 1
                sampling[req_id] = req
            if caching and num_computed // bs > req.num_hashed_blocks:
                to_cache.append((req, num_computed))
            budget -= num_new

        # 2. admit waiting requests, FIFO
        if not preempted:
            waiting = self.waiting
            now = None
            while waiting and budget > 0 and len(running) < self.max_num_seqs:
                req = waiting[0]
                assert not req.num_output_placeholders, "a waiting request with a token in flight"
                if req.sampling_params.prompt_logprobs is None:
                    computed_blocks, num_computed = block_manager.get_computed_blocks(req)
                else:  # prompt logprobs need logits at every prompt position: compute them all
                    computed_blocks, num_computed = [], 0
                num_new = len(req.all_token_ids) - num_computed
                if num_new > budget:
                    if not self.chunked_prefill:
                        break
                    num_new = budget
                if block_manager.allocate_slots(req, num_new, computed_blocks) is None:
                    break  # head of line waits for blocks
                waiting.popleft()
                if req.first_scheduled_time is None:
                    now = now or time.time()
                    req.first_scheduled_time = now
                    req.num_cached_tokens = num_computed
                req.status = _RUNNING
                req.num_computed_tokens = num_computed + num_new
                running.append(req)
                if req.num_computed_tokens == len(req.all_token_ids):
                    req.num_output_placeholders = 1
                    sampling[req.req_id] = req
                if caching and req.num_computed_tokens // bs > req.num_hashed_blocks:
                    to_cache.append((req, req.num_computed_tokens))
                num_scheduled[req.req_id] = num_new
                new_reqs.append(
                    NewRequestData(
                        req_id=req.req_id,
                        prompt_token_ids=req.prompt_token_ids,
                        output_token_ids=list(req.output_token_ids),
                        sampling_params=req.sampling_params,
                        block_ids=list(req.block_ids),
                        num_computed_tokens=num_computed,
                        eos_token_id=req.eos_token_id,
                    )
                )
                budget -= num_new

        total = self.max_num_batched_tokens - budget
        finished = self.finished_req_ids
        if total:
            self.finished_req_ids = set()
        else:
            finished = set(finished)
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=CachedRequestData(cached_ids, cached_new_blocks, cached_computed),
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total,
            finished_req_ids=finished,
        )
        self._steps.append(_ScheduledStep(output, sampling, to_cache))
        return output

    # ------------------------------------------------------------------ update

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply one step's sampled tokens; see the module docstring.

        Stops are checked per token, in this order: stop_token_ids (STOP,
        stop_reason=token), EOS unless ignore_eos (STOP), max_tokens
        (LENGTH), max_model_len (LENGTH). A stop token or EOS only counts
        once at least min_tokens tokens precede it (as the sampler masks them
        for the first min_tokens positions).

        `scheduler_output` must be the oldest scheduled step not yet updated.
        """
        if not self._steps or self._steps[0].output is not scheduler_output:
            raise RuntimeError("update_from_output() must follow schedule() in order, once per step")
        step = self._steps.popleft()
        outputs = self._pending_outputs
        self._pending_outputs = []
        block_manager = self.block_manager

        # Register the blocks this step filled, before any of them is freed.
        for req, num_computed in step.to_cache:
            if req.status == _RUNNING:
                block_manager.cache_full_blocks(req, num_computed)
        sampling = step.sampling
        num_sampled = 0

        requests = self.requests
        sampled = runner_output.sampled_token_ids
        logprobs = runner_output.logprobs
        prompt_logprobs = runner_output.prompt_logprobs
        check_stop = self._check_stop
        any_finished = False
        for i, req_id in enumerate(runner_output.req_ids):
            new_token_ids = sampled[i]
            if not new_token_ids:
                continue  # partial prefill chunk
            req = sampling.get(req_id)
            if req is None:
                continue
            req.num_output_placeholders -= 1
            num_sampled += 1
            status = req.status
            if status >= _FINISHED:
                continue  # aborted, or finished by the step before (async scheduling): dropped
            # PREEMPTED: async scheduling preempted it while this token was in flight
            output_token_ids = req.output_token_ids
            first = not output_token_ids
            if len(new_token_ids) == 1:  # the common case, inlined
                token_id = new_token_ids[0]
                output_token_ids.append(token_id)
                req.all_token_ids.append(token_id)
                # cheap superset of the stop conditions, then the exact check
                finished = (
                    len(output_token_ids) >= req.max_output_tokens
                    or token_id == req.eos_token_id
                    or token_id in req.stop_token_ids
                ) and check_stop(req, token_id)
            else:
                finished = False
                for n, token_id in enumerate(new_token_ids):
                    req.append_output_token(token_id)
                    if check_stop(req, token_id):
                        finished = True
                        new_token_ids = new_token_ids[: n + 1]
                        break
            out = EngineCoreOutput(req_id, new_token_ids, num_cached_tokens=req.num_cached_tokens)
            if logprobs is not None and logprobs[i] is not None:
                out.new_logprobs = [logprobs[i]]
            if first:
                out.first_scheduled_time = req.first_scheduled_time
                if prompt_logprobs is not None and req_id in prompt_logprobs:
                    out.prompt_logprobs = prompt_logprobs[req_id]
            if finished:
                out.finish_reason = req.finish_reason
                out.stop_reason = req.stop_reason
                block_manager.free(req)
                del requests[req_id]
                self.num_host_token_reqs -= req.reads_tokens_on_host
                self.finished_req_ids.add(req_id)
                if status == _PREEMPTED:
                    self.waiting.remove(req)
                any_finished = True
            outputs.append(out)

        if num_sampled != len(sampling):  # the runner returned no token for some: none is in flight now
            got = {req_id for req_id, tokens in zip(runner_output.req_ids, sampled) if tokens}
            for req_id, req in sampling.items():
                if req_id not in got:
                    req.num_output_placeholders -= 1
        if any_finished:
            self.running = [r for r in self.running if r.status == _RUNNING]
        return outputs

    @staticmethod
    def _check_stop(req: Request, token_id: int) -> bool:
        """Sets req.status (and stop_reason) and returns True if `token_id`,
        just appended, ends the request."""
        num_out = len(req.output_token_ids)
        if num_out > req.sampling_params.min_tokens:
            if token_id in req.stop_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = token_id
                return True
            if token_id == req.eos_token_id and not req.sampling_params.ignore_eos:
                req.status = RequestStatus.FINISHED_STOPPED
                return True
        if num_out >= req.max_output_tokens:  # max_tokens, or max_model_len reached
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    # ------------------------------------------------------------------ stats

    def make_stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=bm.usage,
            num_preemptions_total=self.num_preemptions_total,
            prefix_cache_queries_total=bm.prefix_cache_queries_total,
            prefix_cache_hits_total=bm.prefix_cache_hits_total,
            num_blocks_total=bm.num_blocks,
        )
