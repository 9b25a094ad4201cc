"""Random weights for any config, for benchmarks: N(0, std) written in place
on the target device in the target dtype (no float32 CPU detour), norms 1."""

from __future__ import annotations

import torch
from torch import nn

from models.layers.norm import RMSNorm


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    params = list(model.parameters())
    if not params or params[0].device.type == "meta":
        return
    generator = torch.Generator(device=params[0].device).manual_seed(seed)
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    for param in params:  # tied weights appear once
        if id(param) in norm_weights:
            param.fill_(1.0)
        else:
            param.normal_(0.0, std, generator=generator)
