"""Fused GPU kernels (Triton) for the ops the layers call through
`models.layers.ops.OPS`, plus the KV-cache store of the FlashInfer backend.

    install_cuda_ops()     # once at start-up, when the engine runs on CUDA

swaps `rms_norm`, `fused_add_rms_norm`, `rotary_embedding` and
`silu_and_mul` for one-launch kernels, and `linear` and `add_rms_norm_linear`
for GEMVs on one-row inputs (runner/gemv.py: at batch 1 a sublayer's
residual add, norm and first matmul are one launch); the models stay plain
torch. Each
kernel keeps the reference's signature and rounding where it is cheap to
(normalise in float32, round, then scale by the weight in the model dtype, as
HF does); rope computes in float32 and rounds once, so it may differ from the
reference by an ulp.

Triton kernels compile in about a second on first use (cached under
~/.triton), unlike FlashInfer's JIT modules (tens of seconds each).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from models.layers import ops
from runner.gemv import GemvConfig, NormInput, gemv
from runner.gemv import supports as gemv_supports

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------
# RMSNorm, with and without the residual add
# ---------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # rows addressed as (row // num_inner, row % num_inner) through the strides
    out_ptr,  # contiguous [num_rows, D]
    w_ptr,  # [D]
    stride_outer,
    stride_inner,
    num_inner,
    D,
    eps,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    x_row = x_ptr + (row // num_inner).to(tl.int64) * stride_outer + (row % num_inner).to(tl.int64) * stride_inner
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * D + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr,  # [num_rows, D], row stride stride_x; overwritten with the normed output
    res_ptr,  # [num_rows, D], row stride stride_res; overwritten with x + residual
    w_ptr,
    stride_x,
    stride_res,
    D,
    eps,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
    # residual' = x + residual, rounded to the model dtype as torch's add would
    r = (x + r).to(res_ptr.dtype.element_ty)
    tl.store(res_ptr + row * stride_res + cols, r, mask=mask)
    r = r.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(r * r, axis=0) / D + eps)
    normed = (r * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_ptr + row * stride_x + cols, (normed * w).to(x_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [num_tokens, D] or [num_tokens, num_heads, D] (any row strides, last dim contiguous)."""
    D = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 2:
        num_inner, stride_outer, stride_inner = 1, x.stride(0), 0
    elif x.dim() == 3:
        num_inner, stride_outer, stride_inner = x.shape[1], x.stride(0), x.stride(1)
    else:
        x = x.reshape(-1, D)
        num_inner, stride_outer, stride_inner = 1, x.stride(0), 0
    num_rows = out.numel() // D
    block = triton.next_power_of_2(D)
    _rms_norm_kernel[(num_rows,)](
        x, out, weight, stride_outer, stride_inner, num_inner, D, eps, BLOCK_D=block, num_warps=_warps(block)
    )
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual += x; x = rms_norm(residual). Returns (x, residual)."""
    D = x.shape[-1]
    if x.numel() == 0:
        return x, residual
    assert x.dim() == 2 and x.stride(-1) == 1 and residual.stride(-1) == 1, "fused_add_rms_norm wants [num_tokens, D] rows"
    block = triton.next_power_of_2(D)
    _fused_add_rms_norm_kernel[(x.shape[0],)](
        x, residual, weight, x.stride(0), residual.stride(0), D, eps, BLOCK_D=block, num_warps=_warps(block)
    )
    return x, residual


def _warps(block: int) -> int:
    """Warps for a one-row-per-program kernel: about 16 elements per thread."""
    return max(1, min(16, block // 512))


# ---------------------------------------------------------------------------
# Rotary embedding (neox style), in place on q and k
# ---------------------------------------------------------------------------


@triton.jit
def _rope_kernel(
    pos_ptr,  # [num_tokens] int64
    q_ptr,  # [num_tokens, num_q_heads, D] strided
    k_ptr,  # [num_tokens, num_k_heads, D] strided
    v_ptr,  # STORE: [num_tokens, num_k_heads, D] strided
    cache_ptr,  # [max_position, D] float32: cos | sin
    kv_ptr,  # STORE: [num_blocks, 2, block_size, num_k_heads, D] contiguous
    slot_ptr,  # STORE: [num_tokens] int64, block_id * block_size + offset
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    num_q_heads,
    num_k_heads,
    block_size,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    STORE: tl.constexpr,  # False: k rotated in place; True: rotated k and v go to the KV cache
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    half = tl.arange(0, HALF)
    cos = tl.load(cache_ptr + pos * (2 * HALF) + half)[None, :]  # [1, HALF]
    sin = tl.load(cache_ptr + pos * (2 * HALF) + HALF + half)[None, :]
    heads = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]

    q_mask = heads < num_q_heads
    q1_ptr = q_ptr + t * stride_qt + heads * stride_qh + half[None, :]
    q1 = tl.load(q1_ptr, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q1_ptr + HALF, mask=q_mask, other=0.0).to(tl.float32)
    tl.store(q1_ptr, (q1 * cos - q2 * sin).to(q_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q1_ptr + HALF, (q2 * cos + q1 * sin).to(q_ptr.dtype.element_ty), mask=q_mask)

    k_mask = heads < num_k_heads
    k1_ptr = k_ptr + t * stride_kt + heads * stride_kh + half[None, :]
    k1 = tl.load(k1_ptr, mask=k_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k1_ptr + HALF, mask=k_mask, other=0.0).to(tl.float32)
    k1_out = (k1 * cos - k2 * sin).to(k_ptr.dtype.element_ty)
    k2_out = (k2 * cos + k1 * sin).to(k_ptr.dtype.element_ty)
    if STORE:
        # one token's row of the cache: [num_k_heads, D] at (slot // block_size, 0 or 1, slot % block_size)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        row = num_k_heads * (2 * HALF)
        k_dst = kv_ptr + (slot // block_size) * (2 * block_size * row) + (slot % block_size) * row
        k_dst = k_dst + heads * (2 * HALF) + half[None, :]
        tl.store(k_dst, k1_out, mask=k_mask)
        tl.store(k_dst + HALF, k2_out, mask=k_mask)
        v1_ptr = v_ptr + t * stride_vt + heads * stride_vh + half[None, :]
        v_dst = k_dst + block_size * row
        tl.store(v_dst, tl.load(v1_ptr, mask=k_mask), mask=k_mask)
        tl.store(v_dst + HALF, tl.load(v1_ptr + HALF, mask=k_mask), mask=k_mask)
    else:
        tl.store(k1_ptr, k1_out, mask=k_mask)
        tl.store(k1_ptr + HALF, k2_out, mask=k_mask)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on q [T, Hq, D] and k [T, Hk, D] (row strides free, head_dim contiguous)."""
    _launch_rope(positions, q, k, None, cos_sin_cache, None, None)
    return q, k


def rope_and_store_kv(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D], rotated in place
    k: torch.Tensor,  # [T, Hk, D], left as it is
    v: torch.Tensor,  # [T, Hk, D]
    cos_sin_cache: torch.Tensor,  # [max_position, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hk, D] contiguous
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """rotary_embedding + store_kv in one launch: the rotated k and v go
    straight to kv_cache[slot // bs, 0 / 1, slot % bs] (k itself is not
    written: attention reads keys from the cache)."""
    assert kv_cache.is_contiguous() and kv_cache.dtype == k.dtype == v.dtype
    _launch_rope(positions, q, k, v, cos_sin_cache, kv_cache, slot_mapping)


def rope_table(cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """The rope table as the kernels read it: float32, contiguous (RotaryEmbedding
    keeps it so already; anything else is converted)."""
    if cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous():
        return cos_sin_cache
    return cos_sin_cache.float().contiguous()


def _launch_rope(positions, q, k, v, cos_sin_cache, kv_cache, slot_mapping) -> None:
    num_tokens, num_q_heads, D = q.shape
    num_k_heads = k.shape[1]
    if num_tokens == 0:
        return
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and D % 2 == 0
    assert D & (D - 1) == 0, f"rope kernel needs a power-of-two head_dim, got {D}"
    cos_sin_cache = rope_table(cos_sin_cache)
    store = kv_cache is not None
    if store:
        assert v.stride(-1) == 1
    else:  # unused pointers: any tensor will do
        v, kv_cache, slot_mapping = k, k, positions
    _rope_kernel[(num_tokens,)](
        positions, q, k, v, cos_sin_cache, kv_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        num_q_heads, num_k_heads, kv_cache.shape[2] if store else 1,
        HALF=D // 2, BLOCK_H=triton.next_power_of_2(max(num_q_heads, num_k_heads)), STORE=store,
    )


# ---------------------------------------------------------------------------
# SiLU(gate) * up
# ---------------------------------------------------------------------------


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, d, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    # as torch: silu rounded to the model dtype, then the product rounded
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * d + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2d] (gate | up) -> [num_tokens, d]."""
    num_tokens, two_d = x.shape
    d = two_d // 2
    out = torch.empty((num_tokens, d), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    assert x.stride(-1) == 1
    block = min(1024, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(d, block))](x, out, x.stride(0), d, BLOCK=block)
    return out


# ---------------------------------------------------------------------------
# KV cache store through the slot mapping
# ---------------------------------------------------------------------------


@triton.jit
def _store_kv_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim], heads contiguous within a row
    v_ptr,
    cache_ptr,  # [num_blocks, 2, block_size, num_kv_heads, head_dim] contiguous
    slot_ptr,  # [num_tokens] int64: block_id * block_size + offset
    stride_k,
    stride_v,
    block_size,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    block = slot // block_size
    offset = slot % block_size
    k_dst = cache_ptr + block * (2 * block_size * ROW) + offset * ROW
    v_dst = k_dst + block_size * ROW
    for start in tl.static_range(0, ROW, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < ROW
        tl.store(k_dst + cols, tl.load(k_ptr + t * stride_k + cols, mask=mask), mask=mask)
        tl.store(v_dst + cols, tl.load(v_ptr + t * stride_v + cols, mask=mask), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache[slot // bs, 0, slot % bs] = k[i]; [..., 1, ...] = v[i], for slot = slot_mapping[i]."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert kv_cache.is_contiguous() and kv_cache.dtype == k.dtype == v.dtype
    assert k.stride(2) == 1 and k.stride(1) == head_dim and v.stride(2) == 1 and v.stride(1) == head_dim
    row = num_kv_heads * head_dim
    _store_kv_kernel[(num_tokens,)](
        k, v, kv_cache, slot_mapping, k.stride(0), v.stride(0), kv_cache.shape[2],
        ROW=row, BLOCK=min(2048, triton.next_power_of_2(row)),
    )


# ---------------------------------------------------------------------------
# Linear: a Triton GEMV for one-row inputs where it beats cuBLAS
# ---------------------------------------------------------------------------

# Measured on the H200 (bench/bench_kernels.py, bench/results/kernels_linear_h200.txt),
# Llama-3.1-8B shapes at batch 1, device time per call: qkv 15.4 -> 14.3 us,
# o 13.4 -> 10.8 us, down 31.1 -> 30.2 us (and no split-K reduce kernel);
# gate_up (28672 x 4096) is faster in cuBLAS (54.7 vs 57.0 us), so weights of
# more than GEMV_MAX_ELEMENTS stay there.
GEMV_MAX_ELEMENTS = 64 << 20


# The residual add + RMSNorm folded into the GEMV pays from the largest shapes
# too (gate_up 28672 x 4096: 57.4 us against 59.4 for the norm kernel + cuBLAS).
NORM_GEMV_MAX_ELEMENTS = 128 << 20


@functools.lru_cache(maxsize=None)
def _gemv_config(n: int, k: int, norm: bool = False) -> GemvConfig:
    """The sweeps' winners (bench/bench_kernels.py on the H200). Plain: 4 rows
    per program up to N = 4096, else 8; 8 warps from ~20M elements. With the
    norm: 8 rows, 4 warps; 512 columns and 4 stages up to N = 8192 (qkv: 14.9
    us against 16.2 for the norm kernel + GEMV), else 256 and 2 (gate_up)."""
    if norm:
        return GemvConfig(block_n=8, block_k=512, num_warps=4, num_stages=4) if n <= 8192 else \
            GemvConfig(block_n=8, block_k=256, num_warps=4, num_stages=2)
    return GemvConfig(block_n=4 if n <= 4096 else 8, block_k=512, num_warps=8 if n * k > (20 << 20) else 4,
                      num_stages=4)


def _use_gemv(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig, max_elements: int) -> bool:
    return weight.numel() <= max_elements and gemv_supports(x, weight, config)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear, except one-row inputs (batch-1 decode) on weights up to
    GEMV_MAX_ELEMENTS go to runner/gemv.py."""
    if _use_gemv(x, weight, config := _gemv_config(*weight.shape), GEMV_MAX_ELEMENTS):
        return gemv(x, weight, config, bias=bias)
    return F.linear(x, weight, bias)


def add_rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ops.add_rms_norm_linear: a one-row input on a weight up to
    NORM_GEMV_MAX_ELEMENTS is one GEMV launch with the residual add and the
    norm inside; otherwise the norm kernel, then `linear`."""
    config = _gemv_config(*weight.shape, True)
    if (residual is None or residual.stride(-1) == 1) and _use_gemv(x, weight, config, NORM_GEMV_MAX_ELEMENTS):
        return gemv(x, weight, config, bias=bias, norm=NormInput(residual, norm_weight, eps))
    return ops.add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias)


CUDA_OPS = {
    "linear": linear,
    "add_rms_norm_linear": add_rms_norm_linear,
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "rotary_embedding": rotary_embedding,
    "silu_and_mul": silu_and_mul,
}


def install_cuda_ops() -> None:
    """Route the layers' ops to the Triton kernels (process-wide, until
    `models.layers.ops.reset_ops()`). The registry is global, so each op
    still hands tensors that are not on a GPU to the torch reference: a
    process that also runs a CPU model (tests) keeps working."""
    for name, fn in CUDA_OPS.items():
        ops.set_op(name, _cuda_or_reference(fn, ops._REFERENCE[name]))
    logger.info("fused Triton kernels for %s", ", ".join(CUDA_OPS))


def _cuda_or_reference(kernel, reference):
    def op(first: torch.Tensor, *args, **kwargs):
        return kernel(first, *args, **kwargs) if first.is_cuda else reference(first, *args, **kwargs)

    op.__name__ = kernel.__name__
    return op
