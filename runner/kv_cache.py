"""KV cache sizing and allocation.

Per layer one tensor in FlashInfer's paged NHD layout:
    [num_blocks, 2, block_size, num_kv_heads, head_dim]   (k at [:, 0], v at [:, 1])
Block ids are shared by all layers: block b of a request holds its tokens
b*block_size .. (b+1)*block_size-1 in every layer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from scheduler.config import ConfigError, EngineConfig

logger = logging.getLogger(__name__)

_GiB = 1 << 30


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id costs across all layers, keys and values."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def num_blocks_for(self, num_bytes: float) -> int:
        return int(num_bytes // self.bytes_per_block)

    def allocate(self, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
        """One zeroed cache per layer, indexed by layer_idx."""
        shape = (num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(self.num_layers)]


def determine_num_blocks(
    config: EngineConfig, spec: KVCacheSpec, device: torch.device, reserved_bytes: int | None = None
) -> int:
    """How many KV blocks to allocate.

    num_gpu_blocks_override wins (tests); on CPU --kv-cache-memory GiB; on
    CUDA see `cuda_num_blocks` (`reserved_bytes`: what `profile_cuda_memory`
    measured for activations and graphs).
    """
    if config.num_gpu_blocks_override is not None:
        num_blocks = config.num_gpu_blocks_override
        source = f"num_gpu_blocks_override={num_blocks}"
    elif device.type == "cuda":
        num_blocks = cuda_num_blocks(spec, device, config.gpu_memory_utilization, reserved_bytes)
        source = f"--gpu-memory-utilization {config.gpu_memory_utilization}"
    else:
        num_blocks = spec.num_blocks_for(config.kv_cache_memory_gb * _GiB)
        source = f"--kv-cache-memory {config.kv_cache_memory_gb} GiB"
    if num_blocks < 1:
        raise ConfigError(
            f"{source} leaves no room for a single KV block ({spec.bytes_per_block / 2**20:.2f} MiB "
            f"with --block-size {spec.block_size}); give the KV cache more memory"
        )
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens, %.2f GiB (%s)",
        num_blocks,
        spec.block_size,
        num_blocks * spec.block_size,
        num_blocks * spec.bytes_per_block / _GiB,
        source,
    )
    return num_blocks


# Activation headroom kept free on CUDA when no profile run was made.
_CUDA_ACTIVATION_RESERVE_GiB = 2.0
# Per captured graph, besides the shared pool of activations: FlashInfer's
# 8 MiB plan buffer per decode wrapper, page tables, allocator rounding. On the
# H200, 20 graphs took 330-384 MiB and 28 took 472 MiB in all (pool included).
_CUDA_GRAPH_RESERVE_PER_GRAPH = 16 << 20


def cuda_num_blocks(
    spec: KVCacheSpec, device: torch.device, gpu_memory_utilization: float, reserved_bytes: int | None = None
) -> int:
    """KV blocks that fit on the GPU:
    total * gpu_memory_utilization - memory used by other processes and the
    CUDA context - what is allocated now (weights, backend workspaces) -
    reserved_bytes (activation peak + graph pool, from `profile_cuda_memory`;
    a fixed 2 GiB when None).
    """
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = total - free - torch.cuda.memory_reserved(device)
    budget = total * gpu_memory_utilization - torch.cuda.memory_allocated(device) - used_by_others
    budget -= _CUDA_ACTIVATION_RESERVE_GiB * _GiB if reserved_bytes is None else reserved_bytes
    return max(spec.num_blocks_for(budget), 0)


def profile_cuda_memory(
    model: torch.nn.Module,
    backend,  # runner.attention.RunnerAttentionBackend
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    graph_batch_size: int,
    device: torch.device,
) -> int:
    """Bytes to keep free beside the KV cache, measured by dummy steps:
    the peak of the largest step (max_num_batched_tokens tokens of prefill,
    in requests of at most max_model_len, then the LM head and sampling
    temporaries over max_num_seqs rows), plus, with CUDA graphs
    (graph_batch_size > 0), the peak of a decode step of graph_batch_size
    requests (what the graphs' private pool keeps) and their static buffers."""
    q_lens = [min(max_model_len, max_num_batched_tokens - start) for start in range(0, max_num_batched_tokens, max_model_len)]
    step_peak = _profile_step(model, backend, q_lens, min(max_num_seqs, max_num_batched_tokens), device)
    graph_peak = 0
    if graph_batch_size:
        from runner.cuda_graph import capture_sizes

        graph_peak = _profile_step(model, backend, [1] * graph_batch_size, 0, device)
        graph_peak += _CUDA_GRAPH_RESERVE_PER_GRAPH * len(capture_sizes(graph_batch_size))
    logger.info(
        "profile: a %d-token step peaks at %.2f GiB of activations; CUDA graphs reserve %.2f GiB; weights %.2f GiB",
        max_num_batched_tokens, step_peak / _GiB, graph_peak / _GiB, torch.cuda.memory_allocated(device) / _GiB,
    )
    return step_peak + graph_peak


@torch.inference_mode()
def _profile_step(model, backend, q_lens: list[int], num_sampled: int, device: torch.device) -> int:
    """Peak bytes allocated by one dummy step of fresh prefills of q_lens
    tokens (q_lens all 1: a decode step). Every token's k/v goes to one scratch
    block and every page index is 0: only memory is measured, not numbers."""
    from models.forward_context import ForwardContext, forward_context
    from runner.attention import AttentionInputs

    num_tokens, num_reqs = sum(q_lens), len(q_lens)
    spec = backend.spec  # set by backend.configure()
    bs = spec.block_size
    num_layers = model.config.num_layers
    scratch = [
        torch.zeros(1, 2, bs, spec.num_kv_heads, spec.head_dim, dtype=backend.dtype, device=device)
        for _ in range(num_layers)
    ]
    i32 = torch.int32
    qsl = torch.zeros(num_reqs + 1, dtype=i32)
    qsl[1:] = torch.tensor(q_lens, dtype=i32).cumsum(0)
    seq_lens = torch.tensor(q_lens, dtype=i32)
    max_pages = (max(q_lens) + bs - 1) // bs
    block_table = torch.zeros(num_reqs, max_pages, dtype=i32)
    inputs = AttentionInputs(
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        max_query_len=max(q_lens),
        max_seq_len=max(q_lens),
        block_size=bs,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        num_computed_tokens_cpu=torch.zeros(num_reqs, dtype=i32),
        block_table_cpu=block_table,
        query_start_loc=qsl.to(device),
        seq_lens=seq_lens.to(device),
        block_table=block_table.to(device),
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=device),
    )
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(q, device=device) for q in q_lens])

    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    meta = backend.build_metadata(inputs)
    with forward_context(ForwardContext(backend, meta, scratch)):
        hidden = model(input_ids, positions)
    if num_sampled:
        # the LM head, then about the sampler's float32 temporaries
        probs = model.compute_logits(hidden[:num_sampled]).float().softmax(dim=-1)
        (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del hidden, scratch, meta
    torch.cuda.empty_cache()
    return peak
