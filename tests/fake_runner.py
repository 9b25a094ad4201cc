"""A deterministic fake model runner for scheduler and engine tests (no torch).

It behaves like a real runner where the scheduler can tell:
- it keeps a persistent batch (req_id -> token ids, block table, computed count)
  updated only from the SchedulerOutput diff, and checks the diff is coherent
  (cached requests' num_computed_tokens match what it computed, a token is
  never computed twice in one life of a request);
- it has a paged "KV cache" `kv[num_blocks, block_size]` holding the token id
  each slot was computed for. Computing positions [start, end) first checks
  that every earlier position of the request reads back its own token through
  the block table (so a wrong prefix-cache hit or a freed-too-early block is
  caught), then writes its slots, refusing to write into a block that another
  live request also maps;
- the sampled token is a pure function of the context read back from the KV
  cache: `next_token(context)`. So outputs do not depend on batching,
  chunking, preemption or caching, and `reference_generate` gives the tokens
  a request must produce when run alone.
A partial prefill chunk samples nothing (empty token list).

`execute_async(so)` (async scheduling) computes the step at once and returns
a handle whose `result()` gives its RunnerOutput; it checks that results are
collected once each, in launch order, and counts how many steps were in
flight at once (`max_in_flight`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from scheduler.request import reads_tokens_on_host

from scheduler.types import (
    EngineCoreRequest,
    Logprob,
    RunnerOutput,
    SamplingParams,
    SchedulerOutput,
)


def next_token(context: Sequence[int], vocab_size: int) -> int:
    """The fake model: deterministic in the whole context."""
    return hash(tuple(context)) % vocab_size


def reference_generate(prompt: Sequence[int], num_tokens: int, vocab_size: int) -> list[int]:
    """What a request generates alone, ignoring stops: the oracle for tests."""
    tokens = list(prompt)
    out = []
    for _ in range(num_tokens):
        tok = next_token(tokens, vocab_size)
        out.append(tok)
        tokens.append(tok)
    return out


def make_request(req_id: str, prompt: Sequence[int], eos_token_id: int | None = None, **sampling) -> EngineCoreRequest:
    sampling.setdefault("temperature", 0.0)
    return EngineCoreRequest(
        req_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(**sampling),
        eos_token_id=eos_token_id,
    )


class _ReqState:
    __slots__ = ("tokens", "block_ids", "num_computed", "sampling_params", "num_outputs")

    def __init__(self, tokens, block_ids, num_computed, sampling_params, num_outputs):
        self.tokens = tokens
        self.block_ids = block_ids
        self.num_computed = num_computed
        self.sampling_params = sampling_params
        self.num_outputs = num_outputs


class FakeRunner:
    """See the module docstring.

    script: req_id -> forced tokens; the k-th token a request samples is
        script[req_id][k] when given (to hit EOS / stop tokens on purpose).
    Records for tests:
        computed[req_id]: every position computed, in order, over all the
            request's lives (a position listed twice was recomputed);
        history: every SchedulerOutput executed.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        vocab_size: int = 1000,
        script: dict[str, list[int]] | None = None,
        check_kv: bool = True,
    ) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.script = script or {}
        self.check_kv = check_kv
        self.kv = np.full((num_blocks, block_size), -1, dtype=np.int64)
        self.reqs: dict[str, _ReqState] = {}
        self.block_users: dict[int, set[str]] = {}
        self.computed: dict[str, list[int]] = {}
        self.history: list[SchedulerOutput] = []
        self._launched: list[_FakeStep] = []  # steps whose result() is not collected yet
        self.max_in_flight = 0

    # ------------------------------------------------------------------ batch

    def _map_blocks(self, req_id: str, block_ids: list[int]) -> None:
        for b in block_ids:
            self.block_users.setdefault(b, set()).add(req_id)

    def _drop(self, req_id: str) -> None:
        st = self.reqs.pop(req_id, None)
        if st is None:
            return
        for b in st.block_ids:
            self.block_users[b].discard(req_id)

    def _update_batch(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self._drop(req_id)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.reqs, f"{new.req_id} added twice without being dropped"
            tokens = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.reqs[new.req_id] = _ReqState(
                tokens, list(new.block_ids), new.num_computed_tokens, new.sampling_params, len(new.output_token_ids)
            )
            self._map_blocks(new.req_id, new.block_ids)
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            st = self.reqs[req_id]
            assert st.num_computed == num_computed, (
                f"{req_id}: scheduler says {num_computed} computed, runner computed {st.num_computed}"
            )
            st.block_ids.extend(new_blocks)
            self._map_blocks(req_id, new_blocks)

    # ------------------------------------------------------------------ compute

    def _read_kv(self, st: _ReqState, end: int) -> list[int]:
        pos = np.arange(end)
        table = np.asarray(st.block_ids, dtype=np.int64)
        return self.kv[table[pos // self.block_size], pos % self.block_size].tolist()

    def _compute(self, req_id: str, st: _ReqState, start: int, end: int) -> list[int]:
        bs = self.block_size
        assert 0 < end <= len(st.tokens), f"{req_id}: scheduled up to {end}, has {len(st.tokens)} tokens"
        assert len(st.block_ids) * bs >= end, f"{req_id}: {len(st.block_ids)} blocks for {end} tokens"
        if self.check_kv and start:
            seen = self._read_kv(st, start)
            assert seen == st.tokens[:start], f"{req_id}: KV of positions < {start} is wrong"
        for p in range(start, end):
            b = st.block_ids[p // bs]
            users = self.block_users[b]
            assert users == {req_id}, f"{req_id} writes block {b} also mapped by {users - {req_id}}"
            self.kv[b, p % bs] = st.tokens[p]
        self.computed.setdefault(req_id, []).extend(range(start, end))
        st.num_computed = end
        return self._read_kv(st, end)

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        self.history.append(so)
        self._update_batch(so)
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        logprobs: list[Logprob | None] = []
        prompt_logprobs: dict[str, list[Logprob]] = {}
        for req_id, n in so.num_scheduled_tokens.items():
            st = self.reqs[req_id]
            context = self._compute(req_id, st, st.num_computed, st.num_computed + n)
            req_ids.append(req_id)
            if len(context) < len(st.tokens):
                sampled.append([])  # partial prefill
                logprobs.append(None)
                continue
            forced = self.script.get(req_id)
            if forced is not None and st.num_outputs < len(forced):
                tok = forced[st.num_outputs]
            else:
                tok = next_token(context, self.vocab_size)
            sp = st.sampling_params
            if sp.prompt_logprobs is not None and st.num_outputs == 0:
                prompt_logprobs[req_id] = [
                    Logprob(token_ids=[t], logprobs=[-1.0], rank=1) for t in st.tokens[1:]
                ]
            logprobs.append(
                None
                if sp.logprobs is None
                else Logprob(token_ids=[tok] + list(range(sp.logprobs)), logprobs=[-0.5] * (sp.logprobs + 1), rank=1)
            )
            st.tokens.append(tok)
            st.num_outputs += 1
            sampled.append([tok])
        return RunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs or None,
        )


    def execute_async(self, so: SchedulerOutput) -> "_FakeStep":
        step = _FakeStep(self, self.execute(so))
        if self._launched:  # launched ahead: no request in the batch may read its tokens on the host
            reads = [r for r, st in self.reqs.items() if reads_tokens_on_host(st.sampling_params)]
            assert not reads, f"{reads} read their tokens on the host, yet a step was launched ahead"
        self._launched.append(step)
        self.max_in_flight = max(self.max_in_flight, len(self._launched))
        assert len(self._launched) <= 2, "more than one step launched ahead"
        return step


class _FakeStep:
    def __init__(self, runner: FakeRunner, output: RunnerOutput) -> None:
        self.runner = runner
        self.output = output

    def result(self) -> RunnerOutput:
        launched = self.runner._launched
        assert launched and launched[0] is self, "results collected out of launch order, or twice"
        launched.pop(0)
        return self.output


# ---------------------------------------------------------------------- drivers


def step_scheduler(scheduler, runner: FakeRunner):
    """One engine step on a bare Scheduler: (SchedulerOutput, outputs).
    Like EngineCore.step, the runner is skipped when nothing is scheduled."""
    from scheduler.types import EMPTY_RUNNER_OUTPUT

    so = scheduler.schedule()
    ro = runner.execute(so) if so.total_num_scheduled_tokens else EMPTY_RUNNER_OUTPUT
    return so, scheduler.update_from_output(so, ro)


class Collected:
    """Outputs gathered per request: tokens, finish_reason, stop_reason, all outputs."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, object] = {}
        self.stop_reason: dict[str, int | None] = {}
        self.outputs: dict[str, list] = {}

    def add(self, outputs) -> None:
        for out in outputs:
            assert out.req_id not in self.finish, f"{out.req_id}: output after it finished"
            self.tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
            self.outputs.setdefault(out.req_id, []).append(out)
            if out.finish_reason is not None:
                self.finish[out.req_id] = out.finish_reason
                self.stop_reason[out.req_id] = out.stop_reason


def run_until_done(scheduler, runner: FakeRunner, max_steps: int = 10_000, collected: Collected | None = None) -> Collected:
    collected = collected or Collected()
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return collected
        collected.add(step_scheduler(scheduler, runner)[1])
    raise AssertionError(f"requests still unfinished after {max_steps} steps: {list(scheduler.requests)}")
