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


def determine_num_blocks(config: EngineConfig, spec: KVCacheSpec, device: torch.device) -> int:
    """How many KV blocks to allocate.

    num_gpu_blocks_override wins (tests); on CPU --kv-cache-memory GiB; on
    CUDA see `cuda_num_blocks`.
    """
    if config.num_gpu_blocks_override is not None:
        num_blocks = config.num_gpu_blocks_override
        source = f"num_gpu_blocks_override={num_blocks}"
    elif device.type == "cuda":
        num_blocks = cuda_num_blocks(spec, device, config.gpu_memory_utilization)
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


# Activation headroom kept free on CUDA until the profile run exists.
_CUDA_ACTIVATION_RESERVE_GiB = 2.0


def cuda_num_blocks(spec: KVCacheSpec, device: torch.device, gpu_memory_utilization: float) -> int:
    """KV blocks that fit on the GPU after the weights are loaded.

    TODO(profile): run the model once on a dummy batch of
    max_num_batched_tokens tokens (with the sampler), read
    torch.cuda.max_memory_allocated() as the activation peak, and size the
    cache as total * gpu_memory_utilization - weights - peak - graph pool.
    Until then: total * utilization - what is allocated now (the weights) - a
    fixed activation reserve.
    """
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = total - free - torch.cuda.memory_reserved(device)
    budget = total * gpu_memory_utilization - torch.cuda.memory_allocated(device) - used_by_others
    budget -= _CUDA_ACTIVATION_RESERVE_GiB * _GiB
    return max(spec.num_blocks_for(budget), 0)
