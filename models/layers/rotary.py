"""Rotary position embedding from explicit positions, with a cos/sin cache.

The cache is computed once, in float32, for positions 0..max_position-1 and
read per token by `positions`, so a flat batch of many requests at arbitrary
offsets needs nothing else:
    positions = [0, 1, 2, 7, 8]  # request A's first 3 tokens, request B at offsets 7-8
"""

from __future__ import annotations

import math

import torch
from torch import nn

from models.config import RopeScaling
from models.layers.ops import OPS


def rope_inv_freq(head_dim: int, base: float, scaling: RopeScaling | None) -> torch.Tensor:  # [head_dim/2] f32
    """inv_freq[i] = base^(-2i/head_dim), rescaled as HF's rope init functions do."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (base**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "freq_factors":
        return inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float32, device=inv_freq.device)
    return _llama3_inv_freq(inv_freq, scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Wavelengths shorter than original_max/high_freq_factor keep their
    # frequency, longer than original_max/low_freq_factor are divided by
    # `factor`; in between, a linear blend in original_max/wavelen.
    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """One per model, shared by every attention layer."""

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: RopeScaling | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        inv_freq = rope_inv_freq(head_dim, base, scaling)  # [head_dim/2]
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim/2]
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_position, head_dim]
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return OPS["rotary_embedding"](positions, q, k, self.cos_sin_cache)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_position={self.max_position}"
