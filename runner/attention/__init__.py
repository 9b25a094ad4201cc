"""Attention backends for the runner, behind one interface, picked once at
start-up by name from a small registry.

The runner owns what every backend needs to know about a step and hands it
over as `AttentionInputs`; each backend turns that into its own metadata type
once per step (`build_metadata`), and the model's attention layers call
`backend.forward(layer, q, k, v, kv_cache, meta)` through the forward context
(`models.forward_context`). A graph runner (CUDA graphs, later) talks to the
backend only through `prepare_for_capture` / `prepare_for_replay`, so it knows
nothing about a backend's internals.

Registry: name -> "module:Class", imported lazily so that `flashinfer` is only
imported when it is chosen.
"""

from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass
from typing import Any

import torch

from models.forward_context import AttentionBackend


@dataclass
class AttentionInputs:
    """One step's batch, as the attention backends see it.

    Requests are in batch order; request i owns query tokens
    query_start_loc[i]:query_start_loc[i+1] of the flat token batch, and those
    are the LAST q_len of its seq_len tokens (context first, then this step).
    Example: two requests, one decode with 6 tokens cached, one prefill chunk
    of 3 on top of 4 cached:
        query_start_loc = [0, 1, 4]      seq_lens = [7, 7]
        num_computed_tokens = [6, 4]     (seq_lens - q_lens)
    `*_cpu` tensors live on the host (for metadata built on the CPU, e.g.
    FlashInfer's plan()); the unsuffixed ones live on the device. On a CPU
    run they are the same tensors.
    """

    num_reqs: int
    num_tokens: int  # sum of q_lens (no padding)
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1] int32
    seq_lens_cpu: torch.Tensor  # [num_reqs] int32
    num_computed_tokens_cpu: torch.Tensor  # [num_reqs] int32
    # [num_reqs, num_cols] int32, num_cols >= cdiv(max_seq_len, block_size) (the
    # runner passes exactly that many): row i's first cdiv(seq_lens[i], block_size)
    # entries are its blocks; entries past them are valid block ids or 0, never read
    block_table_cpu: torch.Tensor
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, device
    seq_lens: torch.Tensor  # [num_reqs] int32, device
    block_table: torch.Tensor  # [num_reqs, num_cols] int32, device: block_table_cpu's copy
    slot_mapping: torch.Tensor  # [num_tokens] int64, device: block_id * block_size + offset

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass(frozen=True)
class AttentionSpec:
    """What every attention layer of the model and its KV cache share, for
    backends that plan a step ahead of the layers (FlashInfer's plan() needs
    the head counts before any layer runs)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # softmax scale, head_dim ** -0.5
    block_size: int


class RunnerAttentionBackend(AttentionBackend):
    """The runner-side contract on top of `models.forward_context.AttentionBackend`.

    A backend is built once (`__init__(device, dtype)`), told the model's
    geometry once (`configure(spec)`), then per step:
    `meta = backend.build_metadata(inputs)`, and per layer
    `backend.forward(layer, q, k, v, kv_cache, meta)`.
    """

    name: str = "abstract"

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device = device
        self.dtype = dtype
        self.spec: AttentionSpec | None = None

    def configure(self, spec: AttentionSpec) -> None:
        """Called once at start-up, after the model is built, before any step."""
        self.spec = spec

    @abc.abstractmethod
    def build_metadata(self, inputs: AttentionInputs) -> Any:
        """Everything forward() needs for this step, built once for all layers."""

    # -- CUDA-graph hooks (decode-only batches). Backends without graph support
    # leave these as they are; the graph runner checks `supports_graphs`.
    supports_graphs: bool = False

    def prepare_for_capture(self, max_num_reqs: int, max_blocks_per_req: int, padding_block_id: int) -> None:
        """Allocate the static buffers the captured graphs will read.
        `padding_block_id` is a KV block no request owns: the padded rows of a
        graph's batch write their k/v there and attend over it."""
        raise NotImplementedError(f"attention backend {self.name!r} does not support CUDA graphs")

    def build_metadata_for_capture(self, num_reqs: int) -> Any:
        """Metadata over the static buffers for a padded decode batch of num_reqs."""
        raise NotImplementedError(f"attention backend {self.name!r} does not support CUDA graphs")

    def prepare_for_replay(self, inputs: AttentionInputs, padded_num_reqs: int) -> Any:
        """Copy this step's inputs (a decode-only batch of inputs.num_reqs <=
        padded_num_reqs requests) into the static buffers, padding rows
        num_reqs..padded_num_reqs-1; return the metadata the graph for
        padded_num_reqs was captured with."""
        raise NotImplementedError(f"attention backend {self.name!r} does not support CUDA graphs")


_BACKENDS: dict[str, str] = {
    "torch": "runner.attention.torch_backend:TorchAttentionBackend",
    "flashinfer": "runner.attention.flashinfer:FlashInferAttentionBackend",
}


def register_backend(name: str, target: str) -> None:
    """Register a backend class by "module:Class" path (imported on first use)."""
    _BACKENDS[name] = target


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_backend_cls(name: str) -> type[RunnerAttentionBackend]:
    if name not in _BACKENDS:
        raise ValueError(
            f"--attention-backend {name!r} is unknown; choose one of {', '.join(available_backends())}"
        )
    module_name, cls_name = _BACKENDS[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--attention-backend {name}: cannot import {module_name} ({exc})") from exc
    return getattr(module, cls_name)


def default_backend_name(device: torch.device) -> str:
    """flashinfer on CUDA, torch everywhere else."""
    return "flashinfer" if device.type == "cuda" else "torch"
