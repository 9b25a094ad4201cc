"""ModelRunner: runs one SchedulerOutput on one device.

    execute(sched_out) = execute_async(sched_out).result()
    execute_async(sched_out):
        apply the diff to the persistent batch (drop finished, add new,
        extend cached), prepare the flat inputs with numpy, build the
        backend's attention metadata, run the model inside the forward
        context, compute logits at the tokens that sample, sample, reserve
        the sampled tokens' places in the batch, start their copy to the
        host; return the launched step without waiting for the device.
    step.result():
        wait for the sampled ids, write them into the batch, return a
        RunnerOutput.

Async scheduling launches step N before collecting step N-1: a decode whose
input token N-1 sampled reads it from N-1's sampled ids on the device (the
batch holds PLACEHOLDER_TOKEN_ID there until N-1 is collected). Every pinned
host buffer a step copies from is written again only after the previous
step's copies have run (`inputs_copied`); sampled ids come back through two
pinned buffers used in turn. Steps that read tokens on the host (grammar
bitmasks, penalties) are only launched with nothing in flight: the engine
core decides (scheduler.request.reads_tokens_on_host), the runner checks.

The step's requests are in `num_scheduled_tokens` order; request i owns the
flat tokens query_start_loc[i]:query_start_loc[i+1].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from models.forward_context import ForwardContext, forward_context
from runner.attention import AttentionInputs, RunnerAttentionBackend
from runner.input_batch import PLACEHOLDER_TOKEN_ID, CpuGpuBuffer, InputBatch
from runner.sampler import Sampler, SamplingMetadata, make_logprobs
from runner.structured_output import GrammarMatchers
from scheduler.types import EMPTY_RUNNER_OUTPUT, Logprob, RunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from runner.cuda_graph import CudaGraphRunner

# prompt logprobs: compute logits for at most this many positions at once
_PROMPT_LOGITS_CHUNK = 256


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class StepInputs:
    """This step's prepared inputs (device tensors unless suffixed _cpu / numpy)."""

    req_ids: list[str]  # step order
    rows: np.ndarray  # [num_reqs] batch row of each request
    num_scheduled: np.ndarray  # [num_reqs] int32
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn: AttentionInputs
    sample_reqs: np.ndarray  # [num_sampling] indices into req_ids of requests that sample
    logits_indices: torch.Tensor  # [num_sampling] int64, their last flat token


@dataclass(eq=False)
class LaunchedStep:
    """A step on its way: `result()` waits for its sampled ids (once, in launch order)."""

    runner: "ModelRunner | None"  # None: nothing to wait for, `output` is the result
    req_ids: list[str] = field(default_factory=list)  # step order
    sample_reqs: np.ndarray | None = None  # indices into req_ids of the requests that sample
    sample_rows: np.ndarray | None = None  # [num_sampled] their rows at launch
    positions: np.ndarray | None = None  # [num_sampled] where each sampled token goes in its row
    sampled: torch.Tensor | None = None  # [num_sampled] int64, on the device
    batch_version: int = -1  # InputBatch.version at launch
    ring_slot: int = 0  # which pinned buffer / event it uses
    logprobs: list[Logprob | None] | None = None  # one per sampled request
    prompt_logprobs: dict[str, list[Logprob]] | None = None
    guided: bool = False  # some sampled request is guided: advance the matchers
    # requests dropped from the batch since launch (async scheduling): their tokens are not written
    dropped: set[str] = field(default_factory=set)
    output: RunnerOutput | None = None

    def result(self) -> RunnerOutput:
        if self.output is None:
            assert self.runner is not None
            self.output = self.runner._collect(self)
        return self.output


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        backend: RunnerAttentionBackend,
        *,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        device: torch.device,
        eos_token_ids: tuple[int, ...] = (),
        seed: int = 0,
        logprobs_mode: str = "raw",
        grammar_matchers: GrammarMatchers | None = None,
        graph_runner: CudaGraphRunner | None = None,
    ):
        self.model = model
        # guided decoding: one grammar matcher per running guided request
        self.grammar_matchers = grammar_matchers
        # decode-only steps replay its CUDA graphs when it can (see _forward)
        self.graph_runner = graph_runner
        self.kv_caches = kv_caches  # one per layer: [num_blocks, 2, block_size, num_kv_heads, head_dim]
        self.backend = backend
        self.device = device
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_blocks_per_req = cdiv(max_model_len, block_size)

        self.batch = InputBatch(max_num_seqs, max_model_len, self.max_blocks_per_req, device)
        self.sampler = Sampler(eos_token_ids, device, seed=seed, logprobs_mode=logprobs_mode)

        # Step buffers, refilled from the batch every step.
        self.input_ids = CpuGpuBuffer(max_num_batched_tokens, dtype=torch.int64, device=device)
        self.positions = CpuGpuBuffer(max_num_batched_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = CpuGpuBuffer(max_num_batched_tokens, dtype=torch.int64, device=device)
        self.query_start_loc = CpuGpuBuffer(max_num_seqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = CpuGpuBuffer(max_num_seqs, dtype=torch.int32, device=device)
        # flat: a step's [num_reqs, num_cols] table is one contiguous prefix (see _prepare_inputs)
        self.block_table = CpuGpuBuffer(max_num_seqs * self.max_blocks_per_req, dtype=torch.int32, device=device)
        self.logits_indices = CpuGpuBuffer(max_num_seqs, dtype=torch.int64, device=device)
        # decodes whose input token is in flight: flat token index <- index in the previous step's sampled ids
        self.gather_dst = CpuGpuBuffer(max_num_seqs, dtype=torch.int64, device=device)
        self.gather_src = CpuGpuBuffer(max_num_seqs, dtype=torch.int64, device=device)
        self.num_computed_tokens_cpu = torch.zeros(max_num_seqs, dtype=torch.int32)
        self.arange = np.arange(max(max_num_batched_tokens, max_num_seqs) + 1, dtype=np.int64)
        cuda = device.type == "cuda"
        # Recorded once a step's host-to-device input copies are enqueued (before
        # its forward): the next step waits for it before rewriting the pinned buffers.
        self.inputs_copied = torch.cuda.Event() if cuda else None
        # Sampled ids come back through ring slot k's pinned buffer, then step_done[k]
        # fires; two slots: step N+1 launches before step N is collected.
        self.sampled_ids_cpu = [torch.zeros(max_num_seqs, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self.step_done = [torch.cuda.Event() for _ in range(2)] if cuda else None
        self._ring_owner: list[LaunchedStep | None] = [None, None]
        self._next_slot = 0
        # the step launched last, until collected: its sampled ids feed the next step's decodes
        self._in_flight: LaunchedStep | None = None

    # ------------------------------------------------------------------
    def execute(self, sched_out: SchedulerOutput) -> RunnerOutput:
        return self.execute_async(sched_out).result()

    @torch.inference_mode()
    def execute_async(self, sched_out: SchedulerOutput) -> LaunchedStep:
        """Launch one step; see the module docstring. At most one launched
        step may be uncollected when this is called."""
        if self.inputs_copied is not None:
            self.inputs_copied.synchronize()  # the previous step's pinned input buffers are free again
        self._update_batch(sched_out)
        if sched_out.total_num_scheduled_tokens == 0:
            return LaunchedStep(None, output=EMPTY_RUNNER_OUTPUT)

        step = self._prepare_inputs(sched_out.num_scheduled_tokens)
        hidden = self._forward(step)  # [num_tokens, hidden]
        launched = LaunchedStep(self, req_ids=step.req_ids, sample_reqs=step.sample_reqs)

        # guided rows' token bitmasks, filled on the CPU while the device runs the forward
        guided = None
        if self.grammar_matchers:  # some running request is guided
            if self._in_flight is not None:
                raise RuntimeError("guided decoding needs every earlier token on the host: no step may be in flight")
            sample_req_ids = [step.req_ids[i] for i in step.sample_reqs.tolist()]
            guided = self.grammar_matchers.fill_bitmask(sample_req_ids)
            launched.guided = guided is not None

        launched.prompt_logprobs = self._prompt_logprobs(hidden, step)
        sample_rows = step.rows[step.sample_reqs]
        if sample_rows.size:
            logits = self.model.compute_logits(hidden[step.logits_indices])  # [num_sampling, vocab]
            meta = SamplingMetadata.from_batch(self.batch, sample_rows)
            if guided is not None:
                meta.bitmask_rows, meta.token_bitmask = guided
            out = self.sampler(logits, meta)
            launched.sampled = out.sampled_token_ids
            launched.logprobs = out.logprobs
            launched.sample_rows = sample_rows
            launched.positions = self.batch.reserve_tokens(sample_rows)
        launched.batch_version = self.batch.version
        self._start_copy_to_host(launched)
        self._in_flight = launched
        return launched

    def _start_copy_to_host(self, launched: LaunchedStep) -> None:
        """Take a ring slot; on CUDA, copy the sampled ids into its pinned
        buffer and record its event (also when nothing was sampled: the
        event then marks the end of the step's device work)."""
        slot = self._next_slot
        owner = self._ring_owner[slot]
        if owner is not None and owner.output is None:
            raise RuntimeError("a step was launched while two earlier steps were not collected")
        self._ring_owner[slot] = launched
        self._next_slot = 1 - slot
        launched.ring_slot = slot
        if self.step_done is None:
            return
        if launched.sampled is not None:
            n = launched.sampled.shape[0]
            self.sampled_ids_cpu[slot][:n].copy_(launched.sampled, non_blocking=True)
        self.step_done[slot].record()

    def _wait_sampled(self, launched: LaunchedStep) -> list[int]:
        """The step's sampled ids on the host; on CUDA this waits for the step's device work."""
        if self.step_done is None:
            return [] if launched.sampled is None else launched.sampled.tolist()
        self.step_done[launched.ring_slot].synchronize()
        n = 0 if launched.sampled is None else launched.sampled.shape[0]
        return self.sampled_ids_cpu[launched.ring_slot][:n].tolist()

    def _collect(self, launched: LaunchedStep) -> RunnerOutput:
        """LaunchedStep.result(): the sampled ids into the batch (where their
        requests still are) and the matchers, then the RunnerOutput."""
        if self._in_flight is launched:
            self._in_flight = None
        sampled = self._wait_sampled(launched)
        req_ids, sample_reqs = launched.req_ids, launched.sample_reqs
        if sampled:
            self._fill_sampled(launched, sampled)
            if launched.guided:
                self.grammar_matchers.accept([req_ids[i] for i in sample_reqs.tolist()], sampled)

        logprobs = launched.logprobs
        if len(sampled) == len(req_ids):  # every request samples (decode steps)
            sampled_token_ids = [[token_id] for token_id in sampled]
        else:
            sampled_token_ids = [[] for _ in req_ids]
            for i, token_id in zip(sample_reqs.tolist(), sampled):
                sampled_token_ids[i] = [token_id]
            if logprobs is not None:
                logprobs = [None] * len(req_ids)
                for i, lp in zip(sample_reqs.tolist(), launched.logprobs):
                    logprobs[i] = lp
        return RunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=sampled_token_ids,
            logprobs=logprobs,
            prompt_logprobs=launched.prompt_logprobs,
        )

    def _fill_sampled(self, launched: LaunchedStep, sampled: list[int]) -> None:
        batch = self.batch
        rows, positions = launched.sample_rows, launched.positions
        tokens = np.array(sampled, dtype=np.int32)
        if batch.version != launched.batch_version:
            # rows moved or requests left since launch (the next step was launched): find them by id
            ids = [launched.req_ids[i] for i in launched.sample_reqs.tolist()]
            keep = [k for k, req_id in enumerate(ids) if req_id not in launched.dropped]
            rows = np.fromiter((batch.req_id_to_row[ids[k]] for k in keep), dtype=np.int64, count=len(keep))
            positions, tokens = positions[keep], tokens[keep]
        batch.fill_tokens(rows, positions, tokens)

    def _forward(self, step: StepInputs) -> torch.Tensor:
        """The one place that picks CUDA-graph replay (decode-only steps that
        fit a captured batch size) or an eager forward. `inputs_copied` is
        recorded after the step's last host-to-device copy, before its kernels."""
        if self.graph_runner is not None and self.graph_runner.can_replay(step.attn):
            size = self.graph_runner.prepare(step.input_ids, step.positions, step.attn)
            self._mark_inputs_copied()
            return self.graph_runner.launch(size, step.attn.num_reqs)
        meta = self.backend.build_metadata(step.attn)
        self._mark_inputs_copied()
        with forward_context(ForwardContext(self.backend, meta, self.kv_caches)):
            return self.model(step.input_ids, step.positions)

    def _mark_inputs_copied(self) -> None:
        if self.inputs_copied is not None:
            self.inputs_copied.record()

    # ------------------------------------------------------------------
    def _update_batch(self, sched_out: SchedulerOutput) -> None:
        batch = self.batch
        grammar_matchers = self.grammar_matchers
        in_flight = self._in_flight
        for req_id in sched_out.finished_req_ids:
            batch.remove_request(req_id)  # unknown ids are ignored
            if grammar_matchers is not None:
                grammar_matchers.remove_request(req_id)
            if in_flight is not None:
                in_flight.dropped.add(req_id)  # its token in flight is not written into the batch
        for req in sched_out.scheduled_new_reqs:
            batch.add_request(req)
            if grammar_matchers is not None:
                grammar_matchers.add_request(req)  # a resumed request replays its outputs
        cached = sched_out.scheduled_cached_reqs
        batch.update_requests(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens)
        batch.condense()

    def _prepare_inputs(self, num_scheduled_tokens: dict[str, int]) -> StepInputs:
        batch = self.batch
        req_ids = list(num_scheduled_tokens)
        num_reqs = len(req_ids)
        rows = np.fromiter(map(batch.req_id_to_row.__getitem__, req_ids), dtype=np.int64, count=num_reqs)
        num_scheduled = np.fromiter(num_scheduled_tokens.values(), dtype=np.int64, count=num_reqs)
        # num_scheduled=[2, 3] -> cu_num_scheduled=[2, 5], num_tokens=5
        cu_num_scheduled = np.cumsum(num_scheduled)
        num_tokens = int(cu_num_scheduled[-1])
        if num_tokens > self.max_num_batched_tokens:
            raise ValueError(f"{num_tokens} tokens scheduled, more than max_num_batched_tokens={self.max_num_batched_tokens}")

        # num_scheduled=[2, 3] -> req_indices=[0, 0, 1, 1, 1], offsets=[0, 1, 0, 1, 2]
        req_indices = np.repeat(self.arange[:num_reqs], num_scheduled)
        offsets = self.arange[:num_tokens] - np.repeat(cu_num_scheduled - num_scheduled, num_scheduled)
        num_computed = batch.num_computed_tokens[rows].astype(np.int64)
        seq_lens = num_computed + num_scheduled
        if (seq_lens > batch.num_tokens[rows]).any():
            bad = req_ids[int(np.argmax(seq_lens > batch.num_tokens[rows]))]
            raise ValueError(f"request {bad!r} is scheduled past the tokens the runner holds for it")

        # num_computed=[5, 0] -> positions=[5, 6, 0, 1, 2]
        positions = self.positions.np[:num_tokens]
        np.add(num_computed[req_indices], offsets, out=positions)
        token_rows = rows[req_indices]
        input_ids_np = self.input_ids.np[:num_tokens]
        input_ids_np[:] = batch.token_ids[token_rows, positions]
        # tokens sampled by the step in flight (async scheduling): only on the device
        in_flight = np.flatnonzero(input_ids_np == PLACEHOLDER_TOKEN_ID)
        # slot = block_table[pos // block_size] * block_size + pos % block_size
        # block_size=4, blocks=[7, 2], pos=5 -> 2 * 4 + 1 = 9
        bs = self.block_size
        block_ids = batch.block_table.table[token_rows, positions // bs]
        np.add(block_ids * bs, positions % bs, out=self.slot_mapping.np[:num_tokens])

        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[1 : num_reqs + 1] = cu_num_scheduled
        self.seq_lens.np[:num_reqs] = seq_lens
        self.num_computed_tokens_cpu.numpy()[:num_reqs] = num_computed
        # Only the columns the step reads, i.e. the longest request's blocks
        # (the table is max_model_len / block_size wide: 8 MiB at 256 x 131,072):
        # seq_lens=[33, 5], block_size=16 -> num_cols=3, block_table [2, 3]
        max_seq_len = int(seq_lens.max())
        num_cols = min(cdiv(max_seq_len, bs), self.max_blocks_per_req)
        num_entries = num_reqs * num_cols
        np.take(
            batch.block_table.table[:, :num_cols],
            rows,
            axis=0,
            out=self.block_table.np[:num_entries].reshape(num_reqs, num_cols),
        )

        # A request samples iff this step reaches its last token (partial
        # prefill chunks do not): logits at its last flat token.
        sample_reqs = np.flatnonzero(seq_lens == batch.num_tokens[rows])
        num_sampling = sample_reqs.size
        np.subtract(cu_num_scheduled[sample_reqs], 1, out=self.logits_indices.np[:num_sampling])
        logits_indices = self.logits_indices.copy_to_gpu(num_sampling)
        input_ids = self.input_ids.copy_to_gpu(num_tokens)
        if in_flight.size:
            self._gather_in_flight(input_ids, in_flight, batch.in_flight_index[token_rows[in_flight]])

        attn = AttentionInputs(
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            max_query_len=int(num_scheduled.max()),
            max_seq_len=max_seq_len,
            block_size=bs,
            query_start_loc_cpu=self.query_start_loc.cpu[: num_reqs + 1],
            seq_lens_cpu=self.seq_lens.cpu[:num_reqs],
            num_computed_tokens_cpu=self.num_computed_tokens_cpu[:num_reqs],
            block_table_cpu=self.block_table.cpu[:num_entries].view(num_reqs, num_cols),
            query_start_loc=self.query_start_loc.copy_to_gpu(num_reqs + 1),
            seq_lens=self.seq_lens.copy_to_gpu(num_reqs),
            block_table=self.block_table.copy_to_gpu(num_entries).view(num_reqs, num_cols),
            slot_mapping=self.slot_mapping.copy_to_gpu(num_tokens),
        )
        return StepInputs(
            req_ids=req_ids,
            rows=rows,
            num_scheduled=num_scheduled,
            input_ids=input_ids,
            positions=self.positions.copy_to_gpu(num_tokens),
            attn=attn,
            sample_reqs=sample_reqs,
            logits_indices=logits_indices,
        )

    def _gather_in_flight(self, input_ids: torch.Tensor, flat: np.ndarray, src: np.ndarray) -> None:
        """input_ids[flat[i]] = (the step in flight's sampled ids)[src[i]], on the device.
        flat=[0, 2], src=[1, 0], in-flight sampled ids [7, 9] -> input_ids [9, x, 7, ...]"""
        in_flight = self._in_flight
        if in_flight is None or in_flight.sampled is None:
            raise RuntimeError("an input token is neither on the host nor sampled by the step in flight")
        n = flat.size
        self.gather_dst.np[:n] = flat
        self.gather_src.np[:n] = src
        dst = self.gather_dst.copy_to_gpu(n)
        input_ids.index_copy_(0, dst, in_flight.sampled.index_select(0, self.gather_src.copy_to_gpu(n)))

    def _prompt_logprobs(self, hidden: torch.Tensor, step: StepInputs) -> dict[str, list[Logprob]] | None:
        """Logprobs of the prompt tokens this step's chunks predict, from the
        model's raw logits: the token at position p is scored by the logits at
        p - 1, so a chunk over positions [c, c + n) scores prompt tokens
        c + 1 .. min(c + n, num_prompt - 1). Accumulated in the batch; handed
        out in the step that finishes the prefill."""
        batch = self.batch
        if not batch.prompt_logprobs:
            return None
        done: dict[str, list[Logprob]] = {}
        qsl = self.query_start_loc.np
        sampling = set(step.sample_reqs.tolist())
        for i, req_id in enumerate(step.req_ids):
            acc = batch.prompt_logprobs.get(req_id)
            if acc is None:
                continue
            row = int(step.rows[i])
            start_pos = int(batch.num_computed_tokens[row])
            num_prompt = int(batch.num_prompt_tokens[row])
            end_target = min(start_pos + int(step.num_scheduled[i]), num_prompt - 1)  # last scored position
            num_top = int(batch.sampling.num_prompt_logprobs[row])
            for lo in range(start_pos + 1, end_target + 1, _PROMPT_LOGITS_CHUNK):
                hi = min(lo + _PROMPT_LOGITS_CHUNK, end_target + 1)  # targets lo..hi-1
                flat = torch.arange(hi - lo, device=hidden.device) + int(qsl[i]) + (lo - 1 - start_pos)
                lp = torch.log_softmax(self.model.compute_logits(hidden[flat]).float(), dim=-1)
                targets = torch.from_numpy(batch.token_ids[row, lo:hi].astype(np.int64)).to(lp.device)
                acc.extend(make_logprobs(lp, targets, [num_top] * (hi - lo)))
            if i in sampling:
                done[req_id] = batch.prompt_logprobs.pop(req_id)
        return done or None
