"""Linear layers, plain and output-stacked (fused QKV, fused gate/up).

Weights are allocated uninitialised (`torch.empty`) in the ambient device and
default dtype, so building an 8B model costs nothing until the loader fills it.
"""

from __future__ import annotations

import torch
from torch import nn

from models.layers.ops import OPS


class Linear(nn.Module):
    """y = x @ weight.T (+ bias); weight: [out_features, in_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return OPS["linear"](x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim, run
    as one matmul. Each named shard owns a row range of weight (and bias):

        MergedLinear(64, {"q": 64, "k": 32, "v": 32})
        shard_offsets == {"q": (0, 64), "k": (64, 32), "v": (96, 32)}  # (offset, size)
    """

    def __init__(self, in_features: int, output_sizes: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(output_sizes.values()), bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for shard, size in output_sizes.items():
            self.shard_offsets[shard] = (offset, size)
            offset += size

    def shard(self, param: torch.Tensor, shard: str) -> torch.Tensor:
        """The rows of `param` (self.weight or self.bias) that `shard` owns, as a view."""
        offset, size = self.shard_offsets[shard]
        return param.narrow(0, offset, size)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Cut a forward output [..., out_features] back into its shards."""
        return y.split([size for _, size in self.shard_offsets.values()], dim=-1)
