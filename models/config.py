"""`ModelConfig`: the model shape the decoder is built from.

Built once from a Hugging Face config (`ModelConfig.from_hf`), which the
loaders get from config.json or from GGUF metadata. Everything the decoder,
the weight loaders and the runner's KV-cache sizing need is here, validated
on construction, so a checkpoint we cannot run fails at start-up with a
message naming what is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Architectures the one decoder covers, with what HF hard-codes per family
# rather than putting in config.json.
#   qkv_bias: None -> read `attention_bias` from the config (Llama, Qwen3);
#             True -> always on (Qwen2 has q/k/v bias and no o_proj bias).
#   qk_norm:  per-head RMSNorm on q and k before rope (Qwen3).
_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"qkv_bias": None, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": None, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": None, "qk_norm": True},
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_ARCHITECTURES)

_HF_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint asks for something this decoder does not implement."""


@dataclass(frozen=True)
class RopeScaling:
    """How rope frequencies are rescaled.

    rope_type:
      "linear"       positions divided by `factor` (inv_freq / factor).
      "llama3"       Llama 3.x: long wavelengths divided by `factor`, short ones
                     kept, a smooth blend between (low/high_freq_factor,
                     original_max_position_embeddings).
      "freq_factors" inv_freq[i] / freq_factors[i]; what llama.cpp stores in a
                     GGUF's `rope_freqs.weight` (Llama 3.x converted to GGUF).
    """

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    freq_factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ("linear", "llama3", "freq_factors"):
            raise UnsupportedModelError(
                f"rope scaling type {self.rope_type!r} is not supported; supported: linear, llama3"
            )
        if self.rope_type == "freq_factors" and not self.freq_factors:
            raise ValueError("rope_type 'freq_factors' needs freq_factors")
        if self.rope_type == "llama3":
            if self.original_max_position_embeddings is None:
                raise ValueError("llama3 rope scaling needs original_max_position_embeddings")
            if not self.high_freq_factor > self.low_freq_factor:
                raise ValueError(
                    f"llama3 rope scaling needs high_freq_factor > low_freq_factor, "
                    f"got {self.high_freq_factor} and {self.low_freq_factor}"
                )

    @classmethod
    def from_hf(cls, params: dict[str, Any] | None) -> RopeScaling | None:
        """From HF `rope_parameters` (transformers 5) or `rope_scaling` (4.x).
        {"rope_type": "default", "rope_theta": ...} -> None."""
        if not params:
            return None
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "default":
            return None
        if rope_type not in _HF_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope scaling type {rope_type!r} is not supported; supported: default, linear, llama3"
            )
        if rope_type == "linear":
            return cls("linear", factor=float(params["factor"]))
        return cls(
            "llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # e.g. "LlamaForCausalLM"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on the q/k/v projections
    o_proj_bias: bool = False  # bias on the output projection (Llama attention_bias=True)
    qk_norm: bool = False  # per-head RMSNorm on q and k before rope (Qwen3)
    sliding_window: int | None = None  # set only when the checkpoint really uses one
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None  # the checkpoint's dtype, e.g. "bfloat16"

    def __post_init__(self) -> None:
        if self.architecture not in _ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"model config: {name} must be at least 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim must be even for rope, got {self.head_dim}")
        scaling = self.rope_scaling
        if scaling is not None and scaling.freq_factors is not None and len(scaling.freq_factors) != self.head_dim // 2:
            raise ValueError(
                f"rope freq_factors has {len(scaling.freq_factors)} entries, expected head_dim/2 = {self.head_dim // 2}"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """From a transformers `PretrainedConfig` (4.x or 5.x attribute names)."""
        archs = getattr(hf_config, "architectures", None) or []
        if not archs:
            raise UnsupportedModelError(
                "config.json has no `architectures` entry; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        arch = archs[0]
        if arch not in _ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        traits = _ARCHITECTURES[arch]

        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"{arch}: hidden_act {act!r} is not supported; supported: silu")
        if getattr(hf_config, "mlp_bias", False):
            raise UnsupportedModelError(f"{arch}: mlp_bias=True is not supported")

        # transformers 5 folds rope_theta and rope_scaling into rope_parameters;
        # 4.x keeps them as two attributes.
        rope_params = getattr(hf_config, "rope_parameters", None)
        if isinstance(rope_params, dict) and rope_params:
            rope_theta = rope_params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
            if rope_params.get("partial_rotary_factor", 1.0) != 1.0:
                raise UnsupportedModelError(f"{arch}: partial_rotary_factor != 1 is not supported")
        else:
            rope_params = getattr(hf_config, "rope_scaling", None)
            rope_theta = getattr(hf_config, "rope_theta", 10000.0)

        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads

        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        qkv_bias = attention_bias if traits["qkv_bias"] is None else traits["qkv_bias"]
        # Llama's attention_bias also puts a bias on o_proj; Qwen3's does too.
        o_proj_bias = attention_bias if traits["qkv_bias"] is None else False

        sliding_window = getattr(hf_config, "sliding_window", None)
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not getattr(hf_config, "use_sliding_window", False):
            sliding_window = None

        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)

        dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if dtype is not None and not isinstance(dtype, str):
            dtype = str(dtype).removeprefix("torch.")

        return cls(
            architecture=arch,
            hidden_size=hf_config.hidden_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=hf_config.intermediate_size,
            vocab_size=hf_config.vocab_size,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=float(rope_theta),
            rope_scaling=RopeScaling.from_hf(rope_params),
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_proj_bias,
            qk_norm=traits["qk_norm"],
            sliding_window=sliding_window,
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            eos_token_ids=eos_ids,
            torch_dtype=dtype,
        )
