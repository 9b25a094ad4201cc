"""Split-KV paged decode attention in ONE Triton launch, for small decode batches.

At batch 1 a Llama-3.1-8B layer attends 32 query heads over a few hundred
cached tokens: ~0.5 MB of keys and values, a microsecond of bandwidth. What
costs is latency. FlashInfer's decode runs a split-KV kernel and then a
second kernel that merges the splits (9.3 + 2.4 us per layer on the H200,
bench/results/GPU_NOTES.md). Here each program attends one (request, kv head,
split) and the LAST program of a (request, kv head) to finish merges the
splits itself, found with an atomic ticket: one launch, no merge kernel.

Grid: (batch, num_kv_heads, num_splits). A program takes the GROUP = Hq / Hkv
query heads of its kv head (padded to 16 rows for tl.dot) over a contiguous
run of the request's tokens. Tokens per split are a multiple of block_t, so a
short context uses fewer splits than the grid has, e.g. seq_len 300,
num_splits 16, block_t 32: 32 tokens per split, splits 0..9 busy, 10..15
return at once.

    scratch = DecodeScratch(device, max_batch, num_q_heads, num_kv_heads, head_dim)
    paged_decode(q, kv_cache, block_table, seq_lens, scale, scratch, out, num_splits)

Invariant: scratch.tickets is all zeros between launches (the merging
program resets its entry), so launches of any grid may follow each other on
one stream, layer after layer, and inside CUDA graphs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MIN_ROWS = 16  # tl.dot wants at least 16 rows: the GQA group is padded to this
MAX_SPLITS = 32
# Programs the grid aims at: the loop over a split's tokens is latency-bound,
# so long contexts want many splits, but the merge walks the splits one by
# one. Measured on the H200 (Llama-3.1-8B heads, bench/results/GPU_NOTES.md):
# the fastest split count was 4 / 16 / 32 at batch 1 and 256 / 1500 / 8192
# tokens (64 was slower), 16 at batch 4, 8 at batch 8, 4 at batch 16; short
# contexts use fewer splits than the grid has anyway (64 tokens at least).
TARGET_PROGRAMS = 512


@dataclass(frozen=True)
class DecodeConfig:
    # the sweep's pick on the H200 (GPU_NOTES.md): 64 tokens per iteration
    # wins at every batch and context measured; 3 stages at long contexts
    block_t: int = 64  # tokens per loop iteration (and the split granularity)
    num_warps: int = 4
    num_stages: int = 3


DEFAULT_CONFIG = DecodeConfig()


@dataclass(frozen=True)
class RopeInput:
    """This step's token per request, for paged_decode to rotate and store."""

    positions: torch.Tensor  # [B] int64
    cos_sin_cache: torch.Tensor  # [max_position, head_dim] float32: cos | sin (neox)
    k: torch.Tensor  # [B, Hkv, D], not rotated
    v: torch.Tensor  # [B, Hkv, D]
    slot_mapping: torch.Tensor  # [B] int64: block_id * page + offset


def num_splits_for(batch: int, num_kv_heads: int) -> int:
    """Splits per (request, kv head), the most a context may use: batch 1
    with 8 kv heads -> 32, batch 4 -> 16, batch 8 -> 8, batch 64 -> 1."""
    return max(1, min(MAX_SPLITS, TARGET_PROGRAMS // max(1, batch * num_kv_heads)))


class DecodeScratch:
    """Partial results and merge tickets for up to max_batch requests."""

    def __init__(self, device: torch.device, max_batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int):
        self.max_batch = max_batch
        f32 = torch.float32
        self.partial_out = torch.empty(max_batch, num_q_heads, MAX_SPLITS, head_dim, dtype=f32, device=device)
        self.partial_lse = torch.empty(max_batch, num_q_heads, MAX_SPLITS, dtype=f32, device=device)
        self.tickets = torch.zeros(max_batch, num_kv_heads, dtype=torch.int32, device=device)


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [B, Hq, D], head_dim contiguous
    kv_ptr,  # [num_blocks, 2, PAGE, Hkv, D] contiguous
    block_table_ptr,  # [B, >= cdiv(seq_len, PAGE)] int32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [B, Hq, D] contiguous
    part_out_ptr,  # [max_B, Hq, MAX_SPLITS, D] float32
    part_lse_ptr,  # [max_B, Hq, MAX_SPLITS] float32
    tickets_ptr,  # [max_B, Hkv] int32, zero on entry and on exit
    pos_ptr,  # ROPE: [B] int64, this step's token position
    cos_sin_ptr,  # ROPE: [max_position, D] float32, cos | sin
    k_new_ptr,  # ROPE: [B, Hkv, D] this step's k, not rotated yet
    v_new_ptr,  # ROPE: [B, Hkv, D]
    slot_ptr,  # ROPE: [B] int64, where this step's k/v go
    stride_qb,
    stride_qh,
    stride_bt,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    num_kv_heads,
    scale_log2,  # softmax scale * log2(e): the kernel works in base 2
    ROPE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_T) * BLOCK_T
    num_used = tl.cdiv(seq_len, per_split)
    start = s * per_split
    end = tl.minimum(start + per_split, seq_len)
    if start < seq_len:
        g = tl.arange(0, GROUP_P)
        heads = h * GROUP + g
        g_mask = g < GROUP
        d = tl.arange(0, D)
        half = tl.arange(0, D // 2)
        row_stride = num_kv_heads * D  # one token's [Hkv, D] row of a page
        # q in two halves (rope pairs element i with i + D/2), as [GROUP_P, D/2] each
        q_lo_ptrs = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + half[None, :]
        q_lo = tl.load(q_lo_ptrs, mask=g_mask[:, None], other=0.0)
        q_hi = tl.load(q_lo_ptrs + D // 2, mask=g_mask[:, None], other=0.0)
        if ROPE:
            # neox rope of this step's token, in float32, rounded once (as cuda_ops' rope kernel)
            pos = tl.load(pos_ptr + b).to(tl.int64)
            cos = tl.load(cos_sin_ptr + pos * D + half)  # [D/2]
            sin = tl.load(cos_sin_ptr + pos * D + D // 2 + half)
            q1, q2 = q_lo.to(tl.float32), q_hi.to(tl.float32)
            q_lo = (q1 * cos[None, :] - q2 * sin[None, :]).to(q_ptr.dtype.element_ty)
            q_hi = (q2 * cos[None, :] + q1 * sin[None, :]).to(q_ptr.dtype.element_ty)
            if end == seq_len:
                # the split that holds the last token writes it (rotated k, v) to the cache,
                # then reads it back with the rest (the barrier orders the CTA's threads)
                slot = tl.load(slot_ptr + b).to(tl.int64)
                dst = kv_ptr + (slot // PAGE) * (2 * PAGE * row_stride) + (slot % PAGE) * row_stride + h * D
                k_src = k_new_ptr + b.to(tl.int64) * stride_kb + h * stride_kh + half
                k1 = tl.load(k_src).to(tl.float32)
                k2 = tl.load(k_src + D // 2).to(tl.float32)
                tl.store(dst + half, (k1 * cos - k2 * sin).to(kv_ptr.dtype.element_ty))
                tl.store(dst + D // 2 + half, (k2 * cos + k1 * sin).to(kv_ptr.dtype.element_ty))
                v_src = v_new_ptr + b.to(tl.int64) * stride_vb + h * stride_vh + d
                tl.store(dst + PAGE * row_stride + d, tl.load(v_src))
                tl.debug_barrier()
        m = tl.full([GROUP_P], float("-inf"), dtype=tl.float32)
        l = tl.zeros([GROUP_P], dtype=tl.float32)
        acc = tl.zeros([GROUP_P, D], dtype=tl.float32)
        bt_row = block_table_ptr + b.to(tl.int64) * stride_bt
        for t0 in range(start, end, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            t_mask = t < end
            page = tl.load(bt_row + t // PAGE, mask=t_mask, other=0).to(tl.int64)
            k_rows = kv_ptr + page * (2 * PAGE * row_stride) + (t % PAGE) * row_stride + h * D
            k_lo = tl.load(k_rows[:, None] + half[None, :], mask=t_mask[:, None], other=0.0)
            k_hi = tl.load(k_rows[:, None] + D // 2 + half[None, :], mask=t_mask[:, None], other=0.0)
            scores = tl.dot(q_lo, tl.trans(k_lo)) + tl.dot(q_hi, tl.trans(k_hi))  # [GROUP_P, BLOCK_T]
            scores = tl.where(t_mask[None, :], scores * scale_log2, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            p = tl.exp2(scores - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            l = l * alpha + tl.sum(p, axis=1)
            v = tl.load(k_rows[:, None] + PAGE * row_stride + d[None, :], mask=t_mask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        out_rows = out_ptr + (b.to(tl.int64) * (num_kv_heads * GROUP) + heads[:, None]) * D + d[None, :]
        if NUM_SPLITS == 1:
            tl.store(out_rows, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
        else:
            # this split's normalised output and log-sum-exp (base 2)
            part = (b.to(tl.int64) * (num_kv_heads * GROUP) + heads) * MAX_SPLITS  # [GROUP_P]
            tl.store(part_out_ptr + (part + s)[:, None] * D + d[None, :], acc / l[:, None], mask=g_mask[:, None])
            tl.store(part_lse_ptr + part + s, m + tl.log2(l), mask=g_mask)
            # every thread's stores happen before the ticket is taken (release);
            # the last taker sees all of them (acquire) and merges
            tl.debug_barrier()
            ticket_ptr = tickets_ptr + b * num_kv_heads + h
            ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
            if ticket == num_used - 1:
                lse_max = tl.full([GROUP_P], float("-inf"), dtype=tl.float32)
                for i in range(0, num_used):
                    lse_i = tl.load(part_lse_ptr + part + i, mask=g_mask, other=0.0, cache_modifier=".cg")
                    lse_max = tl.maximum(lse_max, lse_i)
                total = tl.zeros([GROUP_P], dtype=tl.float32)
                merged = tl.zeros([GROUP_P, D], dtype=tl.float32)
                for i in range(0, num_used):
                    lse_i = tl.load(part_lse_ptr + part + i, mask=g_mask, other=0.0, cache_modifier=".cg")
                    w = tl.exp2(lse_i - lse_max)
                    o_i = tl.load(
                        part_out_ptr + (part + i)[:, None] * D + d[None, :],
                        mask=g_mask[:, None],
                        other=0.0,
                        cache_modifier=".cg",
                    )
                    merged += w[:, None] * o_i
                    total += w
                tl.store(out_rows, (merged / total[:, None]).to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
                tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")


def paged_decode(
    q: torch.Tensor,  # [B, Hq, D] (row strides free, head_dim contiguous)
    kv_cache: torch.Tensor,  # [num_blocks, 2, page, Hkv, D] contiguous
    block_table: torch.Tensor,  # [B, num_cols] int32, row stride free
    seq_lens: torch.Tensor,  # [B] int32, each >= 1 (this step's token included)
    scale: float,
    scratch: DecodeScratch,
    out: torch.Tensor,  # [B, Hq, D] contiguous, written
    num_splits: int,
    config: DecodeConfig = DEFAULT_CONFIG,
    rope: RopeInput | None = None,
) -> torch.Tensor:
    """Each query row attends over all seq_lens[b] tokens of its request,
    which are in kv_cache; with `rope`, q and this step's k arrive unrotated
    and the kernel rotates them and writes k/v to the cache first (no rope
    or store kernel before it)."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    group = num_q_heads // num_kv_heads
    assert batch <= scratch.max_batch and 1 <= num_splits <= MAX_SPLITS
    assert q.stride(-1) == 1 and kv_cache.is_contiguous() and out.is_contiguous()
    assert head_dim & (head_dim - 1) == 0 and head_dim >= 16, f"head_dim {head_dim}: a power of two >= 16"
    if batch == 0:
        return out
    if rope is not None:
        k, v = rope.k, rope.v
        assert k.stride(-1) == 1 and v.stride(-1) == 1 and rope.cos_sin_cache.dtype == torch.float32
        rope_args = (rope.positions, rope.cos_sin_cache, k, v, rope.slot_mapping)
        kv_strides = (k.stride(0), k.stride(1), v.stride(0), v.stride(1))
    else:  # unused pointers and strides
        rope_args, kv_strides = (seq_lens, q, q, q, seq_lens), (0, 0, 0, 0)
    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        q, kv_cache, block_table, seq_lens, out,
        scratch.partial_out, scratch.partial_lse, scratch.tickets, *rope_args,
        q.stride(0), q.stride(1), block_table.stride(0), *kv_strides,
        num_kv_heads, scale * math.log2(math.e),
        ROPE=rope is not None, GROUP=group, GROUP_P=max(MIN_ROWS, triton.next_power_of_2(group)), D=head_dim,
        PAGE=kv_cache.shape[2], BLOCK_T=config.block_t, NUM_SPLITS=num_splits, MAX_SPLITS=MAX_SPLITS,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
