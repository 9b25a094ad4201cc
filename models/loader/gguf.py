"""Weights and config from one GGUF file (llama.cpp's format).

Every tensor is dequantised to float32 with `gguf.quants.dequantize`
(Q4_1, Q8_0, ... as well as F16/F32) and renamed to its HF name, so the
decoder's ordinary `load_weights` maps and checks it:
    blk.3.attn_k.weight -> model.layers.3.self_attn.k_proj.weight

llama.cpp stores Llama's q/k projections with rows permuted for its
interleaved rope; we undo that exactly as transformers' GGUF loader does.
"""

from __future__ import annotations

import dataclasses
import re
import types
from typing import Any, Iterator

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from tqdm.auto import tqdm

from models.config import ModelConfig, RopeScaling, UnsupportedModelError
from models.loader.hf import PROGRESS_MIN_BYTES

# general.architecture -> (HF architecture, transformers config class name)
_GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"),
}

_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# Tensors that configure rather than weigh: consumed by gguf_model_config.
_CONFIG_TENSORS = ("rope_freqs.weight",)


def open_gguf(path: str) -> GGUFReader:
    return GGUFReader(path)


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_architecture(reader: GGUFReader) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(_GGUF_ARCHITECTURES)}"
        )
    return arch


def gguf_config_values(reader: GGUFReader) -> dict[str, Any]:
    """The GGUF metadata as HF config.json values (4.x names: rope_theta, rope_scaling)."""
    arch = gguf_architecture(reader)
    hf_arch, _ = _GGUF_ARCHITECTURES[arch]
    tensor_names = {t.name for t in reader.tensors}

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    hidden_size = meta("embedding_length")
    num_heads = meta("attention.head_count")
    num_kv_heads = meta("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):
        if len(set(num_kv_heads)) != 1:
            raise UnsupportedModelError(f"GGUF: per-layer head_count_kv {num_kv_heads} is not supported")
        num_kv_heads = num_kv_heads[0]
    head_dim = meta("attention.key_length") or meta("rope.dimension_count") or hidden_size // num_heads
    rope_dim = meta("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise UnsupportedModelError(f"GGUF: partial rope ({rope_dim} of {head_dim} dims) is not supported")

    vocab_size = meta("vocab_size")
    if vocab_size is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab_size = len(tokens.data) if tokens is not None else None
    if vocab_size is None:
        embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
        vocab_size = int(embd.shape[-1])  # GGUF shapes are [in, out]: [hidden, vocab]

    rope_scaling = None
    scaling_type = meta("rope.scaling.type")
    if scaling_type not in (None, "none"):
        if scaling_type != "linear":
            raise UnsupportedModelError(f"GGUF rope scaling {scaling_type!r} is not supported; supported: linear")
        rope_scaling = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}

    kwargs: dict[str, Any] = dict(
        architectures=[hf_arch],
        hidden_size=hidden_size,
        num_hidden_layers=meta("block_count"),
        intermediate_size=meta("feed_forward_length"),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=meta("context_length"),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        vocab_size=vocab_size,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )
    if rope_scaling is not None:
        kwargs["rope_scaling"] = rope_scaling
    if arch in ("llama", "qwen3"):
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    return kwargs


def gguf_hf_config(reader: GGUFReader) -> Any:
    """A transformers PretrainedConfig built from the GGUF metadata."""
    import transformers

    _, config_cls_name = _GGUF_ARCHITECTURES[gguf_architecture(reader)]
    return getattr(transformers, config_cls_name)(**gguf_config_values(reader))


def gguf_model_config(reader: GGUFReader) -> ModelConfig:
    """ModelConfig from the metadata (without importing transformers), plus
    what llama.cpp keeps in tensors: Llama 3.x rope scaling as per-frequency
    divisors in `rope_freqs.weight` (which transformers ignores)."""
    config = ModelConfig.from_hf(types.SimpleNamespace(**gguf_config_values(reader)))
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        factors = dequantize(freqs.data, freqs.tensor_type).reshape(-1)
        scaling = RopeScaling("freq_factors", freq_factors=tuple(float(x) for x in factors))
        config = dataclasses.replace(config, rope_scaling=scaling)
    return config


def gguf_hf_name(name: str) -> str:
    """GGUF tensor name -> HF name; unknown names come back unchanged (the
    decoder then reports them as unexpected)."""
    if name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[name]
    m = _BLOCK_RE.fullmatch(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return name


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's convert_hf_to_gguf `permute` of Llama q/k rows.

    llama.cpp views each head's rows as [2, head_dim/2] (HF's two rope halves)
    and stores them as [head_dim/2, 2] (interleaved pairs); for a head of 4 rows
    HF order [a0, a1, b0, b1] is stored as [a0, b0, a1, b1]. Works for biases too.
    """
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf_weights(reader: GGUFReader, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 CPU tensor) for every weight tensor of the file."""
    unpermute = gguf_architecture(reader) == "llama"
    show_progress = reader.data.nbytes >= PROGRESS_MIN_BYTES  # reader.data: the whole file, memory-mapped
    for tensor in tqdm(reader.tensors, desc="Dequantising GGUF", disable=not show_progress):
        if tensor.name in _CONFIG_TENSORS:
            continue
        w = dequantize(tensor.data, tensor.tensor_type)  # numpy, in [out, in] order
        name = gguf_hf_name(tensor.name)
        if unpermute and ".self_attn.q_proj." in name:
            w = unpermute_rope_rows(w, config.num_heads)
        elif unpermute and ".self_attn.k_proj." in name:
            w = unpermute_rope_rows(w, config.num_kv_heads)
        if not (w.flags.writeable and w.flags.c_contiguous):  # e.g. an F32 tensor still in the memmap
            w = np.array(w, order="C")
        yield name, torch.from_numpy(w)
