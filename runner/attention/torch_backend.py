"""Plain torch attention over the paged KV cache: the CPU path, and the
reference the GPU backends are tested against.

Per step (`build_metadata`) the requests are split in two kinds:
- prefill-like requests (q_len > 1): one SDPA call each. A request with no
  cached context attends only to this step's k/v (`is_causal=True`, no
  gather); one with context gathers its pages from the cache and uses an
  explicit causal mask shifted by the context length.
- decode requests (q_len == 1): sorted by seq_len and packed into a few
  groups, each one padded gather of pages + one SDPA call with a key mask,
  the group size bounded so a gather never copies more than
  `decode_gather_tokens` tokens per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from runner.attention import AttentionInputs, RunnerAttentionBackend


@dataclass
class PrefillSeq:
    """One request with q_len > 1: query tokens start:end of the batch."""

    start: int
    end: int
    seq_len: int
    block_ids: torch.Tensor | None  # [num_blocks] int64; None when there is no cached context
    # [1, 1, q_len, seq_len] bool, True = attend; query i sees keys 0..ctx+i.
    # None when there is no context (plain causal over this step's k/v).
    mask: torch.Tensor | None


@dataclass
class DecodeGroup:
    """Decode requests attended with one padded SDPA call."""

    token_indices: torch.Tensor  # [B] int64, the query token of each request
    block_ids: torch.Tensor  # [B, num_blocks] int64 (padded with block 0)
    mask: torch.Tensor  # [B, 1, 1, num_blocks * block_size] bool, key < seq_len


@dataclass
class TorchAttentionMetadata:
    num_tokens: int
    slot_blocks: torch.Tensor  # [num_tokens] int64: slot_mapping // block_size
    slot_offsets: torch.Tensor  # [num_tokens] int64: slot_mapping % block_size
    prefills: list[PrefillSeq] = field(default_factory=list)
    decode_groups: list[DecodeGroup] = field(default_factory=list)


class TorchAttentionBackend(RunnerAttentionBackend):
    name = "torch"

    def __init__(self, device: torch.device, dtype: torch.dtype, decode_gather_tokens: int = 32768):
        super().__init__(device, dtype)
        self.decode_gather_tokens = decode_gather_tokens

    # ------------------------------------------------------------------
    def build_metadata(self, inputs: AttentionInputs) -> TorchAttentionMetadata:
        bs = inputs.block_size
        n = inputs.num_reqs
        qsl = inputs.query_start_loc_cpu.numpy()
        seq_lens = inputs.seq_lens_cpu.numpy()[:n].astype(np.int64)
        q_lens = np.diff(qsl[: n + 1]).astype(np.int64)
        ctx_lens = seq_lens - q_lens
        # ceil(seq_len / block_size): seq_len=9, block_size=4 -> 3 blocks
        num_blocks = (seq_lens + bs - 1) // bs
        slot_mapping = inputs.slot_mapping[: inputs.num_tokens]
        meta = TorchAttentionMetadata(
            num_tokens=inputs.num_tokens,
            slot_blocks=torch.div(slot_mapping, bs, rounding_mode="floor"),
            slot_offsets=torch.remainder(slot_mapping, bs),
        )
        block_table = inputs.block_table

        for i in np.flatnonzero(q_lens > 1):
            start, end, seq_len, ctx = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i]), int(ctx_lens[i])
            if ctx == 0:
                meta.prefills.append(PrefillSeq(start, end, seq_len, None, None))
                continue
            # query i (0-based within the chunk) sits at position ctx + i:
            # ctx=2, q_len=3 -> rows [[1,1,1,0,0], [1,1,1,1,0], [1,1,1,1,1]]
            qpos = torch.arange(end - start, device=self.device)[:, None] + ctx
            kpos = torch.arange(seq_len, device=self.device)[None, :]
            meta.prefills.append(
                PrefillSeq(
                    start,
                    end,
                    seq_len,
                    block_table[i, : int(num_blocks[i])].long(),
                    (kpos <= qpos)[None, None],
                )
            )

        decode_reqs = np.flatnonzero(q_lens == 1)
        if decode_reqs.size:
            # shortest first, so each group pads to a similar length
            decode_reqs = decode_reqs[np.argsort(seq_lens[decode_reqs], kind="stable")]
            start = 0
            while start < decode_reqs.size:
                end = start + 1
                while end < decode_reqs.size and (end - start + 1) * int(num_blocks[decode_reqs[end]]) * bs <= self.decode_gather_tokens:
                    end += 1
                meta.decode_groups.append(self._decode_group(inputs, decode_reqs[start:end], num_blocks, seq_lens))
                start = end
        return meta

    def _decode_group(self, inputs: AttentionInputs, reqs: np.ndarray, num_blocks: np.ndarray, seq_lens: np.ndarray) -> DecodeGroup:
        bs = inputs.block_size
        max_blocks = int(num_blocks[reqs].max())
        reqs_t = torch.from_numpy(reqs).to(self.device)
        # Blocks past a request's length are masked out; whatever id sits in
        # the table there (0 for unused entries) is a valid index to gather.
        block_ids = inputs.block_table[reqs_t, :max_blocks].long()
        kpos = torch.arange(max_blocks * bs, device=self.device)
        lens = torch.from_numpy(seq_lens[reqs]).to(self.device)
        mask = (kpos[None, :] < lens[:, None])[:, None, None, :]
        token_indices = inputs.query_start_loc[reqs_t].long()
        return DecodeGroup(token_indices, block_ids, mask)

    # ------------------------------------------------------------------
    def forward(self, layer, q, k, v, kv_cache, meta: TorchAttentionMetadata) -> torch.Tensor:
        num_tokens = meta.num_tokens
        q, k, v = q[:num_tokens], k[:num_tokens], v[:num_tokens]
        # kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim]
        kv_cache[meta.slot_blocks, 0, meta.slot_offsets] = k.to(kv_cache.dtype)
        kv_cache[meta.slot_blocks, 1, meta.slot_offsets] = v.to(kv_cache.dtype)
        num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
        scale = getattr(layer, "scale", None)
        out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]

        for p in meta.prefills:
            qi = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, num_heads, q_len, head_dim]
            if p.block_ids is None:
                ki = k[p.start : p.end].transpose(0, 1).unsqueeze(0)
                vi = v[p.start : p.end].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
            else:
                # [num_blocks, block_size, num_kv_heads, head_dim] -> [num_blocks * block_size, ...]
                ki = kv_cache[:, 0][p.block_ids].flatten(0, 1)[: p.seq_len]
                vi = kv_cache[:, 1][p.block_ids].flatten(0, 1)[: p.seq_len]
                ki = ki.transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, num_kv_heads, seq_len, head_dim]
                vi = vi.transpose(0, 1).unsqueeze(0).to(q.dtype)
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=p.mask, scale=scale, enable_gqa=True)
            out[p.start : p.end] = o[0].transpose(0, 1)

        for g in meta.decode_groups:
            num = g.block_ids.shape[0]
            # gather: [B, num_blocks, block_size, num_kv_heads, head_dim] -> [B, num_kv_heads, L, head_dim]
            kg = kv_cache[:, 0][g.block_ids].view(num, -1, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
            vg = kv_cache[:, 1][g.block_ids].view(num, -1, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
            qg = q[g.token_indices].unsqueeze(2)  # [B, num_heads, 1, head_dim]
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale, enable_gqa=True)
            out[g.token_indices] = o.squeeze(2)
        return out
