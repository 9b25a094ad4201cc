"""POST /v1/completions: prompt(s) -> sequences -> a `text_completion` body
or a stream of them.

`prompt` may be a string, a list of strings, a list of token ids or a list of
token-id lists; with P prompts and n choices, choice index = p * n + i.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

import msgspec
from fastapi.responses import Response
from starlette.requests import Request

from server.errors import invalid_field
from server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
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

def normalize_prompts(
    prompt: str | list[str] | list[int] | list[list[int]], state: ServingState, add_special_tokens: bool
) -> list[tuple[str | None, list[int]]]:
    """Each prompt as (text if given as text, token ids)."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif len(prompt) == 0:
        raise invalid_field("prompt", "prompt must not be empty")
    elif all(isinstance(p, int) for p in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    vocab_size = state.client.info.vocab_size
    out: list[tuple[str | None, list[int]]] = []
    for k, item in enumerate(items):
        where = "prompt" if len(items) == 1 else f"prompt[{k}]"
        if isinstance(item, str):
            tokenizer = state.require_tokenizer("prompt")
            ids = list(tokenizer.encode(item, add_special_tokens=add_special_tokens))
            text: str | None = item
        else:
            ids = list(item)
            text = None
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise invalid_field("prompt", f"{where} has token id {bad}, out of range [0, {vocab_size})")
        if not ids:
            raise invalid_field("prompt", f"{where} is empty")
        out.append((text, ids))
    return out


class _Offsets:
    """Running text offset of each choice, for logprobs.text_offset."""

    def __init__(self) -> None:
        self.pos: dict[int, int] = {}


def completion_logprobs(
    token_text: TokenText,
    token_ids: list[int],
    logprobs: list[dict[int, Any] | None],
    top_n: int,
    offsets: _Offsets,
    index: int,
) -> CompletionLogprobs:
    """OpenAI's legacy logprobs: a token's entry is None where there is no
    logprob (the first prompt token under echo). top_logprobs holds the top-N
    and the sampled token, so it may have N + 1 entries."""
    out = CompletionLogprobs()
    pos = offsets.pos.get(index, 0)
    for tid, position in zip(token_ids, logprobs):
        text, _ = token_text(tid)
        out.tokens.append(text)
        out.text_offset.append(pos)
        pos += len(text)
        if not position:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        _, sampled_lp, top = split_position(position, top_n)
        out.token_logprobs.append(sampled_lp)
        top_dict = {token_text(t)[0]: v for t, v in top}
        top_dict.setdefault(text, sampled_lp)
        out.top_logprobs.append(top_dict)
    offsets.pos[index] = pos
    return out


class CompletionHandler:
    def __init__(self, state: ServingState):
        self.state = state

    async def __call__(self, req: CompletionRequest, raw: Request) -> Response:
        state = self.state
        reject_unsupported(req)
        state.check_model(req.model)
        state.check_healthy()
        client = state.client
        vocab_size = client.info.vocab_size

        prompts = normalize_prompts(req.prompt, state, req.add_special_tokens)
        if req.echo and any(text is None for text, _ in prompts):
            state.require_tokenizer("echo")
        # max_tokens=None: each prompt fills its own context
        max_tokens = [
            check_context_length(len(ids), req.max_tokens, state.max_model_len,
                                 prompt_param="prompt", max_tokens_param="max_tokens")
            for _, ids in prompts
        ]
        want_prompt_lps = req.echo and req.logprobs is not None
        params = build_sampling_params(
            req,
            max_tokens=max_tokens[0],
            logprobs=req.logprobs,
            prompt_logprobs=req.logprobs if want_prompt_lps else None,
            vocab_size=vocab_size,
            rename={"prompt_logprobs": "logprobs"},
            structured_output=structured_output_spec(req),
        )

        release = state.admission.acquire(req.n * len(prompts))
        request_id = random_id("cmpl")
        seqs: list[Sequence] = []
        for p, (text, ids) in enumerate(prompts):
            p_params = msgspec.structs.replace(params, max_tokens=max_tokens[p])
            for i in range(req.n):
                index = p * req.n + i
                seqs.append(Sequence(index, f"{request_id}-{index}", ids, child_params(p_params, i), prompt=text))
            state.metrics.prompt_tokens.inc(len(ids))
        created = int(time.time())
        return await respond(
            state, raw, request_id, seqs, release, stream=req.stream, guided=params.structured_output is not None,
            sse_stream=lambda events: self._stream(req, request_id, created, seqs, events),
            response=lambda: self._response(req, request_id, created, seqs),
        )

    # -- helpers -------------------------------------------------------------

    def _echo(self, req: CompletionRequest, seq: Sequence, offsets: _Offsets) -> tuple[str, CompletionLogprobs | None]:
        """The prompt's text, and its logprobs (first token: None) when asked."""
        text = seq.prompt if seq.prompt is not None else self.state.client.tokenizer.decode(seq.prompt_token_ids)
        if req.logprobs is None:
            return text, None
        lps: list[dict[int, Any] | None] = list(seq.prompt_logprobs or [])
        lps += [None] * (len(seq.prompt_token_ids) - len(lps))
        return text, completion_logprobs(self.state.token_text, seq.prompt_token_ids, lps, req.logprobs,
                                         offsets, seq.index)

    def _response(self, req: CompletionRequest, request_id: str, created: int, seqs: list[Sequence]) -> CompletionResponse:
        offsets = _Offsets()
        choices = []
        for s in seqs:
            text = s.text
            logprobs = None
            if req.echo:
                prefix, logprobs = self._echo(req, s, offsets)
                text = prefix + text
            if req.logprobs is not None:
                gen = completion_logprobs(self.state.token_text, s.token_ids, list(s.logprobs), req.logprobs,
                                          offsets, s.index)
                logprobs = _concat(logprobs, gen)
            choices.append(CompletionChoice(index=s.index, text=text, logprobs=logprobs, finish_reason=s.finish_reason))
        return CompletionResponse(
            id=request_id, created=created, model=self.state.served_model_name, choices=choices,
            usage=usage_info(seqs, req.n),
        )

    async def _stream(self, req: CompletionRequest, request_id: str, created: int,
                      seqs: list[Sequence], events: AsyncIterator[tuple[int, Any]]) -> AsyncIterator[bytes]:
        state = self.state
        opts = req.stream_options
        include_usage = opts is not None and opts.include_usage
        continuous = include_usage and opts is not None and opts.continuous_usage_stats
        exclude = None if include_usage else {"usage"}
        offsets = _Offsets()
        echoed: set[int] = set()

        def chunk(choice: CompletionChoice) -> bytes:
            c = CompletionStreamResponse(id=request_id, created=created, model=state.served_model_name,
                                         choices=[choice], usage=usage_info(seqs, req.n) if continuous else None)
            return sse_event(c, exclude=exclude)

        try:
            async for i, delta in events:
                seq = seqs[i]
                text = delta.text or ""
                logprobs = None
                if req.echo and i not in echoed:
                    # Prompt logprobs arrive with the first output, so the echo goes out with it.
                    echoed.add(i)
                    prefix, logprobs = self._echo(req, seq, offsets)
                    text = prefix + text
                if req.logprobs is not None and delta.token_ids:
                    lps = list(delta.logprobs or [None] * len(delta.token_ids))
                    gen = completion_logprobs(state.token_text, list(delta.token_ids), lps, req.logprobs,
                                              offsets, seq.index)
                    logprobs = _concat(logprobs, gen)
                if text or logprobs is not None or delta.finish_reason is not None:
                    yield chunk(CompletionChoice(index=seq.index, text=text, logprobs=logprobs,
                                                 finish_reason=delta.finish_reason))
            if include_usage:
                yield sse_event(CompletionStreamResponse(id=request_id, created=created,
                                                         model=state.served_model_name, choices=[],
                                                         usage=usage_info(seqs, req.n)))
        except Exception as e:
            yield sse_event(state.error_for(e, request_id).body())
        yield DONE


def _concat(a: CompletionLogprobs | None, b: CompletionLogprobs) -> CompletionLogprobs:
    if a is None:
        return b
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )
