"""One config-driven decoder for Llama, Mistral, Qwen2/2.5 and Qwen3.

    model(input_ids [num_tokens], positions [num_tokens]) -> hidden [num_tokens, hidden]
    model.compute_logits(hidden [n, hidden]) -> logits [n, vocab], model dtype

The batch is flat: the tokens of many requests concatenated, no batch dim;
which token belongs to which request is the attention backend's business
(its metadata in the forward context), nothing else here needs to know.

Parameter names follow HF's except for the two fused projections, so a
checkpoint loads by name with a short mapping (`load_weights`).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from models.config import ModelConfig
from models.layers.attention import Attention
from models.layers.embedding import LMHead, VocabEmbedding
from models.layers.linear import Linear, MergedLinear
from models.layers.norm import RMSNorm
from models.layers.ops import OPS
from models.layers.rotary import RotaryEmbedding


class WeightLoadError(ValueError):
    """A checkpoint does not fit the model: a weight is missing, unexpected or misshapen."""


class MLP(nn.Module):
    """down_proj(silu(gate) * up). The decoder layer runs gate_up_proj fused
    with the norm before it (RMSNorm.forward_linear); forward() takes its output."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, {"gate": size, "up": size})
        self.down_proj = Linear(size, config.hidden_size)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * intermediate] -> [num_tokens, hidden]
        return self.down_proj(OPS["silu_and_mul"](gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx, rotary_emb)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden]: the previous layer's MLP output
        residual: torch.Tensor | None,  # [num_tokens, hidden]; None at layer 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Each sublayer starts with residual' = hidden + residual, then its
        # first projection of norm(residual'): one op (RMSNorm.forward_linear),
        # so a GPU kernel can do the add, the norm and the matmul in one pass.
        qkv, residual = self.input_layernorm.forward_linear(hidden, residual, self.self_attn.qkv_proj)
        hidden = self.self_attn(positions, qkv)
        gate_up, residual = self.post_attention_layernorm.forward_linear(hidden, residual, self.mlp.gate_up_proj)
        return self.mlp(gate_up), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(DecoderLayer(config, i, rotary_emb) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


# HF projection name -> (our fused parameter's module, shard name).
_STACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}

# Checkpoint entries that are not weights of ours.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class DecoderForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
    ) -> torch.Tensor:  # [num_tokens, hidden]
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab], model dtype
        return self.lm_head(hidden)

    # ------------------------------------------------------------------
    # Weights
    # ------------------------------------------------------------------

    def checkpoint_names(self) -> dict[str, list[str]]:
        """Our parameter name -> the HF checkpoint names that fill it, e.g.
        "model.layers.0.self_attn.qkv_proj.weight" -> [... q_proj.weight, ... k_proj.weight, ... v_proj.weight]."""
        reverse = {}
        for hf_part, (ours, shard) in _STACKED.items():
            reverse.setdefault(ours, []).append(hf_part)
        names: dict[str, list[str]] = {}
        for name, _ in self.named_parameters():  # tied lm_head.weight is listed once, as the embedding
            module_path, _, leaf = name.rpartition(".")
            parent, _, module = module_path.rpartition(".")
            if module in reverse:
                names[name] = [f"{parent}.{part}.{leaf}" for part in reverse[module]]
            else:
                names[name] = [name]
        return names

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill every parameter from (HF name, tensor) pairs, in any order;
        tensors are cast and copied onto the parameters' dtype and device.
        Raises WeightLoadError naming the weight when one is unexpected,
        misshapen, or (after all pairs are consumed) missing."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()  # HF names seen
        for hf_name, tensor in weights:
            if hf_name.endswith(_IGNORED_SUFFIXES):
                continue
            if hf_name.startswith("lm_head.") and self.config.tie_word_embeddings:
                continue  # some tied checkpoints also store the head; the embedding is the truth
            target, shard = self._map_name(hf_name)
            param = params.get(target)
            if param is None:
                raise WeightLoadError(f"unexpected weight {hf_name} in the checkpoint (no parameter {target})")
            if shard is not None:
                module = modules[target.rpartition(".")[0]]
                dest = module.shard(param.data, shard)
            else:
                dest = param.data
            if tuple(tensor.shape) != tuple(dest.shape):
                raise WeightLoadError(
                    f"weight {hf_name} has shape {tuple(tensor.shape)} in the checkpoint, "
                    f"expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.add(hf_name)

        missing = [hf for hfs in self.checkpoint_names().values() for hf in hfs if hf not in loaded]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise WeightLoadError(f"checkpoint is missing {len(missing)} weight(s): {shown}")

    @staticmethod
    def _map_name(hf_name: str) -> tuple[str, str | None]:
        """"model.layers.3.self_attn.k_proj.weight" -> ("model.layers.3.self_attn.qkv_proj.weight", "k")."""
        module_path, _, leaf = hf_name.rpartition(".")
        parent, _, module = module_path.rpartition(".")
        if module in _STACKED:
            ours, shard = _STACKED[module]
            return f"{parent}.{ours}.{leaf}", shard
        return hf_name, None
