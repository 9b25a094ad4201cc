"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from models.layers.linear import Linear
from models.layers.ops import OPS


class RMSNorm(nn.Module):
    """norm(x) -> normed; norm(x, residual) -> (normed, new_residual), where
    new_residual = x + residual is what the next layer adds onto."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(
        self,
        x: torch.Tensor,  # [..., hidden]
        residual: torch.Tensor | None = None,  # [..., hidden]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return OPS["rms_norm"](x, self.weight, self.eps)
        return OPS["fused_add_rms_norm"](x, residual, self.weight, self.eps)

    def forward_linear(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        residual: torch.Tensor | None,  # [num_tokens, hidden]; None: x is the residual (layer 0)
        linear: Linear,  # the projection this norm feeds
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(norm(x + residual)), x + residual) as ONE op, so a GPU
        kernel can fold the norm into the matmul's read of its input."""
        return OPS["add_rms_norm_linear"](x, residual, self.weight, self.eps, linear.weight, linear.bias)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
