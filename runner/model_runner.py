"""ModelRunner: runs one SchedulerOutput on one device.

    execute(sched_out):
        apply the diff to the persistent batch (drop finished, add new,
        extend cached), prepare the flat inputs with numpy, build the
        backend's attention metadata, run the model inside the forward
        context, compute logits at the tokens that sample, sample, append
        the sampled tokens to the batch, return a RunnerOutput.

The step's requests are in `num_scheduled_tokens` order; request i owns the
flat tokens query_start_loc[i]:query_start_loc[i+1].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from models.forward_context import ForwardContext, forward_context
from runner.attention import AttentionInputs, RunnerAttentionBackend
from runner.input_batch import CpuGpuBuffer, InputBatch
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
        self.num_computed_tokens_cpu = torch.zeros(max_num_seqs, dtype=torch.int32)
        self.arange = np.arange(max(max_num_batched_tokens, max_num_seqs) + 1, dtype=np.int64)
        # The step's one host sync: sampled ids land here, then the host waits
        # on step_done. Pinned host buffers reused next step rely on it.
        self.sampled_ids_cpu = torch.zeros(max_num_seqs, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.step_done = torch.cuda.Event() if device.type == "cuda" else None

    # ------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched_out: SchedulerOutput) -> RunnerOutput:
        self._update_batch(sched_out)
        if sched_out.total_num_scheduled_tokens == 0:
            return EMPTY_RUNNER_OUTPUT

        step = self._prepare_inputs(sched_out.num_scheduled_tokens)
        hidden = self._forward(step)  # [num_tokens, hidden]

        # guided rows' token bitmasks, filled on the CPU while the device runs the forward
        guided = None
        if self.grammar_matchers:  # some running request is guided
            sample_req_ids = [step.req_ids[i] for i in step.sample_reqs.tolist()]
            guided = self.grammar_matchers.fill_bitmask(sample_req_ids)

        prompt_logprobs = self._prompt_logprobs(hidden, step)
        sample_rows = step.rows[step.sample_reqs]
        sampled: list[int] = []
        logprobs = None
        if sample_rows.size:
            logits = self.model.compute_logits(hidden[step.logits_indices])  # [num_sampling, vocab]
            meta = SamplingMetadata.from_batch(self.batch, sample_rows)
            if guided is not None:
                meta.bitmask_rows, meta.token_bitmask = guided
            out = self.sampler(logits, meta)
            sampled = self._to_host(out.sampled_token_ids)
            self.batch.append_tokens(sample_rows, np.array(sampled, dtype=np.int32))
            if guided is not None:
                self.grammar_matchers.accept(sample_req_ids, sampled)
            if out.logprobs is not None:
                if len(sampled) == len(step.req_ids):  # every request samples (decode steps)
                    logprobs = out.logprobs
                else:
                    logprobs = [None] * len(step.req_ids)
                    for i, lp in zip(step.sample_reqs.tolist(), out.logprobs):
                        logprobs[i] = lp
        else:
            self._to_host(None)  # nothing sampled: still wait for the step's device work

        if len(sampled) == len(step.req_ids):
            sampled_token_ids = [[token_id] for token_id in sampled]
        else:
            sampled_token_ids = [[] for _ in step.req_ids]
            for i, token_id in zip(step.sample_reqs.tolist(), sampled):
                sampled_token_ids[i] = [token_id]
        return RunnerOutput(
            req_ids=step.req_ids,
            sampled_token_ids=sampled_token_ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def _forward(self, step: StepInputs) -> torch.Tensor:
        """The one place that picks CUDA-graph replay (decode-only steps that
        fit a captured batch size) or an eager forward."""
        if self.graph_runner is not None and self.graph_runner.can_replay(step.attn):
            return self.graph_runner.replay(step.input_ids, step.positions, step.attn)
        meta = self.backend.build_metadata(step.attn)
        with forward_context(ForwardContext(self.backend, meta, self.kv_caches)):
            return self.model(step.input_ids, step.positions)

    def _to_host(self, token_ids: torch.Tensor | None) -> list[int]:
        """Sampled ids [n] -> list, through pinned memory; on CUDA this waits
        for the step's device work (also when nothing was sampled: None)."""
        if self.step_done is None:
            return [] if token_ids is None else token_ids.tolist()
        n = 0 if token_ids is None else token_ids.shape[0]
        if n:
            self.sampled_ids_cpu[:n].copy_(token_ids, non_blocking=True)
        self.step_done.record()
        self.step_done.synchronize()
        return self.sampled_ids_cpu[:n].tolist()

    # ------------------------------------------------------------------
    def _update_batch(self, sched_out: SchedulerOutput) -> None:
        batch = self.batch
        grammar_matchers = self.grammar_matchers
        for req_id in sched_out.finished_req_ids:
            batch.remove_request(req_id)  # unknown ids are ignored
            if grammar_matchers is not None:
                grammar_matchers.remove_request(req_id)
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
        self.input_ids.np[:num_tokens] = batch.token_ids[token_rows, positions]
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
        logits_indices = torch.from_numpy(cu_num_scheduled[sample_reqs] - 1).to(self.device)

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
            input_ids=self.input_ids.copy_to_gpu(num_tokens),
            positions=self.positions.copy_to_gpu(num_tokens),
            attn=attn,
            sample_reqs=sample_reqs,
            logits_indices=logits_indices,
        )

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
