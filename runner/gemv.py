"""Triton GEMVs for one-row linears (batch-1 decode): y[1, N] = x[1, K] @ w[N, K].T,
optionally with the residual add and RMSNorm before the matmul.

At batch 1 a decode step is the time to read every weight once. cuBLAS
serves [1, K] x [K, N] with GEMM tiles (and split-K plus a reduce kernel for
the tall-K shapes), which reach 3.1-4.0 TB/s of the H200's 4.19 on the
Llama-3.1-8B shapes (bench/results/GPU_NOTES.md). This kernel streams
BLOCK_N rows of w per program over the whole K: no split, no second kernel.

    y = gemv(x, w)                                  # F.linear(x, w)
    y, r = gemv(x, w, norm=NormInput(residual, g, eps))
        # r = x + residual; y = F.linear(rms_norm(r, g, eps), w)

The norm rides along the matmul's own reads of x: rms_norm(r) @ w.T =
rstd * ((r * g) @ w.T), with rstd = rsqrt(mean(r^2) + eps) summed in the same
loop, so the normalised row is never written and no norm kernel runs;
program 0 also writes r (the next sublayer's residual). (SiLU-and-mul folded
into the down projection's GEMV the same way measured slower than its own
kernel on the H200: 32.7 against 31.7 us, GPU_NOTES.md.)

Rows accumulate in float32 and round once, like cuBLAS; the sum order (and,
with the norm, the rounding of the normalised row, which HF rounds to the
model dtype before scaling) differs, so results may differ from the unfused
ops by an ulp of the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 8  # rows of w per program
    block_k: int = 512  # columns per loop iteration (K must be a multiple)
    num_warps: int = 4
    num_stages: int = 4


DEFAULT_CONFIG = GemvConfig()


@dataclass(frozen=True)
class NormInput:
    """The RMSNorm in front of the matmul: x is the sublayer output, added to
    `residual` (None: x is the residual itself, as at layer 0)."""

    residual: torch.Tensor | None  # [1, K]
    weight: torch.Tensor  # [K]
    eps: float


@triton.jit
def _gemv_kernel(
    x_ptr,  # [K]
    res_ptr,  # NORM and HAS_RES: [K] residual
    norm_w_ptr,  # NORM: [K]
    res_out_ptr,  # NORM and HAS_RES: [K], program 0 writes x + residual
    w_ptr,  # [N, K], row stride stride_w
    bias_ptr,  # HAS_BIAS: [N]
    out_ptr,  # [N]
    N,
    K,
    stride_w,
    eps,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    sum_sq = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + cols).to(tl.float32)
        if NORM:
            if HAS_RES:
                # residual' = x + residual, rounded to the model dtype as torch's add
                r = (x + tl.load(res_ptr + cols).to(tl.float32)).to(x_ptr.dtype.element_ty)
                tl.store(res_out_ptr + cols, r, mask=(cols < K) & (pid == 0))
                x = r.to(tl.float32)
            sum_sq += x * x
            x = x * tl.load(norm_w_ptr + cols).to(tl.float32)
        w = tl.load(w_rows + cols[None, :], mask=row_mask[:, None], other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if NORM:
        y = y * tl.rsqrt(tl.sum(sum_sq, axis=0) / K + eps)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)


def supports(x: torch.Tensor, w: torch.Tensor, config: GemvConfig = DEFAULT_CONFIG) -> bool:
    """Whether gemv(x, w, config) applies: one row, CUDA, K a multiple of block_k."""
    return (
        x.dim() == 2
        and x.shape[0] == 1
        and x.is_cuda
        and x.dtype == w.dtype
        and w.stride(-1) == 1
        and x.stride(-1) == 1
        and w.shape[1] % config.block_k == 0
    )


def gemv(
    x: torch.Tensor,  # [1, K]
    w: torch.Tensor,  # [N, K]
    config: GemvConfig = DEFAULT_CONFIG,
    *,
    bias: torch.Tensor | None = None,  # [N]
    norm: NormInput | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """y [1, N]; with `norm`, (y, residual') where residual' = x + residual."""
    N, K = w.shape
    assert x.shape[-1] == K, f"gemv: input {tuple(x.shape)} for weight {tuple(w.shape)}"
    out = torch.empty((1, N), dtype=x.dtype, device=x.device)
    residual = norm.residual if norm is not None else None
    res_out = torch.empty_like(x) if residual is not None else x
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1
    grid = (triton.cdiv(N, config.block_n),)
    _gemv_kernel[grid](
        x, residual if residual is not None else x, norm.weight if norm is not None else x, res_out,
        w, bias if bias is not None else x, out,
        N, K, w.stride(0), norm.eps if norm is not None else 0.0,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        NORM=norm is not None, HAS_RES=residual is not None, HAS_BIAS=bias is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if norm is None:
        return out
    return out, res_out
