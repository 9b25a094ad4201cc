"""What chat and completions share: request -> SamplingParams, the context
length check, admission (429), fanning a request out into sequences,
merging their streams, and answering with a stream or a body while watching
for a client that went away. (Logprobs as token strings and bytes:
server/logprobs.py.)
"""

from __future__ import annotations

import asyncio
import logging
import contextlib
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import msgspec
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.requests import Request

from scheduler.types import SamplingParams, SamplingParamsError, StructuredOutputSpec
from server.engine_client import EngineDeadError, RequestRejectedError
from server.errors import APIError, engine_dead, invalid_field, model_not_found
from server.logprobs import TokenText
from server.metrics import SequenceTimer, ServerMetrics
from server.protocol import ChatCompletionRequest, CompletionRequest, UsageInfo
from server.sse import SSEResponse

T = TypeVar("T")
logger = logging.getLogger("serval.server")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Admission:
    """Caps the sequences in flight at max_num_seqs + max_queued_requests.

    in_flight counts sequences (an n=4 request is 4) from admission until
    the response is over; past the cap a request gets 429 with Retry-After.
    A request alone on an idle server is always admitted, whatever its n.
    """

    def __init__(self, limit: int | None):
        self.limit = limit
        self.in_flight = 0

    def acquire(self, num_seqs: int) -> Callable[[], None]:
        if self.limit is not None and self.in_flight > 0 and self.in_flight + num_seqs > self.limit:
            raise APIError(
                f"The server is at capacity ({self.in_flight} sequences running or queued, "
                f"limit {self.limit}); retry later.",
                status=HTTPStatus.TOO_MANY_REQUESTS,
                code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )
        self.in_flight += num_seqs
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.in_flight -= num_seqs

        return release


@dataclass
class ServingState:
    """What every handler needs; built once by the app factory."""

    client: Any  # server.engine_client.AsyncEngineClient (or a test double)
    served_model_name: str
    metrics: ServerMetrics
    admission: Admission
    token_text: TokenText
    tool_parser: Any = None  # server.tool_parsers.ToolParser (--tool-call-parser)

    @property
    def max_model_len(self) -> int:
        return self.client.info.max_model_len

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise model_not_found(model, self.served_model_name)

    def check_healthy(self) -> None:
        if not self.client.is_healthy():
            raise engine_dead()

    def require_tokenizer(self, param: str) -> Any:
        """The tokenizer; a model served without one (dummy weights of a bare
        config) takes token-id prompts only."""
        tokenizer = self.client.tokenizer
        if tokenizer is None:
            raise invalid_field(param, f"this model has no tokenizer: {param} must be given as token ids")
        return tokenizer

    def error_for(self, exc: BaseException, request_id: str) -> APIError:
        """The API error for a failure while generating: the engine died
        (503), refused the request (400), or something else broke (500)."""
        if isinstance(exc, EngineDeadError) or not self.client.is_healthy():
            return engine_dead()
        if isinstance(exc, RequestRejectedError):
            param = getattr(exc, "param", None)
            if param is not None:  # e.g. a schema or regex the engine could not compile
                return invalid_field(param, f"{param}: {exc}")
            return APIError(f"The request was rejected: {exc}", code="request_rejected")
        logger.error("request %s failed", request_id, exc_info=exc)
        return APIError(f"Internal server error: {type(exc).__name__}: {exc}", status=500)


# ---------------------------------------------------------------------------
# Request -> SamplingParams
# ---------------------------------------------------------------------------


def check_context_length(
    num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, *, prompt_param: str, max_tokens_param: str
) -> int:
    """Return the max_tokens to use; 400 when prompt + max_tokens > max_model_len.

    max_tokens=None fills the context: prompt 100, max_model_len 2048 -> 1948.
    """
    what = "messages" if prompt_param == "messages" else "prompt"
    if max_tokens is None:
        if num_prompt_tokens >= max_model_len:
            raise APIError(
                f"This model's maximum context length is {max_model_len} tokens. However, your {what} "
                f"has {num_prompt_tokens} tokens, which leaves no room for a completion. "
                f"Please reduce the length of the {what}.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        return max_model_len - num_prompt_tokens
    if num_prompt_tokens + max_tokens > max_model_len:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {what}, {max_tokens} in "
            f"the completion, `{max_tokens_param}`). Please reduce the length of the {what} or "
            f"`{max_tokens_param}`.",
            param=max_tokens_param,
            code="context_length_exceeded",
        )
    return max_tokens


def build_sampling_params(
    req: ChatCompletionRequest | CompletionRequest,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    vocab_size: int,
    rename: dict[str, str],
    structured_output: StructuredOutputSpec | None = None,
) -> SamplingParams:
    """The request's sampling fields as validated SamplingParams (n=1: one
    sequence; fan_out() makes the n children). `rename` maps a SamplingParams
    field to the request field the user wrote, e.g. {"logprobs": "top_logprobs"}."""
    if req.stream_options is not None and not req.stream:
        raise invalid_field("stream_options", "stream_options is only allowed when stream is true")
    if req.n < 1:
        raise invalid_field("n", f"n must be at least 1, got {req.n}")
    logit_bias: dict[int, float] | None = None
    if req.logit_bias:
        logit_bias = {}
        for key, bias in req.logit_bias.items():
            try:
                tok = int(key)
            except ValueError:
                raise invalid_field("logit_bias", f"logit_bias keys must be token ids, got {key!r}") from None
            if not 0 <= tok < vocab_size:
                raise invalid_field("logit_bias", f"logit_bias token id {tok} is out of range [0, {vocab_size})")
            logit_bias[tok] = bias
    for tok in req.stop_token_ids or ():
        if not 0 <= tok < vocab_size:
            raise invalid_field("stop_token_ids", f"stop_token_ids entry {tok} is out of range [0, {vocab_size})")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])

    kwargs: dict[str, Any] = dict(
        n=1,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        seed=req.seed,
        logit_bias=logit_bias,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        structured_output=structured_output,
    )
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    try:
        return SamplingParams(**kwargs)
    except SamplingParamsError as e:
        param = rename.get(e.param, e.param)
        message = str(e)
        if param != e.param:
            message = message.replace(e.param, param, 1)
        raise invalid_field(param, message) from None


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of choice `index` of n: the same, with seed + index."""
    if params.seed is None or index == 0:
        return params
    seed = params.seed + index
    if seed >= 2**64:
        seed -= 2**64
    return msgspec.structs.replace(params, seed=seed)


# ---------------------------------------------------------------------------
# Sequences
# ---------------------------------------------------------------------------


@dataclass
class Sequence:
    """One generated choice, accumulated from the client's deltas."""

    index: int
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # per token: {token_id: TokenLogprob}, sampled token first (server.outputs.PositionLogprobs)
    logprobs: list[dict[int, Any]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Any] | None] | None = None  # None for the first prompt token
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0

    def absorb(self, delta: Any) -> None:
        self.text += delta.text or ""
        self.token_ids.extend(delta.token_ids or ())
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = list(delta.prompt_logprobs)
        self.num_prompt_tokens = delta.num_prompt_tokens or len(self.prompt_token_ids)
        self.num_output_tokens = max(self.num_output_tokens, delta.num_output_tokens or len(self.token_ids))
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason


def usage_info(seqs: list[Sequence], n: int) -> UsageInfo:
    """Usage of P prompts with n choices each, seqs in prompt order (choice
    index = p * n + i): each prompt counted once whatever n, every choice's
    tokens counted."""
    prompt = sum(s.num_prompt_tokens or len(s.prompt_token_ids) for s in seqs[::n])
    completion = sum(s.num_output_tokens for s in seqs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


async def run_sequence(state: ServingState, seq: Sequence) -> AsyncIterator[Any]:
    """The client's deltas for one sequence, with metrics. Closing this
    iterator (or cancelling its consumer) closes generate(), which aborts the
    request in the engine."""
    timer = SequenceTimer(state.metrics, time.monotonic(), time.time())
    finished = False
    try:
        gen = state.client.generate(seq.req_id, seq.prompt_token_ids, seq.params, prompt=seq.prompt)
        async with contextlib.aclosing(gen):
            async for delta in gen:
                timer.on_output(len(delta.token_ids or ()), getattr(delta, "first_scheduled_time", None))
                seq.absorb(delta)
                if delta.finish_reason is not None:
                    finished = True
                    timer.on_finish(delta.finish_reason)
                yield delta
    except RequestRejectedError as e:
        spec = seq.params.structured_output
        if spec is not None and getattr(e, "param", None) is None:
            e.param = spec.param  # type: ignore[attr-defined]  # its grammar did not compile: name the field
        raise
    finally:
        if not finished:
            timer.on_finish("abort")


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as items arrive: yields (which, item).

    An error in any stream is raised at once; closing the merged iterator
    cancels and closes every stream (so every engine request is aborted).
    """
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:  # type: ignore[type-var]
            async for item in only:
                yield 0, item
        return

    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for item in stream:
                    queue.put_nowait((i, item))
            queue.put_nowait((i, done))
        except Exception as exc:  # handed to the consumer, raised there
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(state: ServingState, seqs: list[Sequence]) -> None:
    """Run all sequences to completion (non-streaming)."""
    async for _ in merge_streams([run_sequence(state, s) for s in seqs]):
        pass


class ClientDisconnected(Exception):
    pass


async def respond(
    state: ServingState,
    raw: Request,
    request_id: str,
    seqs: list[Sequence],
    release: Callable[[], None],
    *,
    stream: bool,
    guided: bool,
    sse_stream: Callable[[AsyncIterator[tuple[int, Any]]], AsyncIterator[bytes]],
    response: Callable[[], BaseModel],
) -> Response:
    """Run the admitted sequences and answer: an SSE stream of
    `sse_stream(events)`, or the JSON of `response()` once all are done.
    `release` (admission) is called when the answer is over; a client that
    goes away first gets 499, a failure its API error. A guided stream waits
    for its first event, so that a grammar the engine cannot compile is a 400
    before any header goes out."""
    if stream:
        events = merge_streams([run_sequence(state, s) for s in seqs])
        if guided:
            try:
                events = await first_then_rest(raw, events)
            except ClientDisconnected:
                release()
                return Response(status_code=499)
            except Exception as e:
                release()
                raise state.error_for(e, request_id) from None
        return SSEResponse(sse_stream(events), on_close=release)
    try:
        await until_disconnect(raw, collect(state, seqs))
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as e:
        raise state.error_for(e, request_id) from None
    finally:
        release()
    return JSONResponse(response().model_dump(mode="json"))


async def first_then_rest(request: Request, events: AsyncIterator[T]) -> AsyncIterator[T]:
    """Wait for the first item of `events`, then return an iterator over all
    of them. What the first wait raises (ClientDisconnected included) is
    raised here, with `events` closed. A guided request streams through this,
    so that a grammar the engine cannot compile is a 400 before any header
    is sent."""
    it = events.__aiter__()
    try:
        first = await until_disconnect(request, it.__anext__())
    except StopAsyncIteration:
        first = None
    except BaseException:
        await it.aclose()  # type: ignore[attr-defined]
        raise

    async def chain() -> AsyncIterator[T]:
        try:
            if first is not None:
                yield first
                async for item in it:
                    yield item
        finally:
            await it.aclose()  # type: ignore[attr-defined]

    return chain()


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the HTTP client goes away first.

    After the body is read, the next ASGI receive() only returns when the
    connection closes (http.disconnect), so one pending receive is the watch.
    """

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watcher.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
        raise
    if task in done:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnected()
