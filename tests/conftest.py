"""Shared test set-up.

- Tests marked `gpu` skip themselves unless CUDA is usable (torch is only
  imported to check when such a test was collected).
- `tiny_model_dir`: a tiny random Llama checkpoint with a real byte-level BPE
  tokenizer and a ChatML template, built once per session.
- `tiny_server`: the real `serval serve` on that model, one per session,
  shared by the server test files that need no special flags.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from server_util import ServerProcess, make_tiny_chat_model  # noqa: E402

# Flags of the shared tiny server: a small KV cache (~20k tokens at 512 B per token),
# and async scheduling, as `serval serve` runs on CUDA (the other servers of the
# suite run the CPU default, synchronous)
TINY_SERVER_ARGS = ["--kv-cache-memory", "0.01", "--log-level", "warning", "--async-scheduling"]


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items and not _cuda_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_chat_model(tmp_path_factory.mktemp("models") / "tiny-llama"))


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir: str):
    with ServerProcess(["--model", tiny_model_dir, "--served-model-name", "tiny", *TINY_SERVER_ARGS]) as server:
        yield server
