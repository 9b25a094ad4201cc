"""Gated activation of the MLP."""

from __future__ import annotations

import torch
from torch import nn

from models.layers.ops import OPS


class SiluAndMul(nn.Module):
    """[num_tokens, 2*d] (gate | up) -> silu(gate) * up: [num_tokens, d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return OPS["silu_and_mul"](x)
