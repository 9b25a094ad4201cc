"""POST /v1/chat/completions: messages -> chat template -> sequences ->
a `chat.completion` body or a stream of `chat.completion.chunk` events."""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

from fastapi.responses import Response
from starlette.requests import Request

from server.errors import APIError, invalid_field
from server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatLogprobToken,
    ChatLogprobTop,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    reject_unsupported,
)
from server.serving_common import (
    Sequence,
    ServingState,
    build_sampling_params,
    check_context_length,
    child_params,
    random_id,
    respond,
    usage_info,
)
from server.logprobs import TokenText, split_position
from server.sse import DONE, sse_event
from server.structured_outputs import structured_output_spec
from server.tool_calls import (
    ToolCallStream,
    ToolContext,
    extract_tool_calls,
    finish_reason_with_tools,
    prepare_tools,
    render_with_tools,
)
from server.tool_parsers import ContentDelta, StreamEvent, ToolCallStart

def messages_for_template(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages as the plain dicts a chat template reads.

    Content given as parts is joined: [{"type": "text", "text": "a"},
    {"type": "text", "text": "b"}] -> "a\\nb". Any other part type is a 400
    naming it, e.g. messages[0].content[1].type.
    """
    if not messages:
        raise invalid_field("messages", "messages must contain at least one message")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text":
                    raise invalid_field(
                        f"messages[{i}].content[{j}].type",
                        f"messages[{i}].content[{j}] has type {part.type!r}; only text content parts are supported",
                    )
                if part.text is None:
                    raise invalid_field(f"messages[{i}].content[{j}].text", f"messages[{i}].content[{j}].text is missing")
                texts.append(part.text)
            content = "\n".join(texts)
        if content is None and not m.tool_calls:
            raise invalid_field(f"messages[{i}].content", f"messages[{i}].content is missing")
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls is not None:
            msg["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None = None) -> tuple[str | None, list[int]]:
    """Apply the chat template; returns (prompt text if known, token ids)."""
    try:
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)
    except APIError:
        raise
    except Exception as e:  # a template that raises (e.g. "roles must alternate") is the user's 400
        raise invalid_field("messages", f"messages could not be rendered with the chat template: {e}") from None
    if isinstance(rendered, str):
        return rendered, list(tokenizer.encode(rendered, add_special_tokens=False))
    return None, list(rendered)


def chat_logprobs(token_text: TokenText, logprobs: list[dict[int, Any]], top_n: int) -> ChatLogprobs:
    content = []
    for position in logprobs:
        sampled_id, sampled_lp, top = split_position(position, top_n)
        text, data = token_text(sampled_id)
        content.append(
            ChatLogprobToken(
                token=text,
                logprob=sampled_lp,
                bytes=data,
                top_logprobs=[ChatLogprobTop(token=token_text(t)[0], logprob=v, bytes=token_text(t)[1]) for t, v in top],
            )
        )
    return ChatLogprobs(content=content)


class ChatHandler:
    def __init__(self, state: ServingState):
        self.state = state

    async def __call__(self, req: ChatCompletionRequest, raw: Request) -> Response:
        state = self.state
        reject_unsupported(req)
        state.check_model(req.model)
        state.check_healthy()
        client = state.client

        messages = messages_for_template(req.messages)
        tool_ctx = prepare_tools(req, state.tool_parser)
        prompt_text, prompt_ids = render_with_tools(render_chat, state.require_tokenizer("messages"), messages,
                                                    req.add_generation_prompt, tool_ctx)
        spec = structured_output_spec(req)
        if tool_ctx is not None and tool_ctx.spec is not None:
            if spec is not None:
                field = spec.param.split(".")[0]
                raise invalid_field(field, f"{field} cannot be combined with tool_choice {req.tool_choice!r}")
            spec = tool_ctx.spec  # required / named: the calls are grammar-constrained JSON

        if req.max_completion_tokens is not None:
            max_tokens_param, max_tokens = "max_completion_tokens", req.max_completion_tokens
        else:
            max_tokens_param, max_tokens = "max_tokens", req.max_tokens
        max_tokens = check_context_length(
            len(prompt_ids), max_tokens, state.max_model_len, prompt_param="messages", max_tokens_param=max_tokens_param
        )
        if req.top_logprobs is not None and not req.logprobs:
            raise invalid_field("top_logprobs", "top_logprobs requires logprobs to be true")
        top_n = req.top_logprobs or 0
        params = build_sampling_params(
            req,
            max_tokens=max_tokens,
            logprobs=top_n if req.logprobs else None,
            prompt_logprobs=None,
            vocab_size=client.info.vocab_size,
            rename={"logprobs": "top_logprobs", "max_tokens": max_tokens_param},
            structured_output=spec,
        )

        release = state.admission.acquire(req.n)
        request_id = random_id("chatcmpl")
        seqs = [
            Sequence(i, f"{request_id}-{i}", prompt_ids, child_params(params, i), prompt=prompt_text)
            for i in range(req.n)
        ]
        state.metrics.prompt_tokens.inc(len(prompt_ids))
        created = int(time.time())
        return await respond(
            state, raw, request_id, seqs, release, stream=req.stream, guided=spec is not None,
            sse_stream=lambda events: self._stream(req, request_id, created, seqs, top_n, events, tool_ctx),
            response=lambda: self._response(req, request_id, created, seqs, top_n, tool_ctx),
        )

    def _response(
        self, req: ChatCompletionRequest, request_id: str, created: int, seqs: list[Sequence], top_n: int,
        tool_ctx: ToolContext | None = None,
    ) -> ChatCompletionResponse:
        choices = []
        for s in seqs:
            content, calls = extract_tool_calls(tool_ctx, s.text) if tool_ctx is not None else (s.text, [])
            tool_calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]
            choices.append(ChatChoice(
                index=s.index,
                message=ChatResponseMessage(content=content, tool_calls=tool_calls or None),
                logprobs=chat_logprobs(self.state.token_text, s.logprobs, top_n) if req.logprobs else None,
                finish_reason=finish_reason_with_tools(s.finish_reason, len(calls)),
            ))
        return ChatCompletionResponse(
            id=request_id, created=created, model=self.state.served_model_name, choices=choices,
            usage=usage_info(seqs, req.n),
        )

    async def _stream(
        self, req: ChatCompletionRequest, request_id: str, created: int, seqs: list[Sequence], top_n: int,
        events: AsyncIterator[tuple[int, Any]], tool_ctx: ToolContext | None = None,
    ) -> AsyncIterator[bytes]:
        state = self.state
        opts = req.stream_options
        include_usage = opts is not None and opts.include_usage
        continuous = include_usage and opts is not None and opts.continuous_usage_stats

        def chunk(index: int, delta: ChatDelta, logprobs: ChatLogprobs | None = None,
                  finish_reason: str | None = None) -> bytes:
            c = ChatCompletionChunk(
                id=request_id, created=created, model=state.served_model_name,
                choices=[ChatStreamChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)],
                usage=usage_info(seqs, req.n) if continuous else None,
            )
            # {"content": "x"}, not {"role": null, "content": "x"}; no usage key unless asked for
            exclude: dict[str, Any] = {"choices": {0: {"delta": _delta_exclude(delta)}}}
            if not include_usage:
                exclude["usage"] = True
            return sse_event(c, exclude=exclude)

        try:
            for s in seqs:
                yield chunk(s.index, ChatDelta(role="assistant", content=""))
            tool_streams = [ToolCallStream(tool_ctx) for _ in seqs] if tool_ctx is not None else None
            async for i, delta in events:
                lps = None
                if req.logprobs and delta.logprobs:
                    lps = chat_logprobs(state.token_text, delta.logprobs, top_n)
                finish_reason = delta.finish_reason
                if tool_streams is None:
                    if delta.text or lps is not None:
                        yield chunk(i, ChatDelta(content=delta.text or ""), lps)
                else:
                    tool_events = tool_streams[i].feed(delta.text or "")
                    if finish_reason is not None:
                        tool_events += tool_streams[i].finish()
                        finish_reason = finish_reason_with_tools(finish_reason, tool_streams[i].num_tool_calls)
                    for k, message_delta in enumerate(_message_deltas(tool_events)):
                        yield chunk(i, message_delta, lps if k == 0 else None)
                    if lps is not None and not tool_events:
                        yield chunk(i, ChatDelta(content=""), lps)
                if finish_reason is not None:
                    yield chunk(i, ChatDelta(), finish_reason=finish_reason)
            if include_usage:
                yield sse_event(
                    ChatCompletionChunk(id=request_id, created=created, model=state.served_model_name,
                                        choices=[], usage=usage_info(seqs, req.n))
                )
        except Exception as e:
            yield sse_event(state.error_for(e, request_id).body())
        yield DONE


def _message_deltas(events: list[StreamEvent]) -> list[ChatDelta]:
    """Tool-parser events -> message deltas, as OpenAI streams a call:
    {"tool_calls": [{"index": 0, "id": "call_..", "type": "function", "function": {"name": "f", "arguments": ""}}]}
    then {"tool_calls": [{"index": 0, "function": {"arguments": "{\"x\": 1}"}}]}."""
    out = []
    for e in events:
        if isinstance(e, ContentDelta):
            out.append(ChatDelta(content=e.text))
        elif isinstance(e, ToolCallStart):
            call = DeltaToolCall(index=e.index, id=e.id, type="function",
                                 function=DeltaFunctionCall(name=e.name, arguments=""))
            out.append(ChatDelta(tool_calls=[call]))
        else:
            out.append(ChatDelta(tool_calls=[DeltaToolCall(index=e.index,
                                                            function=DeltaFunctionCall(arguments=e.arguments))]))
    return out


def _delta_exclude(delta: ChatDelta) -> dict[str, Any]:
    """pydantic's `exclude` leaving out every None field of a delta, tool calls included."""
    exclude: dict[str, Any] = {k: True for k in ("role", "content", "tool_calls") if getattr(delta, k) is None}
    for j, call in enumerate(delta.tool_calls or ()):
        fields: dict[str, Any] = {k: True for k in ("id", "type", "function") if getattr(call, k) is None}
        if call.function is not None:
            fn = {k: True for k in ("name", "arguments") if getattr(call.function, k) is None}
            if fn:
                fields["function"] = fn
        if fields:
            exclude.setdefault("tool_calls", {})[j] = fields
    return exclude
