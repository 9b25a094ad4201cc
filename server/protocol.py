"""Request and response models of the OpenAI API, as pydantic models.

Requests forbid unknown fields: OpenAI itself answers 400 "Unrecognized
request argument supplied: X", and a typo such as `max_token` must not be
silently ignored. Fields OpenAI defines that change nothing on a
self-hosted server (`user`, `metadata`, `store`, `service_tier`) are accepted
and ignored, as listed in `NO_OP_FIELDS`. Fields OpenAI or vLLM define that
Serval does not implement yet are declared (so the message is precise) and
rejected by `reject_unsupported`, the one place to change when they land.

Responses are declared so the OpenAPI document at /openapi.json says what
the routes really return.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from server.errors import APIError

# Accepted and ignored: they do not change what a self-hosted model returns.
NO_OP_FIELDS = ("user", "metadata", "store", "service_tier")


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


# ---------------------------------------------------------------------------
# Shared request pieces
# ---------------------------------------------------------------------------


class StreamOptions(_Request):
    include_usage: bool = False
    # vLLM extension: usage on every chunk
    continuous_usage_stats: bool = False


class _SamplingFields(_Request):
    """Fields common to chat and completions (OpenAI + vLLM extensions)."""

    model: str | None = Field(None, description="The served model name; defaults to the only model served.")
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI no-ops (see NO_OP_FIELDS)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # Structured outputs (server.structured_outputs reads and checks them)
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structured_outputs: Any = None


# ---------------------------------------------------------------------------
# Chat completions
# ---------------------------------------------------------------------------


class ContentPart(BaseModel):
    """One part of a message's content. Only `{"type": "text", "text": ...}` is
    served; other types are declared loosely so the 400 can name them."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(None, description="Deprecated by OpenAI in favour of max_completion_tokens.")
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # Tool calling (server.tool_calls reads and checks them)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # Declared so they are named precisely; rejected by reject_unsupported().
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None


class ChatLogprobTop(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[ChatLogprobTop]


class ChatLogprobs(_Response):
    content: list[ChatLogprobToken] | None = None
    refusal: list[ChatLogprobToken] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str  # JSON text


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


class DeltaFunctionCall(_Response):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response):
    """A streamed tool call: {"index", "id", "type", "function": {"name", "arguments": ""}}
    first, then {"index", "function": {"arguments": <fragment>}}."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class ChatDelta(_Response):
    """Streamed message delta. Fields that are None are left out of the event,
    as OpenAI does: {"role": "assistant", "content": ""} first, then
    {"content": "..."}, then {} with the finish reason."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    """One SSE event of a streamed chat completion (`data: {...}`)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


# ---------------------------------------------------------------------------
# Completions
# ---------------------------------------------------------------------------


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True
    # Declared so they are named precisely; rejected by reject_unsupported().
    suffix: str | None = None
    best_of: int | None = None


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionStreamResponse(_Response):
    """One SSE event of a streamed completion (`data: {...}`)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


# ---------------------------------------------------------------------------
# Models, tokenizer, health, version
# ---------------------------------------------------------------------------


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "serval"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Request):
    """Either `prompt` (raw text) or `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str


class HealthResponse(_Response):
    status: Literal["ok"] = "ok"


class VersionResponse(_Response):
    version: str


# ---------------------------------------------------------------------------
# Unsupported fields: the single place that refuses them
# ---------------------------------------------------------------------------


def reject_unsupported(req: ChatCompletionRequest | CompletionRequest) -> None:
    """Raise a 400 naming the first field Serval does not implement yet.

    Structured outputs and tools are served (server.structured_outputs,
    server.tool_calls check their fields).
    """

    def refuse(field: str, what: str) -> None:
        raise APIError(f"{field} is not supported by this server: {what}", param=field, code="unsupported_parameter")

    if isinstance(req, ChatCompletionRequest):
        if req.functions is not None:
            refuse("functions", "function calling is not implemented")
        if req.function_call is not None:
            refuse("function_call", "function calling is not implemented")
        if req.audio is not None:
            refuse("audio", "audio output is not supported")
        if req.modalities is not None and list(req.modalities) != ["text"]:
            refuse("modalities", "only [\"text\"] is served")
        if req.prediction is not None:
            refuse("prediction", "predicted outputs are not supported")
        if req.reasoning_effort is not None:
            refuse("reasoning_effort", "reasoning models are not supported")
        if req.web_search_options is not None:
            refuse("web_search_options", "web search is not supported")
    else:
        if req.suffix is not None:
            refuse("suffix", "insertion (suffix) is not supported")
        if req.best_of is not None and req.best_of > 1:
            refuse("best_of", "best_of > 1 is not supported; use n")
