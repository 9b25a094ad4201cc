"""Test helpers: tiny random HF checkpoints, and running our models without the runner.

    path = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "qwen3")
    model, config = load_model(ModelSource("hf_dir", str(path), "tiny"), "auto", None, "cpu")
    logits = run_flat_batch(model, [[1, 2, 3], [4, 5]])           # [5, vocab] float32
    expected = hf_logits(load_hf_model(path), [[1, 2, 3], [4, 5]])  # same layout

`SdpaTestBackend` is a test-only AttentionBackend: causal SDPA within each
request of a flat batch whose requests all start at position 0 (full
prefills); it ignores the KV cache, so it needs no runner.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from models.forward_context import AttentionBackend, ForwardContext, forward_context

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

# hidden 64, 2 layers, 4 heads of 16, 2 kv heads: GQA with 2 query heads per kv head.
TINY_CONFIG: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)

# Llama 3.x rope scaling at tiny scale: with head_dim 16 and theta 10000 the
# wavelengths span 6..~20000 tokens, so an original context of 64 puts some
# frequencies below 16 (kept), some above 64 (divided by factor), some between (blended).
LLAMA3_ROPE_SCALING: dict[str, Any] = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=64,
)


def tiny_hf_config(arch: str, **overrides: Any) -> Any:
    """A transformers config of `arch` with TINY_CONFIG values, then `overrides`.
    rope_scaling=LLAMA3_ROPE_SCALING (or any HF rope dict) is accepted as in 4.x configs."""
    import transformers

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; choose from {ARCHITECTURES}")
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    values = {**TINY_CONFIG, **overrides}
    if arch == "MistralForCausalLM":
        values.setdefault("sliding_window", None)
    return config_cls(architectures=[arch], **values)


def _randomize_(model: torch.nn.Module, seed: int) -> None:
    """Weights at a scale where activations stay O(1), and non-trivial norms
    and biases (HF initialises those to 1 and 0, which would hide a loading bug)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)


def make_tiny_checkpoint(
    arch: str,
    path: str | os.PathLike,
    *,
    num_shards: int = 1,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Save a tiny random `arch` model (float32 safetensors + config.json) to
    `path` and return it. Overrides go to the HF config, e.g.
    tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE_SCALING, attention_bias=True.
    num_shards > 1 writes model-0000i-of-0000n.safetensors + model.safetensors.index.json."""
    import transformers

    path = Path(path)
    config = tiny_hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).to(torch.float32)
    _randomize_(model, seed)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    max_shard_size = "50GB"
    if num_shards > 1:
        total = sum(p.numel() * p.element_size() for p in model.state_dict().values())
        max_shard_size = total // num_shards + 1
    model.save_pretrained(path, max_shard_size=max_shard_size)
    if num_shards > 1 and not (path / "model.safetensors.index.json").is_file():
        raise RuntimeError(f"asked for {num_shards} shards but transformers wrote one file to {path}")
    return path


def load_hf_model(path: str | os.PathLike) -> torch.nn.Module:
    """The transformers reference model of a checkpoint directory, float32, eval."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


_GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
              "Qwen3ForCausalLM": "qwen3"}
_GGUF_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_GGUF_BLOCK = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _llama_cpp_permute(w: Any, num_heads: int) -> Any:  # numpy in, numpy out
    # What llama.cpp's converter does to Llama q/k rows: per head, [2, D/2] -> [D/2, 2].
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def make_tiny_gguf(hf_dir: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Convert a (tiny) HF checkpoint to an F32 GGUF file the way llama.cpp's
    convert_hf_to_gguf does (names, metadata, Llama q/k row permutation), so
    the GGUF loader can be checked against the HF original without quantisation error."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from models.loader.hf import checkpoint_files

    hf_dir, path = Path(hf_dir), Path(path)
    config = AutoConfig.from_pretrained(hf_dir)
    arch = _GGUF_ARCH[config.architectures[0]]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(hf_dir.name)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    state: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(str(hf_dir)):
        state.update(load_file(file))
    for name, tensor in state.items():
        module, _, leaf = name.rpartition(".")
        if module in _GGUF_TOP:
            gguf_name = f"{_GGUF_TOP[module]}.{leaf}"
        else:
            _, _, layer, rest = module.split(".", 3)  # model.layers.N.<rest>
            gguf_name = f"blk.{layer}.{_GGUF_BLOCK[rest]}.{leaf}"
        w = tensor.float().numpy()
        if arch == "llama" and ".self_attn.q_proj." in name:
            w = _llama_cpp_permute(w, config.num_attention_heads)
        elif arch == "llama" and ".self_attn.k_proj." in name:
            w = _llama_cpp_permute(w, config.num_key_value_heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---------------------------------------------------------------------------
# Running our model over a flat batch, without the runner
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SdpaTestMetadata:
    seq_lens: tuple[int, ...]  # tokens per request, in batch order; each request starts at position 0

    @classmethod
    def from_positions(cls, positions: torch.Tensor) -> "SdpaTestMetadata":
        """positions [0, 1, 2, 0, 1] -> seq_lens (3, 2): a request starts at each 0."""
        starts = (positions == 0).nonzero().flatten().tolist() + [positions.numel()]
        if not starts or starts[0] != 0:
            raise ValueError("SdpaTestBackend runs full prefills only: the batch must start at position 0")
        return cls(tuple(b - a for a, b in zip(starts, starts[1:])))


class SdpaTestBackend(AttentionBackend):
    """Causal SDPA per request over this step's tokens only (no KV cache)."""

    name = "test_sdpa"

    def forward(self, layer, q, k, v, kv_cache, meta: SdpaTestMetadata) -> torch.Tensor:
        group = layer.num_heads // layer.num_kv_heads
        out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
        start = 0
        for n in meta.seq_lens:
            qs = q[start : start + n].transpose(0, 1)  # [heads, n, head_dim]
            ks = k[start : start + n].transpose(0, 1).repeat_interleave(group, dim=0)
            vs = v[start : start + n].transpose(0, 1).repeat_interleave(group, dim=0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=layer.scale)
            out[start : start + n] = o.transpose(0, 1)
            start += n
        return out


def flat_batch(prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor, SdpaTestMetadata]:
    """prompts [[5, 6, 7], [8, 9]] -> input_ids [5, 6, 7, 8, 9], positions [0, 1, 2, 0, 1]."""
    input_ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
    positions = torch.cat([torch.arange(len(p), dtype=torch.long) for p in prompts])
    return input_ids, positions, SdpaTestMetadata.from_positions(positions)


@torch.inference_mode()
def run_flat_batch(model: torch.nn.Module, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Our model over the prompts as one flat batch: float32 logits [total_tokens, vocab]."""
    input_ids, positions, meta = flat_batch(prompts)
    device = next(model.parameters()).device
    kv_caches = [torch.empty(0, device=device)] * model.config.num_layers
    with forward_context(ForwardContext(SdpaTestBackend(), meta, kv_caches)):
        hidden = model(input_ids.to(device), positions.to(device))
    return model.compute_logits(hidden).float()


@torch.inference_mode()
def hf_logits(hf_model: torch.nn.Module, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """transformers' logits for each prompt run alone, concatenated like run_flat_batch's."""
    device = next(hf_model.parameters()).device
    outs = [hf_model(torch.tensor([p], device=device)).logits[0].float() for p in prompts]
    return torch.cat(outs)
