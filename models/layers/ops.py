"""The math the layers run, as plain torch functions, behind one small hook.

Layers call `OPS[name](...)` at each forward, so a platform (e.g. the CUDA
runner with FlashInfer's fused kernels) can replace an op once at start-up,
before or after the model is built, without touching the models:

    from models.layers import ops
    ops.set_op("fused_add_rms_norm", my_fused_kernel)

Each replacement must keep the reference function's signature and semantics;
the torch versions below are the reference that parity tests pin to
transformers. `reset_ops()` restores them.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [num_tokens, hidden], x.dtype
    # As HF Llama/Qwen: normalise in float32, scale in the input dtype.
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def fused_add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual').
    A fused kernel may update `x` and `residual` in place and return them."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]: cos in [:, :D/2], sin in [:, D/2:]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rope (HF Llama's rotate_half): with x = [x1, x2] halves,
    out = [x1*cos - x2*sin, x2*cos + x1*sin]. A fused kernel may work in place."""
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)  # [num_tokens, D/2] each
    cos = cos.unsqueeze(1).to(q.dtype)
    sin = sin.unsqueeze(1).to(q.dtype)
    return _rotate_neox(q, cos, sin), _rotate_neox(k, cos, sin)


def _rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_and_mul(
    x: torch.Tensor,  # [num_tokens, 2 * d]: gate in [:, :d], up in [:, d:]
) -> torch.Tensor:  # [num_tokens, d]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear(
    x: torch.Tensor,  # [num_tokens, in_features]
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None,
) -> torch.Tensor:  # [num_tokens, out_features]
    return F.linear(x, weight, bias)


def add_rms_norm_linear(
    x: torch.Tensor,  # [num_tokens, hidden]: a sublayer's output (or the embeddings at layer 0)
    residual: torch.Tensor | None,  # [num_tokens, hidden]; None at layer 0
    norm_weight: torch.Tensor,  # [hidden]
    eps: float,
    weight: torch.Tensor,  # [out_features, hidden]
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm sublayer's entry: residual' = x + residual (x alone when
    residual is None), y = linear(rms_norm(residual'), weight, bias).
    Returns (y, residual').

    One op, so that a kernel can fold the norm into the matmul; this reference
    composes the ops above through OPS, so each can still be replaced alone."""
    if residual is None:
        normed, residual = OPS["rms_norm"](x, norm_weight, eps), x
    else:
        normed, residual = OPS["fused_add_rms_norm"](x, residual, norm_weight, eps)
    return OPS["linear"](normed, weight, bias), residual


_REFERENCE: dict[str, Callable] = {
    "linear": linear,
    "add_rms_norm_linear": add_rms_norm_linear,
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "rotary_embedding": rotary_embedding,
    "silu_and_mul": silu_and_mul,
}

OPS: dict[str, Callable] = dict(_REFERENCE)


def set_op(name: str, fn: Callable) -> None:
    if name not in OPS:
        raise KeyError(f"unknown op {name!r}; ops: {', '.join(OPS)}")
    OPS[name] = fn


def reset_ops() -> None:
    OPS.clear()
    OPS.update(_REFERENCE)
