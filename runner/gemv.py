"""A Triton GEMV for one-row linears (batch-1 decode): y[1, N] = x[1, K] @ w[N, K].T.

At batch 1 a decode step is the time to read every weight once. cuBLAS
serves [1, K] x [K, N] with GEMM tiles (and split-K plus a reduce kernel for
the tall-K shapes), which reach 3.1-4.0 TB/s of the H200's 4.19 on the
Llama-3.1-8B shapes (bench/results/GPU_NOTES.md). This kernel streams
BLOCK_N rows of w per program over the whole K: no split, no second kernel.

    y = gemv(x, w)            # x [1, K], w [N, K] row-major, same dtype
    y = gemv(x, w, config)    # a GemvConfig from bench/bench_kernels.py's sweep

Rows accumulate in float32 and round once, like cuBLAS; the sum order differs,
so the result may differ from F.linear by an ulp of the output.
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


@triton.jit
def _gemv_kernel(
    x_ptr,  # [K]
    w_ptr,  # [N, K], row stride stride_w
    out_ptr,  # [N]
    N,
    K,
    stride_w,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + cols).to(tl.float32)
        w = tl.load(w_rows + cols[None, :], mask=row_mask[:, None], other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * x[None, :]
    tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=row_mask)


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


def gemv(x: torch.Tensor, w: torch.Tensor, config: GemvConfig = DEFAULT_CONFIG) -> torch.Tensor:
    N, K = w.shape
    out = torch.empty((1, N), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(N, config.block_n),)
    _gemv_kernel[grid](
        x, w, out, N, K, w.stride(0),
        BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
