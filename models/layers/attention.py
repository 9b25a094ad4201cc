"""The attention layer: q/k norm, rope, the backend, the output projection.

The layer takes q, k, v of a flat token batch from its qkv projection (which
the decoder layer runs fused with the norm before it) and hands them to the
attention backend of the current forward context, which writes k/v into this
layer's paged KV cache and attends (see models/forward_context.py).
"""

from __future__ import annotations

import torch
from torch import nn

from models.config import ModelConfig
from models.forward_context import get_forward_context
from models.layers.linear import Linear, MergedLinear
from models.layers.norm import RMSNorm
from models.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    """Read by backends: num_heads, num_kv_heads, head_dim, scale, layer_idx."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.layer_idx = layer_idx
        self.qkv_proj = MergedLinear(
            config.hidden_size,
            {"q": config.q_size, "k": config.kv_size, "v": config.kv_size},
            bias=config.attention_bias,
        )
        self.o_proj = Linear(config.q_size, config.hidden_size, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # Shared by all layers; not a weight (its cache is a non-persistent buffer).
        self.rotary_emb = rotary_emb

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        qkv: torch.Tensor,  # [num_tokens, q_size + 2 * kv_size]: qkv_proj's output
    ) -> torch.Tensor:  # [num_tokens, hidden]
        num_tokens = qkv.shape[0]
        q, k, v = self.qkv_proj.split(qkv)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        ctx = get_forward_context()
        kv_cache = ctx.kv_caches[self.layer_idx]
        if ctx.backend.applies_rope:  # rope inside the backend's KV store (self.rotary_emb.cos_sin_cache)
            out = ctx.backend.forward(self, q, k, v, kv_cache, ctx.attn_metadata, positions)
        else:
            q, k = self.rotary_emb(positions, q, k)
            out = ctx.backend.forward(self, q, k, v, kv_cache, ctx.attn_metadata)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
