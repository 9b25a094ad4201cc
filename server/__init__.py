"""Serval's user-facing front: the OpenAI-compatible HTTP server and the
offline `LLM` API.

    from server import LLM, SamplingParams
    llm = LLM()  # the embedded SmolLM2-135M-Instruct on the CPU
    out = llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(max_tokens=32))
    print(out[0].outputs[0].text)

`LLM` is imported lazily: the HTTP server imports this package and must stay
torch-free (LLM runs the engine, and so torch, in its own process).
"""

from typing import TYPE_CHECKING

from scheduler.types import SamplingParams
from server.outputs import CompletionOutput, RequestOutput

if TYPE_CHECKING:
    from server.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    if name == "LLM":
        from server.llm import LLM

        return LLM
    raise AttributeError(f"module 'server' has no attribute {name!r}")
