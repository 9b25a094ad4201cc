"""Build a model and fill its weights from where `resolve_model` says they are.

    model, config = load_model(source, "auto", None, torch.device("cpu"))

source.kind (scheduler.config.ModelSource):
  "hf_dir"     config.json + safetensors (single or sharded) or .bin
  "gguf"       one .gguf file: config from its metadata, weights dequantised
  "config_dir" config.json only: load_format must be "dummy"
load_format "dummy" fills random weights for any of them.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

from models.config import ModelConfig
from models.decoder import WeightLoadError
from models.loader.dummy import init_dummy_weights
from models.registry import get_model_class

if TYPE_CHECKING:
    from scheduler.config import ModelSource

__all__ = [
    "WeightLoadError",
    "build_model",
    "load_hf_config",
    "load_model",
    "parse_dtype",
    "resolve_dtype",
]

_DTYPE_NAMES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


def parse_dtype(name: str) -> torch.dtype | None:
    """--dtype value -> torch dtype; "auto" -> None (see resolve_dtype)."""
    if name == "auto":
        return None
    try:
        return _DTYPE_NAMES[name]
    except KeyError:
        raise ValueError(f"--dtype must be one of auto, float32, bfloat16, float16, got {name!r}") from None


def resolve_dtype(dtype: torch.dtype | None, config: ModelConfig, device: torch.device) -> torch.dtype:
    """None ("auto"): float32 on CPU (bf16 matmuls are slow there and parity
    tests want fp32); elsewhere the checkpoint's dtype, bfloat16 if it names none."""
    if dtype is not None:
        return dtype
    if torch.device(device).type == "cpu":
        return torch.float32
    return _DTYPE_NAMES.get(config.torch_dtype or "", torch.bfloat16)


def load_hf_config(source: ModelSource) -> Any:
    """The transformers PretrainedConfig of the model: config.json, or built
    from the GGUF metadata."""
    if source.kind == "gguf":
        from models.loader.gguf import gguf_hf_config, open_gguf

        return gguf_hf_config(open_gguf(source.path))
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(source.path)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The model with uninitialised weights allocated on `device` in `dtype`
    (device "meta" allocates nothing: shapes only)."""
    model_cls = get_model_class(config.architecture)
    with torch.device(device), _default_dtype(dtype):
        model = model_cls(config)
    return model.eval()


def load_model(
    source: ModelSource,
    load_format: str = "auto",
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> tuple[nn.Module, ModelConfig]:
    device = torch.device(device)
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"--load-format must be 'auto' or 'dummy', got {load_format!r}")
    if source.kind not in ("hf_dir", "gguf", "config_dir"):
        raise ValueError(f"unknown model source kind {source.kind!r}")
    if source.kind == "config_dir" and load_format != "dummy":
        raise ValueError(f"{source.path} has a config.json but no weights; pass --load-format dummy")
    if device.type == "meta" and load_format != "dummy":
        raise ValueError("the meta device holds no weights: use load_format='dummy' with it")

    reader = None
    if source.kind == "gguf":
        from models.loader.gguf import gguf_model_config, open_gguf

        reader = open_gguf(source.path)
        config = gguf_model_config(reader)
    else:
        config = ModelConfig.from_hf(load_hf_config(source))

    model = build_model(config, resolve_dtype(dtype, config, device), device)
    if load_format == "dummy":
        init_dummy_weights(model)
    elif reader is not None:
        from models.loader.gguf import iter_gguf_weights

        model.load_weights(iter_gguf_weights(reader, config))
    else:
        from models.loader.hf import iter_hf_weights

        model.load_weights(iter_hf_weights(source.path, device))
    return model, config
