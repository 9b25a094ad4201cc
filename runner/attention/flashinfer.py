"""FlashInfer paged attention: the CUDA backend.

Per step, `build_metadata` plans ONE wrapper that every layer then runs:
- a decode-only step (every request has q_len 1): BatchDecodeWithPagedKVCacheWrapper,
  with tensor cores (the FA2 kernels) from DECODE_TENSOR_CORES_FROM requests,
  on CUDA cores below;
- any step with a prefill chunk (prefill only, or mixed with decodes):
  BatchPrefillWithPagedKVCacheWrapper, causal. FlashInfer aligns the causal
  mask to the end of the keys, so query i of a chunk of q_len on top of ctx
  cached tokens sees keys 0..ctx+i, and a decode row (q_len 1) sees all.
The prefill wrapper and the tensor-core decode share one FA2 JIT module per
(dtype, head_dim); the CUDA-core decode kernel is a second one.

The KV cache layout is FlashInfer's NHD paged layout,
`[num_blocks, 2, block_size, num_kv_heads, head_dim]`. Each layer first
rotates q and k and writes k/v through the slot mapping (one Triton kernel:
the backend `applies_rope`), then attends. The page table FlashInfer reads is
built on the host from the block table, e.g. seq_lens=[5, 1], block_size=4,
block_table=[[7, 2], [9, 0]]:
    kv_indptr = [0, 2, 3]   kv_indices = [7, 2, 9]   kv_last_page_len = [1, 1]

Small decode batches (at most TRITON_DECODE_MAX_BATCH requests) skip
FlashInfer: runner/attention/triton_decode.py attends them in one launch
(split-KV with the merge inside), straight from the block table and seq_lens
on the device, with no plan() on the host.

CUDA graphs (decode only): one decode wrapper per graph batch size, built
with `use_cuda_graph=True` over fixed indptr / indices / last_page_len
buffers, planned again before each replay; buckets of at most
TRITON_DECODE_MAX_BATCH read a fixed block table and seq_lens instead.
Padded rows (num_reqs..B-1) get one page, the padding block, holding one
token; their k/v land there too.
"""

from __future__ import annotations

import builtins
import os
import sys
from dataclasses import dataclass
from typing import Union

import numpy as np
import torch
from flashinfer import BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper

from runner.attention import AttentionInputs, AttentionSpec, RunnerAttentionBackend
from runner.attention.triton_decode import DecodeScratch, RopeInput, num_splits_for, paged_decode
from runner.cuda_ops import rope_and_store_kv, rope_table, store_kv
from runner.input_batch import CpuGpuBuffer
from scheduler.config import ConfigError

# Scratch for split-KV partial results, shared by every wrapper (they run one
# at a time on one stream).
WORKSPACE_BYTES = 256 << 20
_FA_BACKEND = "fa2"
# Decode batches of at least this many requests run FlashInfer's tensor-core
# decode kernel (the FA2 prefill kernel), smaller ones its CUDA-core kernel;
# each CUDA graph bucket makes the choice for its own batch size.
# SERVAL_FLASHINFER_DECODE_TENSOR_CORES_FROM=N overrides it (1: always).
DECODE_TENSOR_CORES_FROM = int(os.environ.get("SERVAL_FLASHINFER_DECODE_TENSOR_CORES_FROM", "1"))
# Decode batches of at most this many requests run the one-launch Triton
# kernel (triton_decode.py) instead; 0 turns it off.
# SERVAL_TRITON_DECODE_MAX_BATCH=N overrides it.
TRITON_DECODE_MAX_BATCH = int(os.environ.get("SERVAL_TRITON_DECODE_MAX_BATCH", "8"))

Wrapper = Union[BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper]


def _tensor_aware_max(*args, **kwargs):
    """builtins.max, except that max(tensor) is one torch reduction.

    FlashInfer's plan() (0.6.18) takes `max(kv_lens).item()` of a [batch]
    CPU tensor: the builtin iterates it as `batch` 0-d tensors, about 1 ms
    of host time per decode step at batch 256 while the GPU waits (measured
    on the H200, bench/results/GPU_NOTES.md). Same value, one call."""
    if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
        return args[0].max()
    return builtins.max(*args, **kwargs)


# Module globals shadow builtins: only FlashInfer's decode/prefill modules see it.
for _cls in (BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper):
    sys.modules[_cls.__module__].max = _tensor_aware_max


@dataclass
class TritonDecode:
    """A small decode batch for triton_decode.paged_decode: device tensors only."""

    block_table: torch.Tensor  # [num_reqs, num_cols] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    num_splits: int


@dataclass
class FlashInferMetadata:
    num_tokens: int  # rows of q/k/v this step (a graph's padded batch size when replayed)
    slot_mapping: torch.Tensor  # [num_tokens] int64, device
    wrapper: Wrapper | None  # planned for this step; None when triton_decode is set
    triton_decode: TritonDecode | None = None


class _PageTable:
    """Host-built kv_indptr / kv_indices / kv_last_page_len for FlashInfer,
    in pinned buffers (indices also copied to the device). They are rewritten
    every step; the runner waits for the previous step's input copies
    (ModelRunner.inputs_copied, recorded after plan()) before it prepares the
    next step, so a copy enqueued from them has finished before they change,
    also with a step in flight (async scheduling)."""

    def __init__(self, device: torch.device, num_rows: int, num_pages: int):
        self.device = device
        self.indptr = CpuGpuBuffer(num_rows + 1, dtype=torch.int32, device=device)
        self.last_page_len = CpuGpuBuffer(num_rows, dtype=torch.int32, device=device)
        self.num_pages = np.zeros(num_rows, dtype=np.int32)
        self.indices = CpuGpuBuffer(max(num_pages, 1), dtype=torch.int32, device=device)
        self.page_arange = np.arange(1, dtype=np.int32)

    def _reserve(self, num_rows: int, num_pages: int) -> None:
        """Grow the buffers (rarely: they start at the common sizes)."""
        if num_rows > self.num_pages.shape[0]:
            self.indptr = CpuGpuBuffer(2 * num_rows + 1, dtype=torch.int32, device=self.device)
            self.last_page_len = CpuGpuBuffer(2 * num_rows, dtype=torch.int32, device=self.device)
            self.num_pages = np.zeros(2 * num_rows, dtype=np.int32)
        if num_pages > self.indices.cpu.shape[0]:
            self.indices = CpuGpuBuffer(2 * num_pages, dtype=torch.int32, device=self.device)

    def fill(
        self, inputs: AttentionInputs, num_rows: int, padding_block_id: int = -1
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pages of inputs' requests, plus num_rows - num_reqs padding rows of
        one page (padding_block_id) with one token. Returns (indptr_cpu,
        indices_gpu, last_page_len_cpu)."""
        n, bs = inputs.num_reqs, inputs.block_size
        seq_lens = inputs.seq_lens_cpu.numpy()[:n]
        # the most pages any real request needs, before touching the buffers
        max_pages = int((int(seq_lens.max()) + bs - 1) // bs) if n else 0
        self._reserve(num_rows, n * max_pages + (num_rows - n))
        num_pages = self.num_pages[:num_rows]
        # ceil(seq_len / block_size): seq_len 5, block_size 4 -> 2 pages, 1 token in the last
        np.floor_divide(seq_lens + (bs - 1), bs, out=num_pages[:n], casting="unsafe")
        num_pages[n:] = 1
        last = self.last_page_len.np[:num_rows]
        last[:n] = seq_lens - (num_pages[:n] - 1) * bs
        last[n:] = 1
        indptr = self.indptr.np[: num_rows + 1]
        indptr[0] = 0
        np.cumsum(num_pages, out=indptr[1:])
        num_real, total = int(indptr[n]), int(indptr[num_rows])
        if self.page_arange.shape[0] < max_pages:
            self.page_arange = np.arange(2 * max_pages, dtype=np.int32)
        # row-major boolean pick: request 0's pages, then request 1's, ...
        used = self.page_arange[:max_pages][None, :] < num_pages[:n, None]
        self.indices.np[:num_real] = inputs.block_table_cpu.numpy()[:n, :max_pages][used]
        self.indices.np[num_real:total] = padding_block_id
        return self.indptr.cpu[: num_rows + 1], self.indices.copy_to_gpu(total), self.last_page_len.cpu[:num_rows]


class FlashInferAttentionBackend(RunnerAttentionBackend):
    name = "flashinfer"
    supports_graphs = True

    def __init__(self, device: torch.device, dtype: torch.dtype):
        super().__init__(device, dtype)
        if device.type != "cuda":
            raise ConfigError("--attention-backend flashinfer needs --device cuda; use --attention-backend torch")
        if dtype not in (torch.bfloat16, torch.float16):
            raise ConfigError(
                f"--attention-backend flashinfer runs bfloat16 or float16, not {str(dtype).removeprefix('torch.')}; "
                "pass --dtype bfloat16 (or --attention-backend torch)"
            )
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill_wrapper = BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=_FA_BACKEND)
        # eager decode steps: one wrapper per kernel kind (see DECODE_TENSOR_CORES_FROM)
        self.decode_wrappers = {
            tc: BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=tc) for tc in (True, False)
        }
        self.pages = _PageTable(device, 256, 4096)
        # CUDA graphs: set by prepare_for_capture
        self.graph_pages: _PageTable | None = None
        self.graph_metadata: dict[int, FlashInferMetadata] = {}
        self.padding_block_id = -1
        self.decode_scratch: DecodeScratch | None = None  # set by configure()

    def configure(self, spec: AttentionSpec) -> None:
        if spec.num_heads % spec.num_kv_heads:
            raise ValueError(f"num_heads {spec.num_heads} is not a multiple of num_kv_heads {spec.num_kv_heads}")
        super().configure(spec)
        if TRITON_DECODE_MAX_BATCH > 0:
            self.decode_scratch = DecodeScratch(
                self.device, TRITON_DECODE_MAX_BATCH, spec.num_heads, spec.num_kv_heads, spec.head_dim
            )

    def _uses_triton_decode(self, num_reqs: int) -> bool:
        return self.decode_scratch is not None and num_reqs <= self.decode_scratch.max_batch

    # ------------------------------------------------------------------
    def build_metadata(self, inputs: AttentionInputs) -> FlashInferMetadata:
        n = inputs.num_reqs
        if inputs.is_decode_only and self._uses_triton_decode(n):
            plan = TritonDecode(inputs.block_table[:n], inputs.seq_lens[:n], self._num_splits(n))
            return FlashInferMetadata(inputs.num_tokens, inputs.slot_mapping[: inputs.num_tokens], None, plan)
        indptr, indices, last_page_len = self.pages.fill(inputs, n)
        if inputs.is_decode_only:
            wrapper = self.decode_wrappers[n >= DECODE_TENSOR_CORES_FROM]
            self._plan_decode(wrapper, indptr, indices, last_page_len)
        else:
            wrapper = self.prefill_wrapper
            spec = self._spec()
            wrapper.plan(
                inputs.query_start_loc_cpu[: n + 1],
                indptr,
                indices,
                last_page_len,
                spec.num_heads,
                spec.num_kv_heads,
                spec.head_dim,
                spec.block_size,
                causal=True,
                sm_scale=spec.scale,
                q_data_type=self.dtype,
                kv_data_type=self.dtype,
                non_blocking=True,
            )
        return FlashInferMetadata(inputs.num_tokens, inputs.slot_mapping[: inputs.num_tokens], wrapper)

    def _plan_decode(self, wrapper, indptr, indices, last_page_len) -> None:
        spec = self._spec()
        wrapper.plan(
            indptr,
            indices,
            last_page_len,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            spec.block_size,
            sm_scale=spec.scale,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
            non_blocking=True,
        )

    def _num_splits(self, num_reqs: int) -> int:
        return num_splits_for(num_reqs, self._spec().num_kv_heads)

    def _spec(self) -> AttentionSpec:
        if self.spec is None:
            raise RuntimeError("FlashInferAttentionBackend.configure(spec) was not called")
        return self.spec

    # ------------------------------------------------------------------
    applies_rope = True  # rope + KV store: one kernel per layer

    def forward(self, layer, q, k, v, kv_cache, meta: FlashInferMetadata, positions=None) -> torch.Tensor:
        n = meta.num_tokens
        q, k, v = q[:n], k[:n], v[:n]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [num_tokens, num_heads, head_dim]
        plan = meta.triton_decode
        rope = None
        if positions is None:  # q and k come rotated (tests, callers outside the model)
            store_kv(k, v, kv_cache, meta.slot_mapping)
        elif plan is not None:  # the Triton decode rotates and stores inside the attention kernel
            rope = RopeInput(positions[:n], rope_table(layer.rotary_emb.cos_sin_cache), k, v, meta.slot_mapping)
        else:  # q rotated in place; rotated k and v written to the cache (k itself is left alone)
            rope_and_store_kv(positions[:n], q, k, v, layer.rotary_emb.cos_sin_cache, kv_cache, meta.slot_mapping)
        if plan is not None:
            paged_decode(
                q, kv_cache, plan.block_table, plan.seq_lens, self._spec().scale, self.decode_scratch, out,
                plan.num_splits, rope=rope,
            )
        else:
            meta.wrapper.run(q, kv_cache, out=out)
        return out

    # -- CUDA graphs -------------------------------------------------------
    def prepare_for_capture(self, max_num_reqs: int, max_blocks_per_req: int, padding_block_id: int) -> None:
        self.padding_block_id = padding_block_id
        # Every graph's wrapper reads slices of these fixed device buffers.
        max_pages = max_num_reqs * max_blocks_per_req
        self.graph_pages = _PageTable(self.device, max_num_reqs, max_pages)
        self.graph_indptr = torch.zeros(max_num_reqs + 1, dtype=torch.int32, device=self.device)
        self.graph_indices = torch.zeros(max_pages, dtype=torch.int32, device=self.device)
        self.graph_last_page_len = torch.zeros(max_num_reqs, dtype=torch.int32, device=self.device)
        self.graph_slot_mapping = torch.zeros(max_num_reqs, dtype=torch.int64, device=self.device)
        # the Triton decode buckets' inputs
        triton_rows = min(max_num_reqs, self.decode_scratch.max_batch if self.decode_scratch else 0)
        self.graph_block_table = torch.zeros(triton_rows, max_blocks_per_req, dtype=torch.int32, device=self.device)
        self.graph_seq_lens = torch.ones(triton_rows, dtype=torch.int32, device=self.device)
        self.graph_metadata = {}

    def build_metadata_for_capture(self, num_reqs: int) -> FlashInferMetadata:
        # captured over a batch of padding rows only
        self._pad_graph_rows(0, num_reqs)
        slot_mapping = self.graph_slot_mapping[:num_reqs]
        if self._uses_triton_decode(num_reqs):
            plan = TritonDecode(
                self.graph_block_table[:num_reqs], self.graph_seq_lens[:num_reqs], self._num_splits(num_reqs)
            )
            meta = FlashInferMetadata(num_reqs, slot_mapping, None, plan)
        else:
            wrapper = BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=num_reqs >= DECODE_TENSOR_CORES_FROM,
                paged_kv_indptr_buffer=self.graph_indptr[: num_reqs + 1],
                paged_kv_indices_buffer=self.graph_indices,
                paged_kv_last_page_len_buffer=self.graph_last_page_len[:num_reqs],
            )
            empty = _empty_decode_inputs(self.device, self._spec().block_size)
            self._plan_decode(wrapper, *self.graph_pages.fill(empty, num_reqs, self.padding_block_id))
            meta = FlashInferMetadata(num_reqs, slot_mapping, wrapper)
        self.graph_metadata[num_reqs] = meta
        return meta

    def prepare_for_replay(self, inputs: AttentionInputs, padded_num_reqs: int) -> FlashInferMetadata:
        assert inputs.is_decode_only and inputs.num_reqs <= padded_num_reqs
        meta = self.graph_metadata[padded_num_reqs]
        n = inputs.num_reqs
        if meta.triton_decode is not None:
            self.graph_block_table[:n, : inputs.block_table.shape[1]].copy_(inputs.block_table[:n])
            self.graph_seq_lens[:n].copy_(inputs.seq_lens[:n])
        else:
            self._plan_decode(meta.wrapper, *self.graph_pages.fill(inputs, padded_num_reqs, self.padding_block_id))
        self.graph_slot_mapping[:n].copy_(inputs.slot_mapping[:n])
        self._pad_graph_rows(n, padded_num_reqs)
        return meta

    def _pad_graph_rows(self, start: int, stop: int) -> None:
        """Rows start..stop-1 of the graphs' inputs become padding: their k/v go
        to the padding block and (Triton buckets) they attend over its one token."""
        if start >= stop:
            return
        self.graph_slot_mapping[start:stop].fill_(self.padding_block_id * self._spec().block_size)
        if self._uses_triton_decode(stop):
            self.graph_block_table[start:stop, 0] = self.padding_block_id
            self.graph_seq_lens[start:stop] = 1


def _empty_decode_inputs(device: torch.device, block_size: int) -> AttentionInputs:
    """A decode batch of no requests (what a graph is captured over before padding)."""
    i32 = torch.int32
    return AttentionInputs(
        num_reqs=0,
        num_tokens=0,
        max_query_len=1,
        max_seq_len=1,
        block_size=block_size,
        query_start_loc_cpu=torch.zeros(1, dtype=i32),
        seq_lens_cpu=torch.zeros(0, dtype=i32),
        num_computed_tokens_cpu=torch.zeros(0, dtype=i32),
        block_table_cpu=torch.zeros((0, 1), dtype=i32),
        query_start_loc=torch.zeros(1, dtype=i32, device=device),
        seq_lens=torch.zeros(0, dtype=i32, device=device),
        block_table=torch.zeros((0, 1), dtype=i32, device=device),
        slot_mapping=torch.zeros(0, dtype=torch.int64, device=device),
    )
