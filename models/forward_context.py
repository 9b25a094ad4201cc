"""The per-step context the attention layers read, set by the runner.

Models never see the runner. The runner builds the step's attention metadata
with its backend and runs the model inside `forward_context(...)`:

    with forward_context(ForwardContext(backend, meta, kv_caches)):
        hidden = model(input_ids, positions)

and each `models.layers.attention.Attention` calls
`get_forward_context().backend.forward(layer, q, k, v, kv_cache, meta)`.
"""

from __future__ import annotations

import abc
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch


class AttentionBackend(abc.ABC):
    """One implementation per platform (`torch` on CPU and as the reference,
    `flashinfer` on CUDA), chosen once at start-up from a registry in runner/.

    KV cache layout, per layer (FlashInfer's paged NHD layout):
        kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim]
    kv_cache[b, 0] holds keys, kv_cache[b, 1] values of block b.
    """

    name: str = "abstract"
    # True: forward() takes `positions` and applies the layer's rope to q and k
    # itself (FlashInfer: rope and the KV store are one kernel); False: the
    # layer hands over q and k already rotated
    applies_rope: bool = False

    @abc.abstractmethod
    def forward(
        self,
        layer: Any,  # models.layers.attention.Attention: num_heads, num_kv_heads, head_dim, scale, layer_idx
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        meta: Any,  # the backend's own metadata type for this step
        positions: torch.Tensor | None = None,  # [num_tokens], given when applies_rope
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write k/v of this step's tokens into kv_cache (through the slot
        mapping in `meta`), then attend each query token causally over its
        request's cached tokens."""


@dataclass
class ForwardContext:
    backend: AttentionBackend
    attn_metadata: Any
    kv_caches: list[torch.Tensor]  # one per layer, indexed by layer_idx


_current: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    assert _current is None, "nested forward_context is not allowed"
    _current = ctx
    try:
        yield ctx
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    assert _current is not None, "attention ran outside forward_context(...)"
    return _current
