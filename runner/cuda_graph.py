"""CUDA graphs for decode-only steps.

One graph per batch-size bucket (1, 2, 4, 8, then every 8 up to
max_num_seqs), captured largest first into one memory pool, so the smaller
graphs reuse the largest one's intermediate memory. A decode step of n
requests replays the smallest bucket B >= n: the step's token ids and
positions are copied into static buffers, the backend copies its metadata
into its own static buffers (`prepare_for_replay`), the graph runs, and
rows 0..n-1 of the static hidden-state buffer are the result. Rows n..B-1
are padding: the backend points their k/v writes and attention at a KV block
no request owns.

The graph runner knows nothing about a backend's metadata: it only calls
`prepare_for_capture`, `build_metadata_for_capture` and `prepare_for_replay`.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from models.forward_context import ForwardContext, forward_context
from runner.attention import AttentionInputs, RunnerAttentionBackend

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Graph batch sizes, ascending: 1, 2, 4, 8, 16, 24, ... (every 8), max_num_seqs.
    max_num_seqs=30 -> [1, 2, 4, 8, 16, 24, 30]. Every 8, not 16: a decode step
    at batch 249 replays the 256 graph, and at large batches the padded rows
    cost matmul time (the GEMMs are compute-bound there)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += range(16, max_num_seqs, 8)
    sizes.append(max_num_seqs)
    return sizes


@dataclass
class GraphBuffers:
    """The tensors every captured graph reads and writes, sized for the largest."""

    input_ids: torch.Tensor  # [max_batch] int64
    positions: torch.Tensor  # [max_batch] int64
    hidden: torch.Tensor  # [max_batch, hidden_size], the model's output


class CudaGraphRunner:
    def __init__(
        self,
        model: nn.Module,
        backend: RunnerAttentionBackend,
        *,
        max_num_seqs: int,
        max_blocks_per_req: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        if not backend.supports_graphs:
            raise ValueError(f"attention backend {backend.name!r} does not support CUDA graphs")
        self.model = model
        self.backend = backend
        self.max_blocks_per_req = max_blocks_per_req
        self.sizes = capture_sizes(max_num_seqs)
        self.max_batch = self.sizes[-1]
        self.device = device
        self.buffers = GraphBuffers(
            input_ids=torch.zeros(self.max_batch, dtype=torch.int64, device=device),
            positions=torch.zeros(self.max_batch, dtype=torch.int64, device=device),
            hidden=torch.zeros(self.max_batch, hidden_size, dtype=dtype, device=device),
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    # ------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, kv_caches: list[torch.Tensor], padding_block_id: int) -> None:
        """Capture every size, largest first, into one pool. `padding_block_id`
        is a KV block no request owns (the engine allocates one extra)."""
        self.backend.prepare_for_capture(self.max_batch, self.max_blocks_per_req, padding_block_id)
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        self.pool = torch.cuda.graph_pool_handle()
        sizes = list(reversed(self.sizes))
        for size in _progress(sizes, desc="Capturing CUDA graphs"):
            meta = self.backend.build_metadata_for_capture(size)
            ctx = ForwardContext(self.backend, meta, kv_caches)
            self._run(ctx, size)  # warm-up: JIT compiles, allocator, handles
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._run(ctx, size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info(
            "captured %d CUDA graphs (batch sizes %s) in %.1f s, %.0f MiB",
            len(sizes), _ranges(self.sizes), time.perf_counter() - start, used / 2**20,
        )

    def _run(self, ctx: ForwardContext, size: int) -> None:
        buf = self.buffers
        with forward_context(ctx):
            hidden = self.model(buf.input_ids[:size], buf.positions[:size])
        buf.hidden[:size].copy_(hidden)

    # ------------------------------------------------------------------
    def can_replay(self, attn: AttentionInputs) -> bool:
        return bool(self.graphs) and attn.is_decode_only and attn.num_reqs <= self.max_batch

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionInputs) -> torch.Tensor:
        """input_ids, positions: [num_reqs] (one token per request) -> hidden [num_reqs, hidden_size]."""
        return self.launch(self.prepare(input_ids, positions, attn), attn.num_reqs)

    def prepare(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionInputs) -> int:
        """replay's first half: fill the static buffers and the backend's
        metadata (every host-to-device copy of the step); returns the bucket."""
        n = attn.num_reqs
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        buf = self.buffers
        buf.input_ids[:n].copy_(input_ids[:n], non_blocking=True)
        buf.positions[:n].copy_(positions[:n], non_blocking=True)
        self.backend.prepare_for_replay(attn, size)
        return size

    def launch(self, size: int, num_reqs: int) -> torch.Tensor:
        """replay's second half: run the bucket's graph -> hidden [num_reqs, hidden_size]."""
        self.graphs[size].replay()
        return self.buffers.hidden[:num_reqs]


def _progress(items: list[int], desc: str):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a dependency; stay usable without it
        return items
    return tqdm(items, desc=desc, unit="graph", dynamic_ncols=True)


def _ranges(sizes: list[int]) -> str:
    """[1, 2, 4, 8, 16, 32, 48] -> "1, 2, 4, 8, 16..48"."""
    head = [s for s in sizes if s <= 8]
    tail = [s for s in sizes if s > 8]
    parts = [str(s) for s in head]
    if tail:
        parts.append(f"{tail[0]}..{tail[-1]}" if len(tail) > 1 else str(tail[0]))
    return ", ".join(parts)
