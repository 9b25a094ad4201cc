"""Weights from an HF checkpoint directory: safetensors, single or sharded
(model.safetensors.index.json), or PyTorch .bin files as a fallback."""

from __future__ import annotations

import json
import os
from typing import Iterator

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

# Show a progress bar only for checkpoints at least this big.
PROGRESS_MIN_BYTES = 1 << 30


def checkpoint_files(path: str) -> list[str]:
    """The weight files to read, in order. With an index, exactly the files it
    names (a directory may also hold a consolidated copy, e.g. Mistral's
    consolidated.safetensors, which must not be read twice)."""
    for index_name, fallback in (
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        index = os.path.join(path, index_name)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            return [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
        if os.path.isfile(os.path.join(path, fallback)):
            return [os.path.join(path, fallback)]
    for ext in (".safetensors", ".bin"):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(ext))
        if files:
            return files
    raise FileNotFoundError(f"{path}: no *.safetensors or *.bin weight files")


def iter_hf_weights(path: str, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of the checkpoint. Safetensors are
    read straight onto `device` when it is a GPU (no CPU copy of the model)."""
    files = checkpoint_files(path)
    total_bytes = sum(os.path.getsize(f) for f in files)
    read_device = str(device) if device.type == "cuda" else "cpu"
    with tqdm(
        total=total_bytes, unit="B", unit_scale=True, desc="Loading weights",
        disable=total_bytes < PROGRESS_MIN_BYTES,
    ) as bar:
        for file in files:
            if file.endswith(".safetensors"):
                with safe_open(file, framework="pt", device=read_device) as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)
            else:
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
                yield from state.items()
                del state
            bar.update(os.path.getsize(file))
